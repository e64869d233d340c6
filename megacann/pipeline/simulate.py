"""Run the plans of every stage of a pipeline in Python, without tensors: check them and time them.

The model of communication is the strictest of the backends: the transfers between two ranks form one
ordered stream per pair (as NCCL and HCCL run them), so the k-th transfer one end posts to the other must be
the counterpart of the k-th the other end posts (a send against a receive of the same kind). A transfer
completes when both ends have posted it; an Exchange completes when all of its transfers have. Forward and
backward take fixed times and transfers none, which gives the schedule's ideal timeline and bubble; a
backward split into B and W (zero-bubble schedules) takes half of the backward's time in each unless told.
It also counts each stage's peak number of micro-batches in flight (forward run, backward or W not yet).
The V-shaped schedules (:mod:`megacann.pipeline.v_schedules`: two chunks per stage in a V, transfers listed
by their ``VExchange``) run with ``v_shape=True``: their tensors go to the chunk's neighbour in the V or stay
on the last stage, and every send must carry what its chunk made, oldest first.

:func:`simulate` raises :class:`PlanError` when the plans would deadlock, mismatch a transfer, feed a
chunk the wrong micro-batch or leave work undone; tests run it over many pipeline shapes in milliseconds.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass
from typing import Optional

from megacann.errors import MegacannError
from megacann.pipeline.p2p import EVEN_ORDER, ODD_ORDER
from megacann.pipeline.plan import Action, Backward, BackwardWeight, Exchange, Forward, build_plan
from megacann.pipeline.v_schedules import (
    ACTIVATION,
    V_SCHEDULES,
    VExchange,
    v_is_model_first,
    v_is_model_last,
    v_local_handoff,
)


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


def _producer(stage: int, chunk: int, stages: int, activation: bool, v_shape: bool = False) -> tuple[int, int]:
    """(stage, chunk) whose output feeds ``chunk`` of ``stage`` (activation) or whose input gradient it
    receives (gradient); ``v_shape``: in the V placement of :mod:`megacann.pipeline.v_schedules`."""
    if v_shape:
        if activation:
            return (stage - 1, 0) if chunk == 0 else ((stage, 0) if stage == stages - 1 else (stage + 1, 1))
        return (stage - 1, 1) if chunk == 1 else ((stage, 1) if stage == stages - 1 else (stage + 1, 0))
    if activation:
        return (stage - 1, chunk) if stage > 0 else (stages - 1, chunk - 1)
    return (stage + 1, chunk) if stage < stages - 1 else (0, chunk + 1)


def simulate(
    plans: list[list[Action]],
    virtual_stages: int = 1,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    forward_only: bool = False,
    input_time: Optional[float] = None,
    weight_time: Optional[float] = None,
    v_shape: bool = False,
) -> SimulationResult:
    """Run ``plans`` (one per stage); raise PlanError on any inconsistency. A BackwardInput takes
    ``input_time`` and a BackwardWeight ``weight_time`` (default: half of ``backward_time`` each).
    ``v_shape``: the plans run two chunks per stage in the V placement (:mod:`megacann.pipeline.v_schedules`):
    tensors go to their chunk's neighbour or stay on the last stage, transfers are VExchanges."""
    input_time = backward_time / 2 if input_time is None else input_time
    weight_time = backward_time / 2 if weight_time is None else weight_time
    p, v = len(plans), 2 if v_shape else virtual_stages
    pc = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    pending_ops: list[Optional[list[_Op]]] = [None] * p  # the Exchange a stage waits in
    streams: dict[tuple[int, int], list[_Op]] = {}  # (from, to): ops posted by `from` on the pair
    inputs = [[deque() for _ in range(v)] for _ in range(p)]
    grads = [[deque() for _ in range(v)] for _ in range(p)]
    saved = [[deque() for _ in range(v)] for _ in range(p)]
    last_out: list[Optional[tuple[int, int, int]]] = [None] * p
    last_grad: list[Optional[tuple[int, int, int]]] = [None] * p
    done_f = [set() for _ in range(p)]
    done_b = [set() for _ in range(p)]
    done_w = [set() for _ in range(p)]
    weights = [[deque() for _ in range(v)] for _ in range(p)]  # B run, W not yet
    in_flight, peak = [0] * p, [0] * p
    outbox: dict[tuple[int, str, int], deque] = {}  # V: (stage, kind, chunk) -> labels made, not yet sent

    def route(stage: int, kind: str, chunk: int, label: tuple[int, int, int]) -> None:
        """V: what a chunk made goes to its outbox, or stays on the last stage for the other chunk."""
        if v_local_handoff(p, stage, chunk, kind):
            (inputs if kind == ACTIVATION else grads)[stage][1 - chunk].append(label)
        else:
            outbox.setdefault((stage, kind, chunk), deque()).append(label)

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
        model_first, model_last = stage == 0 and c == 0, stage == p - 1 and c == v - 1
        if v_shape:
            model_first, model_last = v_is_model_first(stage, c), v_is_model_last(stage, c)
        if isinstance(action, Forward):
            if (c, i) in done_f[stage]:
                raise fail(stage, f"forward of chunk {c}, micro-batch {i} runs twice")
            if not model_first:
                if not inputs[stage][c]:
                    raise fail(stage, f"forward of chunk {c}, micro-batch {i} has no input received")
                got = inputs[stage][c].popleft()
                want = (*_producer(stage, c, p, True, v_shape), i)
                if got != want:
                    raise fail(stage, f"forward of chunk {c}, micro-batch {i} got the output of {got}, needs {want}")
            done_f[stage].add((c, i))
            if not forward_only:
                saved[stage][c].append(i)
                in_flight[stage] += 1
                peak[stage] = max(peak[stage], in_flight[stage])
            last_out[stage] = None if model_last else (stage, c, i)
            if v_shape and not model_last:
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
                want = (*_producer(stage, c, p, False, v_shape), i)
                if got != want:
                    raise fail(stage, f"backward of chunk {c}, micro-batch {i} got the gradient of {got}, needs {want}")
            done_b[stage].add((c, i))
            last_grad[stage] = None if model_first else (stage, c, i)
            if v_shape and not model_first:
                route(stage, "gradient", c, (stage, c, i))
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
            if last_out[stage] is None:
                raise fail(stage, "sends an activation but ran no forward whose output goes on")
            ops.append((nxt, _Op(True, "activation", last_out[stage]), "send_next"))
            last_out[stage] = None
        if ex.recv_forward is not None:
            ops.append((prev, _Op(False, "activation", None, ex.recv_forward), "recv_prev"))
        if ex.send_backward:
            if last_grad[stage] is None:
                raise fail(stage, "sends a gradient but ran no backward whose input gradient goes back")
            ops.append((prev, _Op(True, "gradient", last_grad[stage]), "send_prev"))
            last_grad[stage] = None
        if ex.recv_backward is not None:
            ops.append((nxt, _Op(False, "gradient", None, ex.recv_backward), "recv_next"))
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
                queue = inputs if op.kind == "activation" else grads
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
    take them each, as before); a V-shaped schedule's chunk, half of a stage's layers, takes half."""
    plans = [build_plan(stages, s, num_microbatches, virtual_stages, forward_only, schedule) for s in range(stages)]
    v_shape = schedule in V_SCHEDULES
    if v_shape:  # the times are a stage's; each of the V's two chunks holds half of its layers
        forward_time, backward_time = forward_time / 2, backward_time / 2
        input_time = None if input_time is None else input_time / 2
        weight_time = None if weight_time is None else weight_time / 2
    return simulate(
        plans, virtual_stages or 1, forward_time, backward_time, forward_only, input_time, weight_time, v_shape
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
