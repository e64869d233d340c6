"""Start-up of one rank: time, values drawn and peak host memory, before and after the block-wise draw.

Cases (each measured in a fresh process, so its peak is its own):

- ``llama7b``: one tp-8 rank of examples/configs/llama/llama_7b.yaml (bf16 weights, built for real);
- ``moe30b``: one tp-8 rank of examples/configs/qwen3_moe/qwen3_30b_a3b.yaml (48 layers of 128 experts),
  weights on the meta device (the host here cannot hold the rank's 7.6 GB), each parameter drawn into a
  transient buffer of its local shape, as building it for real would;
- ``init_from_1b``: ``model.init_from`` a 1.1B LLaMA Hugging Face directory (d2048, 22 layers, ffn 5632, gqa
  32/4, vocab 32000, bf16) that the benchmark writes once into ``--workdir``; one rank, tp 1.

``--draw old`` emulates the start-up before issue 39: each parameter's whole tensor drawn from torch's CPU
RNG at construction and again by ``initialize_weights``, then sliced, also when ``init_from`` then loads
it, and the load itself as it was (files memory-mapped, each tensor made fp32 whole before slicing). ``--draw new`` is the code as it is. The tp-8 rank is simulated in one process (parallel_state answers
tp 8, rank 0; building a chunk needs no collective). Peak host memory is the process's ``ru_maxrss`` at the
end minus its ``ru_maxrss`` after imports (resident memory, file pages mapped included).

    python benchmarks/startup.py                   # every case, old and new, one table
    python benchmarks/startup.py --cases llama7b,moe30b --layers 2   # both cut to 2 layers
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

import bench_common  # noqa: F401 -- puts the checkout on sys.path
import torch

TP = 8
HF_1B = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
    num_key_value_heads=4, max_position_embeddings=2048, torch_dtype="bfloat16",
)  # fmt: skip


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _simulate_tp_rank(tp: int) -> None:
    """parallel_state answers tp ``tp``, rank 0, without process groups."""
    from megacann import parallel_state as ps

    ps.get_tensor_model_parallel_world_size = lambda: tp
    ps.get_tensor_model_parallel_rank = lambda: 0


def _old_draw(counter: list[int]):
    """The draw before issue 39: the whole logical tensor from torch's CPU RNG (or a fresh generator), padded,
    then this rank's slice."""
    from megacann.layers.sharding import shard_tensor

    @torch.no_grad()
    def draw(param, sharding, init_method, seed, tp_rank, tp_size):
        if param.is_meta:
            return
        shape = list(sharding.logical_shape)
        drawn = torch.empty(shape, dtype=torch.float32)
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.default_generator.manual_seed(seed)
            init_method(drawn)
        counter[0] += drawn.numel()
        if sharding.logical_size is not None and sharding.tp_dim is not None:
            full = torch.zeros(sharding.full_shape, dtype=torch.float32)
            full.narrow(sharding.tp_dim, 0, sharding.logical_size).copy_(drawn)
        else:
            full = drawn
        param.copy_(shard_tensor(full, sharding, tp_rank, tp_size) if tp_size > 1 else full)

    return draw


RECIPES = {"llama7b": "examples/configs/llama/llama_7b.yaml", "moe30b": "examples/configs/qwen3_moe/qwen3_30b_a3b.yaml"}


def _old_loading() -> None:
    """The loading before issue 39: safetensors files memory-mapped (handles kept for the whole load), each
    tensor made fp32 whole, padded, sliced, then cast to the parameter's dtype."""
    from safetensors import safe_open

    from megacann import parallel_state as ps
    from megacann.interop import hf, reading
    from megacann.layers.sharding import get_sharding, shard_tensor

    class MappedFile:
        def __init__(self, path: str):
            self.handle = safe_open(path, framework="pt")

        def keys(self) -> list[str]:
            return list(self.handle.keys())

        def get_tensor(self, name: str) -> torch.Tensor:
            return self.handle.get_tensor(name)

    @torch.no_grad()
    def load(param, full, name, source="state"):
        layout = get_sharding(param)
        full = full.to(torch.float32)
        if layout.logical_size is not None and layout.tp_dim is not None:
            padded = torch.zeros(layout.full_shape, dtype=torch.float32)
            padded.narrow(layout.tp_dim, 0, layout.logical_size).copy_(full)
            full = padded
        tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        param.copy_(shard_tensor(full, layout, tp_rank, tp_size).to(dtype=param.dtype, device=param.device))

    hf.SafetensorsFile = MappedFile
    reading.load_full_tensor_ = load


def _recipe(case: str, workdir: str, layers: int):
    """The case's recipe: a published-size one laid out for one tp-8 rank, or init_from the 1B directory."""
    from megacann.config import config_from_dict, load_config
    from megacann.training.recipe import prepare_recipe

    if case == "init_from_1b":
        cfg = config_from_dict({"model": {"init_from": _hf_1b(workdir), "precision": "bf16"}})
        prepare_recipe(cfg, world_size=1)
        return cfg
    cfg = load_config(os.path.join(bench_common.ROOT, RECIPES[case]))
    d = cfg.distributed
    d.world_size, d.tensor_parallel_size, d.pipeline_parallel_size, d.data_parallel_size = TP, TP, 1, 1
    d.expert_parallel_size, d.zero_optimization = 1, False
    if layers:
        cfg.model.num_layers = layers
    prepare_recipe(cfg, world_size=TP)
    return cfg


def _hf_1b(workdir: str) -> str:
    """The 1.1B Hugging Face directory, written once (random bf16 weights, N(0, 0.02))."""
    path = os.path.join(workdir, "llama_1b_hf")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    import transformers
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(**HF_1B)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in transformers.LlamaForCausalLM(config).named_parameters()}
    generator = torch.Generator().manual_seed(0)
    tensors = {n: (torch.randn(s, generator=generator) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    return path


def _draw_into_transient_buffers(chunks, seed: int) -> None:
    """Draw every (meta) parameter of ``chunks`` as building it for real would, into a CPU buffer of its local
    shape that is dropped at once (``--draw old``: twice, at construction and by initialize_weights)."""
    from megacann.layers.init import parameter_seed
    from megacann.layers.sharding import INIT_ATTR, INIT_NAME_ATTR, init_sharded_

    for chunk in chunks:
        for name, param in chunk.named_parameters():
            buffer = torch.empty(param.shape, dtype=param.dtype)
            buffer.__dict__.update({k: v for k, v in param.__dict__.items() if k.startswith("megacann")})
            key = getattr(param, INIT_NAME_ATTR, name)
            init_sharded_(buffer, getattr(param, INIT_ATTR), 0, TP, parameter_seed(seed, key))


def measure(case: str, draw: str, workdir: str, layers: int = 0) -> dict:
    """One case in this process: seconds, values drawn, the rank's weights and the peak host memory
    (``layers``: llama7b / moe30b cut to that many layers)."""
    from megacann.layers import block_draw, sharding
    from megacann.models import get_model_spec
    from megacann.pipeline import build_model_chunks
    from megacann.training import finetune
    from megacann.training.rank_model import build_rank_chunks

    cfg = _recipe(case, workdir, layers)
    spec = get_model_spec(cfg.model.type)
    _simulate_tp_rank(cfg.distributed.tensor_parallel_size)
    torch.manual_seed(cfg.seed)
    base = _peak_mib()
    device = "meta" if case == "moe30b" else "cpu"
    with block_draw.count_drawn_values() as drawn:
        if draw == "old":
            sharding.draw_shard_ = _old_draw(drawn)
            _old_loading()
        start = time.perf_counter()
        if draw == "old":
            chunks = build_model_chunks(cfg, spec, device=device)
        else:
            chunks = build_rank_chunks(cfg, spec, device)
        if device == "meta":
            for _ in range(2 if draw == "old" else 1):
                _draw_into_transient_buffers(chunks, cfg.seed)
        finetune.prepare_model_chunks(cfg, chunks)  # model.init_from: the load
        seconds = time.perf_counter() - start
    params = [p for chunk in chunks for p in chunk.parameters()]
    whole = spec.total_parameters(cfg.model)
    one_block_each = replicated = 0
    for p in params:
        layout = sharding.get_sharding(p)
        dim = block_draw.block_dim(p, layout)
        logical = layout.logical_shape
        one_block_each += math.prod(logical) // max(1, logical[dim]) * block_draw.block_extent(logical, dim)
        replicated += math.prod(logical) if layout.tp_dim is None else 0
    return {
        "tp": cfg.distributed.tensor_parallel_size,
        "one_block_each": one_block_each,
        "replicated": replicated,
        "case": case,
        "draw": draw,
        "seconds": round(seconds, 2),
        "drawn": drawn[0],
        "whole": whole,
        "kept": sum(p.numel() for p in params),
        "weights_mib": round(sum(p.numel() * p.element_size() for p in params) / 2**20, 1),
        "peak_mib": round(_peak_mib() - base, 1),
        "parameters": len(params),
    }


def _table(rows: list[dict]) -> str:
    lines = [
        "| case | draw | seconds | values drawn | / whole model | / kept | rank's weights | peak host memory | peak / weights |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['draw']} | {r['seconds']:.1f} | {r['drawn']:,} | {r['drawn'] / r['whole']:.3f} | "
            f"{r['drawn'] / r['kept']:.3f} | {r['weights_mib']:,.0f} MiB | {r['peak_mib']:,.0f} MiB | "
            f"{r['peak_mib'] / r['weights_mib']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="llama7b,moe30b,init_from_1b")
    parser.add_argument("--draws", default="old,new")
    parser.add_argument("--workdir", default="/tmp/megacann_startup_bench")
    parser.add_argument("--layers", type=int, default=0, help="cut llama7b / moe30b to this many layers (0: all)")
    parser.add_argument("--one", nargs=2, metavar=("CASE", "DRAW"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one, args.workdir, args.layers)))
        return
    os.makedirs(args.workdir, exist_ok=True)
    if "init_from_1b" in args.cases:
        _hf_1b(args.workdir)  # written before any measurement
    rows = []
    for case in args.cases.split(","):
        for draw in args.draws.split(","):
            command = [sys.executable, __file__, "--one", case, draw, "--workdir", args.workdir]
            command += ["--layers", str(args.layers)]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} (tp-{TP} cases: rank 0 simulated)"
    )
    print(_table(rows))
    for r in rows:
        target = r["whole"] / r["tp"] + r["one_block_each"]
        print(
            f"{r['case']} {r['draw']}: whole model {r['whole'] / 1e9:.2f} B values; drawn {r['drawn']:,} vs 1/{r['tp']} "
            f"of it plus one block per parameter {target:,.0f} ({r['drawn'] / target:.3f}x); replicated over TP and "
            f"kept whole: {r['replicated']:,}"
        )


if __name__ == "__main__":
    main()
