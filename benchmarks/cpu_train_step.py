"""Training tokens/s on CPU: megacann's trainer vs transformers' LlamaForCausalLM with torch.optim.AdamW.

Same model shape, same batch, same threads, in one process, alternating rounds so both see the same
machine state. A step is forward, backward, global-norm clipping (1.0) and an AdamW update.

    python benchmarks/cpu_train_step.py                       # fp32 and bf16, d512 x 8 layers, seq 512, mb 8
    python benchmarks/cpu_train_step.py --precision fp32 --steps 2 --rounds 1

bf16: megacann keeps bf16 weights with fp32 master weights and fp32 gradient accumulation; transformers
runs under torch.autocast(bf16) with fp32 weights (the usual mixed precision for a HF model).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megacann.config import config_from_dict, validate


def megacann_trainer(args, precision: str):
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    raw = {
        "model": {
            "type": "llama",
            "precision": precision,
            "hidden_size": args.hidden,
            "num_layers": args.layers,
            "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads,
            "ffn_hidden_size": args.ffn,
            "vocab_size": args.vocab,
            "max_position_embeddings": args.seq,
        },
        "data": {"seq_length": args.seq, "batch_size": args.micro_batch},
        "optim": {"lr": 1e-4, "max_steps": 10_000, "clip_grad": 1.0, "weight_decay": 0.1},
        "distributed": {"device": "cpu"},
    }
    cfg = config_from_dict(raw)
    validate(cfg, world_size=1)
    batch = fixed_batch(args)

    class Data:
        train = iter(lambda: {"tokens": batch, "labels": batch}, None)

        @staticmethod
        def valid():
            return None

    trainer = Trainer(cfg, setup_runtime(cfg), data=Data())
    return trainer.train_step


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
    model = LlamaForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    batch = fixed_batch(args)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def fixed_batch(args) -> torch.Tensor:
    return torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=torch.Generator().manual_seed(0))


def timed(step, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv_heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=1376)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro_batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per system")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokens = args.micro_batch * args.seq
    print(
        f"LLaMA d{args.hidden} x {args.layers} layers, heads {args.heads}/{args.kv_heads}, ffn {args.ffn}, "
        f"vocab {args.vocab}, seq {args.seq}, micro-batch {args.micro_batch}, {args.threads} threads, torch {torch.__version__}"
    )
    results = {}
    for precision in args.precision:
        systems = {"transformers": hf_step(args, precision), "megacann": megacann_trainer(args, precision)}
        for step in systems.values():  # warm-up
            step()
        times: dict[str, list[float]] = {name: [] for name in systems}
        for _ in range(args.rounds):
            for name, step in systems.items():
                times[name].append(timed(step, args.steps))
        row = {name: tokens / statistics.median(t) for name, t in times.items()}
        results[precision] = row
        ratio = row["megacann"] / row["transformers"]
        print(
            f"{precision}: transformers {row['transformers']:,.0f} tok/s | megacann {row['megacann']:,.0f} tok/s "
            f"| ratio {ratio:.2f}x (goal >= 1.3x)",
            flush=True,
        )
        del systems
        from megacann.training.runtime import shutdown_runtime

        shutdown_runtime()


if __name__ == "__main__":
    main()
