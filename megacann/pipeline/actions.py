"""The actions a pipeline plan lists: what one stage computes and when it talks to its neighbours.

- ``Forward(chunk, micro_batch)``: run model chunk ``chunk`` on a micro-batch; its input is the oldest
  activation received for that chunk (none on the model's first chunk);
- ``Backward(chunk, micro_batch)``: back-propagate the oldest forward of that chunk; the gradient of its
  output is the oldest one received for that chunk (none on the model's last chunk, whose output is the loss);
- ``BackwardInput(chunk, micro_batch)`` and ``BackwardWeight(chunk, micro_batch)``: the two halves of a
  Backward that the split-backward schedules run apart: B computes only the gradient of the chunk's input
  (what the previous stage waits for), W later the gradients of the chunk's weights, oldest B first;
- ``Exchange``: one step's transfers on the loop placement (see :mod:`megacann.pipeline.p2p`): send the
  output of the latest Forward to the next stage, send the input gradient of the latest Backward to the
  previous stage, receive an activation for chunk ``recv_forward`` and/or a gradient for chunk ``recv_backward``;
- ``VExchange``: one step's transfers on the V placement, each a :class:`Transfer` with either neighbour,
  posted in the order listed.

Actions are plain frozen data: a plan is a list of them, equal plans compare equal and print the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

ACTIVATION, GRADIENT = "activation", "gradient"


@dataclass(frozen=True)
class Forward:
    chunk: int
    micro_batch: int


@dataclass(frozen=True)
class Backward:
    chunk: int
    micro_batch: int


@dataclass(frozen=True)
class BackwardInput:
    chunk: int
    micro_batch: int


@dataclass(frozen=True)
class BackwardWeight:
    chunk: int
    micro_batch: int


@dataclass(frozen=True)
class Exchange:
    send_forward: bool = False
    send_backward: bool = False
    recv_forward: Optional[int] = None  # chunk that the activation from the previous stage is for
    recv_backward: Optional[int] = None  # chunk that the gradient from the next stage is for


@dataclass(frozen=True)
class Transfer:
    """One point-to-point transfer of a V exchange: with the stage ``peer`` away (+1 next, -1 previous),
    a send (the oldest unsent output of chunk ``chunk``) or a receive (for chunk ``chunk``) of ``kind``."""

    peer: int
    send: bool
    kind: str  # ACTIVATION | GRADIENT
    chunk: int


@dataclass(frozen=True)
class VExchange:
    """One slot's transfers of a V-shaped plan, posted in this order, then all waited for."""

    transfers: tuple[Transfer, ...]


Action = Union[Forward, Backward, BackwardInput, BackwardWeight, Exchange, VExchange]
Compute = (Forward, Backward, BackwardInput, BackwardWeight)


def exchange(
    send_forward: bool = False,
    send_backward: bool = False,
    recv_forward: Optional[int] = None,
    recv_backward: Optional[int] = None,
) -> list[Action]:
    """An Exchange as a list of one, or an empty list when it would transfer nothing (to extend a plan)."""
    if not (send_forward or send_backward) and recv_forward is None and recv_backward is None:
        return []
    return [Exchange(send_forward, send_backward, recv_forward, recv_backward)]
