"""Draw parallel layouts, train each a few steps on CPU ranks and compare with one process (`make fuzz`).

    python scripts/fuzz_layouts.py --world 4 --count 20 --first-seed 1000   # 20 new layouts at 4 ranks
    python scripts/fuzz_layouts.py --world 4 --seed 1007                    # replay one layout

Each failing layout is printed with its seed, the overrides it drew and what differed; the exit status is
the number of failures (capped at 100). The generator and the checks are tests/layout_fuzz.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="ranks per layout (2, 4 or 8)")
    parser.add_argument("--count", type=int, default=10, help="how many layouts to draw")
    parser.add_argument("--first-seed", type=int, default=1000, help="seeds first-seed .. first-seed+count-1")
    parser.add_argument("--seed", type=int, action="append", help="replay this seed (repeatable)")
    parser.add_argument("--batch", type=int, default=5, help="layouts per set of rank processes")
    args = parser.parse_args(argv)

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    os.environ.setdefault("MEGACANN_DEVICE", "cpu")
    os.environ.setdefault("MEGACANN_CACHE", tempfile.mkdtemp(prefix="megacann-fuzz-cache-"))
    from layout_fuzz import fuzz, sample_layout

    seeds = args.seed or list(range(args.first_seed, args.first_seed + args.count))
    failures = 0
    for start in range(0, len(seeds), args.batch):
        for seed, problems in fuzz(seeds[start : start + args.batch], args.world).items():
            layout = sample_layout(seed, args.world)
            status = "FAIL" if problems else "ok"
            print(f"{status} seed {seed} world {args.world}: {layout.describe()}", flush=True)
            for problem in problems:
                print("    " + problem.replace("\n", "\n    "), flush=True)
            failures += bool(problems)
    print(f"{len(seeds) - failures} of {len(seeds)} layouts trained like one process", flush=True)
    if failures:
        print(f"replay one: python scripts/fuzz_layouts.py --world {args.world} --seed <seed>")
    return min(failures, 100)


if __name__ == "__main__":
    sys.exit(main())
