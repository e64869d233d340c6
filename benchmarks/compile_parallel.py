"""Compiled vs eager training step at tensor parallel 2 (+ sequence parallel) and context parallel 2, with
the compile time apart from the steady-state step time (gloo, CPU).

    python benchmarks/compile_parallel.py [--layouts tp cp --backend inductor --compile-steps 2 --steps 3
                                           --rounds 2 --reference-ops --hidden 256 --layers 4 --seq 256]

Two gloo ranks (one thread each) build, per layout, an eager trainer and one with ``precision.compile``
(``--backend``). The compiled trainer's first ``--compile-steps`` steps are the compile phase (dynamo
traces, the backend compiles forward and backward; a later step can still recompile); the eager trainer
gets one warm-up step. Then both take turns, ``--steps`` steps each per round, over ``--rounds`` rounds.
Printed per layout (the slower rank): eager and compiled steady-state step (median), their ratio
compiled / eager, and compile seconds = the compile phase minus as many steady compiled steps. The
dynamo counters say how many graphs were compiled and whether the timed steps recompiled (they should
not). ``--reference-ops`` compiles the PyTorch reference ops (``precision.fused_ops: false``, what CUDA
runs) instead of the CPU default, megacann's C++ kernels, which are opaque calls in the graph.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_common import add_int_args, add_llama_size_args, two_rank_header  # first: puts tests/ on sys.path
from comm_overlap import _trainer  # a Trainer on random tokens, built for the given overrides
from dist_harness import run_on_ranks  # the tests' gloo launcher

LAYOUTS = {
    "tp": ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"],
    "cp": ["distributed.context_parallel_size=2"],
}


def _timed(trainer) -> float:
    start = time.perf_counter()
    trainer.train_step()
    return time.perf_counter() - start


def _measure(args) -> dict:
    from torch._dynamo.utils import counters

    from megacann import parallel_state as ps

    common = ["precision.fused_ops=false"] if args.reference_ops else []
    results = {}
    for layout in args.layouts:
        ps.destroy_model_parallel()
        eager, _, _ = _trainer(args, [*common, *LAYOUTS[layout]])
        ps.destroy_model_parallel()
        compiled, _, _ = _trainer(args, [*common, *LAYOUTS[layout], f"precision.compile={args.backend}"])
        counters.clear()
        compile_phase = [_timed(compiled) for _ in range(args.compile_steps)]
        graphs = counters["stats"]["unique_graphs"]
        _timed(eager)  # warm-up
        times = {"eager": [], "compiled": []}
        for _ in range(args.rounds):
            times["eager"] += [_timed(eager) for _ in range(args.steps)]
            times["compiled"] += [_timed(compiled) for _ in range(args.steps)]
        steady = {name: statistics.median(t) for name, t in times.items()}
        results[layout] = {
            **steady,
            "compile": sum(compile_phase) - args.compile_steps * steady["compiled"],
            "graphs": graphs,
            "recompiled": counters["stats"]["unique_graphs"] - graphs,
            "breaks": sum(counters["graph_break"].values()),
        }
        del eager, compiled
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=["tp", "cp"])
    parser.add_argument("--backend", default="inductor", help="precision.compile's backend")
    parser.add_argument("--compile-steps", type=int, default=2, help="compiled steps counted as compiling")
    parser.add_argument("--reference-ops", action="store_true", help="precision.fused_ops: false")
    add_llama_size_args(parser, hidden=256, layers=4, ffn=688, vocab=8192, seq=256)
    add_int_args(parser, batch=4, steps=3, rounds=2)
    parser.add_argument("--bucket_mb", type=float, default=1.0)
    args = parser.parse_args(argv)
    per_rank = run_on_ranks(_measure, 2, args=(args,), timeout=3600)
    ops = "reference ops" if args.reference_ops else "C++ kernels"
    what = f"fp32, {ops}, backend {args.backend}; steady state = median of {args.rounds} rounds x {args.steps} steps"
    print(two_rank_header(args, what + "; the slower rank"))
    for layout in args.layouts:
        row = max((r[layout] for r in per_rank), key=lambda m: m["compiled"])
        print(
            f"  {layout}: eager {row['eager'] * 1e3:8.1f} ms  compiled {row['compiled'] * 1e3:8.1f} ms  "
            f"compiled/eager {row['compiled'] / row['eager']:.2f}x  compile {row['compile']:.1f} s "
            f"({row['graphs']} graphs, {row['breaks']} graph breaks, {row['recompiled']} recompiled in the timed steps)"
        )
    return {"args": vars(args), "ranks": per_rank}


if __name__ == "__main__":
    main()
