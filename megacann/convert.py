"""``megacann-convert``: checkpoints and weights between megacann's formats and Hugging Face's, on one process.

    megacann-convert consolidate SOURCE OUT [--dtype fp32|bf16|fp16]   checkpoint -> consolidated directory
    megacann-convert to-hf SOURCE OUT [--dtype ...]                     checkpoint / consolidated -> HF directory
    megacann-convert from-hf HF_DIR OUT [--dtype ...]                   HF directory -> consolidated directory

SOURCE is a checkpoint directory (``checkpoint_<step>``, written under any parallel layout), an output
directory (its newest complete checkpoint is used) or a consolidated directory. No accelerator and no
process group are needed.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

from megacann.accelerator import PRECISION_DTYPES
from megacann.checkpoint.export import consolidate, export_hf, import_hf

COMMANDS = {
    "consolidate": (consolidate, "checkpoint (any layout) -> consolidated safetensors directory with megacann names"),
    "to-hf": (export_hf, "checkpoint or consolidated directory -> Hugging Face directory"),
    "from-hf": (import_hf, "Hugging Face directory -> consolidated megacann directory"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megacann-convert", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (_, text) in COMMANDS.items():
        sub = commands.add_parser(name, help=text, description=text)
        sub.add_argument("source", help="input directory")
        sub.add_argument("out", help="output directory (created)")
        sub.add_argument(
            "--dtype", choices=sorted(PRECISION_DTYPES), default=None, help="cast weights (default: as stored)"
        )
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    function, _ = COMMANDS[args.command]
    start = time.perf_counter()
    try:
        out = function(args.source, args.out, args.dtype)
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        print(f"megacann-convert {args.command}: error: {err}", file=sys.stderr)
        return 1
    print(f"megacann-convert {args.command}: wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
