#!/usr/bin/env python3
"""Where one decoding step's CPU time goes, in megacann's generator or transformers' ``generate``, on
benchmarks/generation_vs_transformers.py's model: torch.profiler's self CPU time per op, for a step.

    OMP_NUM_THREADS=1 python benchmarks/decode_step_profile.py --library megacann [--dtype bf16] [--batch 16]
        [--new_tokens 34]

A step's figure is the difference of two profiled generations (``--new_tokens`` and 2 new tokens, each
after a warm-up), divided by the steps between them, so the prefill drops out. ``--phase prefill`` profiles
a generation of one new token instead: the prefill (and one choice of a token), to compare the work of the
two libraries' prefills op by op. One thread by default: the
profile of one process is what it says, whatever else runs on the machine (the load is printed).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import bench_common  # noqa: F401 (puts the checkout on sys.path)
import torch
from generation_vs_transformers import DTYPES, SHAPE, hf_generate, write_model
from torch.profiler import ProfilerActivity, profile

from megacann.generation import Generator, SamplingParams
from megacann.interop import from_pretrained_hf
from megacann.models import get_model_spec
from megacann.ops import registry


def way(library: str, directory: str, dtype: str, prompts: torch.Tensor):
    """``generate(new_tokens)`` of ``library`` on ``prompts``; ``megacann@NAME`` is megacann with its
    ``decode_attention`` pinned to implementation ``NAME`` (e.g. ``fp32_sdpa``: the route before the C++
    kernel), to compare the two in one process; ``megacann-plain`` is megacann's generator without the
    call's weight copies (``Generator(cpu_weight_copies=False)``: the products as before them)."""
    if "@" in library:
        pinned = library.split("@", 1)[1]
        generate = way("megacann", directory, dtype, prompts)

        def generate_pinned(new_tokens: int):
            registry.pin("decode_attention", pinned)
            try:
                return generate(new_tokens)
            finally:
                registry.pin("decode_attention", None)

        return generate_pinned
    if library == "transformers":
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=DTYPES[dtype], attn_implementation="eager"
        ).eval()
        model.generation_config.eos_token_id = None
        return lambda new_tokens: hf_generate(model, prompts, new_tokens)
    model = from_pretrained_hf(directory, precision=dtype).eval()
    generator = Generator(model, get_model_spec("llama"), cpu_weight_copies=library != "megacann-plain")
    rows = prompts.tolist()
    return lambda new_tokens: generator.generate(rows, SamplingParams(max_new_tokens=new_tokens))


def self_times(generate, new_tokens: int) -> dict[str, tuple[float, int]]:
    """Each op's (self CPU microseconds, calls) in one profiled ``generate(new_tokens)`` after a warm-up."""
    with torch.no_grad():
        generate(new_tokens)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            generate(new_tokens)
    return {e.key: (e.self_cpu_time_total, e.count) for e in prof.key_averages()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", required=True, help="megacann, transformers or megacann@<decode_attention impl>")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=34)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--phase", choices=["decode", "prefill"], default="decode")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    prompts = torch.randint(
        1, SHAPE["vocab_size"], (args.batch, args.prompt), generator=torch.Generator().manual_seed(args.batch)
    )
    with tempfile.TemporaryDirectory() as directory:
        write_model(directory)
        generate = way(args.library, directory, args.dtype, prompts)
        if args.phase == "prefill":
            short, long, steps = {}, self_times(generate, 1), 1
        else:
            short, long = self_times(generate, 2), self_times(generate, args.new_tokens)
            steps = args.new_tokens - 2
    step = {
        op: ((t - short.get(op, (0, 0))[0]) / steps, (n - short.get(op, (0, 0))[1]) / steps)
        for op, (t, n) in long.items()
    }
    total = sum(t for t, _ in step.values())
    print(
        f"{args.library} {args.dtype} batch {args.batch}: {total / 1e3:.2f} ms self CPU "
        f"{'a decoding step' if args.phase == 'decode' else 'the prefill (a 1-token generation)'} "
        f"({torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f})"
    )
    for op, (t, n) in sorted(step.items(), key=lambda item: -item[1][0])[: args.top]:
        print(f"  {op[:52]:52s} {t / 1e3:8.3f} ms {100 * t / total:5.1f}%  {n:5.1f} calls")


if __name__ == "__main__":
    main()
