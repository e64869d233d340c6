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


def check_pipeline_generation(chunks: Sequence[torch.nn.Module], spec: ModelSpec) -> None:
    """Refuse what generation on pipeline stages cannot do: not all of this rank's interleaved chunks,
    chunks placed otherwise than in the loop order (a V-shaped schedule's), a family whose decode path
    takes no ``hidden_states`` from the previous stage; and a stage's chunk without pipeline stages."""
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
    expected = [(stage == 0 and v == 0, stage == stages - 1 and v == count - 1) for v in range(count)]
    if count > 1 and ends != expected:
        raise ValueError(
            f"generation runs interleaved chunks in the loop order (chunk v of every stage, then chunk v + 1); "
            f"pipeline stage {stage}'s chunks hold the embedding / head as {ends}, not {expected} "
            "(a V-shaped schedule such as zbv or dualpipev): generate with distributed.pipeline_schedule interleaved"
        )
    if "hidden_states" not in inspect.signature(spec.decode).parameters:
        raise ValueError(
            f"model family {spec.name!r}: its decode path (ModelSpec.decode) takes no hidden_states, so it "
            "cannot generate on pipeline stages (pipeline_parallel_size "
            f"{ps.get_pipeline_model_parallel_world_size()})"
        )


class PipelineStages:
    """Runs one forward of a micro-batch through this rank's chunks (the whole model without pipeline
    parallelism; its stage's chunk, or its interleaved chunks in order) and shares the last stage's per-row
    choices with every stage. :meth:`begin` starts a generation (every stage calls it, then the same
    forwards in the same order)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], spec: ModelSpec):
        self.chunks, self.spec = list(chunks), spec
        self.size = ps.get_pipeline_model_parallel_world_size()
        self.stage = ps.get_pipeline_model_parallel_rank() if self.size > 1 else 0
        self.first, self.last = self.stage == 0, self.stage == self.size - 1
        self.hidden_size: Optional[int] = None  # learnt from the previous stage in a generation's first forward
        self._announce = False  # this stage still owes the next one the hidden size

    def begin(self) -> None:
        """A new generation: the hidden size is (re)announced ahead of its first transfer (by every stage
        that sends at all: all but the last one, which sends too when it holds several chunks)."""
        self.hidden_size, self._announce = None, not self.last or len(self.chunks) > 1

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> Optional[torch.Tensor]:
        """The logits ``[rows, vocab]`` of the next token of each row of a micro-batch on the last stage;
        None on the others."""
        if self.size == 1:
            return self.spec.decode(self.chunks[0], ids, positions)[:, -1]
        for index, chunk in enumerate(self.chunks):
            first, last = self.first and index == 0, self.last and index == len(self.chunks) - 1
            param = next(chunk.parameters())
            hidden = None
            if not first:
                if self.hidden_size is None:
                    header = torch.zeros(1, dtype=torch.long, device=param.device)
                    self.hidden_size = int(self._transfer(header, receive=True)[0])
                shape = (*ids.shape, self.hidden_size)
                hidden = exchange(shape=shape, dtype=param.dtype, device=param.device, recv_prev=True)[0]
            out = self.spec.decode(chunk, ids, positions, hidden_states=hidden)
            if last:
                return out[:, -1]
            if self._announce:
                self._transfer(torch.tensor([out.shape[-1]], device=out.device), receive=False)
                self._announce = False
            exchange(shape=tuple(out.shape), dtype=out.dtype, device=out.device, send_next=out)
        return None

    def _transfer(self, header: torch.Tensor, receive: bool) -> torch.Tensor:
        """A small long tensor to the next stage or from the previous one."""
        kind = {"recv_prev": True} if receive else {"send_next": header}
        got = exchange(shape=tuple(header.shape), dtype=header.dtype, device=header.device, **kind)[0]
        return got if receive else header

    def share(self, choices: torch.Tensor) -> torch.Tensor:
        """``choices`` (``[fields, rows]`` float64 on the last stage, any tensor of that shape elsewhere) as
        the last stage holds them, on every stage."""
        if self.size == 1:
            return choices
        choices = choices.contiguous()
        last = ps.get_pipeline_model_parallel_ranks()[-1]
        dist.broadcast(choices, last, group=ps.get_pipeline_model_parallel_group())
        return choices
