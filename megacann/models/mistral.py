"""Mistral: LLaMA's decoder (RMSNorm, rotary positions, SwiGLU, grouped-query attention) with a head width
of its own (``head_dim``, which may differ from ``hidden_size / num_attention_heads``) and sliding-window
attention: with ``sliding_window`` W each query sees its last W keys, itself included (Hugging Face's
``MistralForCausalLM``: key ``j`` is seen from query ``i`` when ``i - W < j <= i``); None: every earlier
key. The window runs on every attention path (the reference and each device's kernel, and each
context-parallel algorithm); see docs/ops.md and docs/context_parallel.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Optional

from megacann.config import ConfigError, MegacannConfig, ModelConfig
from megacann.layers import TransformerBlockConfig
from megacann.models import sizing
from megacann.models.decode_cache import KeysValues, LayerCache
from megacann.models.decoder import DecoderArch, block_config, decoder_model_spec
from megacann.models.hf_mistral import MISTRAL_HF
from megacann.models.llama import LlamaModel


@dataclass
class MistralModelConfig(ModelConfig):
    """The keys of ``model.type: mistral`` on top of those every decoder has."""

    HF_KEYS: ClassVar[dict[str, str]] = {
        **ModelConfig.HF_KEYS,
        "head_dim": "head_dim",
        "sliding_window": "sliding_window",
    }
    # sliding_window is a key of this family, read at any value
    HF_INERT_KEYS: ClassVar[dict[str, object]] = {
        k: v for k, v in ModelConfig.HF_INERT_KEYS.items() if k != "sliding_window"
    }

    type: str = "mistral"
    # width of one attention head; None: hidden_size / num_attention_heads
    head_dim: Optional[int] = field(default=None, metadata={"shape": True})
    # each query sees its last sliding_window keys (itself included); None: all earlier keys
    sliding_window: Optional[int] = field(default=None, metadata={"architecture": True})


def check_mistral_config(cfg: MegacannConfig, source: str) -> None:
    """``head_dim`` and ``sliding_window`` are positive integers (or unset)."""
    m = cfg.model
    for key, value in (("head_dim", m.head_dim), ("sliding_window", m.sliding_window)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{source}: model.{key} must be a positive integer or null, got {value!r}")


class MistralModel(LlamaModel):
    """A Mistral-family model: :class:`LlamaModel` whose blocks take the family's head width and window."""

    ARCH = DecoderArch(normalization="rmsnorm", activation="swiglu", position_embedding="rope")

    @staticmethod
    def make_block_config(cfg: ModelConfig, arch: DecoderArch) -> TransformerBlockConfig:
        return replace(block_config(cfg, arch), sliding_window=cfg.sliding_window)


def mistral_decode_cache(cfg: ModelConfig) -> list[LayerCache]:
    """Every layer caches keys and values, the last ``sliding_window`` of them when there is a window."""
    kind = KeysValues(cfg.kv_heads, sizing.attention_head_dim(cfg), cfg.num_attention_heads, cfg.sliding_window)
    return [kind] * cfg.num_layers


MISTRAL = replace(
    decoder_model_spec("mistral", MistralModel, check_config=check_mistral_config, hf=MISTRAL_HF),
    config_class=MistralModelConfig,
    decode_cache=mistral_decode_cache,
)
