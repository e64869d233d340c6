#!/usr/bin/env python3
"""Plot one or several runs' metrics into one PNG: loss (raw and smoothed), eval loss, learning rate,
grad norm and tokens/s, the runs overlaid under their names.

    python scripts/plot_loss.py output/llama_tiny/metrics.jsonl -o loss.png
    python scripts/plot_loss.py output/run_a output/run_b --names baseline "lr 1e-3" -o compare.png
"""

import argparse
import sys

from megacann.training.plot import plot_runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files, or the run folders holding them")
    parser.add_argument("-o", "--output", default="loss.png", help="PNG to write (default: loss.png)")
    parser.add_argument("--names", nargs="+", help="one name per run (default: the run folders' names)")
    parser.add_argument(
        "--smoothing",
        type=float,
        default=0.6,
        help="EMA weight of the smoothed loss per logged point, 0 <= w < 1 (default 0.6, as TensorBoard)",
    )
    args = parser.parse_args()
    try:
        png = plot_runs(args.metrics, args.output, args.names, args.smoothing)
    except (OSError, ValueError) as err:
        print(f"plot_loss.py: error: {err}", file=sys.stderr)
        return 2
    if png is None:
        return 1
    print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
