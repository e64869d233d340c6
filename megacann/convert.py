"""``megacann-convert``: checkpoints and weights between megacann's formats and Hugging Face's, on one process.

    megacann-convert consolidate SOURCE OUT [--dtype fp32|bf16|fp16]   full model -> consolidated directory
    megacann-convert to-hf SOURCE OUT [--dtype ...] [--fp8-block R C]   full model -> HF directory
    megacann-convert from-hf HF_DIR OUT [--dtype ...]                   HF directory -> consolidated directory
    megacann-convert merge-lora LORA OUT [--to megacann|hf] [--base DIR] [--dtype ...]
                                                                        LoRA checkpoint + its base -> full model
    megacann-convert to-peft LORA OUT [--base NAME] [--dtype ...]       LoRA checkpoint -> PEFT adapter

SOURCE is a checkpoint directory (``checkpoint_<step>``, written under any parallel layout), an output
directory (its newest complete checkpoint is used), a consolidated directory or a Hugging Face directory.
LORA is a checkpoint (or output directory) of a ``lora: true`` run: it holds the adapters and a reference
to its base, which ``merge-lora`` reads back (``--base`` if it moved; the fingerprint must match). No
accelerator and no process group are needed.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

from megacann.accelerator import PRECISION_DTYPES
from megacann.interop.export import consolidate, export_hf, import_hf
from megacann.interop.lora_export import export_peft_checkpoint, merge_lora_checkpoint

COMMANDS = {
    "consolidate": (consolidate, "checkpoint (any layout) -> consolidated safetensors directory with megacann names"),
    "to-hf": (export_hf, "checkpoint or consolidated directory -> Hugging Face directory"),
    "from-hf": (import_hf, "Hugging Face directory -> consolidated megacann directory"),
    "merge-lora": (
        merge_lora_checkpoint,
        "LoRA checkpoint -> full model, adapters merged into the base (consolidated or Hugging Face directory)",
    ),
    "to-peft": (export_peft_checkpoint, "LoRA checkpoint -> adapters alone, in Hugging Face PEFT's format"),
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
        if name == "to-hf":
            sub.add_argument(
                "--fp8-block",
                type=int,
                nargs=2,
                metavar=("ROWS", "COLS"),
                default=None,
                help="write projection weights in block-scaled fp8 (DeepSeek-V3's format, e.g. 128 128)",
            )
        if name == "merge-lora":
            sub.add_argument("--to", choices=("megacann", "hf"), default="megacann", help="output format")
            sub.add_argument("--base", default=None, help="the base's directory (default: the recorded path)")
        if name == "to-peft":
            sub.add_argument(
                "--base", default=None, help="base_model_name_or_path to record (default: a Hugging Face base's path)"
            )
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    function, _ = COMMANDS[args.command]
    extra = {key: getattr(args, key) for key in ("to", "base") if hasattr(args, key)}
    if getattr(args, "fp8_block", None) is not None:
        extra["fp8_block"] = tuple(args.fp8_block)
    start = time.perf_counter()
    try:
        out = function(args.source, args.out, args.dtype, **extra)
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        print(f"megacann-convert {args.command}: error: {err}", file=sys.stderr)
        return 1
    print(f"megacann-convert {args.command}: wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
