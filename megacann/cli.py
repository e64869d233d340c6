"""Command-line entry points (``megacann-train`` and friends)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from megacann.config import ConfigError, load_config
from megacann.launch import add_launch_arguments, launch, wants_launch


def _train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megacann-train",
        description="Train a model from a YAML recipe: one process, or one rank per process under torchrun; "
        "with --nproc_per_node (or any option below) it checks the recipe and starts torchrun itself.",
    )
    parser.add_argument("--config", required=True, help="path to the YAML recipe")
    parser.add_argument("--resume_from", default=None, help="checkpoint directory, or 'latest'")
    parser.add_argument("--dry_run", action="store_true", help="print layout, batch and model size; run nothing")
    add_launch_arguments(parser)
    parser.add_argument("overrides", nargs="*", help="recipe overrides as section.key=value (or key=value)")
    return parser


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ


def train_main(argv: Optional[list[str]] = None, expected_model_type: Optional[str] = None) -> int:
    """``megacann-train``; ``expected_model_type`` lets an example script insist on llama or gpt."""
    parser = _train_parser()
    args = parser.parse_intermixed_args(argv)
    if wants_launch(args):
        if _under_torchrun():
            print(
                "megacann-train: error: --nproc_per_node and the other launcher options start torchrun; "
                "this process already runs under torchrun (drop them)",
                file=sys.stderr,
            )
            return 2
        return launch(args, parser.prog)
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    try:
        cfg = load_config(args.config, args.overrides, world_size=world)
        if expected_model_type and cfg.model.type != expected_model_type:
            raise ConfigError(
                f"{args.config}: model.type is {cfg.model.type!r}, this script trains {expected_model_type!r}"
            )
    except ConfigError as err:
        if os.environ.get("RANK", "0") == "0":  # under torchrun without the launcher: say it once
            print(f"megacann-train: error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        from megacann.dry_run import print_dry_run

        print_dry_run(cfg, args.config)
        return 0
    from megacann.training import train

    train(cfg, resume_from=args.resume_from)
    return 0


if __name__ == "__main__":
    sys.exit(train_main())
