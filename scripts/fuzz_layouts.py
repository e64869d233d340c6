"""Draw parallel layouts, train each a few steps on CPU ranks and compare with one process (`make fuzz`).

    python scripts/fuzz_layouts.py --world 4 --count 20 --first-seed 1000   # 20 new layouts at 4 ranks
    python scripts/fuzz_layouts.py --world 4 --seed 1007                    # replay one layout
    python scripts/fuzz_layouts.py --world 2 --world 4 --count 3 --key "$(git rev-parse HEAD)"
                                                   # 3 seeds per world drawn from a key (what CI runs)

A key (a commit hash, a date) always draws the same seeds, so a run is replayed by its key or, one layout
at a time, by the seeds it prints. Each failing layout is printed with its seed, the overrides it drew, what
differed and the `make fuzz` line that replays it; the exit status is the number of failures (capped at
100). The generator and the checks are tests/layout_fuzz.py; a failure found here is kept as a fixed
regression case in tests/test_layout_fuzz.py (REGRESSIONS).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED_RANGE = 10**6  # seeds drawn from a key lie in [0, SEED_RANGE)


def seeds_from_key(key: str, count: int) -> list[int]:
    """``count`` distinct seeds, the same for the same ``key`` on every machine and Python (sha-256 of it)."""
    rng = random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big"))
    return rng.sample(range(SEED_RANGE), count)


def replay_line(world: int, seed: int | str) -> str:
    return f'make fuzz ARGS="--world {world} --seed {seed}"'


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, action="append", help="ranks per layout (2, 4 or 8; repeatable; 4)")
    parser.add_argument("--count", type=int, default=10, help="how many layouts to draw (per world)")
    parser.add_argument("--first-seed", type=int, default=1000, help="seeds first-seed .. first-seed+count-1")
    parser.add_argument("--key", help="draw --count seeds from this text instead (a commit hash, a date)")
    parser.add_argument("--seed", type=int, action="append", help="replay this seed (repeatable)")
    parser.add_argument("--batch", type=int, default=5, help="layouts per set of rank processes")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # each layout's line as it is known (CI logs, pipes)

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    os.environ.setdefault("MEGACANN_DEVICE", "cpu")
    os.environ.setdefault("MEGACANN_CACHE", tempfile.mkdtemp(prefix="megacann-fuzz-cache-"))
    from layout_fuzz import fuzz, sample_layout

    if args.seed:
        seeds = args.seed
    elif args.key is not None:
        seeds = seeds_from_key(args.key, args.count)
    else:
        seeds = list(range(args.first_seed, args.first_seed + args.count))
    failed = []
    for world in args.world or [4]:
        source = f" (drawn from key {args.key!r})" if args.key is not None and not args.seed else ""
        print(f"layout seeds at world {world}{source}: {' '.join(map(str, seeds))}")
        print(f"  replay one: {replay_line(world, '<seed>')}")
        for start in range(0, len(seeds), args.batch):
            for seed, problems in fuzz(seeds[start : start + args.batch], world).items():
                print(
                    f"{'FAIL' if problems else 'ok'} seed {seed} world {world}: {sample_layout(seed, world).describe()}"
                )
                for problem in problems:
                    print("    " + problem.replace("\n", "\n    "))
                if problems:
                    print(f"    replay: {replay_line(world, seed)}")
                    failed.append((world, seed))
    total = len(seeds) * len(args.world or [4])
    print(f"{total - len(failed)} of {total} layouts trained like one process")
    for world, seed in failed:
        print(f"replay: {replay_line(world, seed)}")
    return min(len(failed), 100)


if __name__ == "__main__":
    sys.exit(main())
