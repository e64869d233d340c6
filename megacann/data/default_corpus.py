"""The embedded default corpus: the running interpreter's standard-library ``.py`` sources.

Real text on every machine, nothing fetched. Files come from ``sysconfig``'s ``stdlib`` path; third-party
packages (site-packages, dist-packages), the interpreter's own test suites (``test/``, ``tests/``,
``idle_test/``, which some distributions strip), build configuration (``config-*``) and the
machine-specific ``_sysconfigdata*`` module are left out, so the same Python version gives the same corpus
everywhere. Documents are ordered by a hash of their relative path, which spreads the held-out split over
the whole library instead of its last letters.

A byte-level BPE of ``vocab_size`` tokens is trained on the corpus and the corpus is tokenized with it
(EOS after each file); both are cached under ``<cache root>/default_corpus/py<version>-<files digest>/``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
import time

from megacann.data.cache import cache_root, digest, file_lock, publish_dir
from megacann.data.indexed_dataset import IndexedDatasetBuilder, dtype_for_vocab, exists
from megacann.data.progress import ProgressBar
from megacann.data.tokenizer import HFTokenizer, tokenizer_fingerprint, train_bpe

EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
ENCODE_CHUNK = 64  # files per encode_batch call


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_sources(root: str | None = None) -> list[str]:
    """Relative paths of the corpus files under ``root`` (default: the stdlib), in corpus order."""
    root = root or stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("config-")]
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                found.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    return sorted(found, key=lambda rel: (hashlib.sha1(rel.encode()).hexdigest(), rel))


def read_sources(relpaths: list[str], root: str | None = None) -> list[str]:
    root = root or stdlib_root()
    texts = []
    for rel in relpaths:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    return texts


def corpus_dir(cache_dir: str | None = None) -> str:
    """The cache folder of this interpreter's corpus (keyed by Python version and the file list)."""
    root = stdlib_root()
    relpaths = stdlib_sources(root)
    sizes = [os.path.getsize(os.path.join(root, rel)) for rel in relpaths]
    version = ".".join(str(v) for v in sys.version_info[:3])
    return os.path.join(cache_root(cache_dir), "default_corpus", f"py{version}-{digest(relpaths, sizes, length=10)}")


def default_tokenizer(cache_dir: str | None = None, vocab_size: int = 8192, verbose: bool = True) -> HFTokenizer:
    """The byte-level BPE trained on the default corpus (trained once, then loaded from the cache)."""
    directory = os.path.join(corpus_dir(cache_dir), f"tokenizer-v{vocab_size}")
    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return HFTokenizer(directory)
    with file_lock(directory + ".lock"):
        if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
            start = time.perf_counter()
            texts = read_sources(stdlib_sources())
            tmp = tempfile.mkdtemp(dir=os.path.dirname(directory), prefix=".tmp-tokenizer-")
            try:
                train_bpe(texts, vocab_size, tmp, show_progress=verbose and sys.stderr.isatty())
                publish_dir(tmp, directory)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            _say(
                verbose,
                f"trained the default BPE tokenizer ({vocab_size} tokens) in {time.perf_counter() - start:.1f} s",
            )
    return HFTokenizer(directory)


def default_corpus_prefix(tokenizer, cache_dir: str | None = None, verbose: bool = True) -> str:
    """Prefix of the ``.bin``/``.idx`` pair of the default corpus tokenized by ``tokenizer`` (cached)."""
    prefix = os.path.join(corpus_dir(cache_dir), f"corpus-{tokenizer_fingerprint(tokenizer)}")
    if exists(prefix):
        return prefix
    with file_lock(prefix + ".lock"):
        if not exists(prefix):
            start = time.perf_counter()
            relpaths = stdlib_sources()
            builder = IndexedDatasetBuilder(prefix, dtype_for_vocab(tokenizer.vocab_size))
            bar = ProgressBar("tokenizing the default corpus", len(relpaths), "files", enabled=verbose)
            try:
                for i in range(0, len(relpaths), ENCODE_CHUNK):
                    batch = relpaths[i : i + ENCODE_CHUNK]
                    for ids in tokenizer.encode_batch(read_sources(batch)):
                        builder.add_document(ids + [tokenizer.eos_id])
                    bar.advance(len(batch))
            except BaseException:
                builder.abort()
                raise
            builder.finalize()
            bar.close()
            _say(
                verbose, f"tokenized the default corpus ({len(relpaths)} files) in {time.perf_counter() - start:.1f} s"
            )
    return prefix


def _say(verbose: bool, message: str) -> None:
    if verbose:
        print(f"[megacann.data] {message}", file=sys.stderr, flush=True)
