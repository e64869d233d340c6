"""Memory formulas of a Gated DeltaNet layer (:class:`megacann.layers.GatedDeltaNet`; a family whose
``DecoderArch.linear_attention_layers`` marks it, reading its ``linear_num_key_heads`` (H_k),
``linear_num_value_heads`` (H_v), ``linear_key_head_dim`` (d_k), ``linear_value_head_dim`` (d_v) and
``linear_conv_kernel_dim`` (K) keys).

**Parameters** on one TP rank (t = TP size, h hidden, c = 2 H_k d_k + H_v d_v the q | k | v channels):
the column-parallel projections h (c + H_v d_v + 2 H_v) / t (q | k | v, z, b, a), the depthwise
convolution c K / t, ``dt_bias`` and ``A_log`` 2 H_v / t, the output projection H_v d_v h / t and the
per-head norm d_v, whole on every rank.

**Activations** for one micro-batch of b sequences of s tokens (T = b s; per rank H_k, H_v and c are
divided by t; a = bytes of the weights' dtype, 4 where it says fp32), what autograd saves with the
chunked op (``megacann.ops.gated_delta_rule`` ``chunked``, chunks of C = 64 tokens), beside the
in-projection's input (a layer's "projection inputs"):

- the convolution: its output before SiLU (a c per token), its input padded on the left with K - 1 zeros
  (a b (s + K - 1) c), and its output after SiLU (a c per token in fp32 training; with low-precision
  weights the fp32 copies of q and k the L2 norms read instead, 4 x 2 H_k d_k);
- gates and norms: the q and k L2 norms' 1/norm (2 H_k, fp32), the decay's input and softplus (2 H_v,
  fp32), beta (a H_v); the op's output, the gated norm's input, 1/rms, output and silu(z) (4 H_v d_v +
  H_v, fp32), the output projection's input (a H_v d_v); two H_v-wide fp32 copies of ``A_log``;
- the chunked op, all fp32, per value head and row of the P = ceil(s / C) C padded tokens (N = b H_v
  lanes, k = P / C chunks): five C-wide rows of the chunks' C x C matrices (the decays, the triangular
  system, q kᵀ and k kᵀ products), 10 d_k + 2 d_v + 3 for the scaled, decayed and copied queries and keys,
  the solved values and keys and each chunk's corrections, less 2 C d_k per lane and head (the first
  chunk reads no state; the last chunk's state update, which no output needs, is freed with its copy of
  the keys), plus per chunk the state entering it and its decay (d_k d_v + 1), and one C x C bool mask;
  the op's own copies of v and beta (d_v + 1 per padded token) when s is not a multiple of C or the
  weights are not fp32.

Selective recompute leaves these as they are (it reruns only softmax attention's core). With the
defaults ``precision.fp32_ops: [rms_norm]`` and every fused op, the layer's other norms save fp32
copies besides (3% more than this count on the tiny bf16 model of tests/test_planner_gated_deltanet.py).

Not counted: what flash-linear-attention's CUDA kernels save instead of the chunked op's tensors, the
reference op (``precision.fused_ops`` without ``gated_delta_rule``: it saves the state at every token),
packed documents (one lane with each document padded to whole chunks), context parallelism's widened
values and handed states.
"""

from __future__ import annotations

import math

from megacann.config import ModelConfig
from megacann.ops.gated_delta import CHUNK

FP32 = 4  # bytes: the op, the gates and the norms compute in fp32 whatever the weights' dtype


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
    if padded > seq or a != FP32:  # the op's own copies of v and beta (padded, or cast to fp32)
        op += lanes * padded * (dv + 1)
    # the convolution's output after SiLU: read as it is in fp32, else through fp32 copies of q and k
    convolved = c * a if a == FP32 else FP32 * 2 * key_heads * dk
    gates = FP32 * (2 * key_heads + 2 * value_heads) + a * value_heads  # 1/norm of q, k; the decay; beta
    norm = FP32 * (4 * value_heads * dv + value_heads) + a * value_heads * dv  # out_proj's input in a
    return {
        "delta rule: convolution": tokens * (a * c + convolved) + a * c * batch * (seq + m.linear_conv_kernel_dim - 1),
        "delta rule: gates and norms": tokens * (gates + norm) + 2 * FP32 * value_heads,
        "delta rule: chunked op": FP32 * op + chunk * chunk,
    }
