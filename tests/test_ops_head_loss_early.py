"""The fused head loss on one shard on CPU sums its gradients in the forward (megacann/ops/head_loss.py,
``_EarlyGrads``), so the backward recomputes no logits: equal to the float64 unfused loss's gradients
(fp32, relative 1e-5) for a mean over the counted tokens, with ignored tokens and vocabulary padding; a
``grad_loss`` that varies over tokens takes the recomputing path (still exact) and turns the early sums off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megacann import ops
from megacann.ops import head_loss

VOCAB, PADDED, HIDDEN, CHUNK = 37, 40, 16, 4


@pytest.fixture
def counted(monkeypatch):
    """Counts of the head's logits products (``_chunk_logits`` in head_loss), of early chunk sums and, per
    product, whether it had to allocate its chunk buffer (``fresh``); early sums on."""
    calls = {"logits": 0, "early": 0}
    fresh = calls["fresh"] = []
    chunk_logits, add = head_loss._chunk_logits, head_loss._EarlyGrads.add

    def counting_logits(h, weight, buffer):
        calls["logits"] += 1
        fresh.append(buffer is None)
        return chunk_logits(h, weight, buffer)

    def counting_add(self, *args):
        calls["early"] += 1
        return add(self, *args)

    monkeypatch.setattr(head_loss, "_chunk_logits", counting_logits)
    monkeypatch.setattr(head_loss._EarlyGrads, "add", counting_add)
    monkeypatch.setattr(head_loss, "_EARLY_MISSED", [False])
    return calls


def _inputs():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 9, HIDDEN, generator=g, requires_grad=True)
    weight = torch.randn(PADDED, HIDDEN, generator=g, requires_grad=True)
    target = torch.randint(0, VOCAB, (2, 9), generator=g)
    target[0, :3] = target[1, 5] = -100
    return hidden, weight, target


def _reference(hidden, weight, target, grad_loss):
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logits = (h64 @ w64[:VOCAB].t()).view(-1, VOCAB)
    loss = F.cross_entropy(logits, target.view(-1), reduction="none", ignore_index=-100)
    loss.backward(grad_loss.view(-1).double())
    w_grad = torch.cat([w64.grad[:VOCAB], torch.zeros(PADDED - VOCAB, HIDDEN, dtype=torch.float64)])
    return loss.view(target.shape), h64.grad, w_grad


def _run(grad_loss):
    hidden, weight, target = _inputs()
    loss = ops.vocab_parallel_head_loss(hidden, weight, target, vocab_size=VOCAB, chunk_size=CHUNK)
    loss.backward(grad_loss)
    ref_loss, ref_h, ref_w = _reference(hidden, weight, target, grad_loss)
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad.double(), ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad.double(), ref_w, rtol=1e-5, atol=1e-6)


def test_a_mean_over_tokens_takes_the_early_gradients(counted):
    target = _inputs()[2]
    grad_loss = (target != -100).float() / (target != -100).sum()  # what a token mean hands back
    grad_loss[0, 0] = 5.0  # an ignored token's gradient changes nothing
    _run(grad_loss)
    chunks = -(-target.numel() // CHUNK)
    fresh = counted.pop("fresh")
    assert counted == {"logits": chunks, "early": chunks}  # the backward recomputed no logits
    assert fresh == [True] + [False] * (chunks - 1)  # every chunk's logits written into the first one's buffer
    assert head_loss._EARLY_MISSED == [False]


def test_a_varying_grad_loss_recomputes_and_turns_the_early_sums_off(counted):
    grad_loss = torch.rand(2, 9, generator=torch.Generator().manual_seed(4))
    _run(grad_loss)
    chunks = -(-18 // CHUNK)
    fresh = counted.pop("fresh")
    assert counted == {"logits": 2 * chunks, "early": chunks} and head_loss._EARLY_MISSED == [True]
    # one buffer per pass (forward, recomputing backward), reused by all of that pass's chunks
    assert fresh == 2 * ([True] + [False] * (chunks - 1))
    _run(grad_loss)  # from now on no early sums
    assert counted == {"logits": 4 * chunks, "early": chunks}
