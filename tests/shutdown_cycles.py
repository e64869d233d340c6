"""One rank of the world-8 shutdown test (tests/test_reliability_shutdown.py), run as a script:

    python tests/shutdown_cycles.py PORT [PORT ...]

with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, TORCHELASTIC_USE_AGENT_STORE) set: each PORT is a
rendezvous store the caller hosts, as torchrun's agent does. For each port it starts the runtime of a
tp 2 x pp 2 x dp 2 recipe (process groups, failure monitor with its store clients), sends traffic through
every group, and shuts it down; each group must carry the recipe's collective timeout; the last cycle goes
through megacann-train's run_training with a recipe that fails after the runtime started. After each cycle no megacann thread may be alive and no process
group initialised; the process must then exit 0, without any C++ "terminate called" on stderr.
"""

from __future__ import annotations

import os
import sys
import threading


def _cycle(overrides: list[str]):
    import torch
    import torch.distributed as dist
    from training_helpers import tiny_config

    from megacann import parallel_state as ps
    from megacann.training.failure import start_failure_monitor
    from megacann.training.runtime import setup_runtime, shutdown_runtime
    from megacann.training.signals import make_stop_signals

    cfg = tiny_config(overrides, world_size=8)
    setup_runtime(cfg)
    for group in (
        ps.get_tensor_model_parallel_group(),
        ps.get_pipeline_model_parallel_group(),
        ps.get_data_parallel_group(),
    ):
        value = torch.ones(1)
        dist.all_reduce(value, group=group)
        assert value.item() == 2.0
        timeout = group._get_backend(torch.device("cpu")).options._timeout
        assert timeout.total_seconds() == 60, timeout  # the recipe's distributed.timeout_minutes, in every group
    assert start_failure_monitor(dist.get_rank(), 8, 1.0) is not None  # the monitor is running
    assert make_stop_signals().agreed() is None
    shutdown_runtime()


def _megacann_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("megacann")]


def main(ports: list[int]) -> None:
    import torch
    import torch.distributed as dist
    from training_helpers import tiny_config

    from megacann.cli import run_training

    torch.set_num_threads(1)
    layout = ["distributed.tensor_parallel_size=2", "distributed.pipeline_parallel_size=2"]
    for port in ports[:-1]:
        os.environ["MASTER_PORT"] = str(port)
        _cycle(layout + ["distributed.timeout_minutes=1"])
        assert not dist.is_initialized() and not _megacann_threads(), _megacann_threads()
    os.environ["MASTER_PORT"] = str(ports[-1])
    cfg = tiny_config(layout + ["data.tokenizer=byte", "experiment.output_dir=" + os.environ["OUT"]], world_size=8)
    code = run_training(cfg, None)  # the byte tokenizer's 259 ids do not fit model.vocab_size 200: an error
    assert code == 2 and not dist.is_initialized() and not _megacann_threads(), (code, _megacann_threads())
    print(f"rank {os.environ['RANK']}: {len(ports)} cycles shut down cleanly", flush=True)


if __name__ == "__main__":
    main([int(p) for p in sys.argv[1:]])
