"""V-shaped schedules: two model chunks per stage placed as a V, run by ``zbv`` and ``dualpipev``.

Placement (:data:`megacann.pipeline.placement.V`): with p stages and the model cut into 2p segments, stage s holds
chunk 0 = segment s and chunk 1 = segment 2p - 1 - s. The model goes down the stages through chunk 0
and comes back up through chunk 1, so stage 0 holds both the embedding (chunk 0) and the last segment
with the head and the loss (chunk 1); on the last stage, chunk 0 hands its output to chunk 1 in place (no
transfer), and its chunk 1 hands the input gradient back to chunk 0 the same way. Forwards of chunk 1 and
backwards of chunk 0 travel towards stage 0, so a link carries tensors both ways.

Schedules (each stage's compute, then :func:`v_plans` places the transfers):

- ``zbv``: the V-shaped zero-bubble schedule (ZB-V of Qi et al., 2023; torchtitan's ZBV) with the
  backward split into B and W. The compute order is built slot by slot (every stage runs one F, B or W
  per slot): a ready B first, then a forward (chunk 1 before chunk 0) while the stage holds fewer than
  2p chunk-activations (what stage 0 of 1F1B holds: p micro-batches of its layers), else the oldest
  pending W, which fills what would be the bubble. Any number of micro-batches works.
- ``dualpipev``: DeepSeek's DualPipeV (the DualPipe repository's ``dualpipev``; MindSpeed), the
  "cut-in-half" DualPipe, in its eight phases: forwards of chunk 0 to warm up, then forwards of both
  chunks, B1 W1 F1 with zero bubble, the main phase where a forward of one micro-batch pairs with the
  backward of another (F0+B1, F1+B0), backwards of both chunks with the second half split into B and W,
  and the deferred Ws last. Needs at least 2p micro-batches. DualPipe overlaps a pair's forward and
  backward (and one's MoE all-to-all with the other's compute) on two streams; here the executor runs
  a pair's backward on a second thread while its forward runs, each chunk on its own communication
  lane (:mod:`megacann.pipeline.overlap`; ``distributed.dualpipev_overlap``), or back to back.

Transfers (:func:`v_plans`): the compute is laid out on a common clock of slots (each stage's next item
as soon as what it needs was made in an earlier slot); a tensor made in slot t is sent at the end of slot
t, and its receiver posts the receive in its own exchange of slot t. Both ends of a link post the link's
transfers in one fixed order (activation of chunk 0, gradient of chunk 0, activation of chunk 1, gradient
of chunk 1); even stages serve their link to the next stage first, odd ones their link to the previous,
so the pairs also match where a backend runs all of a rank's transfers in issue order.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

from megacann.pipeline.actions import (
    ACTIVATION,
    GRADIENT,
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Transfer,
    VExchange,
)
from megacann.pipeline.placement import V
from megacann.pipeline.schedule_spec import ScheduleSpec


def dualpipev_micro_batch_error(stages: int, num_microbatches: int) -> Optional[str]:
    """Why dualpipev cannot run this many micro-batches, or None when it can."""
    if num_microbatches < 2 * stages:
        return (
            f"distributed.pipeline_schedule 'dualpipev' needs at least 2 x pipeline_parallel_size = {2 * stages} "
            f"micro-batches (optim.grad_accum_steps), got {num_microbatches}: use {2 * stages} or more, or 'zbv'"
        )
    return None


Item = tuple[Action, ...]  # what a stage runs in one slot: one action, or DualPipeV's forward+backward pair


def _sends(stages: int, stage: int, action: Action) -> list[Transfer]:
    """The transfers an action's result needs (none when it stays on the stage or is the loss / first input)."""
    c = action.chunk
    if isinstance(action, Forward):
        if V.is_model_last(stages, stage, c) or V.local_handoff(stages, stage, c, ACTIVATION):
            return []
        return [Transfer(1 if c == 0 else -1, True, ACTIVATION, c)]
    if isinstance(action, (Backward, BackwardInput)):
        if V.is_model_first(stage, c) or V.local_handoff(stages, stage, c, GRADIENT):
            return []
        return [Transfer(-1 if c == 0 else 1, True, GRADIENT, c)]
    return []


def _needs(stages: int, stage: int, action: Action) -> Optional[tuple[int, object]]:
    """(stage, action) whose result ``action`` consumes, or None (a W needs only its own B)."""
    c, i = action.chunk, action.micro_batch
    if isinstance(action, Forward):
        if V.is_model_first(stage, c):
            return None
        if c == 0:
            return stage - 1, Forward(0, i)
        return (stage, Forward(0, i)) if stage == stages - 1 else (stage + 1, Forward(1, i))
    if isinstance(action, BackwardWeight):
        return None
    if V.is_model_last(stages, stage, c):
        return stage, Forward(1, i)
    if c == 1:
        return stage - 1, ("B", 1, i)  # a Backward or a BackwardInput: matched by kind below
    return (stage, ("B", 1, i)) if stage == stages - 1 else (stage + 1, ("B", 0, i))


def _key(action: Action) -> object:
    if isinstance(action, (Backward, BackwardInput)):
        return ("B", action.chunk, action.micro_batch)
    return action


def _ready(stages: int, stage: int, action: Action, done: list[dict]) -> bool:
    need = _needs(stages, stage, action)
    return need is None or need[1] in done[need[0]]


def _item_ready(stages: int, stage: int, item: Item, done: list[dict]) -> bool:
    """Every action of ``item`` has what it needs: made in an earlier slot, or earlier in the same item."""
    earlier = set()
    for action in item:
        need = _needs(stages, stage, action)
        if need is not None and need[1] not in done[need[0]] and not (need[0] == stage and need[1] in earlier):
            return False
        earlier.add(_key(action))
    return True


def _in_order(stages: int, orders: list[list[Item]]) -> list[list[Optional[Item]]]:
    """Lay each stage's items on the slot clock: the next item runs in the first slot after what it needs."""
    p = stages
    slots: list[list[Optional[Item]]] = [[] for _ in range(p)]
    done: list[dict] = [{} for _ in range(p)]  # key -> slot it ran in
    pc = [0] * p
    t = 0
    while any(pc[s] < len(orders[s]) for s in range(p)):
        ran = []
        for s in range(p):
            item = orders[s][pc[s]] if pc[s] < len(orders[s]) else None
            ok = item is not None and _item_ready(p, s, item, done)
            slots[s].append(item if ok else None)
            if ok:
                ran.append((s, item))
        if not ran:
            raise ValueError(f"V schedule: no stage can run its next item at slot {t} (an order bug)")
        for s, item in ran:
            pc[s] += 1
            for a in item:
                done[s][_key(a)] = t
        t += 1
    return slots


def zbv_slots(stages: int, num_microbatches: int) -> list[list[Optional[Item]]]:
    """ZB-V's compute on the slot clock, built greedily (see the module docstring)."""
    p, m = stages, num_microbatches
    limit = 2 * p
    slots: list[list[Optional[Item]]] = [[] for _ in range(p)]
    done: list[dict] = [{} for _ in range(p)]
    nxt = [{"F0": 0, "F1": 0, "B0": 0, "B1": 0} for _ in range(p)]
    pending_w: list[list[BackwardWeight]] = [[] for _ in range(p)]
    alive = [0] * p
    total = 6 * m * p  # F, B and W of each chunk on each stage
    ran_total, t = 0, 0
    while ran_total < total:
        picks: list[Optional[Action]] = []
        for s in range(p):
            n = nxt[s]
            backs = [BackwardInput(c, n[f"B{c}"]) for c in (1, 0) if n[f"B{c}"] < n[f"F{c}"]]
            backs = sorted((a for a in backs if _ready(p, s, a, done)), key=lambda a: a.micro_batch)
            fwds = [Forward(c, n[f"F{c}"]) for c in (1, 0) if n[f"F{c}"] < m]
            fwds = [a for a in fwds if _ready(p, s, a, done)] if alive[s] < limit else []
            pick = backs[0] if backs else fwds[0] if fwds else pending_w[s][0] if pending_w[s] else None
            picks.append(pick)
        if not any(picks):
            raise ValueError(f"zbv: no stage can run at slot {t} (p {p}, m {m})")
        for s, pick in enumerate(picks):
            slots[s].append((pick,) if pick is not None else None)
            if pick is None:
                continue
            ran_total += 1
            done[s][_key(pick)] = t
            if isinstance(pick, Forward):
                nxt[s][f"F{pick.chunk}"] += 1
                alive[s] += 1
            elif isinstance(pick, BackwardInput):
                nxt[s][f"B{pick.chunk}"] += 1
                pending_w[s].append(BackwardWeight(pick.chunk, pick.micro_batch))
            else:
                pending_w[s].pop(0)
                alive[s] -= 1
        t += 1
    return slots


class _Counter:
    """The next micro-batch of each chunk's forward and backward on one stage, and its deferred Ws."""

    def __init__(self) -> None:
        self.next = {"F0": 0, "F1": 0, "B0": 0, "B1": 0}
        self.deferred: list[BackwardWeight] = []

    def f(self, c: int) -> Action:
        self.next[f"F{c}"] += 1
        return Forward(c, self.next[f"F{c}"] - 1)

    def b(self, c: int, split: bool = False) -> Action:
        """A backward; ``split``: its B now, its W queued for :meth:`w` (DualPipeV's zero-bubble phases)."""
        self.next[f"B{c}"] += 1
        i = self.next[f"B{c}"] - 1
        if split:
            self.deferred.append(BackwardWeight(c, i))
            return BackwardInput(c, i)
        return Backward(c, i)

    def w(self) -> Item:
        return (self.deferred.pop(0),)


def _dualpipev_order(p: int, r: int, m: int) -> list[Item]:
    n = _Counter()
    out: list[Item] = [(n.f(0),) for _ in range(2 * (p - r - 1))]  # 1: nF0
    for _ in range(r + 1):  # 2: nF0F1
        out += [(n.f(0),), (n.f(1),)]
    for _ in range(p - r - 1):  # 3: nB1W1F1, zero bubble
        out += [(n.b(1, True),), n.w(), (n.f(1),)]
    for _ in range(m - 2 * p + r + 1):  # 4: nF0B1F1B0, a forward paired with a backward
        out += [(n.f(0), n.b(1)), (n.f(1), n.b(0))]
    for _ in range(p - r - 1):  # 5: nB1F1B0
        out += [(n.b(1),), (n.f(1), n.b(0))]
    split = False
    for i in range(r + 1):  # 6: nB1B0, the second half split
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        out.append((n.b(1, split),))
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        out.append((n.b(0, split),))
    for _ in range(p - r - 1):  # 7: nWB0
        out += [n.w(), (n.b(0, True),)]
    out += [n.w() for _ in range(r + 1)]  # 8: nW
    assert not n.deferred and n.next == {"F0": m, "F1": m, "B0": m, "B1": m}, (r, n.next)
    return out


def dualpipev_orders(stages: int, num_microbatches: int) -> list[list[Item]]:
    """Each stage's DualPipeV compute in its eight phases (see the module docstring)."""
    error = dualpipev_micro_batch_error(stages, num_microbatches)
    if error:
        raise ValueError(error)
    return [_dualpipev_order(stages, r, num_microbatches) for r in range(stages)]


def dualpipev_pairs(stages: int, stage: int, num_microbatches: int) -> dict[Action, Action]:
    """DualPipeV's pairs on ``stage``: each paired forward and the fused backward of the other chunk that
    shares its slot (run at once by :mod:`megacann.pipeline.overlap`; the plan lists the forward first)."""
    items = dualpipev_orders(stages, num_microbatches)[stage]
    return {item[0]: item[1] for item in items if len(item) == 2}


def _forward_only_orders(stages: int, num_microbatches: int) -> list[list[Item]]:
    return [[(Forward(c, i),) for c in (0, 1) for i in range(num_microbatches)] for _ in range(stages)]


_LINK_ORDER = [(ACTIVATION, 0), (GRADIENT, 0), (ACTIVATION, 1), (GRADIENT, 1)]


def v_plans(stages: int, slots: list[list[Optional[Item]]]) -> list[list[Action]]:
    """Every stage's plan from the compute laid on the slot clock: each slot's items, then one
    :class:`VExchange` with the slot's sends and the receives of what the neighbours made in it."""
    p = stages
    plans: list[list[Action]] = [[] for _ in range(p)]
    for t in range(max(len(row) for row in slots)):
        sends = [
            [tr for a in (row[t] if t < len(row) and row[t] else ()) for tr in _sends(p, s, a)]
            for s, row in enumerate(slots)
        ]
        for s in range(p):
            item = slots[s][t] if t < len(slots[s]) else None
            plans[s] += list(item or ())
            links = []
            for peer in (1, -1) if s % 2 == 0 else (-1, 1):
                if not 0 <= s + peer < p:
                    continue
                mine = {(tr.kind, tr.chunk): tr for tr in sends[s] if tr.peer == peer}
                theirs = {(tr.kind, tr.chunk) for tr in sends[s + peer] if tr.peer == -peer}
                for kind, chunk in _LINK_ORDER:
                    if (kind, chunk) in mine:
                        links.append(mine[(kind, chunk)])
                    elif (kind, chunk) in theirs:
                        links.append(Transfer(peer, False, kind, chunk))
            if links:
                plans[s].append(VExchange(tuple(links)))
    return plans


def _forward_only_slots(stages: int, num_microbatches: int) -> list[list[Optional[Item]]]:
    return _in_order(stages, _forward_only_orders(stages, num_microbatches))


def dualpipev_slots(stages: int, num_microbatches: int) -> list[list[Optional[Item]]]:
    """DualPipeV's compute on the slot clock."""
    return _in_order(stages, dualpipev_orders(stages, num_microbatches))


Slots = Callable[[int, int], list[list[Optional[Item]]]]


@functools.lru_cache(maxsize=64)
def _all_plans(slots_of: Slots, stages: int, num_microbatches: int, forward_only: bool) -> tuple:
    slots = (_forward_only_slots if forward_only else slots_of)(stages, num_microbatches)
    return tuple(tuple(plan) for plan in v_plans(stages, slots))


def v_plan(slots_of: Slots, stages: int, stage: int, num_microbatches: int, forward_only: bool = False) -> list[Action]:
    """The plan on ``stage`` of the V schedule whose compute ``slots_of`` lays out (built for all stages at
    once, then cached)."""
    return list(_all_plans(slots_of, stages, num_microbatches, forward_only)[stage])


def _layout_error(name: str) -> Callable[[int, Optional[int]], Optional[str]]:
    def error(stages: int, virtual_size: Optional[int]) -> Optional[str]:
        vpp = virtual_size or 1
        if vpp not in (1, 2):
            return (
                f"distributed.pipeline_schedule {name!r} runs two model chunks per stage placed as a V, but "
                f"distributed.virtual_pipeline_size is {vpp}: unset it or set it to 2"
            )
        return None

    return error


ZBV = ScheduleSpec(
    name="zbv",
    placement=V,
    build=lambda stages, stage, m, virtual, forward_only: v_plan(zbv_slots, stages, stage, m, forward_only),
    label="zbv (V-shaped zero bubble, 2 chunks per stage in a V, backward split into input and weight gradients)",
    split_backward=True,
    layout_error=_layout_error("zbv"),
)
DUALPIPEV = ScheduleSpec(
    name="dualpipev",
    placement=V,
    build=lambda stages, stage, m, virtual, forward_only: v_plan(dualpipev_slots, stages, stage, m, forward_only),
    label="dualpipev (DualPipeV, 2 chunks per stage in a V, forward and backward of two micro-batches paired, "
    "run {overlap})",
    split_backward=True,
    layout_error=_layout_error("dualpipev"),
    micro_batch_error=lambda stages, virtual, m: dualpipev_micro_batch_error(stages, m),
    pairs=dualpipev_pairs,
)
