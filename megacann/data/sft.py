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

import json
import os
import sys
from collections.abc import Iterator
from dataclasses import astuple, dataclass, field
from typing import Optional

import numpy as np

from megacann.data.cache import cached_npy_dir, digest
from megacann.data.sft_templates import PromptTemplate
from megacann.data.tokenizer import tokenizer_fingerprint
from megacann.errors import MegacannError

ROLES = ("system", "user", "assistant")


class SFTDataError(MegacannError, ValueError):
    """A JSONL line that is not a usable SFT record."""


@dataclass
class SFTStats:
    lines: int = 0
    samples: int = 0
    bad_lines: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    first_errors: list = field(default_factory=list)

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
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            stats.lines += 1
            try:
                messages = parse_record(json.loads(line))
            except ValueError as err:  # json.JSONDecodeError is a ValueError
                message = f"{path}:{line_no}: malformed SFT record: {err}"
                if not skip_bad_lines:
                    raise SFTDataError(message + " (set data.skip_bad_lines: true to skip such lines)") from None
                stats.bad_lines += 1
                if len(stats.first_errors) < 5:
                    stats.first_errors.append(message)
                continue
            yield line_no, messages


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
) -> tuple[list[tuple[np.ndarray, np.ndarray]], SFTStats]:
    """Every usable sample of the JSONL files, in file and line order, truncated to ``seq_length``."""
    stats = SFTStats()
    samples = []
    for path in paths:
        for _, messages in read_jsonl(path, skip_bad_lines, stats):
            ids, mask = tokenize_conversation(messages, template, tokenizer)
            if len(ids) > seq_length:
                ids, mask = ids[:seq_length], mask[:seq_length]
                if not mask[1:].any():  # no trained token left to predict
                    stats.dropped_too_long += 1
                    continue
                stats.truncated += 1
            samples.append((ids, mask))
    stats.samples = len(samples)
    if stats.bad_lines:
        shown = "\n  ".join(stats.first_errors)
        print(f"[megacann.data] skipped {stats.bad_lines} malformed SFT lines, e.g.\n  {shown}", file=sys.stderr)
    return samples, stats


SFT_CACHE_VERSION = 1
_STAT_FIELDS = ("lines", "samples", "bad_lines", "truncated", "dropped_too_long")


def sft_cache_dir(
    path: str, tokenizer, template: PromptTemplate, seq_length: int, skip_bad_lines: bool, cache_dir, kind: str = "sft"
):
    """Where the tokenized samples of JSONL file ``path`` are cached: beside the data (or in ``cache_dir``),
    keyed by the file (path, size, modification time), the tokenizer, the template and the settings.
    ``kind`` names the record format (``sft``; ``dpo`` for preference pairs)."""
    from megacann.data.gpt_dataset import index_cache_dir

    stat = os.stat(path)
    key = digest(
        *(() if kind == "sft" else (kind,)),
        SFT_CACHE_VERSION,
        os.path.realpath(path),
        stat.st_size,
        stat.st_mtime_ns,
        tokenizer_fingerprint(tokenizer),
        tokenizer.bos_id,
        tokenizer.eos_id,
        astuple(template),
        seq_length,
        skip_bad_lines,
    )
    name = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(index_cache_dir(path, cache_dir), f"{kind}-{name}-{key}")


def samples_to_arrays(samples: list[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> dict[str, np.ndarray]:
    """Samples (ids, trained mask) as three flat arrays for a cache: ids, mask and offsets."""
    lengths = np.array([len(ids) for ids, _ in samples], dtype=np.int64)
    dtype = np.int32 if vocab_size < 2**31 else np.int64
    return {
        "ids": np.concatenate([ids for ids, _ in samples]).astype(dtype) if samples else np.zeros(0, dtype),
        "mask": np.concatenate([m for _, m in samples]) if samples else np.zeros(0, bool),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
    }


def arrays_to_samples(arrays: dict[str, np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The inverse of :func:`samples_to_arrays` (views into the, possibly memory-mapped, arrays)."""
    ids, mask, offsets = arrays["ids"], arrays["mask"], arrays["offsets"].tolist()
    return [(ids[a:b], mask[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]


def cached_sft_samples(
    path: str,
    tokenizer,
    template: PromptTemplate,
    seq_length: int,
    skip_bad_lines: bool = False,
    cache_dir: Optional[str] = None,
) -> tuple[list[tuple[np.ndarray, np.ndarray]], SFTStats, bool]:
    """:func:`load_sft_samples` of one file, tokenized once and cached like pretraining indices: the first
    process to take the cache's lock tokenizes and writes it (atomically), the others wait and read it,
    memory-mapped. Returns (samples, stats, whether this call tokenized)."""
    built = [False]

    def build() -> dict[str, np.ndarray]:
        built[0] = True
        samples, stats = load_sft_samples([path], tokenizer, template, seq_length, skip_bad_lines)
        stat_values = np.array([getattr(stats, f) for f in _STAT_FIELDS], dtype=np.int64)
        return {**samples_to_arrays(samples, tokenizer.vocab_size), "stats": stat_values}

    directory = sft_cache_dir(path, tokenizer, template, seq_length, skip_bad_lines, cache_dir)
    arrays = cached_npy_dir(directory, build)
    samples = arrays_to_samples(arrays)
    stats = SFTStats(**{f: int(v) for f, v in zip(_STAT_FIELDS, arrays["stats"].tolist())})
    return samples, stats, built[0]
