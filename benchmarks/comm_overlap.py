"""Exposed communication time of a training step with and without each overlap, in one run (gloo, CPU).

    python benchmarks/comm_overlap.py [--steps 3 --rounds 2 --hidden 256 --layers 4 --ffn 688 --seq 256
                                       --batch 4 --only dp|tp]

Two gloo ranks (CPU processes, one thread each) train a small LLaMA with the trainer; per layout the
variants below are built side by side and take turns, ``--steps`` steps each per round, after one warm-up
step each:

- data parallelism 2 with ZeRO-2 (gradients reduce-scattered, parameters all-gathered):
  ``none`` (both collectives after backward / in the optimizer step), ``grad`` (``distributed.
  overlap_grad_reduce``: each bucket's reduce-scatter starts during backward), ``grad+param`` (also
  ``distributed.overlap_param_gather``: the all-gather runs behind the next forward);
- tensor parallelism 2 with sequence parallelism: ``none`` (each all-gather / reduce-scatter of the
  linear layers waited for where it is issued) and ``tp_overlap`` (``distributed.tp_comm_overlap``: the
  column-parallel layer's backward reduce-scatter of the input gradient runs while the weight gradient
  is computed).

Exposed communication is the wall time the training thread spends blocked in a collective: inside a
synchronous ``torch.distributed`` collective, or in ``Work.wait()`` of an asynchronous one (both are
wrapped with a timer here; nothing else changes). A collective that finishes while the thread computes
costs nothing there. Printed per variant: step time, exposed communication per step, and both as ratios
to ``none`` of the same layout. On a 2-core machine gloo's transport competes with the compute for the
cores, so hidden communication can still slow the compute: read the step ratio beside the exposed one.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_common import RandomTokens, add_int_args, add_llama_size_args, llama_model, two_rank_header  # first
from dist_harness import run_on_ranks  # the tests' gloo launcher: N ranks, hard timeout

LAYOUTS = {
    "dp": {
        "none": ["distributed.zero_optimization=2"],
        "grad": ["distributed.zero_optimization=2", "distributed.overlap_grad_reduce=true"],
        "grad+param": [
            "distributed.zero_optimization=2",
            "distributed.overlap_grad_reduce=true",
            "distributed.overlap_param_gather=true",
        ],
    },
    "tp": {
        "none": ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"],
        "tp_overlap": [
            "distributed.tensor_parallel_size=2",
            "distributed.sequence_parallel=true",
            "distributed.tp_comm_overlap=true",
        ],
    },
}
_SYNC_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "barrier",
    "send",
    "recv",
)


class BlockedClock:
    """Seconds the calling thread spent blocked in collectives since the last :meth:`take`."""

    def __init__(self):
        self.seconds = 0.0

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def timed(self, fn):
        def wrapper(*args, **kwargs):
            if kwargs.get("async_op"):
                return fn(*args, **kwargs)  # its wait is timed
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return wrapper

    def install(self) -> None:
        import torch.distributed as dist

        from megacann import collectives

        for name in _SYNC_COLLECTIVES:
            setattr(dist, name, self.timed(getattr(dist, name)))
        for name in ("_all_gather_base", "_reduce_scatter_base"):  # bound at import by megacann.collectives
            setattr(collectives, name, self.timed(getattr(collectives, name)))
        wait = dist.Work.wait
        clock = self

        def timed_wait(work, *args, **kwargs):
            start = time.perf_counter()
            try:
                return wait(work, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - start

        dist.Work.wait = timed_wait


def _trainer(args, overrides: list[str]):
    import torch.distributed as dist

    from megacann import parallel_state as ps
    from megacann.config import apply_overrides, config_from_dict, validate
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    raw = {
        "model": llama_model("fp32", args.hidden, args.layers, args.ffn, args.vocab, args.seq),
        "data": {"seq_length": args.seq, "batch_size": args.batch},
        "optim": {"lr": 1e-4, "max_steps": 10_000, "clip_grad": 1.0, "weight_decay": 0.1},
        "distributed": {"device": "cpu", "bucket_size_mb": args.bucket_mb},
    }
    cfg = config_from_dict(raw)
    apply_overrides(cfg, overrides)
    validate(cfg, world_size=dist.get_world_size())
    trainer = Trainer(cfg, setup_runtime(cfg), data=RandomTokens(args.vocab, args.seq, args.batch, seed=0))
    return trainer, ps.get_data_parallel_world_size(), ps.get_tensor_model_parallel_world_size()


def _measure(args, layouts: list[str]) -> dict:
    import torch

    from megacann import parallel_state as ps

    clock = BlockedClock()
    clock.install()
    results = {}
    for layout in layouts:
        variants = LAYOUTS[layout]
        trainers = {}
        for name, overrides in variants.items():
            ps.destroy_model_parallel()
            trainers[name] = _trainer(args, overrides)
        # parallel_state is global: every trainer of a layout has the same groups, so re-create them once
        # per layout and keep them (the trainers hold their groups' handles through their modules)
        steps = {name: [] for name in variants}
        blocked = {name: [] for name in variants}
        for round_ in range(args.rounds + 1):  # round 0: one warm-up step each
            for name, (trainer, _, _) in trainers.items():
                for _ in range(1 if round_ == 0 else args.steps):
                    clock.take()
                    start = time.perf_counter()
                    trainer.train_step()
                    elapsed = time.perf_counter() - start
                    waited = clock.take()
                    if round_:
                        steps[name].append(elapsed)
                        blocked[name].append(waited)
        sizes = {name: (dp, tp) for name, (_, dp, tp) in trainers.items()}
        results[layout] = {
            name: {
                "step": statistics.median(steps[name]),
                "blocked": statistics.median(blocked[name]),
                "dp_tp": sizes[name],
            }
            for name in variants
        }
        del trainers
        torch.set_num_threads(1)
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_llama_size_args(parser, hidden=256, layers=4, ffn=688, vocab=8192, seq=256)
    add_int_args(parser, batch=4, steps=3, rounds=2)
    parser.add_argument("--bucket_mb", type=float, default=1.0, help="gradient bucket size (several per model)")
    parser.add_argument("--only", choices=sorted(LAYOUTS), default=None)
    args = parser.parse_args(argv)
    layouts = [args.only] if args.only else list(LAYOUTS)
    per_rank = run_on_ranks(_measure, 2, args=(args, layouts), timeout=3000)
    what = f"fp32; median of {args.rounds} rounds x {args.steps} steps; exposed = blocked in collectives"
    print(two_rank_header(args, what + " (the slower rank)"))
    for layout in layouts:
        rows = {name: max((r[layout][name] for r in per_rank), key=lambda m: m["blocked"]) for name in LAYOUTS[layout]}
        base = rows["none"]
        for name, row in rows.items():
            dp, tp = row["dp_tp"]
            print(
                f"  {layout} (dp {dp}, tp {tp}) {name:11s} step {row['step'] * 1e3:8.1f} ms (x{row['step'] / base['step']:.2f})"
                f"  exposed comm {row['blocked'] * 1e3:7.1f} ms (x{row['blocked'] / max(base['blocked'], 1e-9):.2f}"
                f" of none, {100 * row['blocked'] / row['step']:.0f}% of the step)"
            )
    return {"args": vars(args), "ranks": per_rank}


if __name__ == "__main__":
    main()
