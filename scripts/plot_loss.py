#!/usr/bin/env python3
"""Plot the loss curve of a run: python scripts/plot_loss.py <output_dir>/metrics.jsonl -o loss.png"""

import argparse
import sys

from megacann.training.plot import plot_metrics


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("metrics", help="path to metrics.jsonl")
    parser.add_argument("-o", "--output", default=None, help="PNG to write (default: loss.png beside the metrics)")
    args = parser.parse_args()
    png = plot_metrics(args.metrics, args.output)
    if png is None:
        return 1
    print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
