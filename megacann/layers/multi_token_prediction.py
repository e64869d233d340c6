"""Multi-token prediction (DeepSeek-V3, Megatron-Core's ``mtp_num_layers``): extra depths that each predict
one more token ahead, trained beside the main next-token loss.

Depth ``k`` (1-based; module ``layers[k-1]``) takes the previous depth's hidden states ``h_{k-1}`` (depth 0:
the main model's output after its final norm) and the embedding of the token ``k`` positions ahead, and::

    h_k    = transformer_layer(eh_proj([enorm(emb(t_{i+k})), hnorm(h_{k-1})]))    eh_proj: 2h -> h
    loss_k = CE(head(final_layernorm(h_k)), t_{i+k+1})                            the shared output head

Positions whose target lies past the sequence end take no loss. The MTP loss is
``mtp_loss_scaling_factor * mean_k(loss_k)`` with each ``loss_k`` the mean over its targets of the
micro-batch; a model adds it to its main loss as an auxiliary loss (the model contract's ``ChunkOutput``).

Parallel layouts: ``eh_proj`` is a :class:`~megacann.layers.ColumnParallelLinear` whose output slices are
gathered (and, under sequence parallelism, scattered back to the sequence shard), the head and loss are
the vocabulary-parallel ones of the model. Under context parallelism tokens and labels are shifted on the
whole sequence (gathered over the cp group, rolled, split again), and each cp rank's value is scaled so
that the trainer's mean over cp ranks is the mean over the micro-batch's targets. On a pipeline, the
module sits on the last stage; the embedding it needs there is the first stage's, tied across stages
(:func:`embedding_copy_for_last_stage`).

Parameter names, per depth ``k-1`` (Hugging Face DeepSeek-V3 stores depth ``k`` as decoder layer
``num_hidden_layers + k - 1``): ``enorm``, ``hnorm``, ``eh_proj``, ``transformer_layer.*`` (the layer's own
names), ``final_layernorm`` (HF: ``shared_head.norm``); the head (HF: ``shared_head.head``) and embedding
are the model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.collectives import all_reduce_if_parallel
from megacann.constants import IGNORE_INDEX
from megacann.layers import mappings
from megacann.layers.context import resolve_sequence_parallel
from megacann.layers.context_parallel import context_parallel_gather, context_parallel_split
from megacann.layers.embedding import VocabParallelEmbedding
from megacann.layers.linear import ColumnParallelLinear
from megacann.layers.norm import RMSNorm
from megacann.layers.sharding import INIT_NAME_ATTR, InitMethod, mark_tied_across_stages

Embed = Callable[[torch.Tensor], torch.Tensor]
Head = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (hidden, labels) -> per-token loss [b, s]


def shift_left(ids: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """``ids`` ``[b, s]`` moved ``k`` positions left along the sequence (position ``i`` holds ``ids[i+k]``),
    the last ``k`` positions ``fill``. Under context parallelism ``ids`` is this cp rank's share: the shift
    runs on the whole sequence (gathered over the cp group) and this rank's share of it is returned."""
    cp = ps.get_context_parallel_world_size()
    with torch.no_grad():
        whole = context_parallel_gather(ids, dim=1) if cp > 1 else ids
        shifted = torch.full_like(whole, fill)
        if k < whole.shape[1]:
            shifted[:, : whole.shape[1] - k] = whole[:, k:]
        return context_parallel_split(shifted, 1) if cp > 1 else shifted


class MTPLayer(torch.nn.Module):
    """One depth: ``forward(hidden, embedded, rotary=None, segment_ids=None) -> hidden`` (``[b, s_local, h]``
    each, the sequence shard under sequence parallelism). ``transformer_layer`` is a block of the model's
    kind (``forward(hidden, rotary, segment_ids)``, e.g. a :class:`~megacann.layers.TransformerBlock`);
    :meth:`head_input` is the final norm applied before the shared head. Arguments left None come from the
    current :class:`~megacann.layers.LayerContext`."""

    def __init__(
        self,
        hidden_size: int,
        transformer_layer: torch.nn.Module,
        *,
        norm_eps: float = 1e-6,
        init_method: Optional[InitMethod] = None,
        sequence_parallel: Optional[bool] = None,
        group: Optional[dist.ProcessGroup] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__()
        self.group = group
        self.sequence_parallel = sp = resolve_sequence_parallel(sequence_parallel)
        norm = dict(eps=norm_eps, sequence_parallel=sp, dtype=dtype, device=device)
        self.enorm = RMSNorm(hidden_size, **norm)
        self.hnorm = RMSNorm(hidden_size, **norm)
        self.eh_proj = ColumnParallelLinear(
            2 * hidden_size,
            hidden_size,
            bias=False,
            sequence_parallel=sp,
            init_method=init_method,
            group=group,
            dtype=dtype,
            device=device,
        )
        self.transformer_layer = transformer_layer
        self.final_layernorm = RMSNorm(hidden_size, **norm)

    def forward(
        self, hidden: torch.Tensor, embedded: torch.Tensor, rotary: Any = None, segment_ids: Any = None
    ) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))  # [b, s, h/tp]
        if mappings.tp_world_size(self.group) > 1:
            x = mappings.gather_from_tensor_model_parallel_region(x, self.group)
            if self.sequence_parallel:
                x = mappings.scatter_to_sequence_parallel_region(x, self.group)
        return self.transformer_layer(x, rotary, segment_ids)

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.final_layernorm(hidden)


class MultiTokenPrediction(torch.nn.Module):
    """The MTP depths of a model (``layers[k-1]`` is depth ``k``) and their loss.

    ``forward(hidden, input_ids, labels, embed, head, rotary=None, segment_ids=None)`` returns
    ``(loss, per_depth)``: the scaled MTP loss (a 0-d fp32 tensor with gradient; add it to the model's
    objective) and each depth's unscaled mean cross entropy (detached). ``hidden`` is the main model's
    output after its final norm, ``input_ids`` / ``labels`` the micro-batch's (``labels[i]`` is token
    ``i+1``, :data:`~megacann.layers.IGNORE_INDEX` where there is none), ``embed(ids)`` the model's input
    embedding, ``head(hidden, labels)`` its output head's per-token loss.
    """

    def __init__(self, layers: Sequence[MTPLayer], loss_scaling_factor: float = 0.1):
        super().__init__()
        if not layers:
            raise ValueError("MultiTokenPrediction needs at least one MTPLayer (mtp_num_layers >= 1)")
        if loss_scaling_factor < 0:
            raise ValueError(f"MultiTokenPrediction: loss_scaling_factor must be >= 0, got {loss_scaling_factor}")
        self.layers = torch.nn.ModuleList(layers)
        self.loss_scaling_factor = loss_scaling_factor

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        embed: Embed,
        head: Head,
        rotary: Any = None,
        segment_ids: Any = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        cp = ps.get_context_parallel_world_size()
        cp_group = ps.get_context_parallel_group() if cp > 1 else None
        total, per_depth = None, []
        for k, layer in enumerate(self.layers, start=1):
            ids_k, labels_k = shift_left(input_ids, k, 0), shift_left(labels, k, IGNORE_INDEX)
            hidden = layer(hidden, embed(ids_k), rotary, segment_ids)
            loss = head(layer.head_input(hidden), labels_k)
            count = (labels_k != IGNORE_INDEX).sum().to(torch.float32).reshape(1)
            count = all_reduce_if_parallel(count, cp_group).reshape(())  # the micro-batch's, over cp ranks
            mean = loss.float().sum() * cp / count.clamp(min=1.0)  # the trainer averages over cp ranks
            per_depth.append(mean.detach())
            total = mean if total is None else total + mean
        return total * (self.loss_scaling_factor / len(self.layers)), per_depth


def embedding_copy_for_last_stage(
    num_embeddings: int,
    embedding_dim: int,
    tied_to: str,
    make_vocab_size_divisible_by: int = 128,
    **kwargs: Any,
) -> VocabParallelEmbedding:
    """An input embedding on the last pipeline stage that copies the first stage's (global parameter name
    ``tied_to``, e.g. ``"embed_tokens.weight"``): initialised and stored as it, gradients summed with it
    over the embedding group, like a tied head's copy. Mark the first stage's embedding with
    :func:`~megacann.layers.tie_embedding_across_stages`. A last stage whose head is already a tied copy
    uses that head's weight instead (:func:`~megacann.layers.embedding.vocab_parallel_embedding`): a stage
    holds one copy."""
    embedding = VocabParallelEmbedding(
        num_embeddings, embedding_dim, make_vocab_size_divisible_by=make_vocab_size_divisible_by, **kwargs
    )
    setattr(embedding.weight, INIT_NAME_ATTR, tied_to)
    mark_tied_across_stages(embedding.weight, duplicate=True)
    return embedding
