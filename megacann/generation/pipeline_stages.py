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
own chunk). Interleaved (virtual) chunks are refused by name.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.models.spec import ModelSpec
from megacann.pipeline.p2p import exchange


def check_pipeline_generation(model: torch.nn.Module, spec: ModelSpec) -> None:
    """Refuse what generation on pipeline stages cannot do: interleaved chunks, and a family whose decode
    path takes no ``hidden_states`` from the previous stage; and a stage's chunk without pipeline stages."""
    whole = getattr(model, "pre_process", True) and getattr(model, "post_process", True)
    if ps.get_pipeline_model_parallel_world_size() == 1:
        if not whole:
            raise ValueError(
                "generation without pipeline parallelism needs the whole model on this rank: this chunk lacks "
                "the embedding or the head (a pipeline stage's)"
            )
        return
    virtual = ps.get_virtual_pipeline_model_parallel_world_size()
    if virtual and virtual > 1:
        raise ValueError(
            f"generation with interleaved pipeline chunks (distributed.virtual_pipeline_size {virtual}) is "
            "refused: generate with one chunk a stage (virtual_pipeline_size 1)"
        )
    if "hidden_states" not in inspect.signature(spec.decode).parameters:
        raise ValueError(
            f"model family {spec.name!r}: its decode path (ModelSpec.decode) takes no hidden_states, so it "
            "cannot generate on pipeline stages (pipeline_parallel_size "
            f"{ps.get_pipeline_model_parallel_world_size()})"
        )


class PipelineStages:
    """Runs one forward of a micro-batch through this rank's stage (or the whole model without pipeline
    parallelism) and shares the last stage's per-row choices with every stage. :meth:`begin` starts a
    generation (every stage calls it, then the same forwards in the same order)."""

    def __init__(self, model: torch.nn.Module, spec: ModelSpec):
        self.model, self.spec = model, spec
        self.size = ps.get_pipeline_model_parallel_world_size()
        self.stage = ps.get_pipeline_model_parallel_rank() if self.size > 1 else 0
        self.first, self.last = self.stage == 0, self.stage == self.size - 1
        self.hidden_size: Optional[int] = None  # learnt from the previous stage in a generation's first forward
        self._announce = False  # this stage still owes the next one the hidden size

    def begin(self) -> None:
        """A new generation: the hidden size is (re)announced ahead of its first transfer."""
        self.hidden_size, self._announce = None, not self.last

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> Optional[torch.Tensor]:
        """The logits ``[rows, vocab]`` of the next token of each row of a micro-batch on the last stage;
        None on the others."""
        if self.size == 1:
            return self.spec.decode(self.model, ids, positions)[:, -1]
        param = next(self.model.parameters())
        hidden = None
        if not self.first:
            if self.hidden_size is None:
                header = torch.zeros(1, dtype=torch.long, device=param.device)
                self.hidden_size = int(self._transfer(header, receive=True)[0])
            shape = (*ids.shape, self.hidden_size)
            hidden = exchange(shape=shape, dtype=param.dtype, device=param.device, recv_prev=True)[0]
        out = self.spec.decode(self.model, ids, positions, hidden_states=hidden)
        if self.last:
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
