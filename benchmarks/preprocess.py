"""Data pipeline speed: preprocessing tokens/s with 1 and 2 workers, and loader samples/s against training.

    python benchmarks/preprocess.py [--workers 1 2] [--repeat 3] [--batches 400] [--cache_dir DIR]

Preprocessing input: the default corpus's files (the interpreter's stdlib sources), tokenized with the
default BPE (trained and cached on first use, like the default job). Each worker is one single-threaded
process, so the 2-worker row against the 1-worker row is the scaling ratio measured in the same run.

Loader: the tiny recipe's data settings (default corpus, seq_length 256, micro-batch 8, 2 workers). It is
compared with what training consumes: ASSUMED 8 samples of 256 tokens per step at about 2 steps/s on a
2-core CPU (16 samples/s), the tiny recipe's rate; change it with --train_samples_per_s. The issue asks
the loader to be at least 10x faster than that.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megacann.data.default_corpus import default_tokenizer, stdlib_root, stdlib_sources  # noqa: E402
from megacann.data.preprocess import preprocess  # noqa: E402


def bench_preprocess(workers: list[int], cache_dir: str | None, repeat: int) -> list[dict]:
    """Best of ``repeat`` runs per worker count, interleaved so that load from other processes on a shared
    machine spreads over every count (the fastest run is the least disturbed one)."""
    tokenizer = default_tokenizer(cache_dir)
    files = [os.path.join(stdlib_root(), rel) for rel in stdlib_sources()]
    best: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeat):
            for n in workers:
                stats = preprocess(
                    files, os.path.join(tmp, f"w{n}"), tokenizer.path, workers=n, append_eod=True, progress=False
                )
                if n not in best or stats["seconds"] < best[n]["seconds"]:
                    best[n] = {"workers": n, **stats}
    for n in workers:
        row = best[n]
        print(
            f"preprocess  workers={n}: {row['tokens']:,} tokens in {row['seconds']:.2f} s = "
            f"{row['tokens_per_second']:,.0f} tokens/s (best of {repeat})"
        )
    return [best[n] for n in workers]


def bench_loader(batches: int, num_workers: int, cache_dir: str | None, train_rate: float) -> dict:
    # Imported here: the spawned preprocessing workers re-import this file and need no torch.
    from megacann.config import MegacannConfig
    from megacann.data import build_data_iterators, build_tokenizer

    cfg = MegacannConfig()
    cfg.data.seq_length, cfg.data.batch_size, cfg.data.num_workers = 256, 8, num_workers
    cfg.data.persistent_workers = num_workers > 0
    cfg.data.cache_dir = cache_dir
    cfg.distributed.data_parallel_size = 1
    cfg.optim.max_steps = batches + 10
    tokenizer = build_tokenizer(cfg)
    start = time.perf_counter()
    data = build_data_iterators(cfg, tokenizer)
    next(data.train)  # worker start-up, reported apart
    setup = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(batches):
        next(data.train)
    seconds = time.perf_counter() - start
    rate = batches * cfg.data.batch_size / seconds
    print(
        f"loader      workers={num_workers}: {rate:,.0f} samples/s ({batches} micro-batches of 8x256; "
        f"start-up {setup:.2f} s) = {rate / train_rate:,.0f}x training's {train_rate:g} samples/s"
    )
    return {
        "num_workers": num_workers,
        "samples_per_second": rate,
        "setup_seconds": setup,
        "ratio_vs_training": rate / train_rate,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="preprocessing worker counts")
    p.add_argument("--repeat", type=int, default=3, help="preprocessing runs per worker count (best is kept)")
    p.add_argument("--batches", type=int, default=400, help="loader micro-batches to time")
    p.add_argument("--loader_workers", type=int, nargs="+", default=[2, 0])
    p.add_argument("--train_samples_per_s", type=float, default=16.0, help="assumed training consumption")
    p.add_argument("--cache_dir", default=None, help="default corpus / index cache (default: the user cache)")
    args = p.parse_args(argv)
    pre = bench_preprocess(args.workers, args.cache_dir, args.repeat)
    if len(pre) >= 2:
        print(
            f"preprocess  scaling {pre[-1]['workers']} vs {pre[0]['workers']} workers: {pre[-1]['tokens_per_second'] / pre[0]['tokens_per_second']:.2f}x"
        )
    loader = [bench_loader(args.batches, n, args.cache_dir, args.train_samples_per_s) for n in args.loader_workers]
    ok = all(row["ratio_vs_training"] >= 10 for row in loader)
    print(f"loader at least 10x faster than training consumes: {'yes' if ok else 'NO'}")
    print(json.dumps({"preprocess": pre, "loader": loader, "assumed_train_samples_per_s": args.train_samples_per_s}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
