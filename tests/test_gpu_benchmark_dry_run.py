"""benchmarks/gpu_train_step.py runs end to end on a CPU at a tiny shape (the GPU run is the same script)."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.extended
def test_dry_run_on_cpu_writes_the_table(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "benchmarks/gpu_train_step.py", "--device", "cpu", "--preset", "tiny"]
    cmd += ["--steps", "1", "--warmup", "1", "--compile-backend", "aot_eager", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    # measured rates are reported, never asserted: a slow CPU rounds its bf16 matmul rate to 0.0 TFLOP/s
    assert result["device"] == "cpu" and isinstance(result["matmul_bf16_tflops"], float)
    assert result["matmul_bf16_tflops"] >= 0
    rows = {row["label"]: row for row in result["rows"]}
    assert sorted(rows) == ["megacann-compile:tiny", "megacann-eager:tiny"], rows
    for row in rows.values():
        assert "error" not in row, row
        assert row["tokens_per_s"] >= 0 and row["tflops"] >= 0
        assert row["mfu_vs_matmul"] is None or row["mfu_vs_matmul"] >= 0  # None: the matmul rate rounded to 0
        assert math.isfinite(row["loss"]) and row["loss"] > 0 and row["grad_norm"] > 0
        assert row["peak_mem_gib"] > 0
    # both rows train the same model from the same seed: the compiled blocks give the eager loss
    assert math.isclose(rows["megacann-compile:tiny"]["loss"], rows["megacann-eager:tiny"]["loss"], rel_tol=1e-3)
    assert "| megacann-eager:tiny | tiny |" in proc.stdout
