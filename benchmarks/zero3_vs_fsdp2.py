"""ZeRO-3 engines side by side: megacann's own (flat buffers, ``zero_optimization: 3``) against PyTorch's
FSDP2 (``torch.distributed.fsdp.fully_shard`` over a DeviceMesh), on the same megacann LLaMA chunk.

    python benchmarks/zero3_vs_fsdp2.py [--dp 2 4] [--steps 3] [--hidden 256 --layers 4 --vocab 8000]

Each engine wraps the same fp32 model (one unit per transformer block plus the chunk), trains it with
AdamW on the same random tokens on ``dp`` gloo ranks, and reports the fastest step (each timed on its
slowest rank), the weight bytes a rank keeps between steps, and whether megacann's per-parameter
metadata (``ParamSharding``: tensor-parallel dim, expert flag, tied-embedding marks, which tensor
parallelism, gradient sync, clipping and checkpoints read) survives the wrapping.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
from dist_harness import run_on_ranks  # noqa: E402

MB = 2**20


def _config(args: argparse.Namespace, dp: int):
    from megacann.config import config_from_dict, validate

    model = {
        "type": "llama",
        "precision": "fp32",
        "hidden_size": args.hidden,
        "num_layers": args.layers,
        "num_attention_heads": 4,
        "ffn_hidden_size": 4 * args.hidden,
        "vocab_size": args.vocab,
        "max_position_embeddings": args.seq,
    }
    cfg = config_from_dict(
        {
            "experiment": {"name": "zero3_vs_fsdp2", "output_dir": "/tmp/megacann-bench-unused"},
            "model": model,
            "data": {"seq_length": args.seq, "batch_size": 1},
            "optim": {"lr": 1e-4, "max_steps": 100, "warmup_steps": 1, "clip_grad": 0.0},
            "distributed": {"zero_optimization": 3, "overlap_grad_reduce": True, "overlap_param_gather": True},
        }
    )
    validate(cfg, world_size=dp)
    return cfg


def _timed(step, steps: int) -> float:
    import torch.distributed as dist

    step()  # warm-up
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        slowest = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times.append(float(slowest.item()))
    return min(times)


def _measure(args: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from megacann import parallel_state as ps
    from megacann.layers.transformer import TransformerBlock
    from megacann.models import LLAMA
    from megacann.optimizer import build_optimizer
    from megacann.optimizer.memory import optimizer_memory
    from megacann.pipeline.partition import build_model_chunks
    from megacann.training.runtime import setup_runtime

    dp = dist.get_world_size()
    cfg = _config(args, dp)
    setup_runtime(cfg)
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, args.vocab, (1, args.seq + 1), generator=g)

    def loss_of(chunk) -> torch.Tensor:
        logits = chunk(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())

    result = {"dp": dp}
    chunk = build_model_chunks(cfg, LLAMA, device="cpu")[0]
    optimizer = build_optimizer(
        cfg, list(chunk.named_parameters()), modules=[chunk], sharding_units=LLAMA.sharding_units
    )

    def megacann_step() -> None:
        optimizer.zero_grad()
        with optimizer.last_micro_batch_backward():
            loss_of(chunk).backward()
        optimizer.finalize_grads()
        optimizer.step()

    result["megacann_s"] = _timed(megacann_step, args.steps)
    result["megacann_weights"] = optimizer_memory(optimizer)["params"]

    torch.manual_seed(cfg.seed)
    chunk = build_model_chunks(cfg, LLAMA, device="cpu")[0]
    kept = {n: set(vars(p)) for n, p in chunk.named_parameters()}
    mesh = init_device_mesh("cpu", (dp,))
    for module in chunk.modules():
        if isinstance(module, TransformerBlock):
            fully_shard(module, mesh=mesh)
    fully_shard(chunk, mesh=mesh)
    adam = torch.optim.AdamW(chunk.parameters(), lr=1e-4)

    def fsdp_step() -> None:
        adam.zero_grad()
        loss_of(chunk).backward()
        adam.step()

    result["fsdp2_s"] = _timed(fsdp_step, args.steps)
    result["fsdp2_weights"] = sum(p.to_local().numel() * p.element_size() for p in chunk.parameters())
    result["fsdp2_metadata_lost"] = sum(kept[n] - set(vars(p)) != set() for n, p in chunk.named_parameters())
    result["params"] = len(kept)
    ps.destroy_model_parallel()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args(argv)
    print(f"{'dp':>2} | {'megacann s':>10} {'FSDP2 s':>8} {'ratio':>6} | {'weights MB':>10} {'FSDP2 MB':>8} | metadata")
    for dp in args.dp:
        r = run_on_ranks(_measure, dp, args=(args,), timeout=900)[0]
        print(
            f"{dp:>2} | {r['megacann_s']:10.3f} {r['fsdp2_s']:8.3f} {r['fsdp2_s'] / r['megacann_s']:6.2f} | "
            f"{r['megacann_weights'] / MB:10.2f} {r['fsdp2_weights'] / MB:8.2f} | FSDP2 dropped it on "
            f"{r['fsdp2_metadata_lost']} of {r['params']} parameters"
        )


if __name__ == "__main__":
    main()
