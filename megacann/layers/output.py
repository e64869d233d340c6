"""The language-model head: a vocabulary-parallel output projection and the per-token loss.

Each tensor-parallel rank holds the rows of its vocabulary range of the ``[padded_vocab, hidden]`` weight
and computes the logits of that range only; the loss (:func:`megacann.layers.loss.token_loss`) never
gathers the full logits, and with the fused op (``precision.fused_ops``) the fp32 logits of the whole
micro-batch are never held either: :func:`megacann.ops.vocab_parallel_head_loss` works in chunks of tokens. The weight is the head's own, the input embedding's (tied, same chunk), or, when
the embedding sits on the first pipeline stage and the head on the last, a copy of it initialised from the
embedding's name and kept equal by summing both gradients over the embedding group
(:func:`tie_embedding_across_stages` marks the first stage's side).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

from megacann import ops
from megacann.layers import mappings
from megacann.layers.context import resolve_sequence_parallel
from megacann.layers.embedding import VocabParallelEmbedding, pad_vocab_size
from megacann.layers.init import default_init_methods, make_parameter
from megacann.layers.loss import token_loss
from megacann.layers.sharding import INIT_NAME_ATTR, InitMethod, mark_tied_across_stages

HEAD_LOSS = "vocab_parallel_head_loss"  # the fused op, used when precision.fused_ops allows it


def tie_embedding_across_stages(embedding: VocabParallelEmbedding) -> None:
    """Mark a first stage's input embedding whose tied copy is an :class:`LMHead` on the last stage."""
    mark_tied_across_stages(embedding.weight, duplicate=False)


class LMHead(torch.nn.Module):
    """Hidden states ``[b, s, h]`` (``[b, s/tp, h]`` under sequence parallelism) to the per-token loss
    ``[b, s]`` (fp32, 0 at ignored labels), or, without labels, to the logits ``[b, s, vocab_size]``.

    Args:
        tie_to: None for a weight of its own; a :class:`VocabParallelEmbedding` of the same model chunk
            to share its weight; or the global name of the first stage's embedding weight (e.g.
            ``"embed_tokens.weight"``) to hold a copy of it on the last stage.

    Arguments left None (``init_method``, ``sequence_parallel``, ``dtype``, ``device``) come from the current
    :class:`~megacann.layers.context.LayerContext`.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        init_method: Optional[InitMethod] = None,
        make_vocab_size_divisible_by: int = 128,
        sequence_parallel: Optional[bool] = None,
        tie_to: Union[None, VocabParallelEmbedding, str] = None,
        group: Optional[dist.ProcessGroup] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.sequence_parallel = resolve_sequence_parallel(sequence_parallel) and mappings.tp_world_size(group) > 1
        self._shared: tuple[VocabParallelEmbedding, ...] = ()
        if isinstance(tie_to, VocabParallelEmbedding):
            self._shared = (tie_to,)  # a tuple: not registered as a submodule, so named once, by its owner
            return
        tp_size = mappings.tp_world_size(group)
        padded = pad_vocab_size(vocab_size, tp_size, make_vocab_size_divisible_by)
        self.weight = make_parameter(
            (padded, hidden_size),
            init_method or default_init_methods()[0],
            tp_rank=mappings.tp_rank(group),
            tp_size=tp_size,
            tp_dim=0,
            logical_size=vocab_size,
            name=f"LMHead padded vocabulary {padded}",
            dtype=dtype,
            device=device,
        )
        if tie_to is not None:
            setattr(self.weight, INIT_NAME_ATTR, tie_to)
            mark_tied_across_stages(self.weight, duplicate=True)

    @property
    def output_weight(self) -> torch.Tensor:
        return self._shared[0].weight if self._shared else self.weight

    def extra_repr(self) -> str:
        tied = ", tied to the input embedding" if self._shared else ""
        return f"vocab {self.vocab_size}, sequence_parallel={self.sequence_parallel}{tied}"

    def logits_shard(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary range of the logits, ``[b, s, padded_vocab/tp]``."""
        if self.sequence_parallel:
            hidden = mappings.gather_from_sequence_parallel_region(hidden, self.group)
        else:
            hidden = mappings.copy_to_tensor_model_parallel_region(hidden, self.group)
        return ops.linear(hidden, self.output_weight, None)

    def forward(self, hidden: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        if labels is not None and ops.fused_enabled(HEAD_LOSS):  # chunks of tokens: no full fp32 logits
            if self.sequence_parallel:
                hidden = mappings.gather_from_sequence_parallel_region(hidden, self.group)
            else:
                hidden = mappings.copy_to_tensor_model_parallel_region(hidden, self.group)
            return ops.vocab_parallel_head_loss(
                hidden,
                self.output_weight,
                labels,
                vocab_size=self.vocab_size,
                group=mappings.tp_group(self.group),
            )
        logits = self.logits_shard(hidden)
        if labels is None:
            logits = mappings.gather_from_tensor_model_parallel_region(logits, self.group)
            return logits[..., : self.vocab_size]
        return token_loss(logits, labels, vocab_size=self.vocab_size, group=self.group)
