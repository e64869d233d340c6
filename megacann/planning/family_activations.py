"""Activations of a family that is not a standard decoder but declares its own formulas
(:class:`~megacann.models.spec.ActivationFormulas` in ``ModelSpec.rank_parameters``; DeepSeek-V4's are in
``models/deepseek_v4_memory.py``): the family gives each layer's terms and its last chunk's head; the MoE
blocks it names are counted by :mod:`megacann.planning.moe`, the token ids, the output layer's input and
the loss as for a decoder (:mod:`megacann.planning.activations`), and :mod:`megacann.planning.estimate`
replays the schedule's micro-batches in flight and adds the pipeline buffers as for any family."""

from __future__ import annotations

from typing import Optional

from megacann.config import MegacannConfig, ModelConfig
from megacann.models.spec import ActivationFormulas, ActivationShape
from megacann.planning.activations import output_layer_terms, token_id_bytes, tokens_per_rank
from megacann.planning.formulas import DTYPE_BYTES, Layout
from megacann.planning.moe import moe_activation_terms
from megacann.planning.static_memory import rank_formulas


def activation_formulas(m: ModelConfig) -> Optional[ActivationFormulas]:
    """The family's own activation formulas (None: a decoder, or a family without them)."""
    formulas = rank_formulas(m)
    return formulas.activations if formulas is not None else None


def activation_shape(cfg: MegacannConfig, layout: Layout) -> ActivationShape:
    return ActivationShape(
        micro_batch=layout.micro_batch,
        seq_length=cfg.data.seq_length,
        tp=layout.tp,
        sequence_parallel=layout.sequence_parallel,
        cp=layout.cp,
        dtype_bytes=DTYPE_BYTES[cfg.model.precision],
    )


def family_layer_terms(cfg: MegacannConfig, layout: Layout, layer_id: int, recompute: str) -> dict[str, float]:
    """Bytes layer ``layer_id`` keeps between its forward and backward for one micro-batch, by what saves
    them: the family's terms and its MoE block's (``full`` recompute: the layer's input alone)."""
    m, formulas = cfg.model, activation_formulas(cfg.model)
    shape = activation_shape(cfg, layout)
    if recompute == "full":
        return {"layer input (full recompute)": formulas.full(m, shape, layer_id)}
    terms = formulas.layer(m, shape, layer_id, recompute)
    moe = formulas.moe(m, layer_id)
    if moe is not None:
        a = DTYPE_BYTES[m.precision]
        terms.update(moe_activation_terms(tokens_per_rank(cfg, layout), a, m.hidden_size, layout.tp, moe))
    return terms


def family_layer_bytes(cfg: MegacannConfig, layout: Layout, layer_id: int, recompute: str) -> float:
    return sum(family_layer_terms(cfg, layout, layer_id, recompute).values())


def family_chunk_terms(
    cfg: MegacannConfig, layout: Layout, first: bool, last: bool, has_layers: bool = True
) -> dict[str, float]:
    """Bytes a chunk saves besides its layers' own: what its layers save once between them, the token ids
    on the first, the family's head, the output layer's input and the loss on the last."""
    terms = {"token ids": token_id_bytes(cfg, layout)} if first else {}
    formulas = activation_formulas(cfg.model)
    if has_layers and formulas.shared is not None:
        terms.update(formulas.shared(cfg.model, activation_shape(cfg, layout), layout.recompute))
    if last:
        terms.update(activation_formulas(cfg.model).head(cfg.model, activation_shape(cfg, layout)))
        terms.update(output_layer_terms(cfg, layout))
    return terms
