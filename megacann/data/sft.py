"""Supervised fine-tuning records: JSONL lines -> token ids with a per-token "trained" mask.

Two record forms are accepted on each line:

* ``{"instruction": ..., "input": ... (optional), "output": ...}``
* ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}`` (an optional system
  message first, then user and assistant turns alternating, ending with an assistant turn)

A sample is ``[BOS] + prompt + answer + EOS`` (BOS only when the tokenizer has one); the answers and the EOS
after the last one are trained, everything else is not. Truncation policy: a sample longer than
``seq_length`` tokens keeps its first ``seq_length`` tokens (the end of the answer is cut); a sample whose
answer would start at or beyond ``seq_length`` has nothing to learn and is dropped and counted.
A malformed line raises :class:`SFTDataError` naming the file and line, or with ``skip_bad_lines`` is
skipped and counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import numpy as np

from megacann.data.jsonl_records import RecordStats, Sample, cached_samples, read_records, records_cache_dir, truncate
from megacann.data.sft_templates import PromptTemplate
from megacann.errors import MegacannError

ROLES = ("system", "user", "assistant")


class SFTDataError(MegacannError, ValueError):
    """A JSONL line that is not a usable SFT record."""


@dataclass
class SFTStats(RecordStats):
    samples: int = 0

    def summary(self) -> str:
        return (
            f"{self.samples} samples from {self.lines} lines; {self.bad_lines} bad lines skipped, "
            f"{self.truncated} truncated, {self.dropped_too_long} dropped (answer beyond seq_length)"
        )


def _check_text(value, key: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"'{key}' must be a string, got {type(value).__name__}")
    return value


def parse_record(record) -> list[dict]:
    """The record's conversation as checked messages; raises ValueError saying what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list of {role, content} objects")
        checked = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
            if m["role"] not in ROLES:
                raise ValueError(f"messages[{i}].role {m['role']!r} is not one of {', '.join(ROLES)}")
            checked.append({"role": m["role"], "content": _check_text(m["content"], f"messages[{i}].content")})
        turns = checked[1:] if checked[0]["role"] == "system" else checked
        expected = ["user", "assistant"] * (len(turns) // 2 + 1)
        if not turns or [t["role"] for t in turns] != expected[: len(turns)] or turns[-1]["role"] != "assistant":
            raise ValueError(
                "messages must alternate user/assistant (after an optional system message) and end with assistant"
            )
        return checked
    if "instruction" in record and "output" in record:
        instruction = _check_text(record["instruction"], "instruction")
        input_text = _check_text(record.get("input") or "", "input")
        output = _check_text(record["output"], "output")
        return [{"role": "user", "content": instruction, "input": input_text}, {"role": "assistant", "content": output}]
    raise ValueError(
        f"expected keys 'instruction' and 'output' (and optional 'input'), or 'messages'; got {sorted(record)}"
    )


def read_jsonl(path: str, skip_bad_lines: bool, stats: SFTStats) -> Iterator[tuple[int, list[dict]]]:
    """(line number, messages) for each usable line of ``path``; blank lines are ignored."""
    return read_records(path, parse_record, skip_bad_lines, stats, "SFT", SFTDataError)


def tokenize_conversation(messages: list[dict], template: PromptTemplate, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (int64) and trained mask (bool) of one sample, segments tokenized one by one."""
    ids: list[int] = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    mask: list[bool] = [False] * len(ids)
    for text, trained in template.render(messages):
        piece = tokenizer.encode(text)
        ids += piece
        mask += [trained] * len(piece)
    ids.append(tokenizer.eos_id)
    mask.append(True)
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)


def load_sft_samples(
    paths: list[str], tokenizer, template: PromptTemplate, seq_length: int, skip_bad_lines: bool = False
) -> tuple[list[Sample], SFTStats]:
    """Every usable sample of the JSONL files, in file and line order, truncated to ``seq_length``."""
    stats = SFTStats()
    samples = []
    for path in paths:
        for _, messages in read_jsonl(path, skip_bad_lines, stats):
            sample, cut = truncate(tokenize_conversation(messages, template, tokenizer), seq_length)
            if sample is None:  # no trained token left to predict
                stats.dropped_too_long += 1
                continue
            stats.truncated += cut
            samples.append(sample)
    stats.samples = len(samples)
    stats.report_skipped("SFT")
    return samples, stats


def cached_sft_samples(
    path: str,
    tokenizer,
    template: PromptTemplate,
    seq_length: int,
    skip_bad_lines: bool = False,
    cache_dir: Optional[str] = None,
) -> tuple[list[Sample], SFTStats, bool]:
    """:func:`load_sft_samples` of one file, tokenized once and cached like pretraining indices (see
    :func:`megacann.data.jsonl_records.cached_samples`). Returns (samples, stats, whether this call tokenized)."""
    directory = records_cache_dir(path, tokenizer, template, seq_length, skip_bad_lines, cache_dir)
    return cached_samples(
        directory,
        lambda: load_sft_samples([path], tokenizer, template, seq_length, skip_bad_lines),
        SFTStats,
        tokenizer.vocab_size,
    )
