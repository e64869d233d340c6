"""megacann's C++ CPU kernels (csrc/) against eager PyTorch, forward + backward, at LLaMA-like shapes; and
the peak memory of the fused output-head loss against the unfused path.

Eager PyTorch is megacann's reference implementation of each op (what runs without the kernels), plus
``torch.nn.functional.rms_norm`` for RMSNorm. Each pair runs alternately in the same process with the
same threads; the figure is the median over rounds of the time per forward + backward. Memory: each
variant runs once in a fresh subprocess; the figure is the rise of the process's peak resident memory
(Linux VmHWM, reset before a second step) over what the inputs and the first step's leftovers hold.

    python benchmarks/ops.py                 # 4096 tokens, hidden 1024 and 4096, vocab 32000
    python benchmarks/ops.py --small         # 512 tokens, hidden 256/512, vocab 8000: seconds
    python benchmarks/ops.py --threads 2 --rounds 5
    python benchmarks/ops.py --variants --only swiglu cross_entropy   # each ISA variant of the loops too

``--variants`` adds, per case, the C++ kernel under every instruction-set variant this build holds and
this CPU runs (``megacann.ops.isa``), in the same process; ``cpp`` is the variant chosen at load, and the
bracketed factors are times relative to it.

Goals: RMSNorm, SwiGLU and RoPE >= 2x; cross entropy >= 1.5x; the fused head loss at most half the peak
memory of F.linear + vocab_parallel_cross_entropy.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from megacann.layers import vocab_parallel_cross_entropy
from megacann.ops import cpp, head_loss, isa, reference

GOALS = {"rms_norm": 2.0, "apply_rotary": 2.0, "swiglu": 2.0, "cross_entropy": 1.5}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def shapes(small: bool) -> dict:
    """Token count, hidden sizes (with their SwiGLU widths), vocabulary, head dim, head-loss chunk."""
    if small:
        return dict(tokens=512, hiddens=(256, 512), ffn={256: 688, 512: 1376}, vocab=8000, head_dim=64, chunk=128)
    return dict(
        tokens=4096,
        hiddens=(1024, 4096),
        ffn={1024: 2816, 4096: 11008},
        vocab=32000,
        head_dim=128,
        chunk=head_loss.DEFAULT_CHUNK_SIZE,
    )


def fwd_bwd(fn: Callable, leaves: list[torch.Tensor], fixed: tuple) -> Callable[[], None]:
    """A closure running fn forward and backward on fresh gradients. The incoming gradient (ones) is made
    once: in a model it comes from the next layer, so it is not part of the op's cost."""
    upstream: dict[str, torch.Tensor] = {}

    def step():
        for leaf in leaves:
            leaf.grad = None
        out = fn(*leaves, *fixed)
        if "grad" not in upstream:
            upstream["grad"] = torch.ones_like(out)
        out.backward(upstream["grad"])

    step.leaves = leaves
    return step


def median_times(steps: dict[str, Callable[[], None]], rounds: int, min_seconds: float) -> dict[str, float]:
    """Median seconds per call of each step over ``rounds`` alternating rounds; a round repeats a step
    until it has run ``min_seconds`` (short steps are noisy on a shared machine)."""
    repeats = {}
    for name, step in steps.items():
        step()  # warm-up (allocations, first-call work)
        start = time.perf_counter()
        step()
        repeats[name] = max(1, min(100, int(min_seconds / max(time.perf_counter() - start, 1e-6))))
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(repeats[name]):
                step()
            samples[name].append((time.perf_counter() - start) / repeats[name])
    return {name: statistics.median(s) for name, s in samples.items()}


def kernel_cases(s: dict, dtypes: list[str]):
    """(op, description, {name: step}) for every timed case; the first step is the C++ kernel."""
    g = torch.Generator().manual_seed(0)
    n = s["tokens"]
    for dname in dtypes:
        dtype = DTYPES[dname]

        def leaf(*shape, scale=1.0, dtype=dtype):
            return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_()

        for h in s["hiddens"]:
            x, w = leaf(n, h), leaf(h)
            yield (
                "rms_norm",
                f"[{n}, {h}] {dname}",
                {
                    "cpp": fwd_bwd(cpp.rms_norm, [x, w], (1e-6,)),
                    "eager (reference)": fwd_bwd(reference.rms_norm, [x, w], (1e-6,)),
                    "F.rms_norm": fwd_bwd(lambda a, b, eps, h=h: F.rms_norm(a, (h,), b, eps), [x, w], (1e-6,)),
                },
            )
        for h, interleaved in [(s["hiddens"][0], False), (s["hiddens"][0], True), (s["hiddens"][-1], False)]:
            d = s["head_dim"]
            q = leaf(1, n, h // d, d)
            angles = torch.randn(n, d // 2, generator=g)
            angles = angles.repeat_interleave(2, -1) if interleaved else torch.cat((angles, angles), -1)
            fixed = (angles.cos(), angles.sin(), interleaved)
            mode = "interleaved" if interleaved else "half"
            yield (
                "apply_rotary",
                f"[1, {n}, {h // d}, {d}] {mode} {dname}",
                {
                    "cpp": fwd_bwd(cpp.apply_rotary, [q], fixed),
                    "eager (reference)": fwd_bwd(reference.apply_rotary, [q], fixed),
                },
            )
        for h in s["hiddens"]:
            f = s["ffn"][h]
            gate_up = leaf(n, 2 * f)
            yield (
                "swiglu",
                f"[{n}, 2x{f}] {dname}",
                {
                    "cpp": fwd_bwd(cpp.swiglu, [gate_up], ()),
                    "eager (reference)": fwd_bwd(reference.swiglu, [gate_up], ()),
                },
            )
        logits = leaf(n, s["vocab"], scale=2.0)
        target = torch.randint(0, s["vocab"], (n,), generator=g)
        yield (
            "cross_entropy",
            f"[{n}, {s['vocab']}] {dname}",
            {
                "cpp": fwd_bwd(cpp.cross_entropy, [logits], (target,)),
                "eager (reference)": fwd_bwd(reference.cross_entropy, [logits], (target,)),
            },
        )


def head_problem(s: dict, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    h = s["hiddens"][0]
    hidden = (torch.randn(s["tokens"], h, generator=g)).to(dtype).requires_grad_()
    weight = (torch.randn(s["vocab"], h, generator=g) * h**-0.5).to(dtype).requires_grad_()
    target = torch.randint(0, s["vocab"], (s["tokens"],), generator=g)
    return hidden, weight, target


def head_steps(s: dict, dtype: torch.dtype) -> dict[str, Callable[[], None]]:
    hidden, weight, target = head_problem(s, dtype)

    def unfused(hd, w):
        return vocab_parallel_cross_entropy(F.linear(hd, w), target)

    def fused(hd, w, kernels):
        return head_loss.head_loss(hd, w, target, kernels=kernels, chunk_size=s["chunk"])

    return {
        "fused (cpp)": fwd_bwd(fused, [hidden, weight], (cpp.CPP_KERNELS,)),
        "fused (torch)": fwd_bwd(fused, [hidden, weight], (head_loss.TORCH_KERNELS,)),
        "unfused": fwd_bwd(unfused, [hidden, weight], ()),
    }


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def memory_probe(variant: str, small: bool, dtype: str) -> None:
    """In a fresh process: the rise of peak RSS over the inputs for one forward + backward (printed as JSON).
    The parent sets a fixed glibc mmap threshold so that freed tensors leave the resident set; one
    warm-up step pages in the libraries and thread pools first."""
    cpp.available()  # load the kernels before measuring
    step = head_steps(shapes(small), DTYPES[dtype])[variant]
    step()
    for leaf in step.leaves:  # free the warm-up's gradients now, not inside the measured step
        leaf.grad = None
    gc.collect()
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    step()
    print(json.dumps({"peak_rise_bytes": (_status_kib("VmHWM") - before) * 1024}))


def measure_memory(variant: str, args) -> float:
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-probe", variant, "--memory-dtype", args.memory_dtype]
    cmd += ["--threads", str(args.threads)] + (["--small"] if args.small else [])
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_rise_bytes"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="small shapes (a quick run)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per case")
    parser.add_argument("--min-seconds", type=float, default=0.2, help="least time per step and round")
    parser.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    parser.add_argument("--memory-dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--only", nargs="+", default=None, help="ops to time (default: all, and the head loss)")
    parser.add_argument("--variants", action="store_true", help="time every ISA variant of the C++ kernels too")
    parser.add_argument("--memory-probe", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def in_variant(step: Callable[[], None], variant: str) -> Callable[[], None]:
    """``step`` run with the C++ kernels' ``variant`` of their loops."""

    def run():
        with isa.use(variant):
            step()

    return run


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_probe:
        memory_probe(args.memory_probe, args.small, args.memory_dtype)
        return {}
    if not cpp.available():
        raise SystemExit("the C++ kernels are not available here (see the log line above)")
    s = shapes(args.small)
    print(
        f"threads {args.threads}, {args.rounds} rounds of >= {args.min_seconds} s, median time per forward + backward"
        f"; C++ kernel variant {isa.current()}, PyTorch capability {torch.backends.cpu.get_cpu_capability()}"
    )
    results = {}
    for op, desc, steps in kernel_cases(s, args.dtype):
        if args.only and op not in args.only:
            continue
        if args.variants:
            for variant in isa.built_variants():
                steps[f"cpp {variant}"] = in_variant(steps["cpp"], variant)
        times = median_times(steps, args.rounds, args.min_seconds)
        kernel = times.pop("cpp")
        line = ", ".join(f"{name} {t * 1e3:.1f} ms ({t / kernel:.2f}x)" for name, t in times.items())
        ratio = times["eager (reference)"] / kernel
        verdict = "meets" if ratio >= GOALS[op] else "below"
        print(f"{op:13s} {desc:34s} cpp {kernel * 1e3:7.1f} ms | {line} | goal {GOALS[op]}x: {verdict}")
        results[f"{op} {desc}"] = ratio
    del steps
    gc.collect()
    if args.only and "vocab_parallel_head_loss" not in args.only:
        return results
    h = s["hiddens"][0]
    for dname in args.dtype:
        times = median_times(head_steps(s, DTYPES[dname]), args.rounds, args.min_seconds)
        base = times["unfused"]
        line = ", ".join(f"{name} {t * 1e3:.1f} ms ({base / t:.2f}x)" for name, t in times.items())
        print(f"head loss     [{s['tokens']}, {h}] x [{s['vocab']}, {h}] {dname}: {line}")
    peaks = {v: measure_memory(v, args) for v in ("fused (cpp)", "fused (torch)", "unfused")}
    ratio = peaks["fused (cpp)"] / peaks["unfused"]
    line = ", ".join(f"{v} {b / 2**20:.0f} MiB" for v, b in peaks.items())
    verdict = "meets" if ratio <= 0.5 else "above"
    print(
        f"head loss peak memory rise ({args.memory_dtype}, fwd+bwd): {line}; fused/unfused {ratio:.2f} (goal <= 0.5: {verdict})"
    )
    results["head_loss_memory_ratio"] = ratio
    return results


if __name__ == "__main__":
    main()
