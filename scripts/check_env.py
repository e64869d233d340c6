#!/usr/bin/env python3
"""Check a machine before training: versions against what megacann needs and was tested with, the visible
devices and their memory, and (with --comm, under torchrun) communication across every rank.

    python scripts/check_env.py
    torchrun --nproc_per_node 8 scripts/check_env.py --comm [--size_mb 64] [--timeout 60]
    (several nodes: the torchrun options of scripts/run_pretrain.sh --print_only, this script instead of -m megacann.train)

--comm runs an all-reduce, an all-gather and a point-to-point ring with a timeout, verifies the data,
prints bandwidth, and names any rank that fails or does not answer. Exit code 0 when all is well, 1 if not.
"""

import argparse
import os
import sys


def _comm(args) -> int:
    import torch

    from megacann.accelerator import get_accelerator
    from megacann.comm_check import run_comm_checks
    from megacann.parallel_state import initialize_distributed

    accelerator = get_accelerator()
    rank, world, local_rank = initialize_distributed(accelerator.backend, timeout_minutes=args.timeout / 60)
    accelerator.set_device(local_rank)
    if world == 1 and rank == 0:
        print("one process: run under torchrun (--nproc_per_node N) to check communication between ranks")
    results = run_comm_checks(args.size_mb, args.iters, args.timeout, device=accelerator.current_device())
    failed = [r for r in results if not r.ok]
    answering = set(range(world)) - {m for r in results for m in r.missing_ranks}
    if rank == min(answering):  # one report, from the lowest rank still answering
        print(f"communication check: {world} ranks, backend {accelerator.backend}, {args.size_mb:g} MiB per rank")
        for result in results:
            print(result.describe())
        print("communication: " + ("FAILED" if failed else "ok"), flush=True)
    sys.stdout.flush()
    if failed:
        os._exit(1)  # peers may be hung: do not wait for them in the process group's teardown
    torch.distributed.destroy_process_group()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--comm", action="store_true", help="check collectives across the ranks (under torchrun)")
    parser.add_argument("--size_mb", type=float, default=64.0, help="MiB each rank sends per collective (64)")
    parser.add_argument("--iters", type=int, default=5, help="timed calls per collective (5)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for every rank, per check (60)")
    args = parser.parse_args()
    if args.comm:
        return _comm(args)
    from megacann.env_report import environment_report

    items = environment_report()
    for item in items:
        print(item.line())
    problems = [i for i in items if i.verdict.startswith(("too old", "mismatch"))]
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
