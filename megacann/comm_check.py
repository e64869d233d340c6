"""A communication health check across every rank: all-reduce, all-gather and a point-to-point ring.

Each check starts with a roll call on the process group's key-value store (every rank writes "arrived"
and waits, up to ``timeout``, for all others), runs its collective asynchronously with a timeout, verifies
the values received, measures bandwidth, and ends with a second roll call in which every rank publishes
its outcome. So a rank that hangs or died is named ("rank 2 did not reach all_gather within 10 s") by
every rank still answering, and a rank whose collective failed or delivered wrong data is named with its
error, instead of everyone waiting in a collective forever.

Bandwidth follows the usual collective-benchmark convention: algorithm bandwidth is the message size over
the time; bus bandwidth scales it to the traffic on each link, ``2(n-1)/n`` for all-reduce and
``(n-1)/n`` for all-gather; the ring reports one link's bandwidth. The slowest rank's time counts.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

CHECKS = ("all_reduce", "all_gather", "p2p_ring")
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name first
_POLL_S = 0.05


@dataclass
class CheckResult:
    """The outcome of one check, the same on every rank still answering."""

    name: str
    ok: bool
    world_size: int
    message_bytes: int = 0
    seconds: Optional[float] = None  # slowest rank's mean time per call
    slowest_rank: Optional[int] = None
    algbw_gbps: Optional[float] = None  # GB/s (1e9 bytes)
    busbw_gbps: Optional[float] = None
    missing_ranks: list[int] = field(default_factory=list)  # did not arrive / did not report (hung or dead)
    failed_ranks: dict[int, str] = field(default_factory=dict)  # rank -> its error

    def describe(self) -> str:
        """One line for the console."""
        if self.missing_ranks:
            who = ", ".join(map(str, self.missing_ranks))
            return f"{self.name}: FAILED: rank(s) {who} did not answer (hung, or the process died)"
        if self.failed_ranks:
            errors = "; ".join(f"rank {r}: {e}" for r, e in sorted(self.failed_ranks.items()))
            return f"{self.name}: FAILED: {errors}"
        if self.seconds is None:
            return f"{self.name}: skipped (needs 2 ranks or more)"
        bus = f", bus {self.busbw_gbps:.2f} GB/s" if self.busbw_gbps is not None else ""
        return (
            f"{self.name}: ok, {self.message_bytes / 2**20:.1f} MiB in {1e3 * self.seconds:.2f} ms "
            f"(slowest rank {self.slowest_rank}): {self.algbw_gbps:.2f} GB/s{bus}"
        )


def _store(run_id: str) -> dist.Store:
    """The default group's store, under a prefix of this check run (torchrun and init_process_group made it)."""
    return dist.PrefixStore(f"megacann_comm_check/{run_id}/", dist.distributed_c10d._get_default_store())


def _roll_call(store: dist.Store, key: str, rank: int, world: int, value: str, deadline: float) -> dict[int, str]:
    """Publish ``value`` under ``key`` for this rank; gather every rank's value until ``deadline``. Ranks
    absent at the deadline are missing from the result."""
    store.set(f"{key}/{rank}", value)
    keys = [f"{key}/{r}" for r in range(world)]
    while not store.check(keys) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    return {r: store.get(k).decode() for r, k in enumerate(keys) if store.check([k])}


def _leave(store: dist.Store, rank: int, answering: set[int], timeout: float) -> None:
    """The last store operation of a check run: rank 0, whose process may host the store (outside torchrun),
    returns only once every rank still answering has left, so none of them loses the store mid-read."""
    store.set(f"left/{rank}", "1")
    if rank != 0:
        return
    keys = [f"left/{r}" for r in sorted(answering)]
    deadline = time.monotonic() + timeout
    while not store.check(keys) and time.monotonic() < deadline:
        time.sleep(_POLL_S)


def _run_op(name: str, numel: int, device: torch.device, iters: int, timeout: float) -> tuple[float, Optional[str]]:
    """Run one collective ``iters`` times (after a warm-up) and verify its result; (seconds per call, error)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    wait = datetime.timedelta(seconds=timeout)

    def once() -> Optional[str]:
        if name == "all_reduce":
            x = torch.full((numel,), float(rank + 1), device=device)
            dist.all_reduce(x, async_op=True).wait(wait)
            expected = world * (world + 1) / 2
            return None if bool((x == expected).all()) else f"all_reduce gave {x[0].item()}, expected {expected}"
        if name == "all_gather":
            x = torch.full((numel,), float(rank), device=device)
            out = torch.empty(world * numel, device=device)
            _all_gather_flat(out, x, async_op=True).wait(wait)
            got = out.view(world, numel)[:, 0].tolist()
            return None if got == [float(r) for r in range(world)] else f"all_gather gave chunks {got}"
        # p2p ring: send to the next rank, receive from the previous one
        send = torch.full((numel,), float(rank), device=device)
        recv = torch.empty(numel, device=device)
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        works = [dist.isend(send, nxt), dist.irecv(recv, prev)]
        for work in works:
            work.wait(wait)
        return None if recv[0].item() == prev else f"received {recv[0].item()} from rank {prev}, expected {prev}"

    try:
        error = once()  # warm-up: connections are set up here
        synchronize = getattr(torch, device.type).synchronize if device.type != "cpu" else lambda: None
        synchronize()
        start = time.perf_counter()
        for _ in range(iters if error is None else 0):
            error = once()
            if error:
                break
        synchronize()
        return (time.perf_counter() - start) / iters, error
    except Exception as err:  # a timeout or a backend error: report it, do not hang or die
        return 0.0, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def _bandwidth(name: str, message_bytes: int, seconds: float, world: int) -> tuple[float, Optional[float]]:
    algbw = message_bytes / seconds / 1e9
    if name == "all_reduce":
        return algbw, algbw * 2 * (world - 1) / world
    if name == "all_gather":
        return algbw, algbw * (world - 1) / world
    return algbw, None


def run_comm_checks(
    size_mb: float = 64.0,
    iters: int = 5,
    timeout: float = 60.0,
    checks: tuple[str, ...] = CHECKS,
    device: Optional[torch.device] = None,
    run_id: str = "0",
) -> list[CheckResult]:
    """Run ``checks`` on every rank of the initialised default group; stop at the first check whose roll call
    finds ranks missing (the group is then broken). ``size_mb`` is each rank's message (all-gather: its chunk).
    ``run_id`` keeps the store keys of separate check runs in one group apart."""
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise ValueError(f"unknown checks {unknown}; expected some of {CHECKS}")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = device or torch.device("cpu")
    store = _store(run_id)
    numel = max(1, int(size_mb * 2**20) // 4)
    results = []
    for name in checks:
        try:
            arrived = _roll_call(store, f"{name}/arrive", rank, world, "1", time.monotonic() + timeout)
        except Exception as err:  # the store's host (rank 0's process) is gone
            results.append(CheckResult(name, False, world, failed_ranks={rank: f"store unreachable: {err}"}))
            break
        missing = sorted(set(range(world)) - set(arrived))
        if missing:
            results.append(CheckResult(name, False, world, missing_ranks=missing))
            break
        if name == "p2p_ring" and world < 2:
            results.append(CheckResult(name, True, world))
            continue
        seconds, error = _run_op(name, numel, device, iters, timeout)
        outcome = json.dumps({"seconds": seconds, "error": error})
        try:
            reports = _roll_call(store, f"{name}/done", rank, world, outcome, time.monotonic() + timeout)
        except Exception as err:
            results.append(CheckResult(name, False, world, failed_ranks={rank: f"store unreachable: {err}"}))
            break
        parsed = {r: json.loads(v) for r, v in reports.items()}
        result = CheckResult(name, True, world, message_bytes=numel * 4 * (world if name == "all_gather" else 1))
        result.missing_ranks = sorted(set(range(world)) - set(parsed))
        result.failed_ranks = {r: p["error"] for r, p in parsed.items() if p["error"]}
        result.ok = not result.missing_ranks and not result.failed_ranks
        if result.ok:
            result.slowest_rank = max(parsed, key=lambda r: parsed[r]["seconds"])
            result.seconds = parsed[result.slowest_rank]["seconds"]
            result.algbw_gbps, result.busbw_gbps = _bandwidth(name, result.message_bytes, result.seconds, world)
        results.append(result)
        if not result.ok:  # the group may be broken now: later checks would only wait for it
            break
    missing = {r for result in results for r in result.missing_ranks}
    with contextlib.suppress(Exception):  # a store already gone leaves nothing to protect
        _leave(store, rank, set(range(world)) - missing, timeout)
    return results


def report_lines(results: list[CheckResult]) -> list[str]:
    return [r.describe() for r in results]


def results_as_dicts(results: list[CheckResult]) -> list[dict]:
    return [asdict(r) for r in results]
