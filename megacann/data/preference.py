"""Preference pairs for DPO: JSONL lines -> a chosen and a rejected token sequence sharing one prompt.

Record forms accepted on each line:

* ``{"prompt": "...", "chosen": "...", "rejected": "..."}`` (the prompt becomes one user turn);
* ``{"prompt": [messages], "chosen": ..., "rejected": ...}``: the prompt a conversation (optional system
  message, user/assistant turns alternating, ending with a user turn); each response a string or a list
  holding one ``{"role": "assistant", "content": ...}`` message;
* ``{"chosen": [messages], "rejected": [messages]}``: two whole conversations equal but for their last,
  assistant, message (the prompt is what they share).

Both sequences are ``[BOS] + prompt + response + EOS`` rendered with the SFT template
(:mod:`megacann.data.sft_templates`); only the final response and its EOS are trained (earlier assistant
turns of a multi-turn prompt are prompt). The prompt is tokenized once for both. A sequence longer than
``seq_length`` keeps its first ``seq_length`` tokens; a pair where either side keeps no response token is
dropped and counted. A malformed line raises :class:`PreferenceDataError` naming the file and line, or
with ``skip_bad_lines`` is skipped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from megacann.data.jsonl_records import RecordStats, Sample, cached_samples, read_records, records_cache_dir, truncate
from megacann.data.sft import parse_record
from megacann.data.sft_templates import PromptTemplate
from megacann.errors import MegacannError


class PreferenceDataError(MegacannError, ValueError):
    """A JSONL line that is not a usable preference record."""


@dataclass
class PreferenceStats(RecordStats):
    pairs: int = 0  # truncated counts sequences (chosen or rejected) cut to seq_length

    def summary(self) -> str:
        return (
            f"{self.pairs} preference pairs from {self.lines} lines; {self.bad_lines} bad lines skipped, "
            f"{self.truncated} sequences truncated, {self.dropped_too_long} pairs dropped (response beyond seq_length)"
        )


def _response(value, key: str) -> str:
    """A response given as a string or as a list holding one assistant message."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        message = value[0]
        if message.get("role") == "assistant" and isinstance(message.get("content"), str):
            return message["content"]
    raise ValueError(f"'{key}' must be a string or a list of one {{role: assistant, content: string}} message")


def parse_preference(record) -> tuple[list[dict], str, str]:
    """(prompt messages, chosen response, rejected response) of a record; ValueError says what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    missing = [k for k in ("chosen", "rejected") if k not in record]
    if missing:
        raise ValueError(f"missing {' and '.join(repr(k) for k in missing)}; got keys {sorted(record)}")
    chosen, rejected = record["chosen"], record["rejected"]
    if "prompt" not in record:  # two whole conversations sharing all but their last message
        for key in ("chosen", "rejected"):
            if not isinstance(record[key], list) or len(record[key]) < 2:
                raise ValueError(
                    f"without 'prompt', '{key}' must be a conversation (a list of at least 2 messages); "
                    "or give 'prompt', 'chosen' and 'rejected'"
                )
        if chosen[:-1] != rejected[:-1]:
            raise ValueError("'chosen' and 'rejected' conversations must be equal but for their last message")
        prompt, chosen, rejected = chosen[:-1], chosen[-1:], rejected[-1:]
    else:
        prompt = record["prompt"]
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        elif not isinstance(prompt, list):
            raise ValueError(f"'prompt' must be a string or a list of messages, got {type(prompt).__name__}")
    responses = _response(chosen, "chosen"), _response(rejected, "rejected")
    messages = parse_record({"messages": [*prompt, {"role": "assistant", "content": responses[0]}]})
    return messages[:-1], responses[0], responses[1]


def tokenize_pair(
    prompt: list[dict], chosen: str, rejected: str, template: PromptTemplate, tokenizer
) -> tuple[Sample, Sample]:
    """(chosen, rejected) token ids (int64) and trained masks; the prompt is tokenized once, segment by
    segment as in SFT, and only the final response (and EOS) is trained."""
    head: list[int] = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    segments = template.render([*prompt, {"role": "assistant", "content": ""}])
    for text, _ in segments[:-1]:  # the prompt side, earlier answers included
        head += tokenizer.encode(text)
    suffix = segments[-1][0]  # the template's answer suffix (empty content rendered)
    out = []
    for response in (chosen, rejected):
        answer = tokenizer.encode(response + suffix) + [tokenizer.eos_id]
        ids = np.asarray(head + answer, dtype=np.int64)
        mask = np.zeros(len(ids), dtype=bool)
        mask[len(head) :] = True
        out.append((ids, mask))
    return out[0], out[1]


def load_preference_pairs(
    path: str, tokenizer, template: PromptTemplate, seq_length: int, skip_bad_lines: bool = False
) -> tuple[list[Sample], PreferenceStats]:
    """Every usable pair of a JSONL file as a flat list ``[chosen_0, rejected_0, chosen_1, ...]``."""
    stats = PreferenceStats()
    samples: list[Sample] = []
    for _, (prompt, chosen, rejected) in read_records(
        path, parse_preference, skip_bad_lines, stats, "preference", PreferenceDataError
    ):
        pair = [truncate(side, seq_length) for side in tokenize_pair(prompt, chosen, rejected, template, tokenizer)]
        if any(side is None for side, _ in pair):  # a side with no response token left to predict
            stats.dropped_too_long += 1
            continue
        stats.truncated += sum(cut for _, cut in pair)
        samples += [side for side, _ in pair]
    stats.pairs = len(samples) // 2
    stats.report_skipped("preference")
    return samples, stats


def cached_preference_pairs(
    path: str,
    tokenizer,
    template: PromptTemplate,
    seq_length: int,
    skip_bad_lines: bool = False,
    cache_dir: Optional[str] = None,
) -> tuple[list[Sample], PreferenceStats, bool, str]:
    """:func:`load_preference_pairs`, tokenized once and cached like SFT samples (a lock, an atomic
    write, memory-mapped reads). Returns (samples, stats, whether this call tokenized, the cache directory)."""
    directory = records_cache_dir(path, tokenizer, template, seq_length, skip_bad_lines, cache_dir, kind="dpo")
    samples, stats, built = cached_samples(
        directory,
        lambda: load_preference_pairs(path, tokenizer, template, seq_length, skip_bad_lines),
        PreferenceStats,
        tokenizer.vocab_size,
    )
    return samples, stats, built, directory
