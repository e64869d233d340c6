"""Generation on pipeline stages: every forward round of a generation (the prefill and each decode step)
runs its micro-batches stage after stage in the pipelined order, and the last stage's choices reach every
stage.

A stage receives a micro-batch's hidden states ``[rows, s, h]`` from the previous stage (the project's
point-to-point :func:`~megacann.pipeline.p2p.exchange`), runs its chunk with that micro-batch's share of
the key/value cache (the attention layers it holds), sends its output on, and goes on to the next
micro-batch without waiting for the later stages: while stage ``k`` runs micro-batch ``m + 1``, stage
``k + 1`` runs ``m`` (:mod:`.micro_batches`). The last stage computes the logits. After a round the last
stage broadcasts every row's token and log-probabilities over the pipeline group (one broadcast a round),
so every stage records the same results and drops the same finished rows: the stages' caches stay in
lockstep. The next round waits for that broadcast: a decode step's input is the token the round before
chose. The hidden size travels once per generation, ahead of the first transfer (a stage knows only its
own chunk).

With interleaved (virtual) chunks each rank holds several chunks: a micro-batch's forward runs chunk 0 of
every stage in turn, then chunk 1 of every stage (the last stage's chunk ``v`` sends to the first stage's
chunk ``v + 1`` over the wrap-around link), and so on to the last chunk of the last stage, which computes
the logits. A micro-batch passes all its chunks before the next one starts, so every link carries its
transfers in one order on both ends. Each chunk's attention layers keep their own cache entries.

In the V placement of ``zbv`` and ``dualpipev`` (two chunks a stage: chunk 0 of stage s is model segment s,
chunk 1 segment ``2P - 1 - s``; chunks built by :func:`~megacann.pipeline.build_model_chunks` say so) a
micro-batch goes down the stages through their chunk 0, the last stage hands chunk 0's output to its chunk 1
in place, and it comes back up through chunk 1 to stage 0, whose chunk 1 holds the head: stage 0 computes
the logits and broadcasts the choices. Each direction of a link carries its own hidden-size header ahead of
its first transfer.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.models.spec import ModelSpec
from megacann.pipeline.p2p import exchange
from megacann.pipeline.placement import PLACEMENT_ATTR


def chunk_placement(chunks: Sequence[torch.nn.Module]) -> str:
    """``"v"`` when every chunk was built for the V placement (zbv, dualpipev), else ``"loop"``."""
    kinds = {getattr(chunk, PLACEMENT_ATTR, "loop") for chunk in chunks}
    return "v" if kinds == {"v"} else "loop"


def check_pipeline_generation(chunks: Sequence[torch.nn.Module], spec: ModelSpec) -> None:
    """Refuse what generation on pipeline stages cannot do: not all of this rank's interleaved chunks (or
    not both of the V's), chunks that do not hold the embedding and head where their placement (the loop
    or the V) puts them, a family whose decode path takes no ``hidden_states`` from the previous stage; and
    a stage's chunk without pipeline stages."""
    whole = getattr(chunks[0], "pre_process", True) and getattr(chunks[-1], "post_process", True)
    if ps.get_pipeline_model_parallel_world_size() == 1:
        if not whole:
            raise ValueError(
                "generation without pipeline parallelism needs the whole model on this rank: this chunk lacks "
                "the embedding or the head (a pipeline stage's)"
            )
        return
    virtual, count = ps.get_virtual_pipeline_model_parallel_world_size() or 1, len(chunks)
    if virtual > 1 and count != virtual:
        raise ValueError(
            f"generation on pipeline stages with distributed.virtual_pipeline_size {virtual} needs all {virtual} "
            f"model chunks of this rank, in order; got {len(chunks)}"
        )
    stage, stages = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    ends = [(getattr(c, "pre_process", False), getattr(c, "post_process", False)) for c in chunks]
    placement = chunk_placement(chunks)
    if placement == "v":
        if count != 2:
            raise ValueError(f"generation in the V placement (zbv, dualpipev) needs this rank's 2 chunks; got {count}")
        expected = [(stage == 0, False), (False, stage == 0)]
    else:
        expected = [(stage == 0 and v == 0, stage == stages - 1 and v == count - 1) for v in range(count)]
    if count > 1 and ends != expected:
        raise ValueError(
            f"generation runs the chunks in their placement's order ({placement}: chunks built by "
            f"megacann.pipeline.build_model_chunks say which); pipeline stage {stage}'s chunks hold the "
            f"embedding / head as {ends}, not {expected}"
        )
    if "hidden_states" not in inspect.signature(spec.decode).parameters:
        raise ValueError(
            f"model family {spec.name!r}: its decode path (ModelSpec.decode) takes no hidden_states, so it "
            "cannot generate on pipeline stages (pipeline_parallel_size "
            f"{ps.get_pipeline_model_parallel_world_size()})"
        )


class PipelineStages:
    """Runs one forward of a micro-batch through this rank's chunks (the whole model without pipeline
    parallelism; its stage's chunk, its interleaved chunks in order, or the V's two chunks) and shares the
    head stage's per-row choices with every stage (``last``: this stage holds the head; the last stage on
    the loop, stage 0 in the V). :meth:`begin` starts a generation (every stage calls it, then the same
    forwards in the same order)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], spec: ModelSpec):
        self.chunks, self.spec = list(chunks), spec
        self.size = ps.get_pipeline_model_parallel_world_size()
        self.stage = ps.get_pipeline_model_parallel_rank() if self.size > 1 else 0
        self.v_shape = self.size > 1 and chunk_placement(self.chunks) == "v"
        self.head_stage = 0 if self.v_shape else self.size - 1
        self.first, self.last = self.stage == 0, self.stage == self.head_stage
        self.hidden_size: Optional[int] = None  # learnt with a generation's first receive
        self._told: set[str] = set()  # the directions ("next", "prev") whose header this stage has sent
        self._heard: set[str] = set()  # ... and received

    def begin(self) -> None:
        """A new generation: the hidden size is (re)announced ahead of the first transfer in each direction."""
        self.hidden_size, self._told, self._heard = None, set(), set()

    def head_rank(self) -> int:
        """The global rank of this pipeline's head stage (the one whose choices :meth:`share` broadcasts)."""
        return ps.get_pipeline_model_parallel_ranks()[self.head_stage]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> Optional[torch.Tensor]:
        """The logits ``[rows, vocab]`` of the next token of each row of a micro-batch on the last stage;
        None on the others."""
        if self.size == 1:
            return self.spec.decode(self.chunks[0], ids, positions)[:, -1]
        if self.v_shape:
            return self._forward_v(ids, positions)
        for index, chunk in enumerate(self.chunks):
            first = self.first and index == 0
            hidden = None if first else self._receive(ids, chunk, "prev")
            out = self.spec.decode(chunk, ids, positions, hidden_states=hidden)
            if self.last and index == len(self.chunks) - 1:
                return out[:, -1]
            self._send(out, "next")
        return None

    def _forward_v(self, ids: torch.Tensor, positions: torch.Tensor) -> Optional[torch.Tensor]:
        """The V: down the stages through chunk 0, across in place on the last stage, up through chunk 1."""
        down, up = self.chunks
        hidden = None if self.first else self._receive(ids, down, "prev")
        out = self.spec.decode(down, ids, positions, hidden_states=hidden)
        if self.stage < self.size - 1:
            self._send(out, "next")
            out = self._receive(ids, up, "next")
        out = self.spec.decode(up, ids, positions, hidden_states=out)
        if self.last:
            return out[:, -1]
        self._send(out, "prev")
        return None

    def _receive(self, ids: torch.Tensor, chunk: torch.nn.Module, direction: str) -> torch.Tensor:
        """The hidden states ``[rows, s, h]`` of ``ids`` from the ``direction`` ("prev", "next") stage."""
        param = next(chunk.parameters())
        if direction not in self._heard:
            header = torch.zeros(1, dtype=torch.long, device=param.device)
            self.hidden_size = int(self._transfer(header, direction, receive=True)[0])
            self._heard.add(direction)
        shape = (*ids.shape, self.hidden_size)
        got = exchange(shape=shape, dtype=param.dtype, device=param.device, **{f"recv_{direction}": True})
        return got[0] if direction == "prev" else got[1]

    def _send(self, out: torch.Tensor, direction: str) -> None:
        """``out`` to the ``direction`` ("next", "prev") stage, its hidden size first in a new generation."""
        if direction not in self._told:
            self._transfer(torch.tensor([out.shape[-1]], device=out.device), direction, receive=False)
            self._told.add(direction)
        exchange(shape=tuple(out.shape), dtype=out.dtype, device=out.device, **{f"send_{direction}": out})

    def _transfer(self, header: torch.Tensor, direction: str, receive: bool) -> torch.Tensor:
        """A small long tensor to the ``direction`` stage or from it."""
        kind = {f"recv_{direction}": True} if receive else {f"send_{direction}": header}
        got = exchange(shape=tuple(header.shape), dtype=header.dtype, device=header.device, **kind)
        return (got[0] if direction == "prev" else got[1]) if receive else header

    def share(self, choices: torch.Tensor) -> torch.Tensor:
        """``choices`` (``[fields, rows]`` float64 on the last stage, any tensor of that shape elsewhere) as
        the last stage holds them, on every stage."""
        if self.size == 1:
            return choices
        choices = choices.contiguous()
        dist.broadcast(choices, self.head_rank(), group=ps.get_pipeline_model_parallel_group())
        return choices
