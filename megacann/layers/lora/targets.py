"""What a LoRA adapts: projection names, fused projections and their parts, and the LoRA settings.

Targets are leaf names of projection layers. megacann may fuse projections: ``qkv_proj`` is q, k, v and
``gate_up_proj`` is gate, up (output blocks, see :data:`FUSED_PROJECTIONS`). Naming the fused layer puts
one rank-r LoRA on the whole fused matrix (one ``A`` shared by the blocks, ``B`` spanning all of them).
Naming parts (``q_proj``, ``v_proj``, ``gate_proj``…) on a fused layer gives each named block its own
rank-r LoRA (own ``A`` and ``B``) and leaves the other blocks unchanged: exactly Hugging Face PEFT's LoRA on
separate projections. On a model with separate projections, a fused name selects each of its parts.

The same names select MoE experts' ``gate_up_proj`` (gate, up) and ``down_proj``; latent attention's
projections have names of their own (:data:`LATENT_PROJECTIONS`), as have Gated DeltaNet's
(:data:`DELTANET_PROJECTIONS`), DeepSeek-V3.2's indexer's (:data:`INDEXER_PROJECTIONS`) and DeepSeek-V4's
attention's (:data:`COMPRESSED_ATTENTION_PROJECTIONS`); ``"all-linear"``
includes none of them. A layer whose output is several blocks under one name (a DeltaNet's
``in_proj_qkv``: q, k, v) gets one LoRA over all its blocks. :func:`resolve_target` is the one place a name
becomes a layer's LoRA; attaching, merging and the PEFT writer / reader all use it.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
HF_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")  # in an MoE model: every expert too
# multi-head latent attention's (DeepSeek-V3): the down- and up-projections of its q and kv latents
LATENT_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
MTP_PROJECTIONS = ("eh_proj",)  # multi-token prediction's projection of [embedding, hidden]
# Gated DeltaNet's (Qwen3.5's names): q, k, v in one projection, the output gate z, the beta and decay inputs
DELTANET_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
INDEXER_PROJECTIONS = ("wq_b", "wk", "weights_proj")  # DeepSeek-V3.2's lightning indexer's
# DeepSeek-V4's compressed sparse attention's (transformers' module names): the one shared KV head's
# projection, and the two halves of the grouped low-rank output projection
COMPRESSED_ATTENTION_PROJECTIONS = ("kv_proj", "o_a_proj", "o_b_proj")
PROJECTION_NAMES = (
    *HF_PROJECTIONS,
    *LATENT_PROJECTIONS,
    *FUSED_PROJECTIONS,
    *MTP_PROJECTIONS,
    *DELTANET_PROJECTIONS,
    *INDEXER_PROJECTIONS,
    *COMPRESSED_ATTENTION_PROJECTIONS,
)
ALL_PROJECTIONS = "all-linear"  # PEFT's shorthand: every attention and MLP projection


@dataclass(frozen=True)
class LoRAConfig:
    """Rank ``rank``, scaling ``alpha / rank``, input dropout ``dropout``, and the projection names to adapt
    (``target_modules``: names from :data:`PROJECTION_NAMES`, or ``"all-linear"``)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __post_init__(self) -> None:
        targets = self.target_modules
        if isinstance(targets, str):
            targets = HF_PROJECTIONS if targets == ALL_PROJECTIONS else (targets,)
        object.__setattr__(self, "target_modules", tuple(targets))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be positive, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules:
            raise ValueError(f"LoRA target_modules is empty; choose from {', '.join(PROJECTION_NAMES)}")
        for name in self.target_modules:
            if name not in PROJECTION_NAMES:
                close = difflib.get_close_matches(str(name), PROJECTION_NAMES, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"LoRA target_modules: {name!r} is not a projection name ({', '.join(PROJECTION_NAMES)} "
                    f"or {ALL_PROJECTIONS!r}){hint}"
                )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class LoRATarget:
    """What a LoRA does on one layer: which of its output blocks (``parts``) get a delta (``selected``), and
    whether those share one ``A`` (a LoRA on the fused matrix) or each has its own. A single part on a
    layer of several blocks is one LoRA over all of them."""

    parts: tuple[str, ...]
    selected: tuple[bool, ...]
    shared: bool

    @property
    def groups(self) -> int:
        """Number of independent (A, B) pairs."""
        return 1 if self.shared else sum(self.selected)

    @property
    def selected_parts(self) -> tuple[str, ...]:
        return tuple(p for p, s in zip(self.parts, self.selected) if s)


def resolve_target(leaf: str, num_blocks: int, targets: Sequence[str]) -> Optional[LoRATarget]:
    """The LoRA a layer named ``leaf`` with ``num_blocks`` fused output blocks gets from ``targets``
    (None: not adapted). Shared by ``attach_lora`` and the PEFT writer/reader, so both agree."""
    parts = FUSED_PROJECTIONS.get(leaf)
    if parts is not None and num_blocks == len(parts):
        named = tuple(p in targets for p in parts)
        if leaf in targets:
            if any(named):
                both = [p for p, n in zip(parts, named) if n]
                raise ValueError(
                    f"LoRA target_modules names both the fused {leaf!r} and its parts {both}; name either the "
                    f"fused projection (one LoRA on the whole matrix) or its parts (one LoRA each)"
                )
            return LoRATarget(parts, (True,) * len(parts), shared=True)
        return LoRATarget(parts, named, shared=False) if any(named) else None
    if leaf in targets or any(leaf in FUSED_PROJECTIONS.get(t, ()) for t in targets):
        return LoRATarget((leaf,), (True,), shared=True)
    return None
