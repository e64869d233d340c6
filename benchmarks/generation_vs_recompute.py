#!/usr/bin/env python3
"""Greedy generation with megacann's KV-cache generator against recomputing the whole left-padded batch
for every new token (what examples/sft/evaluate.py did before it used the generator), same model, same
prompts, in one run: seconds of each, their ratio, and whether the tokens agree.

    python benchmarks/generation_vs_recompute.py [--prompts 64] [--batch 32] [--new_tokens 16] [--threads 1]

The model is a random LLaMA (hidden 256, 4 layers, 8 heads, 4 kv heads, vocabulary 260, fp32); prompts
are 10 to 30 random tokens. Each way runs twice, alternately; the table gives both times.
"""

from __future__ import annotations

import argparse
import time

import bench_common  # noqa: F401 (puts the checkout on sys.path)
import torch

from megacann.config import ModelConfig
from megacann.generation import Generator, SamplingParams
from megacann.layers import initialize_weights
from megacann.models import LlamaModel, get_model_spec

VOCAB = 260


@torch.no_grad()
def recompute_greedy(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy tokens by running every row's whole sequence again for each one (padding: segment 0)."""
    rows = [list(p) for p in prompts]
    for _ in range(new_tokens):
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        positions, segments = torch.zeros_like(ids), torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, width - len(row) :] = torch.tensor(row)
            positions[i, width - len(row) :] = torch.arange(len(row))
            segments[i, width - len(row) :] = 1
        logits = model(input_ids=ids, position_ids=positions, segment_ids=segments)[:, -1]
        for row, token in zip(rows, logits.argmax(-1).tolist()):
            row.append(token)
    return [row[len(p) :] for row, p in zip(rows, prompts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("prompts", 64), ("batch", 32), ("new_tokens", 16), ("threads", 1)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        num_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        ffn_hidden_size=688,
    )
    model = LlamaModel(cfg)
    initialize_weights(model, 0)
    model.eval()
    draw = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(1, VOCAB, (int(torch.randint(10, 31, (1,), generator=draw)),), generator=draw).tolist()
        for _ in range(args.prompts)
    ]
    generator = Generator(model, get_model_spec("llama"))
    params = SamplingParams(max_new_tokens=args.new_tokens)
    batches = [prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)]
    ways = {
        "recompute": lambda batch: recompute_greedy(model, batch, args.new_tokens),
        "kv_cache": lambda batch: [r.tokens for r in generator.generate(batch, params)],
    }
    seconds, tokens = {name: [] for name in ways}, {}
    for _ in range(2):
        for name, way in ways.items():
            start = time.perf_counter()
            tokens[name] = [t for batch in batches for t in way(batch)]
            seconds[name].append(time.perf_counter() - start)
    print(f"{args.prompts} prompts, batch {args.batch}, {args.new_tokens} new tokens, {args.threads} thread(s)")
    for name, times in seconds.items():
        print(f"{name:>10}: {' / '.join(f'{t:.2f} s' for t in times)}")
    print(f"speed-up (best of each): {min(seconds['recompute']) / min(seconds['kv_cache']):.1f}x")
    print(f"same tokens: {tokens['recompute'] == tokens['kv_cache']}")


if __name__ == "__main__":
    main()
