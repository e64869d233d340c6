"""Forward/backward schedules over the micro-batches of one step.

Every schedule has the same signature and returns the sum of per-token losses of the micro-batches it ran
(on the last pipeline stage; zero elsewhere). Each micro-batch's loss is divided by ``loss_normalizer``
(the number of target tokens in the whole global batch) and multiplied by the loss scale before backward,
so gradient accumulation and data-parallel summation give exactly the gradient of one big batch. The
backward of the last micro-batch runs inside ``last_micro_batch_backward()`` (see ``microbatches``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megacann.config import MegacannConfig
from megacann.pipeline.microbatches import last_micro_batch_backward

ForwardBackward = Callable[..., torch.Tensor]


def forward_step(model: torch.nn.Module, batch: dict, input_tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run one model chunk on one micro-batch: hidden states out, or per-token losses on the last stage."""
    return model(
        input_ids=batch["tokens"],
        position_ids=batch.get("position_ids"),
        labels=batch.get("labels"),
        segment_ids=batch.get("segment_ids"),
        hidden_states=input_tensor,
    )


def forward_backward_no_pipelining(
    model_chunks: list[torch.nn.Module],
    micro_batches: list[dict],
    *,
    loss_normalizer: float,
    loss_scale: float = 1.0,
    forward_only: bool = False,
) -> torch.Tensor:
    """Plain gradient accumulation over micro-batches on one stage."""
    (model,) = model_chunks
    total = torch.zeros((), dtype=torch.float32)
    for index, batch in enumerate(micro_batches):
        with torch.set_grad_enabled(not forward_only):
            token_losses = forward_step(model, batch)
            loss_sum = token_losses.sum()
        if not forward_only:
            with last_micro_batch_backward(index == len(micro_batches) - 1):
                (loss_sum * (loss_scale / loss_normalizer)).backward()
        total = total.to(loss_sum.device) + loss_sum.detach().float()
    return total


def get_forward_backward_func(cfg: MegacannConfig) -> ForwardBackward:
    """The schedule the recipe asks for."""
    if cfg.distributed.pipeline_parallel_size > 1:
        raise NotImplementedError("pipeline_parallel_size > 1 needs the pipeline schedules (not implemented yet)")
    return forward_backward_no_pipelining
