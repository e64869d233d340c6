"""megacann-train --dry_run on the seed recipe: layout, batch and size, no devices, no collectives. The
first test runs the installed command in a process of its own; the others call its entry point in-process
(the same ``train_main``), which spares a fresh interpreter's import of torch and megacann."""

import os
import subprocess

import pytest
from cli_helpers import ROOT, console_script, user_env

from megacann.cli import train_main

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


def test_dry_run_with_override_and_bad_key(capsys):
    code = train_main(
        ["--config", SEED, "--dry_run", "distributed.tensor_parallel_size=8", "distributed.data_parallel_size=1"]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "world 32 = tp 8 x pp 4 x dp 1" in out and "global batch 64" in out
    code = train_main(["--config", SEED, "--dry_run", "optim.learning_rate=1"])
    assert code == 2 and "did you mean 'optim.lr'" in capsys.readouterr().err


@pytest.mark.extended
def test_lora_recipe_dry_run_counts_the_adapters_as_peft_does():
    recipe = os.path.join(ROOT, "examples", "configs", "llama", "llama_7b_sft_lora.yaml")
    proc = run_cli("--config", recipe, "--dry_run")
    assert proc.returncode == 0, proc.stderr
    assert "world 8 = tp 1 x pp 1 x dp 8" in proc.stdout and "train_mode: sft" in proc.stdout
    # rank 16 on q, k, v, o (4096 -> 4096) and gate, up, down (4096 <-> 11008) of 32 layers:
    # 32 x 16 x (4 x (4096 + 4096) + 3 x (4096 + 11008)) adapter parameters on LLaMA-7B's 6,738,415,616
    adapters = 32 * 16 * (4 * (4096 + 4096) + 3 * (4096 + 11008))
    assert adapters == 39_976_960
    total = 6_738_415_616 + adapters
    assert f"LoRA rank 16 on all-linear: {adapters:,} trainable of {total:,} (0.59%); the base is frozen" in proc.stdout
    proc = run_cli("--config", recipe, "--dry_run", "lora_target_modules=[q_proj,v_proj]", "lora_rank=8")
    assert f"LoRA rank 8 on ['q_proj', 'v_proj']: {32 * 8 * 2 * (4096 + 4096):,} trainable" in proc.stdout
