"""Run the plans of every stage of a pipeline in Python, without tensors: check them and time them.

The model of communication is the strictest of the backends: the transfers between two ranks form one
ordered stream per pair (as NCCL and HCCL run them), so the k-th transfer one end posts to the other must be
the counterpart of the k-th the other end posts (a send against a receive of the same kind). A transfer
completes when both ends have posted it; an Exchange completes when all of its transfers have. Forward and
backward take fixed times and transfers none, which gives the schedule's ideal timeline and bubble; a
backward split into B and W (zero-bubble schedules) takes half of the backward's time in each unless told.
It also counts each stage's peak number of micro-batches in flight (forward run, backward or W not yet).
Where each tensor comes from and goes is the schedule's :mod:`~megacann.pipeline.placement`: on the loop an
``Exchange`` sends what the latest forward or backward made, in the V (``zbv``, ``dualpipev``) a ``VExchange``
names the chunk whose oldest unsent result it carries, and the last stage keeps some tensors in place.

:func:`simulate` raises :class:`PlanError` when the plans would deadlock, mismatch a transfer, feed a
chunk the wrong micro-batch or leave work undone; tests run it over many pipeline shapes in milliseconds.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass
from typing import Optional

from megacann.errors import MegacannError
from megacann.pipeline.actions import (
    ACTIVATION,
    GRADIENT,
    Action,
    Backward,
    BackwardWeight,
    Exchange,
    Forward,
    VExchange,
)
from megacann.pipeline.p2p import EVEN_ORDER, ODD_ORDER
from megacann.pipeline.placement import LOOP, Placement, V
from megacann.pipeline.plan import build_plan
from megacann.pipeline.schedule_spec import schedule_for


class PlanError(MegacannError, RuntimeError):
    """The plans of a pipeline are inconsistent (would hang or deliver a tensor to the wrong place)."""


@dataclass
class SimulationResult:
    makespan: float  # time until the last stage finishes
    busy: list[float]  # forward + backward time per stage
    finish: list[float]  # time each stage finishes
    peak_in_flight: list[int]  # per stage: most micro-batch chunks whose forward ran and backward (or W) not yet

    def idle_fraction(self, stage: int) -> float:
        return 1.0 - self.busy[stage] / self.makespan


@dataclass
class _Op:
    send: bool
    kind: str  # "activation" | "gradient"
    label: Optional[tuple[int, int, int]]  # (stage, chunk, micro-batch) of what a send carries
    chunk: Optional[int] = None  # where a receive goes
    posted: float = 0.0
    partner: Optional[_Op] = None


def simulate(
    plans: list[list[Action]],
    virtual_stages: int = 1,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    forward_only: bool = False,
    input_time: Optional[float] = None,
    weight_time: Optional[float] = None,
    v_shape: bool = False,
    placement: Optional[Placement] = None,
) -> SimulationResult:
    """Run ``plans`` (one per stage); raise PlanError on any inconsistency. A BackwardInput takes
    ``input_time`` and a BackwardWeight ``weight_time`` (default: half of ``backward_time`` each).
    ``placement``: where the plans' chunks sit (default the loop, or the V with ``v_shape``)."""
    input_time = backward_time / 2 if input_time is None else input_time
    weight_time = backward_time / 2 if weight_time is None else weight_time
    placement = placement or (V if v_shape else LOOP)
    p, v = len(plans), placement.chunks(virtual_stages)
    pc = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    pending_ops: list[Optional[list[_Op]]] = [None] * p  # the Exchange a stage waits in
    streams: dict[tuple[int, int], list[_Op]] = {}  # (from, to): ops posted by `from` on the pair
    inputs = [[deque() for _ in range(v)] for _ in range(p)]
    grads = [[deque() for _ in range(v)] for _ in range(p)]
    saved = [[deque() for _ in range(v)] for _ in range(p)]
    latest: list[dict[str, int]] = [{} for _ in range(p)]  # kind -> chunk that made the latest one
    done_f = [set() for _ in range(p)]
    done_b = [set() for _ in range(p)]
    done_w = [set() for _ in range(p)]
    weights = [[deque() for _ in range(v)] for _ in range(p)]  # B run, W not yet
    in_flight, peak = [0] * p, [0] * p
    outbox: dict[tuple[int, str, int], deque] = {}  # (stage, kind, chunk) -> labels made, not yet sent

    def route(stage: int, kind: str, chunk: int, label: tuple[int, int, int]) -> None:
        """What a chunk made goes to its outbox, or stays on the stage for the other chunk."""
        if placement.local_handoff(p, stage, chunk, kind):
            (inputs if kind == ACTIVATION else grads)[stage][1 - chunk].append(label)
        else:
            outbox.setdefault((stage, kind, chunk), deque()).append(label)
            latest[stage][kind] = chunk

    def take_latest(stage: int, kind: str, message: str) -> tuple[int, int, int]:
        """What an Exchange sends: the oldest unsent result of the chunk that made the latest ``kind``."""
        box = outbox.get((stage, kind, latest[stage].get(kind, -1)))
        if not box:
            raise fail(stage, message)
        return box.popleft()

    def fail(stage: int, message: str) -> PlanError:
        return PlanError(f"stage {stage} of {p} (virtual {v}), action {pc[stage]}: {message}")

    def post(stage: int, peer: int, op: _Op) -> None:
        op.posted = clock[stage]
        mine = streams.setdefault((stage, peer), [])
        mine.append(op)
        theirs = streams.get((peer, stage), [])
        index = len(mine) - 1
        if index < len(theirs):
            other = theirs[index]
            if other.send == op.send or other.kind != op.kind:
                raise fail(
                    stage, f"transfer {index} with stage {peer} is a {_name(op)}, stage {peer} posted a {_name(other)}"
                )
            op.partner, other.partner = other, op

    def run_compute(stage: int, action: Action) -> None:
        c, i = action.chunk, action.micro_batch
        model_first, model_last = placement.is_model_first(stage, c), placement.is_model_last(p, stage, c, v)
        if isinstance(action, Forward):
            if (c, i) in done_f[stage]:
                raise fail(stage, f"forward of chunk {c}, micro-batch {i} runs twice")
            if not model_first:
                if not inputs[stage][c]:
                    raise fail(stage, f"forward of chunk {c}, micro-batch {i} has no input received")
                got = inputs[stage][c].popleft()
                want = (*placement.producer(p, stage, c, ACTIVATION), i)
                if got != want:
                    raise fail(stage, f"forward of chunk {c}, micro-batch {i} got the output of {got}, needs {want}")
            done_f[stage].add((c, i))
            if not forward_only:
                saved[stage][c].append(i)
                in_flight[stage] += 1
                peak[stage] = max(peak[stage], in_flight[stage])
            if not model_last:
                route(stage, ACTIVATION, c, (stage, c, i))
            clock[stage] += forward_time
            busy[stage] += forward_time
        elif isinstance(action, BackwardWeight):
            if not weights[stage][c] or weights[stage][c][0] != i:
                raise fail(stage, f"W of chunk {c}, micro-batch {i} is not the oldest B of the chunk waiting for its W")
            weights[stage][c].popleft()
            done_w[stage].add((c, i))
            in_flight[stage] -= 1
            clock[stage] += weight_time
            busy[stage] += weight_time
        else:
            if not saved[stage][c] or saved[stage][c][0] != i:
                raise fail(stage, f"backward of chunk {c}, micro-batch {i} is not the oldest forward of the chunk")
            saved[stage][c].popleft()
            if not model_last:
                if not grads[stage][c]:
                    raise fail(stage, f"backward of chunk {c}, micro-batch {i} has no output gradient received")
                got = grads[stage][c].popleft()
                want = (*placement.producer(p, stage, c, GRADIENT), i)
                if got != want:
                    raise fail(stage, f"backward of chunk {c}, micro-batch {i} got the gradient of {got}, needs {want}")
            done_b[stage].add((c, i))
            if not model_first:
                route(stage, GRADIENT, c, (stage, c, i))
            if isinstance(action, Backward):
                in_flight[stage] -= 1
                took = backward_time
            else:
                weights[stage][c].append(i)
                took = input_time
            clock[stage] += took
            busy[stage] += took

    def start_v_exchange(stage: int, ex: VExchange) -> None:
        ops: list[_Op] = []
        for tr in ex.transfers:
            peer = stage + tr.peer
            if not 0 <= peer < p:
                raise fail(stage, f"{tr} goes to stage {peer}, which does not exist")
            if tr.send:
                box = outbox.get((stage, tr.kind, tr.chunk))
                if not box:
                    raise fail(stage, f"{tr}: chunk {tr.chunk} made no {tr.kind} to send")
                op = _Op(True, tr.kind, box.popleft())
            else:
                op = _Op(False, tr.kind, None, tr.chunk)
            post(stage, peer, op)
            ops.append(op)
        pending_ops[stage] = ops

    def start_exchange(stage: int, ex: Exchange) -> None:
        if isinstance(ex, VExchange):
            return start_v_exchange(stage, ex)
        prev, nxt = (stage - 1) % p, (stage + 1) % p
        ops: list[tuple[int, _Op, str]] = []
        if ex.send_forward:
            label = take_latest(stage, ACTIVATION, "sends an activation but ran no forward whose output goes on")
            ops.append((nxt, _Op(True, ACTIVATION, label), "send_next"))
        if ex.recv_forward is not None:
            ops.append((prev, _Op(False, ACTIVATION, None, ex.recv_forward), "recv_prev"))
        if ex.send_backward:
            label = take_latest(stage, GRADIENT, "sends a gradient but ran no backward whose input gradient goes back")
            ops.append((prev, _Op(True, GRADIENT, label), "send_prev"))
        if ex.recv_backward is not None:
            ops.append((nxt, _Op(False, GRADIENT, None, ex.recv_backward), "recv_next"))
        order = EVEN_ORDER if stage % 2 == 0 else ODD_ORDER  # the order p2p.exchange posts them in
        ops.sort(key=lambda item: order.index(item[2]))
        for peer, op, _ in ops:
            post(stage, peer, op)
        pending_ops[stage] = [op for _, op, _ in ops]

    def finish_exchange(stage: int) -> bool:
        ops = pending_ops[stage]
        assert ops is not None
        if any(op.partner is None for op in ops):
            return False
        clock[stage] = max([clock[stage]] + [max(op.posted, op.partner.posted) for op in ops])
        for op in ops:
            if not op.send:
                queue = inputs if op.kind == ACTIVATION else grads
                queue[stage][op.chunk].append(op.partner.label)
        pending_ops[stage] = None
        pc[stage] += 1
        return True

    progress = True
    while progress:
        progress = False
        for stage in range(p):
            while pc[stage] < len(plans[stage]):
                action = plans[stage][pc[stage]]
                if isinstance(action, (Exchange, VExchange)):
                    if pending_ops[stage] is None:
                        start_exchange(stage, action)
                        progress = True
                    if not finish_exchange(stage):
                        break
                else:
                    run_compute(stage, action)
                    pc[stage] += 1
                progress = True
    stuck = [s for s in range(p) if pc[s] < len(plans[s])]
    if stuck:
        where = ", ".join(f"stage {s} at action {pc[s]} {plans[s][pc[s]]}" for s in stuck)
        raise PlanError(f"deadlock with {p} stages, virtual {v}: {where}")
    for stage in range(p):
        leftovers = [q for q in inputs[stage] + grads[stage] + saved[stage] + weights[stage] if q]
        leftovers += [q for key, q in outbox.items() if q and key[0] == stage]
        if leftovers:
            raise fail(stage, f"tensors received or saved but never used: {leftovers}")
        expected = len(done_f[0]) if stage else None
        if expected is not None and len(done_f[stage]) != expected:
            raise fail(stage, f"ran {len(done_f[stage])} forwards, stage 0 ran {expected}")
        if not forward_only and done_b[stage] != done_f[stage]:
            raise fail(stage, f"backwards {sorted(done_b[stage])} differ from forwards {sorted(done_f[stage])}")
    return SimulationResult(max(clock), busy, list(clock), peak)


def _name(op: _Op) -> str:
    return f"{'send' if op.send else 'receive'} of {op.kind}"


def simulate_schedule(
    stages: int,
    num_microbatches: int,
    virtual_stages: Optional[int] = None,
    forward_only: bool = False,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    schedule: Optional[str] = None,
    input_time: Optional[float] = None,
    weight_time: Optional[float] = None,
) -> SimulationResult:
    """Build every stage's plan for this pipeline shape (``schedule`` as ``distributed.pipeline_schedule``)
    and :func:`simulate` them. The times are those of a stage's share of the layers (interleaved chunks
    take them each, as before); a chunk of a placement that splits a stage's layers between its chunks (the
    V: half each) takes its share (:attr:`~megacann.pipeline.placement.Placement.chunk_time_fraction`)."""
    plans = [build_plan(stages, s, num_microbatches, virtual_stages, forward_only, schedule) for s in range(stages)]
    placement = schedule_for(schedule, virtual_stages).placement if stages > 1 else LOOP
    share = placement.chunk_time_fraction
    forward_time, backward_time = forward_time * share, backward_time * share
    input_time = None if input_time is None else input_time * share
    weight_time = None if weight_time is None else weight_time * share
    return simulate(
        plans,
        virtual_stages or 1,
        forward_time,
        backward_time,
        forward_only,
        input_time,
        weight_time,
        placement=placement,
    )


def schedule_summary(
    stages: int, num_microbatches: int, virtual_stages: Optional[int] = None, schedule: Optional[str] = None
) -> tuple[float, list[int]]:
    """(bubble, peak micro-batches in flight per stage) of a schedule, simulated with a forward taking one
    unit and a backward two (one each for B and W when split): the bubble is the largest idle share of any
    stage, what the dry run prints. Cached: the layout search asks for each schedule of every layout."""
    bubble, peaks = _summary(stages, num_microbatches, virtual_stages, schedule)
    return bubble, list(peaks)


@functools.lru_cache(maxsize=4096)
def _summary(
    stages: int, num_microbatches: int, virtual_stages: Optional[int], schedule: Optional[str]
) -> tuple[float, tuple[int, ...]]:
    result = simulate_schedule(stages, num_microbatches, virtual_stages, schedule=schedule)
    return max(result.idle_fraction(s) for s in range(stages)), tuple(result.peak_in_flight)
