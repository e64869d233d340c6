"""The ops' declarations: each op's name, signature and docstring, written once.

Each stub below becomes the public function of its op (``megacann.ops.rms_norm`` etc.): a function with
this signature that picks the implementation by the device type of its first argument and calls it with
every argument. The implementations (:mod:`~megacann.ops.reference`, :mod:`~megacann.ops.cpp`,
:mod:`~megacann.ops.npu`, :mod:`~megacann.ops.cuda`, :mod:`~megacann.ops.adamw`, :mod:`~megacann.ops.moe`,
:mod:`~megacann.ops.head_loss`) register under these names and are checked against these signatures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from megacann.constants import IGNORE_INDEX
from megacann.ops.registry import declare

DEFAULT_CHUNK_SIZE = 1024  # tokens per chunk of the fused head loss


@declare
def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    segment_ids: Optional[torch.Tensor] = None,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    sliding_window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention over ``[b, s, heads, d]`` tensors; ``k``/``v`` may have fewer heads than ``q`` (GQA/MQA:
    kv head ``j`` serves q heads ``j*g .. j*g+g-1``). ``segment_ids`` ``[b, s]`` restricts attention to
    equal ids (packed documents); ``attn_mask`` is boolean, True = attend; ``sliding_window`` W (causal
    only) lets each query see its last W keys, itself included. ``sinks`` ``[hq]`` (gpt-oss): one logit per
    query head joining every row's softmax as an extra column with no value (:mod:`megacann.ops.attention_sinks`);
    an implementation that cannot take it refuses it by name. Returns ``[b, s, hq, d]``."""


@declare
def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    attn_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of a decoding step: the new tokens' queries ``q`` ``[b, s, hq, d]`` (``s`` is 1 at every
    step of the generator) over a key/value cache ``k_cache``/``v_cache`` ``[b, slots, hkv, d]`` (GQA as
    for :func:`scaled_dot_product_attention`). ``attn_mask`` ``[b, 1, s, slots]`` bool, True = attend: the
    slots each query may read (its own row's tokens up to it, not padding, empty slots or keys out of its
    window; every query reads at least one); None: every slot. ``scale`` None: ``d ** -0.5``. ``sinks``
    ``[hq]``: one logit per query head joining each row's softmax (gpt-oss). Returns ``[b, s, hq, d]``
    (:mod:`megacann.ops.decode`)."""


Band = Optional[tuple[torch.Tensor, torch.Tensor, int]]  # (query positions, key positions, window)


@declare(fp32_result=True)
def attention_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    band: Band = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one block of queries over one block of keys, with the rows' log-sum-exp: the
    step of blockwise attention (context-parallel rings, packed documents). ``q`` ``[b, hq, sq, d]``,
    ``k``/``v`` ``[b, hkv, sk, d]`` (BHSD; GQA as above). ``causal`` (square blocks): key index <= query
    index. ``band`` (positions of the query rows ``[sq]``, of the keys ``[sk]``, window W): only keys
    ``0 <= query position - key position < W``. Returns the block-normalised output ``[b, hq, sq, d]`` and
    the log-sum-exp ``[b, hq, sq]`` of the scaled scores, both fp32 (fp64 for fp64 inputs); a row that sees
    no key has lse -inf and output 0."""


@declare(fp32_result=True)
def attention_block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    band: Band = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` (fp32, shapes of ``q, k, v``) of one :func:`attention_block` step, given
    the rows' final output ``out`` and log-sum-exp ``lse`` over every block and the output gradient
    ``dout`` (flash-attention's backward: ``delta = rowsum(dout * out)``, probabilities
    ``exp(scores - lse)``). Every row must see some key in some block (finite ``lse``)."""


@declare
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``weight`` ``[out, in]``). For a weight of a model chunk prepared for a
    split backward, its gradient waits for the W pass (:mod:`megacann.ops.weight_grad`). On CPUs without native bf16
    (fp16) GEMM, bf16 (fp16) products run as fp32 GEMMs (:mod:`megacann.ops.bf16_matmul`)."""


@declare
def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    recipe: str = "tensorwise",
    forward_format: str = "e4m3",
    grad_format: str = "e5m2",
    parallel: Optional[str] = None,
    group: Optional[dist.ProcessGroup] = None,
    amax_history: Optional[torch.Tensor] = None,
    token_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its three products on FP8 operands (:mod:`megacann.ops.fp8`):
    ``recipe`` tensorwise | rowwise | blockwise | mxfp8 (:mod:`megacann.ops.fp8_formats`), ``x`` and
    ``weight`` in ``forward_format``, the output gradient in ``grad_format``, fp32 accumulation, the result
    in ``x``'s dtype. ``parallel`` (``column`` | ``row`` | None) says which of the weight's dimensions is
    split over ``group``; a block spanning a split dimension has its amax reduced over the group.
    ``token_group``: the ranks holding the other tokens (rows) of ``x`` (context parallelism); a block
    spanning the tokens has its amax reduced over it.
    ``amax_history`` (tensorwise only): delayed scaling from a ``[1 + length, 3]`` buffer of the amax of ``x``,
    the weight and the output gradient: row 0 collects this step's (updated in place), rows 1.. hold earlier
    steps', whose maximum gives the scale (this use's own amax while they are all zero)."""


@declare
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation over the last dim, scaled by ``weight``: ``weight * x / sqrt(mean(x²) + eps)``."""


@declare
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[b, s, heads, d]`` by the angles whose cos/sin are given
    (``[b, s, d]`` or ``[s, d]``). ``interleaved=False`` (Hugging Face LLaMA, GPT-NeoX): dims ``i`` and
    ``i + d/2`` form a pair; ``interleaved=True`` (GPT-J, original RoPE): dims ``2i`` and ``2i+1`` do.
    The result has ``x``'s dtype."""


@declare
def swiglu(x: torch.Tensor, up: Optional[torch.Tensor] = None, *, overwrite_input: bool = False) -> torch.Tensor:
    """``silu(gate) * up``: with ``up`` given, ``x`` is the gate; otherwise ``x`` is a fused gate|up
    projection whose last dim holds the gate then the up half. ``overwrite_input``: the caller promises
    that nothing reads the fused ``x`` after this op, so the backward may write ``x``'s gradient over it
    (the CPU kernel does: one buffer of ``x``'s size less per call, which on Linux is often a freshly
    mapped, zero-filled one); results are the same either way."""


@declare(fp32_result=True)
def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token cross entropy in fp32 of ``logits`` ``[..., V]`` in any float dtype: shape of ``target``,
    0 where ``target == ignore_index``."""


@declare(fp32_result=True)
def vocab_parallel_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_size: Optional[int] = None,
    ignore_index: int = IGNORE_INDEX,
    group: Optional[dist.ProcessGroup] = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """Per-token fp32 loss of the output head ``hidden @ weight.T`` (``weight``: this TP rank's vocabulary
    shard) computed in chunks of ``chunk_size`` tokens, never holding the whole batch's logits. Equal to
    ``F.linear`` + :func:`megacann.layers.vocab_parallel_cross_entropy`; see :mod:`megacann.ops.head_loss`.
    In a split backward's B the weight's gradient waits for W (which reads the weight again), unless the
    weight is freed before W (ZeRO-3; :func:`megacann.ops.weight_grad.kept_until_w`)."""


@declare
def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """One AdamW update of flat fp32 buffers in place, as ``torch.optim.AdamW``; ``step`` counts from 1
    (this update's)."""


@declare
def moe_permute(tokens: torch.Tensor, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of ``tokens`` ``[T, h]`` sorted by expert (``expert_ids`` ``[T, k]``), and the map back
    (``[T*k]`` int32); see :mod:`megacann.ops.moe`."""


@declare
def moe_unpermute(
    permuted: torch.Tensor, row_id_map: torch.Tensor, probs: torch.Tensor, *, overwrite_input: bool = False
) -> torch.Tensor:
    """Each token's expert outputs, weighted by ``probs`` ``[T, k]`` and summed; inverse of
    :func:`moe_permute`. ``overwrite_input``: nothing reads ``permuted`` after this op, so the backward may
    write its gradient over it (the CPU kernel does); results are the same either way."""


def _check_groups(x: torch.Tensor, weights: Sequence[torch.Tensor], group_sizes: Sequence[int]) -> tuple:
    if len(weights) != len(group_sizes):
        raise ValueError(f"grouped_matmul: {len(weights)} weights but {len(group_sizes)} group sizes")
    if sum(group_sizes) != x.shape[0]:
        raise ValueError(f"grouped_matmul: group sizes add up to {sum(group_sizes)}, x has {x.shape[0]} rows")
    return x, list(weights), [int(n) for n in group_sizes]


@declare(prepare=_check_groups)
def grouped_matmul(x: torch.Tensor, weights: Sequence[torch.Tensor], group_sizes: Sequence[int]) -> torch.Tensor:
    """Consecutive row groups of ``x`` each multiplied by their own weight (``F.linear`` layout): the first
    ``group_sizes[0]`` rows times ``weights[0]ᵀ``, and so on. Implementations get lists (ints)."""


@declare
def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The gated delta rule (Gated DeltaNet's linear attention), per head with state ``S`` ``[dk, dv]``:
    ``S_t = exp(g_t)·(I - beta_t k_t k_tᵀ) S_{t-1} + beta_t k_t v_tᵀ``, output ``o_t = scale · S_tᵀ q_t``.
    ``q``/``k`` ``[b, s, h, dk]``, ``v`` ``[b, s, h, dv]``, ``g`` (log decay, <= 0) and ``beta`` ``[b, s, h]``;
    ``scale`` None: ``dk ** -0.5``. ``cu_seqlens`` (int ``[n+1]``, with ``b == 1``): packed sequences,
    each starting from its own state. ``initial_state`` ``[n, h, dk, dv]`` (n = b, or the number of packed
    sequences; None: zeros). Returns ``o`` (``v``'s shape and dtype) and, when ``output_final_state``, every
    sequence's last state ``[n, h, dk, dv]`` in fp32 (fp64 for fp64 inputs), else None."""
