"""CPU runs keep freed host memory mapped (megacann.host_memory): a step's buffers reuse the previous
step's pages instead of fresh, zero-filled ones; opting out or setting malloc oneself keeps glibc's
defaults; a CPU trainer applies the policy. Each case runs in its own process (the policy is per process)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="the policy is glibc's"
)

# twenty 16 MiB buffers, each filled once, then all freed: how much of the 320 MiB the process hands back
PROBE = r"""
import json, sys
import torch
from megacann.host_memory import keep_freed_host_memory
applied = keep_freed_host_memory() if sys.argv[1] == "apply" else None

def resident_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4 / 1024

buffers = [torch.empty(4 << 20).fill_(1.0) for _ in range(20)]
before = resident_mib()
del buffers
print(json.dumps({"applied": applied, "returned_mib": before - resident_mib()}))
"""


def _probe(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    clean.pop("MEGACANN_HOST_MALLOC", None)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env={**clean, **env}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_freed_buffers_stay_mapped_for_the_next_step():
    kept = _probe("apply")
    system = _probe("none")
    assert kept["applied"] is True and kept["returned_mib"] < 16  # kept for the next step's buffers
    assert system["applied"] is None and system["returned_mib"] > 256  # glibc's defaults: unmapped, to fault again


@pytest.mark.parametrize(
    "env",
    [
        {"MEGACANN_HOST_MALLOC": "system"},
        {"MALLOC_TRIM_THRESHOLD_": "1000000"},
        {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"},
    ],
    ids=["opt-out", "user-malloc-variable", "user-tunables"],
)
def test_an_opt_out_or_the_users_own_malloc_settings_keep_glibcs_defaults(env):
    result = _probe("apply", **env)
    assert result["applied"] is False and result["returned_mib"] > 256


def test_an_unknown_setting_is_refused_by_name():
    clean = {k: v for k, v in os.environ.items() if k != "MEGACANN_HOST_MALLOC"}
    done = subprocess.run(
        [sys.executable, "-c", "from megacann.host_memory import keep_freed_host_memory; keep_freed_host_memory()"],
        env={**clean, "MEGACANN_HOST_MALLOC": "jemalloc"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "MEGACANN_HOST_MALLOC='jemalloc': expected 'keep' (the default) or 'system'" in done.stderr


def test_a_cpu_runtime_applies_the_policy():
    code = (
        "from megacann.config import config_from_dict\n"
        "from megacann import host_memory\n"
        "from megacann.training.runtime import setup_runtime, shutdown_runtime\n"
        "cfg = config_from_dict({'model': {'hidden_size': 64, 'num_layers': 1, 'num_attention_heads': 4, "
        "'vocab_size': 128}, 'distributed': {'device': 'cpu'}})\n"
        "setup_runtime(cfg)\n"
        "print(host_memory._applied)\n"
        "shutdown_runtime()\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    clean.pop("MEGACANN_HOST_MALLOC", None)
    done = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True"
