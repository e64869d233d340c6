"""The launchers as a user meets them: scripts/run_pretrain.sh, megacann-train --nproc_per_node and the
per-cluster scripts, checked through --print_only (nothing starts) and through real config errors."""

import os
import shlex
import subprocess
import sys

import pytest
from cli_helpers import ROOT, TORCHRUN_VARS, console_script, user_env

import megacann.launch as launch
from megacann.cli import train_main

TINY = "examples/configs/llama/tiny.yaml"
SEED_7B = "examples/configs/llama/llama_7b.yaml"
MEGACANN_TRAIN = console_script("megacann-train")


def _run(args, env=None, cwd=ROOT):
    return subprocess.run(args, capture_output=True, text=True, env=user_env(env), cwd=cwd, timeout=120)


def _command(proc) -> list[str]:
    """The torchrun command printed by --print_only (its last line)."""
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout.strip().splitlines()[-1])


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


@pytest.mark.extended
def test_print_only_detects_one_process_on_cpu_and_forwards_overrides():
    proc = _run(["bash", "scripts/run_pretrain.sh", "--config", TINY, "--print_only", "optim.lr=1e-3", "seed=7"])
    cmd = _command(proc)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert _flag(cmd, "--nproc_per_node") == "1" and _flag(cmd, "--nnodes") == "1" and "--standalone" in cmd
    assert cmd[cmd.index("-m", 3) :] == ["-m", "megacann.train", "--config", TINY, "optim.lr=1e-3", "seed=7"]


@pytest.mark.extended
def test_multi_node_flags_reach_torchrun():
    args = ["--config", TINY, "--print_only", "--nproc_per_node", "2", "--nnodes", "2", "--node_rank", "1"]
    cmd = _command(
        _run(["bash", "scripts/run_pretrain.sh", *args, "--master_addr", "10.0.0.7", "--master_port", "29611"])
    )
    assert [
        _flag(cmd, f) for f in ("--nproc_per_node", "--nnodes", "--node_rank", "--master_addr", "--master_port")
    ] == [
        "2",
        "2",
        "1",
        "10.0.0.7",
        "29611",
    ]
    assert "--standalone" not in cmd
    # the same through megacann-train, with the resume flag forwarded to the ranks
    proc = _run([MEGACANN_TRAIN, *args, "--master_addr", "10.0.0.7", "--resume_from", "latest"])
    cmd = _command(proc)
    assert _flag(cmd, "--master_addr") == "10.0.0.7" and _flag(cmd, "--resume_from") == "latest"


@pytest.mark.parametrize(
    "nodes, message",
    [
        (
            ["--node_rank", "0", "--master_addr", "localhost"],
            "--master_addr localhost is this machine's loopback address",
        ),
        (["--node_rank", "0", "--master_addr", "127.0.1.1"], "--master_addr 127.0.1.1 is this machine's loopback"),
        (["--rdzv_endpoint", "127.0.0.1:29400"], "--rdzv_endpoint 127.0.0.1 is this machine's loopback address"),
        (["--node_rank", "0"], "--nnodes 2 needs --master_addr: node 0's hostname or IP address"),
        (["--node_rank", "2", "--master_addr", "10.0.0.7"], "--node_rank 2 is outside 0 .. 1 (--nnodes 2)"),
        (["--master_addr", "10.0.0.7"], "--nnodes 2 needs --node_rank (0 on the master node) or --rdzv_endpoint"),
    ],
)
def test_multi_node_mistakes_are_refused(nodes, message):
    args = ["--config", TINY, "--nproc_per_node", "1", "--nnodes", "2", *nodes]
    with pytest.raises(launch.LaunchError) as err:
        launch.check_nodes(launch.build_parser().parse_intermixed_args(args))
    assert str(err.value).startswith(message)


def test_loopback_master_is_refused_by_the_script_with_exit_code_2():
    proc = _run(["bash", "scripts/run_pretrain.sh", "--config", TINY, "--nnodes", "2", "--node_rank", "0"])
    assert proc.returncode == 2 and proc.stdout == ""
    proc = _run(
        [
            "bash",
            "scripts/run_pretrain.sh",
            "--config",
            TINY,
            "--nnodes",
            "2",
            "--node_rank",
            "0",
            "--master_addr",
            "127.0.0.1",
        ]
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("run_pretrain.sh: error: --master_addr 127.0.0.1 is this machine's loopback address")


def test_config_errors_are_one_message_before_any_rank_starts(monkeypatch, capsys):
    """A typo (near a synonym) and an impossible layout: one line, exit 2, torchrun never started. The
    script runs as a user starts it; megacann-train's entry point runs in-process (the same ``train_main``
    its console script calls: test_launcher_options_under_torchrun_are_refused starts the command)."""
    typo = _run(
        ["bash", "scripts/run_pretrain.sh", "--config", TINY, "--nproc_per_node", "2", "optim.learnig_rate=1e-3"]
    )
    assert typo.returncode == 2, typo.stderr
    assert typo.stderr.splitlines() == [
        "run_pretrain.sh: error: command line override 'optim.learnig_rate=1e-3': unknown key "
        "'optim.learnig_rate'; did you mean 'optim.lr'?"
    ]
    monkeypatch.chdir(ROOT)
    for key in TORCHRUN_VARS:
        monkeypatch.delenv(key, raising=False)
    layout_code = train_main(["--config", TINY, "--nproc_per_node", "2", "distributed.tensor_parallel_size=3"])
    layout_out, layout_err = capsys.readouterr()
    assert layout_code == 2
    assert len(layout_err.splitlines()) == 1 and "tensor_parallel_size" in layout_err
    seed_code = train_main(["--config", SEED_7B, "--nproc_per_node", "8", "--print_only"])
    seed_out, seed_err = capsys.readouterr()
    assert seed_code == 2
    assert seed_err.splitlines()[-1] == (
        f"megacann-train: error: {SEED_7B}: distributed.world_size is 32 but 8 processes were started"
    )
    for out, err in ((typo.stdout, typo.stderr), (layout_out, layout_err), (seed_out, seed_err)):
        assert "Traceback" not in err and "ChildFailedError" not in err
        assert not out  # no rank was started (ranks print the training banner)


@pytest.mark.extended
def test_seed_recipe_prints_its_advice_once_as_a_plain_note():
    proc = _run(
        [
            "bash",
            "scripts/run_pretrain.sh",
            "--config",
            SEED_7B,
            "--nproc_per_node",
            "8",
            "--nnodes",
            "4",
            "--rdzv_endpoint",
            "node0:29400",
            "--rdzv_id",
            "77",
            "--print_only",
        ]
    )
    cmd = _command(proc)
    assert [_flag(cmd, f) for f in ("--rdzv_backend", "--rdzv_endpoint", "--rdzv_id")] == ["c10d", "node0:29400", "77"]
    assert "--node_rank" not in cmd and "--master_addr" not in cmd
    notes = proc.stderr.splitlines()
    assert len(notes) == 1 and notes[0].startswith("megacann: note: ") and "pipeline bubble 43% > 25%" in notes[0]
    assert "warn" not in proc.stderr.lower() and "validate(" not in proc.stderr


def test_device_count_decides_processes_per_node(monkeypatch):
    import torch

    import megacann.accelerator as accelerator

    args = launch.build_parser().parse_intermixed_args(["--config", TINY])
    cfg = launch.load_config(TINY)
    monkeypatch.setenv("MEGACANN_DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert launch.resolve_nproc(args, cfg) == 8

    class FakeNpu:
        @staticmethod
        def device_count():
            return 16

    monkeypatch.setenv("MEGACANN_DEVICE", "npu")
    monkeypatch.setattr(accelerator, "npu_available", lambda: True)
    monkeypatch.setattr(torch, "npu", FakeNpu, raising=False)
    assert launch.resolve_nproc(args, cfg) == 16
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("MEGACANN_DEVICE", "cuda")
    with pytest.raises(launch.LaunchError, match="no cuda device is visible on this node: pass --nproc_per_node"):
        launch.resolve_nproc(args, cfg)
    monkeypatch.setenv("MEGACANN_DEVICE", "cpu")
    assert launch.resolve_nproc(args, cfg) == 1
    args.nproc_per_node = 3
    assert launch.resolve_nproc(args, cfg) == 3


def _exports(proc) -> dict[str, str]:
    assert proc.returncode == 0, proc.stderr
    lines = [line[len("export ") :] for line in proc.stdout.splitlines() if line.startswith("export ")]
    return dict(line.split("=", 1) for line in lines)


@pytest.mark.extended
def test_cluster_scripts_set_platform_defaults_that_users_can_override(tmp_path):
    ascend = _run(
        ["bash", "scripts/clusters/ascend_910b_8npu.sh", "--config", TINY, "--print_only"],
        env={"HCCL_EXEC_TIMEOUT": "600"},
    )
    env = _exports(ascend)
    assert env["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    assert env["HCCL_CONNECT_TIMEOUT"] == "1200" and env["HCCL_EXEC_TIMEOUT"] == "600"  # the user's value wins
    assert "--standalone" in _command(ascend)
    gpu = _exports(_run(["bash", "scripts/clusters/nvidia_8gpu.sh", "--config", TINY, "--print_only"]))
    assert gpu["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and gpu["NCCL_DEBUG"] == "WARN"
    assert gpu["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"

    # Slurm: fake srun (runs its command) and scontrol (lists two hosts) on PATH
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == -* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho gpu-node-a\necho gpu-node-b\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    slurm_env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu-node-[a-b]",
        "SLURM_SUBMIT_DIR": ROOT,
    }
    slurm = _run(
        ["bash", os.path.join(ROOT, "scripts/clusters/slurm.sbatch"), "--config", TINY, "--print_only"],
        env=slurm_env,
        cwd=tmp_path,
    )
    cmd = _command(slurm)
    assert [_flag(cmd, f) for f in ("--nnodes", "--rdzv_endpoint", "--rdzv_id")] == ["2", "gpu-node-a:29500", "4242"]
    assert _exports(slurm)["NCCL_DEBUG"] == "WARN"
    npu = _run(
        ["bash", os.path.join(ROOT, "scripts/clusters/slurm.sbatch"), "--config", TINY, "--print_only"],
        env={**slurm_env, "PLATFORM": "npu"},
        cwd=tmp_path,
    )
    assert _exports(npu)["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"


def test_launcher_options_under_torchrun_are_refused():
    proc = _run([MEGACANN_TRAIN, "--config", TINY, "--nproc_per_node", "2"], env={"TORCHELASTIC_RUN_ID": "x"})
    assert proc.returncode == 2 and "already runs under torchrun" in proc.stderr
