"""A clean end at world 8 (tp 2 x pp 2 x dp 2), many times over: every shutdown stops and joins the failure
monitor and destroys the process groups, also after an error, so no rank dies of SIGABRT at exit.

The cause of the SIGABRT seen after a finished world-8 run: the failure monitor's daemon thread polls the
rendezvous store; when the interpreter exits while that thread is inside a store call, the thread is torn
down inside C++ and the process aborts ("terminate called without an active exception"). shutdown_runtime()
now joins the thread, and megacann-train calls it on every path.

As torchrun's agent does, the test hosts each cycle's rendezvous store itself, bound to a port the kernel
picks as it binds (port 0), and the ranks are its clients (TORCHELASTIC_USE_AGENT_STORE). Ports chosen free
up front and bound by rank 0 only when its cycle came (a minute or more later) could be taken in between
by any other process: init_process_group then failed in ``_create_c10d_store``."""

import datetime
import os
import subprocess
import sys

import pytest
import torch.distributed as dist
from cli_helpers import user_env

WORLD, CYCLES = 8, 10
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shutdown_cycles.py")


@pytest.mark.extended
def test_world_8_shutdown_many_times(tmp_path):
    timeout = datetime.timedelta(minutes=10)
    stores = [
        dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout) for _ in range(CYCLES)
    ]
    ports = [str(store.port) for store in stores]
    procs = []
    for rank in range(WORLD):
        env = user_env({"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank)})
        env.update({"MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_USE_AGENT_STORE": "True", "OUT": str(tmp_path / "run")})
        procs.append(
            subprocess.Popen(
                [sys.executable, SCRIPT, *ports], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outputs = [p.communicate(timeout=600) for p in procs]
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{err[-3000:]}"
        assert out.strip().endswith(f"rank {rank}: {CYCLES} cycles shut down cleanly"), out
        assert "terminate called" not in err and "Traceback" not in err, err[-3000:]
