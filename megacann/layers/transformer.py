"""A pre-norm transformer block: ``h += drop(attn(norm(h)))``, then ``h += drop(mlp(norm(h)))``.

Submodule names follow Hugging Face LLaMA, so a checkpoint maps by name::

    input_layernorm.weight           (LayerNorm: also .bias)
    self_attn.q_proj / k_proj / v_proj / o_proj .weight (.bias)   or self_attn.qkv_proj (fused_qkv)
    self_attn.q_norm / k_norm .weight                             (qk_norm: per-head RMSNorm, Qwen3)
    post_attention_layernorm.weight  (LayerNorm: also .bias)
    mlp.gate_up_proj / down_proj .weight (swiglu, fused_gate_up)  or mlp.gate_proj / up_proj / down_proj
    mlp.up_proj / down_proj .weight (.bias)                       (gelu, gelu_tanh)

GPT-2 maps as ``ln_1 → input_layernorm``, ``attn.c_attn → self_attn.qkv_proj`` (transposed),
``attn.c_proj → self_attn.o_proj``, ``ln_2 → post_attention_layernorm``, ``mlp.c_fc → mlp.up_proj``,
``mlp.c_proj → mlp.down_proj`` (Conv1D weights are stored transposed).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.layers import mappings
from megacann.layers.attention import SelfAttention
from megacann.layers.context import (
    current_layer_context,
    with_context_defaults,
)
from megacann.layers.context_parallel import CONTEXT_PARALLEL_ALGORITHMS, context_parallel_position_ids
from megacann.layers.eager_regions import arm_eager_regions
from megacann.layers.init import init_normal
from megacann.layers.mlp import GeluMLP, SwiGLUMLP
from megacann.layers.norm import LayerNorm, RMSNorm
from megacann.layers.random import checkpoint, dropout
from megacann.layers.rotary import RotaryEmbedding

_CHOICES = {
    "normalization": ("rmsnorm", "layernorm"),
    "activation": ("swiglu", "gelu", "gelu_tanh"),
    "position_embedding": ("rope", "none"),
    "recompute": (None, "none", "selective", "full"),
    "context_parallel_algo": (None, *CONTEXT_PARALLEL_ALGORITHMS),
}


@dataclass
class TransformerBlockConfig:
    """Shape and options of one block. ``output_layer_init_std`` is the std of the projections that feed
    the residual (``o_proj``, ``down_proj``); Megatron uses ``init_method_std / sqrt(2 * num_layers)``.
    ``recompute``: ``selective`` recomputes the core attention in backward, ``full`` the whole block.
    ``add_qkv_bias`` gives q, k, v biases apart from the other projections (Qwen2: only those);
    ``qk_norm`` normalises every query and key head with an RMSNorm (``norm_eps``) before RoPE (Qwen3).
    ``context_parallel_algo`` is how attention crosses the context-parallel group when it has more than
    one rank (``ring``, ``allgather``, ``ulysses``).

    Settings left None (``sequence_parallel``, ``init_method_std``, ``output_layer_init_std``,
    ``recompute``, ``context_parallel_algo``, ``params_dtype``) come from the current
    :class:`~megacann.layers.context.LayerContext` when the block is built; ``block.config`` holds the
    values it was built with. An ``output_layer_init_std`` left None follows an explicit
    ``init_method_std``."""

    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    normalization: str = "rmsnorm"
    norm_eps: float = 1e-6
    activation: str = "swiglu"
    add_bias_linear: bool = False
    add_qkv_bias: Optional[bool] = None  # None: add_bias_linear (True for Qwen2-style q/k/v bias only)
    qk_norm: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    sequence_parallel: Optional[bool] = None
    init_method_std: Optional[float] = None
    output_layer_init_std: Optional[float] = None
    position_embedding: str = "rope"
    rotary_theta: float = 10000.0
    rotary_scaling: Optional[dict[str, Any]] = field(default=None)
    rotary_interleaved: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = True
    softmax_scale: Optional[float] = None
    sliding_window: Optional[int] = None  # each query sees its last W keys (Mistral); None: all earlier ones
    attention_sinks: bool = False  # a learned softmax sink logit per head (gpt-oss; SelfAttention's sinks)
    attention_output_gate: bool = False  # output * sigmoid(gate from q_proj) (Qwen3.5; SelfAttention's output_gate)
    recompute: Optional[str] = None
    context_parallel_algo: Optional[str] = None
    params_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        for key, allowed in _CHOICES.items():
            value = getattr(self, key)
            if value not in allowed:
                close = difflib.get_close_matches(str(value), [a for a in allowed if a is not None], n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                choices = tuple(a for a in allowed if a is not None)
                raise ValueError(f"TransformerBlockConfig.{key}={value!r} is not one of {choices}{hint}")
        for key in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"TransformerBlockConfig.{key} must be in [0, 1), got {getattr(self, key)}")

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


def _with_context(config: TransformerBlockConfig) -> TransformerBlockConfig:
    """``config`` with the settings it leaves None taken from the current layer context."""
    ctx = current_layer_context()
    return with_context_defaults(
        config,
        recompute=config.recompute or ctx.recompute,
        context_parallel_algo=config.context_parallel_algo or ctx.context_parallel_algo,
    )


class TransformerBlock(torch.nn.Module):
    """``forward(hidden [b, s_local, h], rotary=None, segment_ids=None) -> [b, s_local, h]``.

    ``rotary`` is ``(cos, sin)`` for the whole sequence (compute once per model with
    :class:`RotaryEmbedding` and share across blocks), or position ids ``[b, s]``, or None (positions
    ``0..s-1``; ignored when ``position_embedding="none"``). ``segment_ids`` ``[b, s]`` separates packed
    documents. Under sequence parallelism ``hidden`` is this rank's sequence shard, ``s_local = s / tp``.
    Under context parallelism ``s`` is this cp rank's share of the sequence and the tables, position ids
    and ``segment_ids`` cover that share (None: the share's global positions).

    ``mlp`` replaces the dense feed-forward block the config describes (e.g. a
    :class:`~megacann.layers.moe.MoELayer`): any module mapping ``[b, s_local, h]`` to the same shape.
    ``attention`` likewise replaces the config's :class:`SelfAttention` (e.g. a
    :class:`~megacann.layers.LatentAttention`): called as ``attention(hidden, (cos, sin), segment_ids)``,
    with the rotary tables of width ``config.attention_head_dim``.
    """

    def __init__(
        self,
        config: TransformerBlockConfig,
        group: Optional[dist.ProcessGroup] = None,
        device: Optional[Union[torch.device, str]] = None,
        mlp: Optional[torch.nn.Module] = None,
        attention: Optional[torch.nn.Module] = None,
    ):
        super().__init__()
        self.config = c = _with_context(config)
        self.group = group
        init, out_init = init_normal(c.init_method_std), init_normal(c.output_layer_init_std)
        common = dict(sequence_parallel=c.sequence_parallel, dtype=c.params_dtype, device=device)
        self.input_layernorm = self._norm(common)
        # a given attention module is taken as is (the SelfAttention settings below are then unused)
        make_attention = SelfAttention if attention is None else lambda *args, **kwargs: attention
        self.self_attn = make_attention(
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            head_dim=c.head_dim,
            qkv_bias=c.add_bias_linear if c.add_qkv_bias is None else c.add_qkv_bias,
            output_bias=c.add_bias_linear,
            attention_dropout=c.attention_dropout,
            fused_qkv=c.fused_qkv,
            rotary_interleaved=c.rotary_interleaved,
            softmax_scale=c.softmax_scale,
            sliding_window=c.sliding_window,
            recompute_core_attention=c.recompute == "selective",
            context_parallel_algo=c.context_parallel_algo,
            init_method=init,
            output_init_method=out_init,
            group=group,
            qk_norm=c.qk_norm,
            sinks=c.attention_sinks,
            output_gate=c.attention_output_gate,
            qk_norm_eps=c.norm_eps,
            **common,
        )
        self.post_attention_layernorm = self._norm(common)
        dense = dict(bias=c.add_bias_linear, init_method=init, output_init_method=out_init, group=group, **common)
        if mlp is not None:
            self.mlp = mlp
        elif c.activation == "swiglu":
            self.mlp = SwiGLUMLP(c.hidden_size, c.ffn_hidden_size, fused_gate_up=c.fused_gate_up, **dense)
        else:
            approximate = "tanh" if c.activation == "gelu_tanh" else "none"
            self.mlp = GeluMLP(c.hidden_size, c.ffn_hidden_size, approximate=approximate, **dense)
        self.rotary = None
        if c.position_embedding == "rope":
            self.rotary = RotaryEmbedding(c.attention_head_dim, c.rotary_theta, c.rotary_scaling, c.rotary_interleaved)

    def _norm(self, common: dict) -> torch.nn.Module:
        c = self.config
        if c.normalization == "rmsnorm":
            return RMSNorm(c.hidden_size, c.norm_eps, **common)
        return LayerNorm(c.hidden_size, c.norm_eps, bias=True, **common)

    def _tables(self, hidden: torch.Tensor, rotary: Any) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        if self.rotary is None:
            return None
        if isinstance(rotary, (tuple, list)):
            return rotary[0], rotary[1]
        if rotary is None:
            seq = hidden.shape[1] * (mappings.tp_world_size(self.group) if self.config.sequence_parallel else 1)
            rotary = context_parallel_position_ids(seq * ps.get_context_parallel_world_size(), device=hidden.device)
        return self.rotary(rotary, dtype=hidden.dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: Union[tuple[torch.Tensor, torch.Tensor], torch.Tensor, None] = None,
        segment_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        tables = self._tables(hidden, rotary)
        cos, sin = tables if tables is not None else (None, None)
        if self.config.recompute == "full" and self.training:
            return checkpoint(self._forward, hidden, cos, sin, segment_ids)
        return self._forward(hidden, cos, sin, segment_ids)

    def compile_forward(self, **compile_kwargs: Any) -> None:
        """Run the block's computation under ``torch.compile(**compile_kwargs)`` from now on (norms, RoPE,
        SwiGLU and residual adds fused into generated kernels). The activation-checkpoint wrapper of
        ``recompute="full"`` stays outside the compiled region: backward recomputes the compiled forward.
        See :func:`megacann.layers.compile_blocks`."""
        arm_eager_regions()  # the MoE dispatch and overlapped collectives stay eager (graph breaks)
        self._forward = torch.compile(type(self)._forward.__get__(self), **compile_kwargs)

    def _forward(
        self,
        hidden: torch.Tensor,
        cos: Optional[torch.Tensor],
        sin: Optional[torch.Tensor],
        segment_ids: Optional[torch.Tensor],
    ) -> torch.Tensor:
        c = self.config
        rotary = (cos, sin) if cos is not None else None
        attn = self.self_attn(self.input_layernorm(hidden), rotary, segment_ids)
        hidden = hidden + dropout(attn, c.hidden_dropout, self.training, c.sequence_parallel)
        out = self.mlp(self.post_attention_layernorm(hidden))
        return hidden + dropout(out, c.hidden_dropout, self.training, c.sequence_parallel)
