"""Generation on 2 pipeline stages by micro-batches: seconds of the prefill and of a whole generate call
with 1, 2 and 4 micro-batches, on CPU with gloo, in one run.

    python benchmarks/generation_pipeline.py [--batch 16] [--prompt 64] [--new 32] [--repeats 3]

Two processes, one intra-op thread each, hold the stages of a random LLaMA (the trainer's own chunks) and
generate greedily for ``--batch`` prompts of ``--prompt`` tokens, ``--new`` new tokens each, with each
``num_microbatches`` in turn, ``--repeats`` times; each case keeps its fastest run (started together, timed
on the slowest rank). The prefill is the time to the last stage's first choice (every row's first token).
With one micro-batch a stage idles while the other works; with several, the first stage runs micro-batch
m + 1 while the second runs m, within each round (a round waits for the last stage's tokens). With fewer
idle cores than the two processes, the stages cannot run at once and nothing is gained.
"""

from __future__ import annotations

import argparse
import time

from bench_common import add_int_args, add_llama_size_args, llama_model, random_token_trainer
from dist_harness import run_on_ranks

MICRO_BATCHES = (1, 2, 4)


def _rank(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    from megacann.generation import Generator, SamplingParams

    torch.set_num_threads(1)
    recipe = {
        "experiment": {"name": "generation_pipeline", "output_dir": "/tmp/megacann-generation-pipeline"},
        "model": llama_model("fp32", args.hidden, args.layers, args.ffn, args.vocab, args.seq),
        "data": {"seq_length": args.seq, "batch_size": 1},
        "optim": {"grad_accum_steps": 4},
        "distributed": {"pipeline_parallel_size": 2},
        "logging": {"ckpt_interval": 0},
    }
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, args.vocab, (args.batch, args.prompt), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=args.new)
    best: dict[int, tuple[float, float]] = {}
    tokens: dict[int, list] = {}
    with random_token_trainer(recipe) as trainer:
        chunk, spec = trainer.model_chunks[0], trainer.model_spec
        Generator(chunk, spec).generate(prompts[:2], SamplingParams(max_new_tokens=2))  # warm-up
        for _ in range(args.repeats):
            for micro_batches in MICRO_BATCHES:
                first_token: list[float] = []
                dist.barrier()
                start = time.perf_counter()
                results = Generator(chunk, spec, num_microbatches=micro_batches).generate(
                    prompts, params, on_token=lambda *_, seen=first_token: seen or seen.append(time.perf_counter())
                )
                times = torch.tensor([first_token[0] - start, time.perf_counter() - start])
                dist.all_reduce(times, op=dist.ReduceOp.MAX)
                prefill, total = times.tolist()
                if micro_batches not in best or total < best[micro_batches][1]:
                    best[micro_batches] = (prefill, total)
                tokens[micro_batches] = [r.tokens for r in results]
    return {"best": best, "same_tokens": all(tokens[m] == tokens[1] for m in MICRO_BATCHES)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_llama_size_args(parser, hidden=256, layers=8, ffn=1024, vocab=2048, seq=128)
    add_int_args(parser, batch=16, prompt=64, new=32, repeats=3)
    args = parser.parse_args()
    if args.prompt + args.new > args.seq:
        parser.error(f"--prompt {args.prompt} + --new {args.new} is more than --seq {args.seq}")
    out = run_on_ranks(_rank, 2, args=(args,), timeout=3600)[0]
    print(
        f"2 gloo ranks x 1 thread (pp 2): llama d{args.hidden} x {args.layers} layers, ffn {args.ffn}; "
        f"{args.batch} prompts of {args.prompt} tokens, {args.new} new, greedy; fastest of {args.repeats}"
    )
    one = out["best"][1]
    for micro_batches in MICRO_BATCHES:
        prefill, total = out["best"][micro_batches]
        print(
            f"num_microbatches {micro_batches}: prefill {prefill:.3f} s ({one[0] / prefill:.2f}x), "
            f"generate {total:.3f} s ({one[1] / total:.2f}x)"
        )
    print(f"same tokens at every num_microbatches: {out['same_tokens']}")


if __name__ == "__main__":
    main()
