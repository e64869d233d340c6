"""Memory formulas of a Gated DeltaNet layer (:class:`megacann.layers.GatedDeltaNet`; a family whose
``DecoderArch.linear_attention_layers`` marks it, reading its ``linear_num_key_heads`` (H_k),
``linear_num_value_heads`` (H_v), ``linear_key_head_dim`` (d_k), ``linear_value_head_dim`` (d_v) and
``linear_conv_kernel_dim`` (K) keys).

**Parameters** on one TP rank (t = TP size, h hidden, c = 2 H_k d_k + H_v d_v the q | k | v channels):
the column-parallel projections h (c + H_v d_v + 2 H_v) / t (q | k | v, z, b, a), the depthwise
convolution c K / t, ``dt_bias`` and ``A_log`` 2 H_v / t, the output projection H_v d_v h / t and the
per-head norm d_v, whole on every rank.

**Activations** for one micro-batch of b sequences of s tokens (T = b s; per rank H_k, H_v and c are
divided by t; a = bytes of the weights' dtype), what autograd saves in fp32 training with the chunked op
(``megacann.ops.gated_delta_rule`` ``chunked``, chunks of C = 64 tokens), beside the in-projection's
input (a layer's "projection inputs"):

- the convolution: its output before and after SiLU (2c per token) and its input padded on the left
  with K - 1 zeros (b (s + K - 1) c);
- gates and norms: the q and k L2 norms' 1/norm (2 H_k), the decay's and beta's inputs and outputs
  (3 H_v), the op's output, the gated norm's input, 1/rms, output, silu(z) and the output projection's
  input (5 H_v d_v + H_v), and two H_v-wide copies of ``A_log``;
- the chunked op, in fp32 whatever the weights' dtype, per value head and row of the P = ceil(s / C) C
  padded tokens (N = b H_v lanes, k = P / C chunks): five C-wide rows of the chunks' C x C matrices (the
  decays, the triangular system, q kᵀ and k kᵀ products), 10 d_k + 2 d_v + 3 for the scaled, decayed and
  copied queries and keys, the solved values and keys and each chunk's corrections, less 2 C d_k per
  lane and head (the first chunk reads no state; the last chunk's state update, which no output needs,
  is freed with its copy of the keys), plus per chunk the state entering it and its decay (d_k d_v + 1),
  and one C x C bool mask; when s is not a multiple of C the padded values and betas (d_v + 1 per padded
  token) too.

Not counted: flash-linear-attention's kernels on CUDA (they save less: their own chunk states), the
reference op (``precision.fused_ops`` without ``gated_delta_rule``: it saves the state at every token),
packed documents (one lane with each document padded to whole chunks), context parallelism's widened
values and handed states, and the extra fp32 copies of low-precision inputs (measured in fp32 only).
"""

from __future__ import annotations

import math

from megacann.config import ModelConfig
from megacann.ops.gated_delta import CHUNK


def channels(m: ModelConfig) -> int:
    """q | k | v channels of the in-projection and convolution (all TP ranks)."""
    return 2 * m.linear_num_key_heads * m.linear_key_head_dim + m.linear_num_value_heads * m.linear_value_head_dim


def gated_deltanet_parameters_per_rank(m: ModelConfig, tp: int) -> int:
    """One Gated DeltaNet's parameters on one TP rank (see the module docstring)."""
    h, heads, values = m.hidden_size, m.linear_num_value_heads, m.linear_num_value_heads * m.linear_value_head_dim
    c = channels(m)
    projections = h * (c + values + 2 * heads) // tp + values // tp * h
    return projections + c // tp * m.linear_conv_kernel_dim + 2 * heads // tp + m.linear_value_head_dim


def gated_deltanet_activation_terms(
    m: ModelConfig, batch: int, seq: int, a: int, tp: int, chunk: int = CHUNK
) -> dict[str, float]:
    """Bytes one Gated DeltaNet saves for a micro-batch of ``batch`` sequences of ``seq`` tokens on one TP
    rank, beside its in-projection's input (see the module docstring)."""
    key_heads, value_heads = m.linear_num_key_heads // tp, m.linear_num_value_heads // tp
    dk, dv, c = m.linear_key_head_dim, m.linear_value_head_dim, channels(m) // tp
    tokens = batch * seq
    padded = math.ceil(seq / chunk) * chunk
    lanes, chunks = batch * value_heads, padded // chunk
    op = lanes * padded * (5 * chunk + 10 * dk + 2 * dv + 3) - 2 * lanes * chunk * dk
    op += lanes * chunks * (dk * dv + 1)
    if padded > seq:
        op += lanes * padded * (dv + 1)
    return {
        "delta rule: convolution": a * c * (2 * tokens + batch * (seq + m.linear_conv_kernel_dim - 1)),
        "delta rule: gates and norms": a * (tokens * (2 * key_heads + 4 * value_heads + 5 * value_heads * dv))
        + 2 * 4 * value_heads,
        "delta rule: chunked op": 4 * op + chunk * chunk,
    }
