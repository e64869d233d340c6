"""Run a function on N gloo ranks in subprocesses, with a hard timeout that no hang can outlast.

    results = run_on_ranks(check_fn, world_size=4, args=(...,), timeout=120)

Each rank gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), one
thread, and an initialised gloo process group. ``check_fn`` must be importable (a module-level function).
The return value of every rank is collected in rank order. A failure raises RankFailure naming the rank
and carrying its traceback; a hang raises TimeoutError naming the ranks that did not finish. Put several
checks in one function to share the start-up cost of the processes.

Ranks are forked from a server process that has imported torch and megacann once (multiprocessing's
forkserver, started on first use), so a rank starts in a fraction of a second instead of importing both
again (about 3.5 CPU-seconds a rank); each rank still gets the caller's environment and ``sys.path`` of
the moment, as a spawned process would. ``MEGACANN_TEST_START=spawn`` spawns fresh interpreters instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable, Optional


class RankFailure(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# imported once by the forkserver; every rank forks from it with these already loaded
PRELOAD = ["torch", "torch.distributed", "megacann.training.trainer"]
_CONTEXT = None


def _context():
    """The multiprocessing context ranks start from: a forkserver with :data:`PRELOAD` imported, or spawn."""
    global _CONTEXT
    if _CONTEXT is None:
        method = os.environ.get("MEGACANN_TEST_START", "forkserver")
        if method not in mp.get_all_start_methods():
            method = "spawn"
        _CONTEXT = mp.get_context(method)
        if method == "forkserver":
            _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


class _CallerStreams:
    """The caller's stdout and stderr as they are when a rank starts (pytest's capture of the running test
    included), handed to the rank: a forked rank would otherwise write where the server's streams went."""

    def __reduce__(self):
        from multiprocessing.reduction import DupFd  # pickled while the rank is started: the fds travel with it

        return (_received_fds, (DupFd(1), DupFd(2)))


def _received_fds(*fds) -> tuple[int, ...]:
    return tuple(fd.detach() for fd in fds)


def _rank_main(fn, rank, world_size, port, args, kwargs, results, env, init_groups, parent_env, streams):
    # the caller's environment and output streams now, as a spawned process would have them
    os.environ.clear()
    os.environ.update(parent_env)
    for fd, target in zip(streams, (1, 2)):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "MEGACANN_DEVICE": "cpu",
            **(env or {}),
        }
    )
    try:
        import torch

        torch.set_num_threads(1)
        if init_groups:
            from megacann.parallel_state import initialize_distributed

            initialize_distributed("gloo", timeout_minutes=2)
        value = fn(*args, **kwargs)
        # plain pickle copies tensors' data (the queue's own pickler would pass file descriptors of
        # shared memory, which vanish when this process exits)
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


RANK_EXIT_GRACE_S = 5.0  # how long other ranks may take to exit after one rank died without a result


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: Optional[dict] = None,
    timeout: float = 180.0,
    env: Optional[dict[str, str]] = None,
    init_process_group: bool = True,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result in rank order."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                fn,
                rank,
                world_size,
                port,
                args,
                kwargs or {},
                results,
                env,
                init_process_group,
                dict(os.environ),
                _CallerStreams(),
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(collected))
                raise TimeoutError(
                    f"{fn.__name__} on {world_size} ranks: ranks {missing} did not finish within {timeout:.0f} s"
                )
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if any(not p.is_alive() and r not in collected for r, p in enumerate(procs)):
                    # a queued result may still arrive, and ranks ending together (e.g. all on one exit path)
                    # may still be exiting: give both a moment before naming the dead ranks
                    grace = time.monotonic() + RANK_EXIT_GRACE_S
                    while results.empty() and time.monotonic() < grace:
                        if all(not p.is_alive() for r, p in enumerate(procs) if r not in collected):
                            time.sleep(0.5)
                            break
                        time.sleep(0.1)
                    if results.empty():
                        dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in collected]
                        codes = {r: procs[r].exitcode for r in dead}
                        raise RankFailure(f"{fn.__name__}: rank(s) {dead} exited without a result {codes}") from None
                continue
            if status == "error":
                raise RankFailure(f"{fn.__name__} failed on rank {rank} of {world_size}:\n{value}")
            collected[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(collected) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [collected[r] for r in range(world_size)]


class LazyRuns(dict):
    """Results made on first use, ``make(key)`` once per key: a module-scoped fixture returning one spends
    its runs only on the keys the selected tests ask for (the extended tier's keys stay out of `make test`)."""

    def __init__(self, make):
        super().__init__()
        self._make = make

    def __missing__(self, key):
        self[key] = value = self._make(key)
        return value
