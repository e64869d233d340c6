"""DualPipeV with and without its overlap: step time and exposed all-to-all time at pp 2 x ep 2 (MoE), on
CPU with gloo, in one run.

    python benchmarks/dualpipev_overlap.py [--micro_batches 8] [--steps 2] [--repeat 2] [--hidden 128]

Four processes (pp 2 x ep 2) train a small MoE model with ``pipeline_schedule: dualpipev``, once with
``distributed.dualpipev_overlap`` on (each pair's backward on a second thread, megacann.pipeline.overlap)
and once off (pairs back to back), in turn, ``--repeat`` times; each case keeps its fastest run. Every
``all_to_all_single`` (the MoE dispatch and combine, their counts, and their backward) is timed on the
thread that runs it, as the call and, when asynchronous, its wait. Exposed all-to-all time is the part of
those intervals during which no other thread of the rank computes: back to back all of it; with the
overlap, a thread's wait is hidden while the other thread of its pair runs something other than an
all-to-all. Reported per step, the mean over ranks, with the ratio overlap / back to back.

Each process runs one intra-op thread; a rank with the overlap runs two threads. With fewer idle cores
than threads the two halves of a pair compete for a core, so compute does not speed up; what can shrink
is the time a rank waits for its expert-parallel peer.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

from bench_common import random_token_trainer  # first: puts the checkout and tests/ on sys.path
from dist_harness import run_on_ranks


class _TimedWork:
    """An asynchronous all-to-all whose wait is timed on the thread that waits."""

    def __init__(self, work, book):
        self._work, self._book = work, book

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._book(start, time.perf_counter())


def _time_all_to_all(record: list) -> None:
    """Patch torch.distributed.all_to_all_single to append (thread id, start, end) of each call and wait."""
    import torch.distributed as dist

    original = dist.all_to_all_single

    def book(start: float, end: float) -> None:
        record.append((threading.get_ident(), start, end))

    def timed(*args, **kwargs):
        start = time.perf_counter()
        work = original(*args, **kwargs)
        book(start, time.perf_counter())
        return _TimedWork(work, book) if kwargs.get("async_op") else work

    dist.all_to_all_single = timed


def _length(intervals: list) -> float:
    """Total length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _clip(intervals: list, start: float, end: float) -> list:
    return [(max(s, start), min(e, end)) for s, e in intervals if min(e, end) > max(s, start)]


def exposed(comm: list, busy: list) -> float:
    """Seconds of ``comm`` (thread, start, end) during which no other thread is in a ``busy`` interval
    (thread, start, end) outside its own all-to-all."""
    hidden = 0.0
    for thread, start, end in comm:
        others = [(s, e) for t, s, e in busy if t != thread]
        other_comm = [(s, e) for t, s, e in comm if t != thread]
        working = _clip(others, start, end)
        waiting = _clip(other_comm, start, end)
        # time the other thread works here = its busy time minus the part spent in its own all-to-all
        hidden += _length(working) - _length(
            [(max(a, c), min(b, d)) for a, b in working for c, d in waiting if min(b, d) > max(a, c)]
        )
    return sum(e - s for _, s, e in comm) - hidden


def _rank(args: argparse.Namespace, overlap: bool) -> dict:
    import functools
    import warnings

    warnings.simplefilter("ignore")
    recipe = {
        "experiment": {"name": "dualpipev_overlap", "output_dir": "/tmp/megacann-dualpipev-overlap"},
        "model": {
            "type": "moe",
            "precision": "fp32",
            "hidden_size": args.hidden,
            "num_layers": 4,
            "num_attention_heads": 4,
            "ffn_hidden_size": 2 * args.hidden,
            "num_experts": 4,
            "moe_top_k": 2,
            "moe_ffn_hidden_size": args.hidden,
            "vocab_size": 512,
            "max_position_embeddings": args.seq_length,
        },
        "data": {"seq_length": args.seq_length, "batch_size": args.micro_batch},
        "optim": {"grad_accum_steps": args.micro_batches, "max_steps": args.steps + 1},
        "distributed": {
            "pipeline_parallel_size": 2,
            "expert_parallel_size": 2,
            "pipeline_schedule": "dualpipev",
            "dualpipev_overlap": overlap,
        },
        "logging": {"ckpt_interval": 0},
    }
    with random_token_trainer(recipe) as trainer:
        trainer.train_step()  # warm-up
        comm: list = []
        _time_all_to_all(comm)
        schedule = trainer.forward_backward
        steps, exposed_s, comm_s, pairs = [], [], [], []
        for _ in range(args.steps):
            comm.clear()
            probe: list = []
            trainer.forward_backward = functools.partial(schedule, probe=probe)
            start = time.perf_counter()
            trainer.train_step()
            steps.append(time.perf_counter() - start)
            busy = [(t, s, e) for _, t, s, e in probe]
            exposed_s.append(exposed(comm, busy))
            comm_s.append(sum(e - s for _, s, e in comm))
            pairs.append(len(probe) // 2)
    return {"step": steps, "exposed": exposed_s, "comm": comm_s, "pairs": pairs}


def measure(overlap: bool, args: argparse.Namespace) -> list[dict]:
    """Each of the four ranks' figures (pp 2 x ep 2), in rank order."""
    return run_on_ranks(_rank, 4, args=(args, overlap), timeout=3600, init_process_group=False)


def summary(per_rank: list[dict], steps: int) -> dict:
    """Per step: the slowest rank's step time; exposed and total all-to-all time, the mean over ranks."""
    return {
        "step": sum(max(r["step"][i] for r in per_rank) for i in range(steps)) / steps,
        "exposed": sum(sum(r["exposed"]) for r in per_rank) / len(per_rank) / steps,
        "comm": sum(sum(r["comm"]) for r in per_rank) / len(per_rank) / steps,
        "pairs": per_rank[0]["pairs"][0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro_batches", type=int, default=8, help="grad_accum_steps m (>= 4 for pp 2)")
    parser.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up step")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq_length", type=int, default=128)
    parser.add_argument("--micro_batch", type=int, default=2)
    parser.add_argument(
        "--repeat", type=int, default=2, help="run both cases this many times in turn, keep the fastest"
    )
    args = parser.parse_args()
    print(
        f"dualpipev pp 2 x ep 2 on CPU/gloo: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, MoE 4 layers "
        f"hidden {args.hidden}, 4 experts top 2, micro-batch {args.micro_batch} x seq {args.seq_length}, "
        f"m = {args.micro_batches}, {args.steps} measured steps, best of {args.repeat}"
    )
    best: dict = {}
    for _ in range(args.repeat):
        for overlap in (True, False):
            got = summary(measure(overlap, args), args.steps)
            if overlap not in best or got["step"] < best[overlap]["step"]:
                best[overlap] = got
    print(f"{'pairs':<12} {'pairs/step':>10} {'step s':>8} {'all-to-all s':>13} {'exposed s':>10}")
    for overlap, name in ((False, "back to back"), (True, "overlapped")):
        r = best[overlap]
        print(f"{name:<12} {r['pairs']:>10} {r['step']:>8.3f} {r['comm']:>13.3f} {r['exposed']:>10.3f}")
    on, off = best[True], best[False]
    print(
        f"overlapped / back to back: step {on['step'] / off['step']:.2f}x, exposed all-to-all "
        f"{on['exposed'] / off['exposed']:.2f}x (load at the end {os.getloadavg()[0]:.1f})"
    )


if __name__ == "__main__":
    main()
