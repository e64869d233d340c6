"""megacann's trainer step on one GPU, beside the usual alternatives measured in the same run.

A megacann row is the real :class:`~megacann.training.Trainer` step on synthetic data: bf16 parameters with
fp32 master weights and fp32 gradient buffers, fused AdamW (weight decay 0.1), global-norm clipping at
1.0, the fused chunked head loss; variants: ``eager``, ``compile`` (``precision.compile: true``,
torch.compile per transformer block) and ``compile-head`` (also the opt-in ``compiled`` head loss of
:mod:`megacann.ops.cuda`, whose per-chunk arithmetic is compiled; CUDA only). Shapes: the 1.1B TinyLlama shape (d2048, 22 layers, 32/4 heads,
ffn 5632, vocab 32000) and a 125M LLaMA (d768, 12 layers, ffn 2048), seq 2048, micro-batch 8.

For each row: tokens/s, TFLOP/s by the PaLM formula (the llama spec's ``flops_per_token``), MFU against
the 989 TFLOP/s bf16 datasheet peak of an H100/H200 and against a bf16 8192^3 matmul measured at the
start, peak memory, and how many host synchronisations one step makes (CUDA's sync debug mode).

Comparison rows run in the same invocation when a session has copied the measuring aids into the
git-ignored ``.devbench/`` folder (never commit them): ``anchor_gpu.py`` (transformers' LlamaForCausalLM,
eager and compiled) and ``limit_gpu.py`` (a compact hand-written compiled LLaMA). Every row runs in a
process of its own (memory freed between rows, one failure does not lose the table), in priority order,
within ``--budget-s``; rows that no longer fit are listed as skipped.

    python benchmarks/gpu_train_step.py                                 # CUDA: the rows that fit in --budget-s (420)
    python benchmarks/gpu_train_step.py --device cpu --preset tiny      # dry run on a CPU, seconds
    python benchmarks/gpu_train_step.py --preset 1.1B --variants eager --fp8 tensorwise rowwise \
        --no-anchors                      # + a row per FP8 recipe (precision.fp8) after each bf16 row

FP8 rows (``--fp8``) keep the bf16 parameters and fp32 masters and multiply every linear layer of the
blocks through ``ops.fp8_linear`` (docs/ops.md); their step time against the bf16 row of the same variant
is the FP8 speed-up or cost.

Writes ``benchmarks/results/gpu_train_step_<device>.json`` (or ``--out``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from train_vs_transformers import PRESETS, flops_per_token, megacann_trainer  # noqa: E402

from megacann import ops  # noqa: E402

DATASHEET_PEAK = 989e12  # dense bf16 FLOP/s of an H100 / H200 SXM
DEVBENCH = os.path.join(ROOT, ".devbench")
# every row of a shape, most wanted first (the budget may cut the tail): megacann's variants by name,
# the comparison aids by (script, argument)
ORDER = {
    "1.1B": [
        "compile",
        ("limit_gpu.py", "mixed"),
        ("anchor_gpu.py", "hf-compile:1.1B"),
        ("anchor_gpu.py", "hf-eager:1.1B"),
        "compile-head",
        "eager",
        ("anchor_gpu.py", "hf-bf16:1.1B"),
    ],
    "125M": [
        "compile",
        ("anchor_gpu.py", "hf-compile:125M"),
        ("anchor_gpu.py", "hf-eager:125M"),
        "compile-head",
        "eager",
    ],
    "tiny": ["compile", "compile-head", "eager"],
}
VARIANTS = ("compile", "compile-head", "eager")  # compile-head: + the compiled head-loss arithmetic (CUDA)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_flops(device: str, n: int, repeats: int = 20) -> float:
    """FLOP/s of an ``n``^3 bf16 matmul (the practical ceiling of the model's matrix multiplies)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def count_host_syncs(step, device: str) -> dict:
    """Host synchronisations CUDA reports during one ``step()`` (sync debug mode 'warn')."""
    if device != "cuda":
        return {"host_syncs_per_step": None}
    synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    synced = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
    return {"host_syncs_per_step": len(synced), "host_sync_messages": sorted(set(synced))[:5]}


def run_megacann_row(args) -> dict:
    """One megacann row, in this process: build, warm up (compiles), time ``--steps`` steps."""
    preset, variant, *fp8 = args.row.split(":")[1:]
    recipe = fp8[0] if fp8 else "none"
    shape = argparse.Namespace(**{**PRESETS[preset], "device": args.device})
    backend = (args.compile_backend or True) if variant.startswith("compile") else None
    if variant == "compile-head":  # before the trainer resolves ops (compiled blocks cache the choice)
        ops.pin("vocab_parallel_head_loss", "compiled")
    torch.manual_seed(0)
    start = time.perf_counter()
    trainer = megacann_trainer(shape, "bf16", compile_backend=backend, fp8=recipe)
    build_s = time.perf_counter() - start

    def step():
        return trainer.train_step()  # as fit runs it: one read of the device per step (the step guard's)

    start = time.perf_counter()
    for _ in range(args.warmup):
        step()
    synchronize(args.device)
    warmup_s = time.perf_counter() - start
    trainer.runtime.accelerator.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        result = step()
    synchronize(args.device)
    step_s = (time.perf_counter() - start) / args.steps
    memory = trainer.runtime.accelerator.memory_stats()
    row = {
        "name": f"megacann-{variant}" + ("" if recipe == "none" else f"-fp8-{recipe}"),
        "size": preset,
        "tokens_per_s": shape.micro_batch * shape.seq / step_s,
        "step_s": step_s,
        "build_s": build_s,
        "warmup_s": warmup_s,
        "peak_mem_gib": round(memory.get("mem_allocated_peak_gib", memory.get("rss_peak_gib", 0.0)), 2),
        "loss": float(result["loss"]),
        "grad_norm": float(result["grad_norm"]),
        "ops": ops.selection_line(args.device),
    }
    row.update(count_host_syncs(step, args.device))
    return row


def with_rates(row: dict, shape: dict, matmul: float) -> dict:
    """Add TFLOP/s (PaLM formula) and MFU against the datasheet peak and the measured matmul."""
    if "tokens_per_s" not in row:
        return row
    tflops = row["tokens_per_s"] * flops_per_token(argparse.Namespace(**shape)) / 1e12
    row.update(
        tflops=round(tflops, 2),
        mfu_vs_989=round(tflops * 1e12 / DATASHEET_PEAK, 3),
        mfu_vs_matmul=round(tflops * 1e12 / matmul, 3) if matmul else None,
        tokens_per_s=round(row["tokens_per_s"]),
    )
    return row


def run_child(cmd: list[str], timeout: float, env: dict, log: Optional[str] = None) -> list[dict]:
    """Run one row's process; returns the JSON rows it printed (one per line), or an error row. ``log``:
    a file that gets the process's whole output."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as err:
        proc = None
        if log:
            with open(log, "w") as f:
                f.write(f"$ {' '.join(cmd)}\ntimed out after {timeout:.0f} s\n{err.stdout or ''}\n{err.stderr or ''}")
        return [{"error": f"timed out after {timeout:.0f} s"}]
    if log:
        with open(log, "w") as f:
            f.write(f"$ {' '.join(cmd)}\nexit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    rows = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
    if not rows:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        rows = [{"error": f"exit {proc.returncode}: {' | '.join(tail)[:400]}"}]
    return rows


def plan_rows(args) -> list[tuple[str, str, list[str]]]:
    """(size, label, command) of every row, in priority order."""
    rows = []
    for preset in args.preset:
        for entry in ORDER[preset]:
            if isinstance(entry, str):
                if entry not in args.variants:
                    continue
                for recipe in ["none", *args.fp8]:  # the bf16 row, then one per FP8 recipe
                    row = f"megacann:{preset}:{entry}" + ("" if recipe == "none" else f":{recipe}")
                    cmd = [sys.executable, os.path.abspath(__file__), "--row", row]
                    cmd += ["--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup)]
                    if args.compile_backend:
                        cmd += ["--compile-backend", args.compile_backend]
                    label = f"megacann-{entry}" + ("" if recipe == "none" else f"-fp8-{recipe}")
                    rows.append((preset, f"{label}:{preset}", cmd))
            elif args.device == "cuda" and not args.no_anchors:
                script, arg = entry
                path = os.path.join(DEVBENCH, script)
                if os.path.exists(path):
                    rows.append((preset, f"{script[:-3]} {arg}", [sys.executable, path, arg]))
    return rows


def print_table(result: dict) -> None:
    print(f"\nmatmul bf16 {result['matmul_bf16_tflops']} TFLOP/s | {result['device_name']} | torch {result['torch']}")
    print("| row | size | tokens/s | TFLOP/s | MFU (989) | MFU (matmul) | peak GiB | syncs/step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        if "error" in r or "skipped" in r:
            print(f"| {r['label']} | {r['size']} | {r.get('error') or r.get('skipped')} |")
            continue
        print(
            f"| {r['label']} | {r['size']} | {r['tokens_per_s']:,} | {r.get('tflops')} | {r.get('mfu_vs_989')} | "
            f"{r.get('mfu_vs_matmul')} | {r.get('peak_mem_gib', r.get('peak_gib'))} | {r.get('host_syncs_per_step')} |"
        )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--preset", nargs="+", default=None, choices=["1.1B", "125M", "tiny"])
    parser.add_argument("--variants", nargs="+", default=None, choices=VARIANTS, help="megacann rows (default: all)")
    parser.add_argument("--compile-backend", default=None, help="torch.compile backend of the compile rows")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget for all rows")
    parser.add_argument("--row-timeout-s", type=float, default=240.0)
    parser.add_argument("--min-row-s", type=float, default=60.0, help="skip rows when less budget is left")
    parser.add_argument("--log-dir", default=None, help="write each row's full output here")
    parser.add_argument("--matmul-size", type=int, default=None, help="default 8192 on CUDA, 512 on CPU")
    parser.add_argument("--no-anchors", action="store_true", help="skip the .devbench comparison rows")
    parser.add_argument(
        "--fp8",
        nargs="+",
        default=[],
        choices=["tensorwise", "rowwise", "blockwise", "mxfp8"],
        help="after each megacann row, one row per FP8 recipe (precision.fp8)",
    )
    parser.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/gpu_train_step_<device>.json)"
    )
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)  # internal: run one megacann row
    args = parser.parse_args(argv)
    if args.preset is None:
        args.preset = ["1.1B", "125M"] if args.device == "cuda" else ["tiny"]
    if args.variants is None:
        args.variants = list(VARIANTS) if args.device == "cuda" else ["compile", "eager"]
    if "compile-head" in args.variants and args.device != "cuda":
        parser.error("--variants compile-head: the compiled head loss is registered for CUDA only")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.row:  # a child: one megacann row, printed as one JSON line
        print(json.dumps(run_megacann_row(args)), flush=True)
        return {}
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible (use --device cpu for the dry run)")
    began = time.perf_counter()
    n = args.matmul_size or (8192 if args.device == "cuda" else 512)
    matmul = matmul_flops(args.device, n)
    result = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "matmul_size": n,
        "matmul_bf16_tflops": round(matmul / 1e12, 1),
        "datasheet_peak_tflops": DATASHEET_PEAK / 1e12,
        "steps": args.steps,
        "warmup": args.warmup,
        "rows": [],
    }
    if args.device == "cuda":
        torch.cuda.empty_cache()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    env.setdefault("OUT", tempfile.mkdtemp(prefix="gpu_train_step-"))  # where the aids write their own JSON
    print(f"matmul bf16 {n}^3: {matmul / 1e12:.1f} TFLOP/s", flush=True)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    for size, label, cmd in plan_rows(args):
        left = args.budget_s - (time.perf_counter() - began)
        if left < args.min_row_s:
            result["rows"].append({"label": label, "size": size, "skipped": f"budget ({args.budget_s:.0f} s) spent"})
            continue
        log = os.path.join(args.log_dir, label.replace(" ", "_").replace(":", "_") + ".log") if args.log_dir else None
        for row in run_child(cmd, min(args.row_timeout_s, left), env, log):
            row = with_rates({"label": label, "size": size, **row}, PRESETS[size], matmul)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    result["wall_s"] = round(time.perf_counter() - began, 1)
    out = args.out or os.path.join(HERE, "results", f"gpu_train_step_{args.device}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print_table(result)
    print(f"written: {out}")
    return result


if __name__ == "__main__":
    main()
