"""Checkpoint speed: megacann's save (sync and async) and load against per-rank torch.save / torch.load.

    python benchmarks/checkpoint_io.py [--world 2] [--tp 2] [--hidden 512] [--layers 8] [--vocab 32000]
                                       [--dir /tmp/megacann-ckpt-bench] [--repeat 2]

Every rank builds the same LLaMA-shaped model under the given layout on CPU (gloo), takes one optimizer
step (so Adam's moments exist), then times, best of ``--repeat``:

- ``megacann save``: Trainer.save_checkpoint() — every rank writes its pieces (replicas once), publish;
- ``megacann async``: the time until training may go on (state copied to CPU), and until published;
- ``megacann load``: Trainer.load_checkpoint() into the same layout;
- ``torch.save``: the alternative, each rank writing ``{model.state_dict(), optimizer.state_dict()}`` to
  its own file and fsyncing it (same-layout only, no resharding), and ``torch.load`` of it.

MB counts the bytes on disk; MB/s = MB / seconds of the slowest rank. Ratios are against torch.save /
torch.load measured in the same run.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import socket
import time

import torch
import torch.distributed as dist
from bench_common import RandomTokens, add_int_args  # first: puts the checkout on sys.path


def _dir_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files) / 2**20


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _rank(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(args.world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    os.environ.update({"LOCAL_RANK": str(rank), "MEGACANN_DEVICE": "cpu"})
    torch.set_num_threads(1)
    from megacann.checkpoint import Checkpointer
    from megacann.config import config_from_dict, validate
    from megacann.layers.sharding import get_sharding
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    raw = {
        "experiment": {"name": "ckpt-bench", "output_dir": os.path.join(args.dir, "megacann")},
        "model": {
            "type": "llama",
            "precision": args.precision,
            "hidden_size": args.hidden,
            "num_layers": args.layers,
            "num_attention_heads": 8,
            "ffn_hidden_size": 4 * args.hidden,
            "vocab_size": args.vocab,
            "max_position_embeddings": 128,
        },
        "data": {"seq_length": 64, "batch_size": 1},
        "optim": {"max_steps": 10, "warmup_steps": 1},
        "distributed": {"tensor_parallel_size": args.tp},
        "logging": {"log_interval": 1, "ckpt_interval": 0, "keep_last": 2},
    }
    cfg = config_from_dict(raw)
    validate(cfg, world_size=args.world)
    runtime = setup_runtime(cfg)
    trainer = Trainer(cfg, runtime, data=RandomTokens(args.vocab, 64, 1, seed=0))
    trainer.metrics.print = lambda *a, **k: None  # keep the table readable
    trainer.train_step()
    rows: dict[str, list[float]] = {}
    baseline_dir = os.path.join(args.dir, "torch_save")
    baseline_file = os.path.join(baseline_dir, f"rank_{rank:05d}.pt")
    os.makedirs(baseline_dir, exist_ok=True)

    def torch_save() -> None:
        state = {"model": [c.state_dict() for c in trainer.model_chunks], "optimizer": trainer.optimizer.state_dict()}
        with open(baseline_file, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    saved: list[str] = []

    def save(checkpointer) -> None:
        trainer.state.step += 1  # a new checkpoint_<step> each time, as in training
        saved.append(checkpointer.save(trainer.checkpoint_parts(), trainer.cfg, log=trainer.metrics.print))

    for _ in range(args.repeat):
        rows.setdefault("megacann save", []).append(_timed(lambda: save(trainer.checkpointer)))
        rows.setdefault("megacann load", []).append(_timed(lambda: trainer.load_checkpoint(saved[-1])))
        rows.setdefault("torch.save", []).append(_timed(torch_save))
        rows.setdefault("torch.load", []).append(
            _timed(lambda: torch.load(baseline_file, map_location="cpu", weights_only=False))
        )
    background = Checkpointer(async_save=True)
    for _ in range(args.repeat):
        resumes = _timed(lambda: save(background))
        rows.setdefault("megacann async: training resumes", []).append(resumes)
        rows.setdefault("megacann async: published", []).append(resumes + _timed(background.wait))
    background.close()
    if rank == 0:
        ours_mb = _dir_mb(saved[-1])
        theirs_mb = _dir_mb(baseline_dir)
        print(
            f"world {args.world}, tp {args.tp}, {args.precision}, "
            f"{sum(math.prod(get_sharding(p).logical_shape) for p in trainer.params) / 1e6:.1f}M parameters"
        )
        print(f"{'what':36s} {'seconds':>8s} {'MB':>8s} {'MB/s':>8s} {'vs torch':>9s}")
        for name, times in rows.items():
            best = min(times)
            mb = theirs_mb if name.startswith("torch") else ours_mb
            base = min(rows["torch.load" if "load" in name else "torch.save"])
            print(f"{name:36s} {best:8.3f} {mb:8.1f} {mb / best:8.1f} {base / best:8.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_int_args(parser, world=2, tp=2, hidden=512, layers=8, vocab=32000, repeat=2)
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--dir", default="/tmp/megacann-ckpt-bench")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.start_processes(_rank, args=(args, port), nprocs=args.world, start_method="spawn")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
