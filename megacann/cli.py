"""Command-line entry points (``megacann-train`` and friends)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from megacann.config import ConfigError, load_config


def _train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megacann-train",
        description="Train a model from a YAML recipe (one rank per process under torchrun).",
    )
    parser.add_argument("--config", required=True, help="path to the YAML recipe")
    parser.add_argument("--resume_from", default=None, help="checkpoint directory, or 'latest'")
    parser.add_argument("--dry_run", action="store_true", help="print layout, batch and model size; run nothing")
    parser.add_argument("overrides", nargs="*", help="recipe overrides as section.key=value (or key=value)")
    return parser


def train_main(argv: Optional[list[str]] = None, expected_model_type: Optional[str] = None) -> int:
    """``megacann-train``; ``expected_model_type`` lets an example script insist on llama or gpt."""
    args = _train_parser().parse_intermixed_args(argv)
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    try:
        cfg = load_config(args.config, args.overrides, world_size=world)
        if expected_model_type and cfg.model.type != expected_model_type:
            raise ConfigError(
                f"{args.config}: model.type is {cfg.model.type!r}, this script trains {expected_model_type!r}"
            )
        from megacann.training.recipe import prepare_recipe

        _, advice = prepare_recipe(cfg, world_size=world, source=args.config)
    except ConfigError as err:
        print(f"megacann-train: error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        from megacann.dry_run import print_dry_run

        for line in advice:  # a run prints them itself, on its first rank
            print(f"megacann-train: note: {line}", file=sys.stderr)
        print_dry_run(cfg, args.config)
        return 0
    from megacann.training import train

    train(cfg, resume_from=args.resume_from)
    return 0


if __name__ == "__main__":
    sys.exit(train_main())
