"""scripts/check_env.py as a user runs it, and the communication check on 4 gloo ranks: a healthy run with
verified data and bandwidth, then a rank that stops answering, named by every rank still answering."""

import os
import subprocess
import sys
import time

import pytest
from cli_helpers import ROOT, user_env
from dist_harness import free_port, run_on_ranks

SCRIPT = os.path.join(ROOT, "scripts", "check_env.py")


def _healthy_then_one_rank_silent(silent_rank: int, timeout: float):
    import torch.distributed as dist

    from megacann.comm_check import run_comm_checks

    healthy = run_comm_checks(size_mb=0.25, iters=2, timeout=30, run_id="healthy")
    rank = dist.get_rank()
    if rank == silent_rank:  # answers the all-reduce, then stops answering (a hung process)
        run_comm_checks(size_mb=0.25, iters=1, timeout=timeout, checks=("all_reduce",), run_id="silent")
        time.sleep(timeout + 4)
        return healthy, None
    silent = run_comm_checks(size_mb=0.25, iters=1, timeout=timeout, run_id="silent")
    return healthy, silent


@pytest.mark.extended
def test_comm_check_on_four_ranks_names_the_rank_that_does_not_answer():
    results = run_on_ranks(_healthy_then_one_rank_silent, 4, args=(2, 3.0), timeout=120)
    healthy = [r[0] for r in results]
    assert [c.name for c in healthy[0]] == ["all_reduce", "all_gather", "p2p_ring"]
    for check in healthy[0]:
        assert check.ok and check.world_size == 4 and check.seconds > 0 and check.algbw_gbps > 0, check
        assert not check.missing_ranks and not check.failed_ranks
    assert healthy[0][0].busbw_gbps == healthy[0][0].algbw_gbps * 2 * 3 / 4
    assert healthy[0][1].message_bytes == 4 * healthy[0][0].message_bytes  # all-gather: 4 chunks
    assert all(h == healthy[0] for h in healthy)  # every rank reports the same
    for rank, (_, silent) in enumerate(results):
        if rank == 2:
            continue
        assert [c.name for c in silent] == ["all_reduce", "all_gather"]
        assert silent[0].ok and not silent[1].ok and silent[1].missing_ranks == [2]
        assert silent[1].describe() == "all_gather: FAILED: rank(s) 2 did not answer (hung, or the process died)"


def test_check_env_reports_versions_and_devices():
    proc = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, env=user_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()}
    import torch

    assert rows["torch"].startswith(f"torch          {torch.__version__}")
    assert "[tested]" in rows["torch"] or "[untested here (tested with 2.13.0)]" in rows["torch"]
    assert rows["python"].split()[1] == sys.version.split()[0]
    assert rows["device"].split()[1] == "cpu" and rows["cpu"].split()[1] == str(os.cpu_count())


def test_check_env_comm_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    cmd += [SCRIPT, "--comm", "--size_mb", "0.5", "--iters", "2", "--timeout", "30"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=user_env(), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "communication check: 2 ranks, backend gloo, 0.5 MiB per rank"
    assert [line.split(":")[0] for line in lines[1:4]] == ["all_reduce", "all_gather", "p2p_ring"]
    assert all(": ok, " in line and "GB/s" in line for line in lines[1:4])
    assert lines[-1] == "communication: ok"
