"""Whole runs as a user starts them (torchrun, scripts/run_pretrain.sh, the console scripts), on 2 gloo
ranks, from a directory outside the repository:

- a rank killed with SIGKILL under ``torchrun --max-restarts 1``: the job restarts, resumes from the latest
  complete checkpoint by itself, and ends with the loss trace of a run that was never interrupted;
- Ctrl-C (SIGINT to the launcher and its ranks): a checkpoint at the step reached, one line, exit 130;
  resumed on one rank (a smaller global batch than it was saved with), it finishes; resumed once more, it
  says it is already done and how to continue; megacann-convert reads the result.
"""

import os
import re
import signal
import subprocess

import pytest
from cli_helpers import ROOT
from reliability_helpers import (
    console_script,
    logged_steps,
    losses,
    rank_pids,
    run_command,
    torchrun_command,
    train_command,
    user_env,
    wait_for,
    write_corpus,
    write_recipe,
)

# long enough that a kill after step 3 always lands mid-run; checkpoints every 4 steps
RUN = ["optim.max_steps=24", "logging.ckpt_interval=4"]


@pytest.mark.extended
def test_killed_rank_restarts_and_matches_the_uninterrupted_run(tmp_path):
    recipe = write_recipe(tmp_path, write_corpus(tmp_path))
    reference = run_command(torchrun_command(recipe, 2, *RUN, "experiment.output_dir=reference"), cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr[-3000:]

    out = tmp_path / "killed"
    cmd = torchrun_command(recipe, 2, *RUN, f"experiment.output_dir={out}", max_restarts=1)
    with subprocess.Popen(
        cmd, cwd=tmp_path, env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as job:
        ranks = wait_for(lambda: logged_steps(out) >= 5 and rank_pids(job.pid), 240, "step 5 of the run")
        os.kill(ranks[1], signal.SIGKILL)
        stdout, stderr = job.communicate(timeout=300)
    assert job.returncode == 0, stderr[-3000:]
    assert f"resuming from {out}/checkpoint_4 (automatically: output_dir holds a complete checkpoint)" in stdout
    expected = losses(tmp_path / "reference")
    assert sorted(expected) == list(range(1, 25))
    assert losses(out) == expected  # bit for bit, every step


@pytest.mark.extended
def test_ctrl_c_saves_says_one_line_and_the_run_resumes_on_one_rank(tmp_path):
    # a data-loader worker per rank: Ctrl-C reaches it too, and it must not die mid-step
    recipe = write_recipe(tmp_path, write_corpus(tmp_path), logging={"ckpt_interval": 0}, data={"num_workers": 1})
    out = tmp_path / "run"
    cmd = [
        "bash",
        os.path.join(ROOT, "scripts", "run_pretrain.sh"),
        "--config",
        str(recipe),
        "--nproc_per_node",
        "2",
        "optim.max_steps=500",
    ]
    with subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=user_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as job:
        wait_for(lambda: logged_steps(out) >= 3, 240, "step 3 of the run")
        os.killpg(job.pid, signal.SIGINT)  # what Ctrl-C in the terminal does: the launcher and every rank
        stdout, stderr = job.communicate(timeout=120)
    assert job.returncode == 128 + signal.SIGINT, stderr[-3000:]
    (line,) = stderr.strip().splitlines()  # one line, no tracebacks from the ranks or torchrun
    match = re.fullmatch(
        r"megacann-train: SIGINT: stopped after step (\d+) of 500, checkpoint (.*) saved; "
        r"continue with --resume_from latest",
        line,
    )
    assert match, line
    step = int(match.group(1))
    assert match.group(2) == str(out / f"checkpoint_{step}") and (out / f"checkpoint_{step}" / "COMPLETE").is_file()
    assert "Traceback" not in stdout

    # one rank now: half the global batch the checkpoint was saved with (used to stop with StopIteration)
    more = [f"optim.max_steps={step + 2}"]
    resumed = run_command(train_command(recipe, "--resume_from", "latest", *more), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"loaded {out / f'checkpoint_{step}'} (step {step}, {4 * step} samples consumed, resharded" in resumed.stdout
    assert max(losses(out)) == step + 2

    again = run_command(train_command(recipe, "--resume_from", "latest", *more), cwd=tmp_path)
    assert again.returncode == 0 and not again.stderr, again.stderr
    assert again.stdout.strip() == (
        f"{out} is already at step {step + 2} of {step + 2} (optim.max_steps; {out / f'checkpoint_{step + 2}'}): "
        f"nothing to train. To train further, raise optim.max_steps (e.g. optim.max_steps={2 * (step + 2)}) "
        "and resume with --resume_from latest"
    )

    export = run_command(
        [console_script("megacann-convert"), "consolidate", str(out), str(tmp_path / "whole")], cwd=tmp_path
    )
    assert export.returncode == 0, export.stderr[-3000:]
    assert any(name.endswith(".safetensors") for name in os.listdir(tmp_path / "whole"))


def test_launcher_passes_max_restarts_to_torchrun(tmp_path):
    launcher = ["bash", os.path.join(ROOT, "scripts", "run_pretrain.sh"), "--config"]
    recipe = os.path.join(ROOT, "examples", "configs", "llama", "tiny.yaml")
    shown = run_command([*launcher, recipe, "--nproc_per_node", "2", "--max_restarts", "3", "--print_only"], tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert " -m torch.distributed.run --nproc_per_node 2 --nnodes 1 --max-restarts 3 " in shown.stdout.splitlines()[-1]
    refused = run_command([*launcher, recipe, "--max_restarts", "-1"], tmp_path)
    assert (
        refused.returncode == 2
        and refused.stderr.strip() == "run_pretrain.sh: error: --max_restarts must be >= 0, got -1"
    )
