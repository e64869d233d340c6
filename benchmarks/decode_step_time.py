#!/usr/bin/env python3
"""CPU time of one decoding step and of the prefill, megacann's generator against transformers'
``generate``, on benchmarks/generation_vs_transformers.py's model, the two taking turns in one process.

    OMP_NUM_THREADS=1 python benchmarks/decode_step_time.py [--dtype bf16] [--batch 16] [--new_tokens 33]
        [--repeats 3] [--whole 128] [--also megacann@fp32_sdpa]

Each library generates 1 and ``--new_tokens`` tokens, ``--repeats`` times in turn; the least CPU time of
each counts. The prefill's figure is the 1-token call; a step's is the difference divided by the steps
between them, so the prefill drops out. CPU time of one thread moves less with the machine's load than
wall time (the load is printed). The last lines put the two together for a whole call of ``--whole`` new
tokens (prefill + ``--whole - 1`` steps, what benchmarks/generation_vs_transformers.py times): each
library's prefill share of it, and the ratio of the whole calls that the two parts give. ``--also
megacann@NAME`` adds megacann with ``decode_attention`` pinned to implementation NAME as a third way in the
same turns (before / after a kernel, in one process); ``--also megacann-plain`` adds megacann without the
call's weight copies (``Generator(cpu_weight_copies=False)``). For megacann's ways it also prints the CPU time a
step spends in ``megacann.ops.decode_attention`` (the least of the repeats), which the load moves less than
a whole step's.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import bench_common  # noqa: F401 (puts the checkout on sys.path)
import torch
from decode_step_profile import way
from generation_vs_transformers import DTYPES, SHAPE, write_model

import megacann.ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=33)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--whole", type=int, default=128)
    parser.add_argument(
        "--also", nargs="*", default=[], help="more ways: megacann@<decode_attention impl>, megacann-plain"
    )
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    prompts = torch.randint(
        1, SHAPE["vocab_size"], (args.batch, args.prompt), generator=torch.Generator().manual_seed(args.batch)
    )
    libraries = ("transformers", "megacann", *args.also)
    best, attention = {}, {}
    in_attention = [0.0]
    decode_attention = megacann.ops.decode_attention

    def timed_attention(*inputs, **options):
        start = time.process_time()
        out = decode_attention(*inputs, **options)
        in_attention[0] += time.process_time() - start
        return out

    megacann.ops.decode_attention = timed_attention  # the cache layers call it through megacann.ops
    with tempfile.TemporaryDirectory() as directory, torch.no_grad():
        write_model(directory)
        ways = {library: way(library, directory, args.dtype, prompts) for library in libraries}
        for _ in range(args.repeats):
            for new_tokens in (1, args.new_tokens):
                for library, generate in ways.items():
                    in_attention[0] = 0.0
                    start = time.process_time()
                    generate(new_tokens)
                    spent = time.process_time() - start
                    best[library, new_tokens] = min(best.get((library, new_tokens), spent), spent)
                    if new_tokens > 1:
                        attention[library] = min(attention.get(library, in_attention[0]), in_attention[0])
    megacann.ops.decode_attention = decode_attention
    print(
        f"{args.dtype} batch {args.batch}, prompt {args.prompt}, {torch.get_num_threads()} thread(s), "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    step = {lib: (best[lib, args.new_tokens] - best[lib, 1]) / (args.new_tokens - 1) for lib in libraries}
    for library in libraries:
        inside = (
            f" ({attention[library] / (args.new_tokens - 1) * 1e3:.2f} ms of it in decode_attention)"
            if library != "transformers"
            else ""
        )
        print(
            f"  {library:>20}: prefill {best[library, 1] * 1e3:7.1f} ms, a decoding step "
            f"{step[library] * 1e3:6.2f} ms{inside}"
        )
    whole = {lib: best[lib, 1] + (args.whole - 1) * step[lib] for lib in libraries}
    for library in libraries[1:]:
        print(
            f"  transformers / {library}: a step {step['transformers'] / step[library]:.2f}, the prefill "
            f"{best['transformers', 1] / best[library, 1]:.2f}, a call of {args.whole} new tokens "
            f"{whole['transformers'] / whole[library]:.2f}"
        )
    shares = ", ".join(f"{lib} {100 * best[lib, 1] / whole[lib]:.0f}%" for lib in libraries)
    print(f"  prefill share of a call of {args.whole} new tokens: {shares}")


if __name__ == "__main__":
    main()
