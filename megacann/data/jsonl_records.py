"""JSONL training records, whatever their form (SFT conversations, preference pairs): reading and checking
the lines, counting what was skipped, cut or dropped, truncating tokenized samples, and caching them.

A malformed line raises the caller's error naming the file and line, or with ``skip_bad_lines`` is skipped
and counted (the first few messages kept for the log). Tokenized samples are cached once per file, keyed
by the file, the tokenizer, the template and the settings (:func:`records_cache_dir`), with the counts
beside them so a cached read reports what the tokenizing one saw.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import astuple, dataclass, field
from typing import Any, Callable, Optional, TypeVar

import numpy as np

from megacann.data.cache import cached_npy_dir, digest
from megacann.data.sft_templates import PromptTemplate
from megacann.data.tokenizer import tokenizer_fingerprint

Sample = tuple[np.ndarray, np.ndarray]  # token ids, trained mask
KEPT_ERRORS = 5  # skipped lines' messages kept for the log


@dataclass
class RecordStats:
    """What reading a file of records saw; subclasses add the count of what it yields."""

    lines: int = 0
    bad_lines: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    first_errors: list = field(default_factory=list)

    @classmethod
    def count_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "first_errors"]

    def counts(self) -> np.ndarray:
        return np.array([getattr(self, name) for name in self.count_names()], dtype=np.int64)

    @classmethod
    def from_counts(cls, values: np.ndarray):
        return cls(**{name: int(v) for name, v in zip(cls.count_names(), values.tolist())})

    def report_skipped(self, what: str) -> None:
        """Say on stderr how many lines were skipped, with the first messages."""
        if self.bad_lines:
            shown = "\n  ".join(self.first_errors)
            print(f"[megacann.data] skipped {self.bad_lines} malformed {what} lines, e.g.\n  {shown}", file=sys.stderr)


def read_records(
    path: str,
    parse: Callable[[Any], Any],
    skip_bad_lines: bool,
    stats: RecordStats,
    what: str,
    error: type[Exception],
) -> Iterator[tuple[int, Any]]:
    """(line number, ``parse(record)``) for each usable line of ``path``; blank lines are ignored. A line
    that is not JSON or that ``parse`` rejects (ValueError) raises ``error`` naming the file and line, or
    with ``skip_bad_lines`` is counted in ``stats``."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            stats.lines += 1
            try:
                parsed = parse(json.loads(line))
            except ValueError as err:  # json.JSONDecodeError is a ValueError
                message = f"{path}:{line_no}: malformed {what} record: {err}"
                if not skip_bad_lines:
                    raise error(message + " (set data.skip_bad_lines: true to skip such lines)") from None
                stats.bad_lines += 1
                if len(stats.first_errors) < KEPT_ERRORS:
                    stats.first_errors.append(message)
                continue
            yield line_no, parsed


def prompt_records(path: str, label: str = "") -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) of each non-empty line of the JSONL file ``path``, every record an object with
    a ``prompt`` string (generation requests, evaluation prompts); otherwise a ValueError naming ``label``
    (e.g. the recipe key), the file and the line."""
    prefix = f"{label} " if label else ""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{prefix}{path}:{number}: not a JSON object ({err.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f'{prefix}{path}:{number}: expected an object with a "prompt" string')
            yield number, record


def truncate(sample: Sample, seq_length: int) -> tuple[Optional[Sample], bool]:
    """(the sample's first ``seq_length`` tokens, whether it was cut); None for the sample when no trained
    token is left to predict (a trained token after the first)."""
    ids, mask = sample
    if len(ids) <= seq_length:
        return sample, False
    ids, mask = ids[:seq_length], mask[:seq_length]
    return ((ids, mask) if mask[1:].any() else None), True


CACHE_VERSION = 2  # 2: the counts stored in the order of RecordStats subclasses


def records_cache_dir(
    path: str, tokenizer, template: PromptTemplate, seq_length: int, skip_bad_lines: bool, cache_dir, kind: str = "sft"
) -> str:
    """Where the tokenized samples of JSONL file ``path`` are cached: beside the data (or in ``cache_dir``),
    keyed by the file (path, size, modification time), the tokenizer, the template and the settings.
    ``kind`` names the record format (``sft``; ``dpo`` for preference pairs)."""
    from megacann.data.gpt_dataset import index_cache_dir

    stat = os.stat(path)
    key = digest(
        *(() if kind == "sft" else (kind,)),
        CACHE_VERSION,
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


def samples_to_arrays(samples: list[Sample], vocab_size: int) -> dict[str, np.ndarray]:
    """Samples (ids, trained mask) as three flat arrays for a cache: ids, mask and offsets."""
    lengths = np.array([len(ids) for ids, _ in samples], dtype=np.int64)
    dtype = np.int32 if vocab_size < 2**31 else np.int64
    return {
        "ids": np.concatenate([ids for ids, _ in samples]).astype(dtype) if samples else np.zeros(0, dtype),
        "mask": np.concatenate([m for _, m in samples]) if samples else np.zeros(0, bool),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
    }


def arrays_to_samples(arrays: dict[str, np.ndarray]) -> list[Sample]:
    """The inverse of :func:`samples_to_arrays` (views into the, possibly memory-mapped, arrays)."""
    ids, mask, offsets = arrays["ids"], arrays["mask"], arrays["offsets"].tolist()
    return [(ids[a:b], mask[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]


StatsT = TypeVar("StatsT", bound=RecordStats)


def cached_samples(
    directory: str, load: Callable[[], tuple[list[Sample], StatsT]], stats_type: type[StatsT], vocab_size: int
) -> tuple[list[Sample], StatsT, bool]:
    """``load()``'s samples and counts, tokenized once and cached in ``directory`` like pretraining indices:
    the first process to take the cache's lock runs ``load`` and writes the cache (atomically), the others
    wait and read it, memory-mapped. Returns (samples, stats, whether this call ran ``load``)."""
    built = [False]

    def build() -> dict[str, np.ndarray]:
        built[0] = True
        samples, stats = load()
        return {**samples_to_arrays(samples, vocab_size), "stats": stats.counts()}

    arrays = cached_npy_dir(directory, build)
    return arrays_to_samples(arrays), stats_type.from_counts(arrays["stats"]), built[0]
