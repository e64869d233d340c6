"""Command-line entry points (``megacann-train`` and friends)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from megacann.config import ConfigError, load_config
from megacann.errors import MegacannError
from megacann.launch import build_parser, launch, wants_launch


def _train_parser() -> argparse.ArgumentParser:
    return build_parser(
        "megacann-train",
        "Train a model from a YAML recipe: one process, or one rank per process under torchrun; with "
        "--nproc_per_node (or any launcher option) it checks the recipe and starts torchrun itself.",
    )


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
        from megacann.training.recipe import prepare_recipe

        prepare_recipe(cfg, world_size=world, source=args.config)  # advice printed once, on rank 0
        if not args.dry_run:
            from megacann.training.preflight import preflight

            preflight(cfg, args.resume_from)  # output directory, data files, the checkpoint to resume
    except MegacannError as err:
        return _report(parser.prog, err)
    if args.dry_run:
        from megacann.dry_run import print_dry_run

        print_dry_run(cfg, args.config)
        return 0
    return run_training(cfg, args.resume_from, parser.prog)


def _is_first_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _report(prog: str, err: BaseException) -> int:
    """One line on rank 0 (every rank stops alike; a rank's own failure reaches rank 0 as PeerFailure)."""
    from megacann.training.signals import RunInterrupted

    if _is_first_rank():
        label = "" if isinstance(err, RunInterrupted) else "error: "
        print(f"{prog}: {label}{err}", file=sys.stderr, flush=True)
    return getattr(err, "exit_code", 1)


def run_training(cfg, resume_from: Optional[str], prog: str = "megacann-train") -> int:
    """Train ``cfg``; whatever happens, end cleanly: the failure monitor stopped and joined, the process
    groups destroyed (a process that exits with them alive can die of SIGABRT after finishing). Errors
    megacann explains (bad input, a stop on skipped steps, a signal, a failed peer) are one line and an
    exit code; anything else keeps its traceback."""
    from megacann.training import train
    from megacann.training.failure import PeerFailure
    from megacann.training.runtime import shutdown_runtime

    try:
        train(cfg, resume_from=resume_from)
    except (MegacannError, PeerFailure) as err:
        return _report(prog, err)
    except KeyboardInterrupt:  # Ctrl-C before the training loop took over SIGINT (while building)
        if _is_first_rank():
            print(f"{prog}: SIGINT: stopped before training started; nothing saved", file=sys.stderr, flush=True)
        return 130
    finally:
        shutdown_runtime()
    return 0


def _plan_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megacann-plan",
        description="Per-device memory and pipeline bubble of a recipe's layout, and the layouts that fit a "
        "world size and a device memory (estimates; formulas in megacann/planning/formulas.py and activations.py).",
    )
    parser.add_argument("--config", required=True, help="path to the YAML recipe")
    parser.add_argument("--world_size", type=int, help="devices to plan for (default: the recipe's world size)")
    parser.add_argument("--device_memory_gb", type=float, help="memory of one device in GB (1e9 bytes)")
    parser.add_argument("--devices_per_node", type=int, default=8, help="TP stays within a node (default 8)")
    parser.add_argument("--top", type=int, default=10, help="layouts to list (default 10)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides as section.key=value (or key=value)")
    return parser


def plan_main(argv: Optional[list[str]] = None) -> int:
    """``megacann-plan``: the planner's report on stdout; a config error is one message and exit code 2."""
    args = _plan_parser().parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from megacann.interop.model_source import apply_model_source

        apply_model_source(cfg, args.config)  # model.init_from's sizes (and vocabulary) come first
        if cfg.model.vocab_size is None:
            cfg.model.vocab_size = _planning_vocab_size(cfg)
        from megacann.training.recipe import prepare_recipe

        prepare_recipe(cfg, source=args.config)
        world = args.world_size or cfg.distributed.world_size or 1
        if args.world_size is not None and args.world_size < 1:
            raise ConfigError(f"--world_size must be >= 1, got {args.world_size}")
        from megacann.planning import plan_report

        report = plan_report(cfg, args.config, world, args.device_memory_gb, args.devices_per_node, args.top)
    except ConfigError as err:  # the recipe, or what the planner's formulas cannot estimate yet
        print(f"megacann-plan: error: {err}", file=sys.stderr)
        return 2
    print(report)
    return 0


def _planning_vocab_size(cfg) -> int:
    """The vocabulary the run will have: the default BPE's size, or the recipe's tokenizer's."""
    if cfg.data.tokenizer is None:
        return cfg.data.tokenizer_vocab_size
    from megacann.data.tokenizer import TokenizerError, load_tokenizer

    try:
        return load_tokenizer(cfg.data.tokenizer).vocab_size
    except TokenizerError as err:
        raise ConfigError(
            f"model.vocab_size is not set and data.tokenizer cannot tell it ({err}): give model.vocab_size"
        ) from None


if __name__ == "__main__":
    sys.exit(train_main())
