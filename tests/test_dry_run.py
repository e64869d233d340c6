"""megacann-train --dry_run on the seed recipe: layout, batch and size, no devices, no collectives."""

import os
import subprocess

from cli_helpers import ROOT, console_script, user_env

SEED = os.path.join(ROOT, "examples", "configs", "llama", "llama_7b.yaml")


def run_cli(*args, env=None):
    return subprocess.run(
        [console_script("megacann-train"), *args], capture_output=True, text=True, env=user_env(env), timeout=120
    )


def test_seed_recipe_dry_run():
    # MEGACANN_DEVICE=npu would fail if the dry run touched a device: it must not.
    proc = run_cli("--config", SEED, "--dry_run", env={"MEGACANN_DEVICE": "npu"})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "world 32 = tp 4 x pp 4 x dp 2" in out
    assert "global batch 128 sequences" in out
    assert "tensor-parallel groups (8): [0,1,2,3] [4,5,6,7]" in out
    assert "pipeline groups (8): [0,8,16,24]" in out
    assert "data-parallel groups (16): [0,4] [1,5]" in out
    assert "6,738,415,616 parameters" in out
    assert "tensor_parallel_size: 4" in out  # the resolved recipe is printed


def test_dry_run_with_override_and_bad_key():
    proc = run_cli(
        "--config", SEED, "--dry_run", "distributed.tensor_parallel_size=8", "distributed.data_parallel_size=1"
    )
    assert proc.returncode == 0, proc.stderr
    assert "world 32 = tp 8 x pp 4 x dp 1" in proc.stdout and "global batch 64" in proc.stdout
    proc = run_cli("--config", SEED, "--dry_run", "optim.learning_rate=1")
    assert proc.returncode == 2 and "did you mean 'optim.lr'" in proc.stderr
