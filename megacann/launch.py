"""Starting ranks: check the recipe once, then hand torchrun the command that starts one process per device.

``bash scripts/run_pretrain.sh`` (``python -m megacann.launch``) and ``megacann-train --nproc_per_node N``
come here. The recipe and its overrides are loaded and validated in this one process, for the world size
about to be started, so a typo or an impossible layout is one message and exit code 2 instead of one
traceback per rank under torchrun's own. Then:

- ``--nproc_per_node`` defaults to the local device count (NPUs, else CUDA GPUs, else 1 process on CPU);
- several nodes meet either at a static master (``--nnodes --node_rank --master_addr --master_port``) or
  through a c10d rendezvous (``--rdzv_endpoint HOST:PORT [--rdzv_id ID]``, no node ranks: Slurm's way);
  a loopback master address is refused with several nodes (other nodes cannot reach it);
- ``--print_only`` prints the platform environment that matters and the torchrun command, and starts nothing;
- ``--dry_run`` prints the layout for that world size here, without starting ranks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
from typing import Optional

from megacann.config import MegacannConfig, load_config
from megacann.config.advice import ADVICE_SHOWN_ENV
from megacann.errors import MegacannError

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "::1", "0.0.0.0")
DEFAULT_MASTER_PORT = 29500
# Environment variables that decide how a run behaves on its platform (shown by --print_only).
PLATFORM_ENV_PREFIXES = ("HCCL_", "NCCL_", "TORCH_NCCL_", "ASCEND_", "MEGACANN_", "MALLOC_")
PLATFORM_ENV_NAMES = (
    "PYTORCH_NPU_ALLOC_CONF",
    "PYTORCH_CUDA_ALLOC_CONF",
    "TASK_QUEUE_ENABLE",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "OMP_NUM_THREADS",
    "TORCH_DEVICE_BACKEND_AUTOLOAD",
    "GLIBC_TUNABLES",
)
LAUNCH_FLAGS = (
    "nproc_per_node",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "rdzv_endpoint",
    "rdzv_id",
    "max_restarts",
)


class LaunchError(MegacannError, ValueError):
    """Launcher options that cannot start a run as given."""


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The torchrun-facing options shared by scripts/run_pretrain.sh and megacann-train."""
    group = parser.add_argument_group("starting ranks (torchrun)")
    group.add_argument("--nproc_per_node", type=int, help="processes on this node (default: its device count)")
    group.add_argument("--nnodes", type=int, help="number of nodes (default 1)")
    group.add_argument("--node_rank", type=int, help="this node's rank, 0 .. nnodes-1 (static master)")
    group.add_argument("--master_addr", help="address of node 0, reachable from every node (static master)")
    group.add_argument("--master_port", type=int, help=f"port on node 0 (default {DEFAULT_MASTER_PORT})")
    group.add_argument("--rdzv_endpoint", help="HOST:PORT of a c10d rendezvous (instead of a static master)")
    group.add_argument("--rdzv_id", help="rendezvous id, the same on every node (e.g. the Slurm job id)")
    group.add_argument(
        "--max_restarts",
        type=int,
        help="restart the job this many times when a rank fails (each restart resumes from the newest checkpoint)",
    )
    group.add_argument("--print_only", action="store_true", help="print the environment and command; start nothing")


def wants_launch(args: argparse.Namespace) -> bool:
    """Whether megacann-train was asked to start ranks itself (any launcher option given)."""
    return args.print_only or any(getattr(args, name) is not None for name in LAUNCH_FLAGS)


def local_device_count(device_type: str) -> int:
    """Devices of ``device_type`` visible on this node (1 on CPU: one process does the work)."""
    if device_type == "npu":
        import torch

        from megacann.accelerator import npu_available

        return int(torch.npu.device_count()) if npu_available() else 0
    if device_type == "cuda":
        import torch

        return int(torch.cuda.device_count())
    return 1


def _is_loopback(host: str) -> bool:
    host = host.strip().strip("[]").lower()
    return host in LOOPBACK_NAMES or host.startswith("127.")


def _endpoint_host(endpoint: str) -> str:
    """``host`` of ``host:port`` (or of ``[v6]:port``)."""
    return endpoint.rsplit(":", 1)[0] if ":" in endpoint else endpoint


def check_nodes(args: argparse.Namespace) -> None:
    """Multi-node options that can work: node ranks in range, and a master every node can reach."""
    nnodes = args.nnodes or 1
    if nnodes < 1:
        raise LaunchError(f"--nnodes must be >= 1, got {nnodes}")
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise LaunchError(f"--nproc_per_node must be >= 1, got {args.nproc_per_node}")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise LaunchError(f"--max_restarts must be >= 0, got {args.max_restarts}")
    if args.rdzv_endpoint and (args.master_addr or args.node_rank is not None):
        raise LaunchError(
            "give either --rdzv_endpoint (c10d rendezvous: node ranks are assigned) or --master_addr/--node_rank "
            "(static master), not both"
        )
    if args.node_rank is not None and not 0 <= args.node_rank < nnodes:
        raise LaunchError(f"--node_rank {args.node_rank} is outside 0 .. {nnodes - 1} (--nnodes {nnodes})")
    if nnodes == 1:
        return
    if args.rdzv_endpoint:
        where, host = "--rdzv_endpoint", _endpoint_host(args.rdzv_endpoint)
    else:
        if args.node_rank is None:
            raise LaunchError(f"--nnodes {nnodes} needs --node_rank (0 on the master node) or --rdzv_endpoint")
        if args.master_addr is None:
            raise LaunchError(
                f"--nnodes {nnodes} needs --master_addr: node 0's hostname or IP address, the same on every node"
            )
        where, host = "--master_addr", args.master_addr
    if _is_loopback(host):
        raise LaunchError(
            f"{where} {host} is this machine's loopback address, which the other {nnodes - 1} node(s) cannot reach: "
            f"with --nnodes {nnodes} give node 0's hostname or IP address (e.g. `hostname -I` on node 0), "
            "the same on every node"
        )


def torchrun_command(
    args: argparse.Namespace, nproc_per_node: int, python: str = sys.executable, entry: str = "megacann.train"
) -> list[str]:
    """The torchrun command line for these launcher options; the ranks run ``python -m <entry>``."""
    nnodes = args.nnodes or 1
    cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc_per_node), "--nnodes", str(nnodes)]
    if args.max_restarts:
        cmd += ["--max-restarts", str(args.max_restarts)]
    if args.rdzv_endpoint:
        cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", args.rdzv_endpoint]
        cmd += ["--rdzv_id", args.rdzv_id or "megacann"]
    elif nnodes == 1 and args.master_port is None and args.master_addr is None:
        cmd += ["--standalone"]
    else:
        cmd += ["--node_rank", str(args.node_rank or 0), "--master_addr", args.master_addr or "127.0.0.1"]
        cmd += ["--master_port", str(args.master_port or DEFAULT_MASTER_PORT)]
    cmd += ["-m", entry, "--config", args.config]
    if args.resume_from:
        cmd += ["--resume_from", args.resume_from]
    return cmd + list(args.overrides)


def imports_for_ranks(spec, cfg: MegacannConfig) -> list[str]:
    """An ``experiment.imports`` override when the ranks would not know the model family otherwise: it was
    registered by the script that called the launcher or by a module the recipe does not name. megacann's
    own families, and those of ``experiment.imports``, need nothing."""
    from megacann.models import family_import

    entry = family_import(spec.name)
    if entry is None or entry in cfg.experiment.imports:
        return []
    return [f"experiment.imports={json.dumps([*cfg.experiment.imports, entry])}"]


def platform_environment(environ: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The variables of ``environ`` that shape a run on its platform (HCCL, NCCL, allocator, devices)."""
    environ = dict(os.environ if environ is None else environ)
    return {k: v for k, v in sorted(environ.items()) if k.startswith(PLATFORM_ENV_PREFIXES) or k in PLATFORM_ENV_NAMES}


def resolve_nproc(args: argparse.Namespace, cfg: MegacannConfig) -> int:
    """--nproc_per_node, else the local device count of the device the recipe will use."""
    if args.nproc_per_node is not None:
        return args.nproc_per_node
    from megacann.accelerator import resolve_device_type

    device_type = resolve_device_type(cfg.distributed.device)
    count = local_device_count(device_type)
    if count < 1:
        raise LaunchError(f"no {device_type} device is visible on this node: pass --nproc_per_node")
    return count


def launch(args: argparse.Namespace, prog: str, python: str = sys.executable) -> int:
    """Validate the recipe for the world about to start, then exec torchrun (or print / dry-run)."""
    try:
        check_nodes(args)
        cfg = load_config(args.config, args.overrides)  # the layout alone, before the world size is known
        nproc = resolve_nproc(args, cfg)
        world = nproc * (args.nnodes or 1)
        cfg = load_config(args.config, args.overrides, world_size=world)
        from megacann.training.recipe import prepare_recipe  # the model family's and pipeline's rules too

        spec, _ = prepare_recipe(cfg, world_size=world, source=args.config)
        if not (args.dry_run or args.print_only):  # the files the run reads, checked here once
            from megacann.training.preflight import preflight

            preflight(cfg, args.resume_from, create=False)
    except (MegacannError, ValueError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return getattr(err, "exit_code", 2)
    if args.dry_run:
        from megacann.dry_run import print_dry_run

        print_dry_run(cfg, args.config)
        return 0
    cmd = torchrun_command(args, nproc, python) + imports_for_ranks(spec, cfg)
    if args.print_only:
        for key, value in platform_environment().items():
            print(f"export {key}={shlex.quote(value)}")
        print(shlex.join(cmd))
        return 0
    sys.stdout.flush()
    os.environ[ADVICE_SHOWN_ENV] = "1"  # advice was printed here; the ranks need not repeat it
    return run_torchrun(cmd[3:], prog)


# Exit codes after which the ranks have already said what happened (input error, hang, SIGINT, SIGTERM).
SELF_EXPLAINED_EXIT_CODES = (2, 3, 128 + signal.SIGINT, 128 + signal.SIGTERM)


class _QuietShutdown(logging.Filter):
    """Drops torchrun's chatter while it stops workers that megacann is already stopping cleanly."""

    NOISE = ("death signal", "Closing process", "closing signal")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(part in record.getMessage() for part in self.NOISE)


def run_torchrun(torchrun_args: list[str], prog: str) -> int:
    """Run torchrun in this process with ``torchrun_args``; its failures become one line and an exit code
    instead of its tracebacks (a rank's own message, printed by the rank, stays the one to read)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    quiet = _QuietShutdown()
    for name in ("", "torch", "torch.distributed", "torch.distributed.elastic"):  # torch's handlers sit here
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(quiet)
    try:
        torchrun.run(torchrun.parse_args(torchrun_args))
    except SignalException as err:  # Ctrl-C / SIGTERM: the ranks stopped after a step and said so
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if failure.exitcode in SELF_EXPLAINED_EXIT_CODES:
            return failure.exitcode
        how = (
            f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"
        )
        print(f"{prog}: rank {rank} {how} (its output above says why)", file=sys.stderr, flush=True)
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    return 0


def build_parser(
    prog: str = "run_pretrain.sh",
    description: str = "Check a recipe, then start one training process per device under torchrun.",
) -> argparse.ArgumentParser:
    """The training command line (recipe, resume, dry run, launcher options, overrides), for the launcher
    script and for megacann-train."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", required=True, help="path to the YAML recipe")
    parser.add_argument("--resume_from", default=None, help="checkpoint directory, or 'latest'")
    parser.add_argument("--dry_run", action="store_true", help="print layout, batch and model size; run nothing")
    add_launch_arguments(parser)
    parser.add_argument("overrides", nargs="*", help="recipe overrides as section.key=value (or key=value)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    return launch(args, parser.prog)


if __name__ == "__main__":
    sys.exit(main())
