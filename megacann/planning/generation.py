"""The generation cache a recipe allocates on each rank, as ``--dry_run`` and ``megacann-plan`` print it.

What each layer keeps is the family's declaration (``ModelSpec.decode_cache_layout``:
:mod:`megacann.models.decode_cache`), its bytes the same formulas the generator's cache obeys: keys and
values of a rank's kv heads (a sliding window's slots at most), latent attention's compressed latent (and
a sparse indexer's keys) whole on every rank, a Gated DeltaNet layer's state and convolution tail of its
heads. ``generation_eval`` holds ``batch_size`` rows of ``data.seq_length + max_new_tokens - 1`` slots
(prompts longer than ``data.seq_length`` tokens are refused at run time, so this is what the generator
allocates at most); GRPO's rollouts are :mod:`megacann.planning.rl`'s.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from megacann.accelerator import PRECISION_DTYPES
from megacann.config import MegacannConfig
from megacann.config.generation_eval import generation_cache_slots
from megacann.models import get_model_spec
from megacann.models.decode_cache import LayerCache, cache_bytes


def decode_layout(cfg: MegacannConfig) -> list[LayerCache]:
    """What each layer of the recipe's model caches while generating (the family's declaration)."""
    return get_model_spec(cfg.model.type).decode_cache_layout(cfg.model)


def layout_bytes(cfg: MegacannConfig, layout: Sequence[LayerCache], tp: int, rows: int, slots: int) -> int:
    """Bytes one rank of ``tp`` holds of ``layout`` for ``rows`` rows of ``slots`` tokens, at the recipe's
    precision."""
    return cache_bytes(list(layout), tp, rows, slots, PRECISION_DTYPES[cfg.model.precision])


def layout_summary(cfg: MegacannConfig, layout: Sequence[LayerCache], tp: int, rows: int, slots: int) -> str:
    """Each kind of layer once, in model order: how many, what one rank keeps, their bytes."""
    dtype = PRECISION_DTYPES[cfg.model.precision]
    groups = Counter(kind.for_rank(tp) for kind in layout)
    return "; ".join(
        f"{count} layers of {kind.describe()}: {count * kind.nbytes(rows, slots, dtype):,} bytes"
        for kind, count in groups.items()
    )


def generation_cache_bytes(cfg: MegacannConfig, tp: int) -> int:
    """Bytes of the generation_eval cache on one rank of tensor-parallel size ``tp``."""
    rows, slots = cfg.generation_eval.batch_size, generation_cache_slots(cfg)
    return layout_bytes(cfg, decode_layout(cfg), tp, rows, slots)


def generation_cache_lines(cfg: MegacannConfig, tp: int) -> list[str]:
    """The report's lines on the generation_eval cache (none when the recipe asks for no generation)."""
    section = cfg.generation_eval
    if not section.interval:
        return []
    if get_model_spec(cfg.model.type).decode is None:
        return [f"generation_eval: model family {cfg.model.type!r} has no decode path: it cannot generate"]
    rows, slots = section.batch_size, generation_cache_slots(cfg)
    total = generation_cache_bytes(cfg, tp)
    return [
        f"generation_eval key/value cache per rank: {total:,} bytes ({total / 2**20:.2f} MiB): {rows} rows x "
        f"{slots} slots (seq {cfg.data.seq_length} + {section.max_new_tokens} new - 1), {cfg.model.precision}, "
        f"tp {tp}: {layout_summary(cfg, decode_layout(cfg), tp, rows, slots)}"
    ]
