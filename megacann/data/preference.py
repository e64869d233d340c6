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

import json
import sys
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from megacann.data.cache import cached_npy_dir
from megacann.data.sft import arrays_to_samples, parse_record, samples_to_arrays, sft_cache_dir
from megacann.data.sft_templates import PromptTemplate
from megacann.errors import MegacannError

Sample = tuple[np.ndarray, np.ndarray]  # token ids, trained mask


class PreferenceDataError(MegacannError, ValueError):
    """A JSONL line that is not a usable preference record."""


@dataclass
class PreferenceStats:
    lines: int = 0
    pairs: int = 0
    bad_lines: int = 0
    truncated: int = 0  # sequences (chosen or rejected) cut to seq_length
    dropped_too_long: int = 0  # pairs whose response starts at or beyond seq_length
    first_errors: list = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.pairs} preference pairs from {self.lines} lines; {self.bad_lines} bad lines skipped, "
            f"{self.truncated} sequences truncated, {self.dropped_too_long} pairs dropped (response beyond seq_length)"
        )


_STAT_FIELDS = ("lines", "pairs", "bad_lines", "truncated", "dropped_too_long")


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
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            stats.lines += 1
            try:
                prompt, chosen, rejected = parse_preference(json.loads(line))
            except ValueError as err:  # json.JSONDecodeError is a ValueError
                message = f"{path}:{line_no}: malformed preference record: {err}"
                if not skip_bad_lines:
                    raise PreferenceDataError(message + " (set data.skip_bad_lines: true to skip such lines)") from None
                stats.bad_lines += 1
                if len(stats.first_errors) < 5:
                    stats.first_errors.append(message)
                continue
            pair = tokenize_pair(prompt, chosen, rejected, template, tokenizer)
            cut = sum(len(ids) > seq_length for ids, _ in pair)
            pair = [(ids[:seq_length], mask[:seq_length]) for ids, mask in pair]
            if not all(mask[1:].any() for _, mask in pair):  # a side with no response token left to predict
                stats.dropped_too_long += 1
                continue
            stats.truncated += cut
            samples += pair
    stats.pairs = len(samples) // 2
    if stats.bad_lines:
        shown = "\n  ".join(stats.first_errors)
        print(f"[megacann.data] skipped {stats.bad_lines} malformed preference lines, e.g.\n  {shown}", file=sys.stderr)
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
    built = [False]

    def build() -> dict[str, np.ndarray]:
        built[0] = True
        samples, stats = load_preference_pairs(path, tokenizer, template, seq_length, skip_bad_lines)
        stat_values = np.array([getattr(stats, f) for f in _STAT_FIELDS], dtype=np.int64)
        return {**samples_to_arrays(samples, tokenizer.vocab_size), "stats": stat_values}

    directory = sft_cache_dir(path, tokenizer, template, seq_length, skip_bad_lines, cache_dir, kind="dpo")
    arrays = cached_npy_dir(directory, build)
    stats = PreferenceStats(**{f: int(v) for f, v in zip(_STAT_FIELDS, arrays["stats"].tolist())})
    return arrays_to_samples(arrays), stats, built[0], directory
