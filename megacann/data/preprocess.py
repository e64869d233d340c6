"""``megacann-preprocess``: text / JSONL -> a Megatron ``.bin``/``.idx`` pair, streaming and multiprocess.

    megacann-preprocess --input PATH [--input PATH ...] --output_prefix P --tokenizer T \\
        [--workers N] [--json_key text] [--append_eod] [--train_tokenizer VOCAB]

Inputs are files or directories (searched recursively for ``*.jsonl``/``*.json``, read as JSON lines with
the text under ``--json_key``, and ``*.txt``/``*.md``/``*.rst``/``*.py`` text files). One input document
(a JSON line; a text file, or with ``--text_unit line`` each non-empty line) becomes one sequence. Documents
are read lazily and tokenized in chunks by ``--workers`` single-threaded processes with a bounded number
of chunks in flight, so memory stays flat however large the input (the index keeps 12 bytes per document).
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Iterator
from typing import Optional

import numpy as np

from megacann.data.default_corpus import default_tokenizer
from megacann.data.indexed_dataset import IndexedDatasetBuilder, dtype_for_vocab, strip_suffix
from megacann.data.progress import ProgressBar
from megacann.data.tokenizer import TokenizerError, load_tokenizer, train_bpe
from megacann.errors import MegacannError

JSON_EXTS = (".jsonl", ".json")
TEXT_EXTS = (".txt", ".text", ".md", ".rst", ".py")
CHUNK_BYTES = 1 << 20  # characters of text per task
CHUNK_DOCS = 2048
TOKENIZER_HINT = (
    "use --tokenizer default (the BPE trained on the default corpus, cached on first use), --tokenizer byte, "
    "or --train_tokenizer N --tokenizer DIR to train an N-token byte-level BPE on these inputs first and save it in DIR"
)


class PreprocessError(MegacannError, ValueError):
    """An input that cannot be preprocessed as asked."""


def list_inputs(paths: list[str]) -> list[str]:
    """Input files: files as given, directories walked recursively (sorted) for known extensions."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = []
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                found += [os.path.join(dirpath, f) for f in filenames if f.endswith(JSON_EXTS + TEXT_EXTS)]
            if not found:
                raise PreprocessError(f"--input {path}: no {', '.join(JSON_EXTS + TEXT_EXTS)} files in this directory")
            files += sorted(found)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise PreprocessError(f"--input {path}: no such file or directory")
    return files


class BytesRead:
    """Bytes of input read so far (what the progress bar measures against the inputs' total size)."""

    def __init__(self) -> None:
        self.count = 0


def iter_documents(
    files: list[str], json_key: str, text_unit: str = "file", read: Optional[BytesRead] = None
) -> Iterator[str]:
    """Documents of the input files, one at a time (``read`` counts the bytes consumed)."""
    for path in files:
        if path.endswith(JSON_EXTS):
            with open(path, encoding="utf-8") as f:
                for line_no, line in enumerate(f, start=1):
                    if read is not None:
                        read.count += len(line.encode("utf-8"))
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise PreprocessError(f"{path}:{line_no}: not valid JSON ({err})") from None
                    if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
                        raise PreprocessError(
                            f"{path}:{line_no}: expected a JSON object with a string under key {json_key!r} "
                            f"(choose the key with --json_key)"
                        )
                    yield record[json_key]
        elif text_unit == "line":
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if read is not None:
                        read.count += len(line.encode("utf-8"))
                    if line.strip():
                        yield line.rstrip("\n")
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            if read is not None:
                read.count += os.path.getsize(path)
            yield text


def chunk_documents(docs: Iterator[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc)
        if size >= CHUNK_BYTES or len(chunk) >= CHUNK_DOCS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


_WORKER_TOKENIZER = None


def _init_worker(spec: str) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = load_tokenizer(spec)


def _encode_chunk(texts: list[str], append_eod: bool, dtype: str, tokenizer=None) -> list[np.ndarray]:
    tok = tokenizer or _WORKER_TOKENIZER
    encoded = tok.encode_batch(texts)
    if append_eod:
        encoded = [ids + [tok.eos_id] for ids in encoded]
    return [np.asarray(ids, dtype=dtype) for ids in encoded]


class Tally:
    """Documents, tokens and characters written, drawn on the progress bar as bytes of input are read."""

    def __init__(self, bar: ProgressBar, read: BytesRead):
        self.bar, self.read = bar, read
        self.docs = self.tokens = self.chars = 0

    def update(self, docs: int, tokens: int, chars: int) -> None:
        self.docs += docs
        self.tokens += tokens
        self.chars += chars
        elapsed = max(time.perf_counter() - self.bar.start, 1e-9)
        detail = f"{self.docs:,} docs | {self.tokens:,} tokens | {self.tokens / elapsed:,.0f} tokens/s"
        self.bar.advance(self.read.count / 2**20 - self.bar.done, detail)


def preprocess(
    files: list[str],
    output_prefix: str,
    tokenizer_spec: str,
    workers: int = 1,
    json_key: str = "text",
    append_eod: bool = False,
    text_unit: str = "file",
    progress: bool = True,
) -> dict:
    """Tokenize ``files`` into ``output_prefix``.bin/.idx; returns counts and throughput."""
    tokenizer = load_tokenizer(tokenizer_spec)
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    read = BytesRead()
    chunks = chunk_documents(iter_documents(files, json_key, text_unit, read))
    total_mib = sum(os.path.getsize(f) for f in files) / 2**20
    bar = Tally(ProgressBar("tokenizing", total_mib, "MiB read", enabled=progress), read)
    builder = IndexedDatasetBuilder(output_prefix, dtype)
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: --workers means what it says
    try:
        if workers <= 1:
            results = (
                (_encode_chunk(chunk, append_eod, dtype.str, tokenizer), sum(map(len, chunk))) for chunk in chunks
            )
            _write_all(results, builder, bar)
        else:
            with mp.get_context("spawn").Pool(workers, _init_worker, (tokenizer_spec,)) as pool:
                _write_all(_bounded_map(pool, chunks, append_eod, dtype.str, 2 * workers), builder, bar)
    except BaseException:
        builder.abort()
        raise
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    builder.finalize()
    seconds = bar.bar.close()
    return {
        "documents": bar.docs,
        "tokens": bar.tokens,
        "characters": bar.chars,
        "seconds": seconds,
        "tokens_per_second": bar.tokens / max(seconds, 1e-9),
        "dtype": str(dtype),
    }


def _bounded_map(pool, chunks: Iterator[list[str]], append_eod: bool, dtype: str, in_flight: int):
    """Results of ``_encode_chunk`` in input order, never more than ``in_flight`` chunks queued."""
    pending: collections.deque = collections.deque()
    for chunk in chunks:
        pending.append((pool.apply_async(_encode_chunk, (chunk, append_eod, dtype)), sum(map(len, chunk))))
        if len(pending) >= in_flight:
            result, chars = pending.popleft()
            yield result.get(), chars
    while pending:
        result, chars = pending.popleft()
        yield result.get(), chars


def _write_all(results, builder: IndexedDatasetBuilder, bar: Tally) -> None:
    for arrays, chars in results:
        for array in arrays:
            builder.add_document(array)
        bar.update(len(arrays), sum(int(a.size) for a in arrays), chars)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megacann-preprocess", description="Tokenize text or JSONL into a Megatron-compatible .bin/.idx pair."
    )
    p.add_argument("--input", action="append", required=True, help="file or directory (repeatable)")
    p.add_argument("--output_prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument(
        "--tokenizer",
        required=True,
        help="'byte', 'default' (the BPE of the default corpus), a tokenizer.json, a tokenizer directory or a SentencePiece .model "
        "(with --train_tokenizer: the directory to save the new tokenizer in)",
    )
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    p.add_argument("--json_key", default="text", help="key of the text in JSONL records (default 'text')")
    p.add_argument("--append_eod", action="store_true", help="append the tokenizer's EOS to every document")
    p.add_argument("--text_unit", choices=("file", "line"), default="file", help="document unit of text files")
    p.add_argument("--train_tokenizer", type=int, metavar="VOCAB", help="first train a byte-level BPE of VOCAB tokens")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        files = list_inputs(args.input)
        if args.tokenizer == "default" and not args.train_tokenizer:
            args.tokenizer = default_tokenizer().path
        if args.train_tokenizer:
            start = time.perf_counter()
            train_bpe(iter_documents(files, args.json_key, args.text_unit), args.train_tokenizer, args.tokenizer)
            print(
                f"trained a {args.train_tokenizer}-token BPE in {time.perf_counter() - start:.1f} s -> {args.tokenizer}"
            )
        stats = preprocess(
            files,
            strip_suffix(args.output_prefix),
            args.tokenizer,
            workers=args.workers,
            json_key=args.json_key,
            append_eod=args.append_eod,
            text_unit=args.text_unit,
            progress=not args.quiet,
        )
    except TokenizerError as err:
        print(f"megacann-preprocess: error: {err}; {TOKENIZER_HINT}", file=sys.stderr)
        return 1
    except (PreprocessError, ValueError, OSError) as err:
        print(f"megacann-preprocess: error: {err}", file=sys.stderr)
        return 1
    prefix = strip_suffix(args.output_prefix)
    print(
        f"wrote {prefix}.bin/.idx: {stats['documents']:,} documents, {stats['tokens']:,} tokens ({stats['dtype']}) "
        f"in {stats['seconds']:.1f} s = {stats['tokens_per_second']:,.0f} tokens/s with {args.workers} worker(s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
