#!/usr/bin/env python3
"""CPU decode speed of megacann's KV-cache generator against transformers' ``generate`` with the same
weights, in one run: new tokens per second of each, their ratio, and whether the greedy tokens agree.

    python benchmarks/generation_vs_transformers.py [--threads 2] [--batches 1 16] [--dtypes fp32 bf16]
        [--prompt 128] [--new_tokens 128] [--repeats 2]

A random LLaMA (hidden 512, 4 layers, 8 heads, 4 kv heads, ffn 1408, vocabulary 8192) is written by
transformers to a temporary directory; transformers reads it back (eager attention, its dynamic cache) and
megacann loads it through ``from_pretrained_hf``. Every prompt has ``--prompt`` random tokens; both generate
``--new_tokens`` greedy tokens a row with no EOS. A time is a whole ``generate`` call (prefill included);
the two ways take turns, ``--repeats`` calls each, and each one's best time counts. Ratios are of the same
run; the wall seconds move with the machine's load (say it: ``uptime``), so the table also gives tokens per
CPU-second (the process's CPU time, both threads), which other work on the machine moves less.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import bench_common  # noqa: F401 (puts the checkout on sys.path)
import torch

from megacann.generation import Generator, SamplingParams
from megacann.interop import from_pretrained_hf
from megacann.models import get_model_spec

SHAPE = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def write_model(path: str) -> None:
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).save_pretrained(path)


def hf_generate(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    out = model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[:, prompts.shape[1] :]


def megacann_generate(generator: Generator, prompts: list[list[int]], params: SamplingParams) -> torch.Tensor:
    return torch.tensor([result.tokens for result in generator.generate(prompts, params)])


def timed(way, *args) -> tuple[float, float, torch.Tensor]:
    """The wall time and the CPU time (all threads) of one call of ``way(*args)``, and what it returned."""
    start, start_cpu = time.perf_counter(), time.process_time()
    tokens = way(*args)
    return time.perf_counter() - start, time.process_time() - start_cpu, tokens


def best_times(repeats: int, ways: list[tuple]) -> list[tuple[float, float, torch.Tensor]]:
    """For each ``(way, *args)`` of ``ways``: the shortest wall time and the least CPU time of ``repeats``
    calls, and what it returned. The ways take turns (one call each a round), so a change of the machine's
    load falls on all of them alike."""
    best = [(float("inf"), float("inf"), None)] * len(ways)
    for _ in range(repeats):
        for i, (way, *args) in enumerate(ways):
            wall, cpu, tokens = timed(way, *args)
            best[i] = (min(best[i][0], wall), min(best[i][1], cpu), tokens)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min)")
    print(
        f"llama d{SHAPE['hidden_size']} x {SHAPE['num_hidden_layers']} layers, vocab {SHAPE['vocab_size']}; "
        f"prompt {args.prompt}, {args.new_tokens} new tokens, greedy, {args.threads} thread(s)"
    )
    print(
        "dtype  batch  transformers tok/s  megacann tok/s  ratio | per CPU-second: transformers  megacann  ratio | same tokens"
    )
    with tempfile.TemporaryDirectory() as directory:
        write_model(directory)
        for name in args.dtypes:
            reference = transformers.AutoModelForCausalLM.from_pretrained(
                directory, dtype=DTYPES[name], attn_implementation="eager"
            ).eval()
            reference.generation_config.eos_token_id = None
            ours = from_pretrained_hf(directory, precision=name).eval()
            generator = Generator(ours, get_model_spec("llama"))
            params = SamplingParams(max_new_tokens=args.new_tokens)
            for batch in args.batches:
                prompts = torch.randint(
                    1, SHAPE["vocab_size"], (batch, args.prompt), generator=torch.Generator().manual_seed(batch)
                )
                rows = prompts.tolist()
                with torch.no_grad():
                    (theirs_s, theirs_cpu, theirs), (ours_s, ours_cpu, mine) = best_times(
                        args.repeats,
                        [
                            (hf_generate, reference, prompts, args.new_tokens),
                            (megacann_generate, generator, rows, params),
                        ],
                    )
                made = batch * args.new_tokens
                same = (mine == theirs).float().mean().item()
                print(
                    f"{name:>5}  {batch:>5}  {made / theirs_s:>18.1f}  {made / ours_s:>14.1f}  "
                    f"{theirs_s / ours_s:>5.2f} | {made / theirs_cpu:>27.1f}  {made / ours_cpu:>8.1f}  "
                    f"{theirs_cpu / ours_cpu:>5.2f} | {same:>10.1%}",
                    flush=True,
                )
    print(f"load average after: {os.getloadavg()[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
