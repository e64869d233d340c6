"""Training tokens/s: megacann's trainer vs transformers' LlamaForCausalLM with torch.optim.AdamW.

Same model shape, same batch, same threads, same device, in one process, alternating rounds so both see
the same machine state. A step is forward, backward, global-norm clipping (1.0) and an AdamW update.
On CPU megacann's runtime keeps freed host memory mapped (:mod:`megacann.host_memory`), for the whole
process, so transformers' step runs under that policy too (``MEGACANN_HOST_MALLOC=system``: glibc's
defaults for both).

    python benchmarks/train_vs_transformers.py                          # CPU, d512 x 8 layers, seq 512, mb 8
    python benchmarks/train_vs_transformers.py --device cuda --preset 1.1B --precision bf16

bf16: megacann keeps bf16 weights with fp32 master weights and fp32 gradient accumulation; transformers
runs under torch.autocast(bf16) with fp32 weights (the usual mixed precision for a HF model). On CUDA
transformers' AdamW uses the fused kernel too; on CPU it uses torch's default.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from megacann.config import config_from_dict, validate
from megacann.host_memory import keep_freed_host_memory


def llama_model_section(args, precision: str, max_positions: int) -> dict:
    """The ``model`` section of a megacann LLaMA recipe of the size in ``args`` (``hidden``, ``layers``,
    ``heads``, ``kv_heads``, ``ffn``, ``vocab``)."""
    return {
        "type": "llama",
        "precision": precision,
        "hidden_size": args.hidden,
        "num_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "ffn_hidden_size": args.ffn,
        "vocab_size": args.vocab,
        "max_position_embeddings": max_positions,
    }


def megacann_trainer(args, precision: str, compile_backend=None, fp8: str = "none"):
    """megacann's Trainer for the shape in ``args`` on synthetic data (one fixed batch); ``compile_backend``
    sets precision.compile (torch.compile per transformer block), ``fp8`` precision.fp8 (a recipe, or none)."""
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    raw = {
        "model": llama_model_section(args, precision, args.seq),
        "data": {"seq_length": args.seq, "batch_size": args.micro_batch},
        "optim": {"lr": 1e-4, "max_steps": 10_000, "clip_grad": 1.0, "weight_decay": 0.1},
        "distributed": {"device": args.device},
        "precision": {
            "compile": compile_backend or False,
            "fused_ops": not getattr(args, "reference_ops", False),
            "fp8": fp8,
        },
    }
    cfg = config_from_dict(raw)
    validate(cfg, world_size=1)
    batch = fixed_batch(args)
    if args.device == "cuda":
        batch = batch.pin_memory()  # as a data loader with data.pin_memory hands it over: copies need no sync

    class Data:
        train = iter(lambda: {"tokens": batch, "labels": batch}, None)

        @staticmethod
        def valid():
            return None

    return Trainer(cfg, setup_runtime(cfg), data=Data())


def hf_step(args, precision: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(args.device).train()
    fused = {"fused": True} if args.device != "cpu" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **fused)
    batch = fixed_batch(args).to(args.device)

    def step():
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def fixed_batch(args) -> torch.Tensor:
    return torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=torch.Generator().manual_seed(0))


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(step, n: int, device: str, kernel: list) -> float:
    """Seconds per step over ``n`` steps; appends to ``kernel`` this process's minor page faults (MiB of
    fresh pages the OS mapped and zero-filled) and system CPU seconds per step: on CPU a step's large
    temporaries are fresh mappings, whose cost varies more between machines than the products do."""
    synchronize(device)
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    for _ in range(n):
        step()
    synchronize(device)
    seconds = (time.perf_counter() - start) / n
    after = resource.getrusage(resource.RUSAGE_SELF)
    page_mib = resource.getpagesize() / 2**20
    kernel.append(((after.ru_minflt - before.ru_minflt) * page_mib / n, (after.ru_stime - before.ru_stime) / n))
    return seconds


PRESETS = {
    # the CPU shape
    "cpu": dict(hidden=512, layers=8, heads=8, kv_heads=8, ffn=1376, vocab=32000, seq=512, micro_batch=8),
    # the GPU anchor shapes (TinyLlama 1.1B and a 125M LLaMA), seq 2048, micro-batch 8
    "1.1B": dict(hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632, vocab=32000, seq=2048, micro_batch=8),
    "125M": dict(hidden=768, layers=12, heads=12, kv_heads=12, ffn=2048, vocab=32000, seq=2048, micro_batch=8),
    # a dry-run shape: seconds on a CPU
    "tiny": dict(hidden=128, layers=2, heads=4, kv_heads=2, ffn=352, vocab=1024, seq=128, micro_batch=2),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="model shape and batch")
    for key in PRESETS["cpu"]:
        parser.add_argument(f"--{key}", type=int, default=None, help="overrides the preset")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per system")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument(
        "--compile", nargs="?", const=True, default=None, help="megacann with precision.compile (optionally a backend)"
    )
    parser.add_argument("--reference-ops", action="store_true", help="megacann with precision.fused_ops: false")
    parser.add_argument(
        "--versus-compiled", action="store_true", help="megacann eager against megacann with compiled blocks"
    )
    args = parser.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def flops_per_token(args) -> float:
    """Training FLOPs per token by the PaLM formula (6N + 12LHQT), as the llama family's spec computes it."""
    from megacann.config import ModelConfig
    from megacann.models import get_model_spec

    cfg = ModelConfig(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        ffn_hidden_size=args.ffn,
        vocab_size=args.vocab,
    )
    return get_model_spec("llama").flops_per_token(cfg, args.seq)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    tokens = args.micro_batch * args.seq
    print(
        f"LLaMA d{args.hidden} x {args.layers} layers, heads {args.heads}/{args.kv_heads}, ffn {args.ffn}, "
        f"vocab {args.vocab}, seq {args.seq}, micro-batch {args.micro_batch}, {args.threads} threads, torch {torch.__version__}"
        f", megacann compile {args.compile or False}, fused ops {not args.reference_ops}"
    )
    results = {}
    baseline = "megacann" if args.versus_compiled else "transformers"
    other = "megacann-compiled" if args.versus_compiled else "megacann"
    for precision in args.precision:
        trainers = [megacann_trainer(args, precision, compile_backend=args.compile)]
        if args.versus_compiled:  # megacann eager vs megacann with compiled blocks, both in this process
            trainers.append(megacann_trainer(args, precision, compile_backend=args.compile or True))
            systems = {baseline: trainers[0].train_step, other: trainers[1].train_step}
        else:
            systems = {baseline: hf_step(args, precision), other: trainers[0].train_step}
        for step in systems.values():  # warm-up
            step()
        times: dict[str, list[float]] = {name: [] for name in systems}
        kernel: dict[str, list[tuple[float, float]]] = {name: [] for name in systems}
        for _ in range(args.rounds):
            for name, step in systems.items():
                times[name].append(timed(step, args.steps, args.device, kernel[name]))
        row = {name: tokens / statistics.median(t) for name, t in times.items()}
        results[precision] = row
        ratio = row[other] / row[baseline]
        tflops = {name: tps * flops_per_token(args) / 1e12 for name, tps in row.items()}
        print(
            f"{precision}: {baseline} {row[baseline]:,.0f} tok/s ({tflops[baseline]:.3g} TFLOP/s) | "
            f"{other} {row[other]:,.0f} tok/s ({tflops[other]:.3g} TFLOP/s) | ratio {ratio:.2f}x",
            flush=True,
        )
        faults = {name: [statistics.median(column) for column in zip(*k)] for name, k in kernel.items()}
        kept = args.device == "cpu" and keep_freed_host_memory()  # applied by megacann's CPU runtime, or declined
        print(
            f"{precision} per step, fresh pages and system CPU time: "
            + " | ".join(f"{name} {mib:,.0f} MiB, {sys_s:.2f} s" for name, (mib, sys_s) in faults.items())
            + f" (host memory {'kept mapped' if kept else 'the C library defaults'})",
            flush=True,
        )
        del systems, trainers
        from megacann.training.runtime import shutdown_runtime

        shutdown_runtime()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
