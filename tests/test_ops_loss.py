"""The per-token cross entropy op and the fused output-head loss against the unfused path
(``F.linear`` then ``megacann.layers.vocab_parallel_cross_entropy``), at TP 1 and TP 2 (gloo).

Tolerances: fp32 relative 1e-5 for losses and gradients (TP 2: also against one process); bf16 relative
1e-2 (the fused path rounds each chunk's weight-gradient product to bf16 and sums the chunks in fp32; the
unfused path rounds one big product).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import run_on_ranks
from layers_reference import rel_err

from megacann import ops
from megacann.layers import vocab_parallel_cross_entropy
from megacann.ops import cpp, head_loss

HIDDEN, VOCAB, PADDED, TOKENS = 24, 37, 40, (3, 9)  # 27 tokens; vocabulary padded from 37 to 40 rows
KERNELS = {"torch": head_loss.TORCH_KERNELS}
if cpp.available():
    KERNELS["cpp"] = cpp.CPP_KERNELS


def make_problem(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*TOKENS, HIDDEN, generator=g)
    weight = torch.randn(PADDED, HIDDEN, generator=g) * 0.3
    target = torch.randint(0, VOCAB, TOKENS, generator=g)
    target[0, :4] = -100
    target[2, -1] = -100
    target[1, 2] = VOCAB - 1  # the last real token (in the last shard at TP 2)
    return hidden.to(dtype), weight.to(dtype), target


def unfused(hidden, weight, target, vocab_size, group=None):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(F.linear(h, w), target, vocab_size=vocab_size, group=group)
    return loss, h, w


def fused(hidden, weight, target, vocab_size, kernels, chunk_size, group=None):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = head_loss.head_loss(h, w, target, vocab_size=vocab_size, group=group, chunk_size=chunk_size, kernels=kernels)
    return loss, h, w


def test_cross_entropy_op_equals_the_vocab_parallel_loss():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 7, 50, generator=g) * 2
    target = torch.randint(0, 50, (4, 7), generator=g)
    target[1, 3] = -100
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        loss = ops.cross_entropy(x, target)
        assert loss.dtype == torch.float32 and loss.shape == target.shape and loss[1, 3] == 0
        assert rel_err(loss, vocab_parallel_cross_entropy(x, target)) < 1e-6


@pytest.mark.parametrize("kernels", list(KERNELS))
@pytest.mark.parametrize("vocab_size", [VOCAB, None], ids=["padded", "unpadded"])
@pytest.mark.parametrize("chunk_size", [7, 1024], ids=["chunks-of-7", "one-chunk"])
def test_head_loss_equals_unfused_fp32(kernels, vocab_size, chunk_size):
    hidden, weight, target = make_problem()
    ref, ref_h, ref_w = unfused(hidden, weight, target, vocab_size)
    loss, h, w = fused(hidden, weight, target, vocab_size, KERNELS[kernels], chunk_size)
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    assert torch.all(loss[target == -100] == 0) and torch.all(loss[target != -100] > 0)
    assert rel_err(loss, ref) < 1e-6
    g = torch.rand(TOKENS, generator=torch.Generator().manual_seed(2))
    loss.backward(g)
    ref.backward(g)
    assert rel_err(h.grad, ref_h.grad) < 1e-5 and rel_err(w.grad, ref_w.grad) < 1e-5
    if vocab_size is not None:
        assert torch.all(w.grad[vocab_size:] == 0)  # padding rows take no gradient


@pytest.mark.parametrize("kernels", list(KERNELS))
def test_head_loss_equals_unfused_bf16(kernels):
    hidden, weight, target = make_problem(torch.bfloat16)
    ref, ref_h, ref_w = unfused(hidden, weight, target, VOCAB)
    loss, h, w = fused(hidden, weight, target, VOCAB, KERNELS[kernels], chunk_size=8)
    assert loss.dtype == torch.float32 and rel_err(loss, ref) < 1e-2
    loss.sum().backward()
    ref.sum().backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    assert rel_err(h.grad, ref_h.grad) < 1e-2 and rel_err(w.grad, ref_w.grad) < 1e-2


def test_head_loss_never_saves_logits_and_checks_its_arguments():
    hidden, weight, target = make_problem()
    saved: list[torch.Size] = []

    def pack(t):
        saved.append(t.shape)
        return t

    h = hidden.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ops.vocab_parallel_head_loss(h, weight.requires_grad_(), target, vocab_size=VOCAB, chunk_size=5)
    tokens = target.numel()
    assert saved and all(s.numel() <= max(h.numel(), weight.numel()) for s in saved), saved
    assert not any(s[-1] in (PADDED, VOCAB) and s.numel() >= tokens * VOCAB for s in saved)
    with pytest.raises(ValueError, match="vocab_size 41 exceeds the 40 head rows"):
        ops.vocab_parallel_head_loss(hidden, weight, target, vocab_size=41)
    with pytest.raises(ValueError, match="do not fit"):
        ops.vocab_parallel_head_loss(hidden, weight[:, :-1], target)
    with pytest.raises(ValueError, match="chunk_size must be a positive"):
        ops.vocab_parallel_head_loss(hidden, weight, target, chunk_size=0)


def tp2_head_loss_check(kernel_names):
    """On each of 2 ranks (one TP group): fused == unfused for this rank's vocabulary shard, both equal
    the one-process full-vocabulary loss, and the shard gradients reassemble the full ones."""
    from megacann.ops import cpp as cpp_ops
    from megacann.ops import head_loss as hl

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    hidden, weight, target = make_problem(seed=3)
    rows = PADDED // world
    shard = weight[rank * rows : (rank + 1) * rows]
    g = torch.rand(TOKENS, generator=torch.Generator().manual_seed(4))
    full, full_h, full_w = unfused(hidden, weight, target, VOCAB)
    full.backward(g)
    ref, ref_h, ref_w = unfused(hidden, shard, target, VOCAB, group)
    ref.backward(g)
    calls = {"all_reduce": 0}
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls["all_reduce"] += 1
        return original(*args, **kwargs)

    results = {}
    for name in kernel_names:
        kernels = {"torch": hl.TORCH_KERNELS, "cpp": getattr(cpp_ops, "CPP_KERNELS", None)}[name]
        dist.all_reduce, calls["all_reduce"] = counting, 0
        try:
            loss, h, w = fused(hidden, shard, target, VOCAB, kernels, chunk_size=6, group=group)
        finally:
            dist.all_reduce = original
        loss.backward(g)
        grad_h = h.grad.clone()
        dist.all_reduce(grad_h, group=group)  # what copy_to_tensor_model_parallel_region does
        results[name] = dict(
            shard_rows=w.shape[0],
            all_reduces=calls["all_reduce"],
            vs_unfused=max(rel_err(loss, ref), rel_err(h.grad, ref_h.grad), rel_err(w.grad, ref_w.grad)),
            vs_one_process=max(
                rel_err(loss, full),
                rel_err(grad_h, full_h.grad),
                rel_err(w.grad, full_w.grad[rank * rows : (rank + 1) * rows]),
            ),
            padding_grad=float(w.grad[max(0, VOCAB - rank * rows) :].abs().sum()),
        )
    return results


def test_head_loss_tp2_equals_unfused_and_one_process():
    names = list(KERNELS)
    for rank_results in run_on_ranks(tp2_head_loss_check, world_size=2, args=(names,), timeout=180):
        for name in names:
            r = rank_results[name]
            assert r["shard_rows"] == PADDED // 2  # each rank really held half the head
            assert r["all_reduces"] == 2  # the shards were combined (max, then sums), once per batch
            assert r["vs_unfused"] < 1e-5 and r["vs_one_process"] < 1e-5, (name, r)
            assert r["padding_grad"] == 0.0
