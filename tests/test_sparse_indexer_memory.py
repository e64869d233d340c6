"""The lightning indexer's memory (DeepSeek-V3.2, CPU, fp32): its score product equals the product that
repeats every key for every query (scores and gradients within 1e-6, chosen keys exactly) while backward
keeps, of everything that grows with queries x keys, only the ReLU'd per-head scores; and with
``indexer_loss_coeff`` 0 a training step leaves no saved tensor of the indexer behind."""

from __future__ import annotations

import os
import runpy

import torch
import torch.nn.functional as F
from test_planner import SavedTensorTracker

from megacann.layers import LatentAttention
from megacann.layers.rotary import RotaryEmbedding
from megacann.layers.sparse_indexer import SparseIndexer

B, HIDDEN, LATENT, HEADS, WIDTH, ROPE, TOP_K = 2, 32, 16, 4, 16, 4, 5


def _indexer() -> SparseIndexer:
    torch.manual_seed(0)
    indexer = SparseIndexer(HIDDEN, LATENT, HEADS, WIDTH, ROPE, TOP_K)
    with torch.no_grad():  # sharp scores: many distinct values, few ReLU'd to 0
        for param in indexer.parameters():
            param.normal_(0.0, 0.5)
    return indexer


def _inputs(seq: int) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    generator = torch.Generator().manual_seed(seq)
    hidden = torch.randn(B, seq, HIDDEN, generator=generator, requires_grad=True)
    latent = torch.randn(B, seq, LATENT, generator=generator, requires_grad=True)
    return hidden, latent, RotaryEmbedding(ROPE, 10000.0)(torch.arange(seq))


def _repeated_key_scores(indexer: SparseIndexer, hidden, latent, tables) -> torch.Tensor:
    """The product as first written: every query's heads times the keys broadcast to that query."""
    b, s, _ = hidden.shape
    keys = indexer.keys(hidden, tables)
    q = indexer._rotate(indexer.wq_b(latent).view(b, s, HEADS, WIDTH), tables)
    per_head = F.relu(torch.matmul(q, keys.transpose(-1, -2).unsqueeze(1)) * WIDTH**-0.5)
    weights = indexer.weights_proj(hidden) * HEADS**-0.5
    return torch.matmul(weights.unsqueeze(-2), per_head).squeeze(-2)


def test_scores_choices_and_gradients_equal_the_repeated_key_product():
    indexer = _indexer()
    hidden, latent, tables = _inputs(24)
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    results = []
    for score in (indexer.scores, lambda *a: _repeated_key_scores(indexer, *a)):
        indexer.zero_grad()
        hidden.grad = latent.grad = None
        scores = score(hidden, latent, tables)
        (scores * torch.linspace(-1, 1, 24)).sum().backward()
        grads = [hidden.grad, latent.grad] + [p.grad for p in indexer.parameters()]
        results.append((scores.detach(), indexer.select(scores.detach(), causal), grads))
    (scores, chosen, grads), (want_scores, want_chosen, want_grads) = results
    assert (scores != 0).float().mean() > 0.9  # scores far from all ReLU'd away
    torch.testing.assert_close(scores, want_scores, atol=1e-6, rtol=1e-6)
    assert torch.equal(chosen, want_chosen) and (causal & ~chosen[:, 0]).any()  # keys were left out
    for grad, want in zip(grads, want_grads):  # fp32 sums in another order: 1e-6 of the gradient's scale
        assert (grad - want).abs().max() <= 1e-6 * want.abs().max()


def _saved_bytes(seq: int) -> int:
    """Bytes the score product keeps for backward at ``seq`` queries and keys (weights and inputs left out)."""
    indexer = _indexer()
    hidden, latent, tables = _inputs(seq)
    leaves = [*indexer.parameters(), hidden, latent]
    tracker = SavedTensorTracker({t.untyped_storage().data_ptr() for t in leaves})
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        scores = indexer.scores(hidden, latent, tables)
    assert scores.grad_fn is not None
    return tracker.live


def test_backward_keeps_only_the_per_head_scores_per_query_and_key():
    """Saved bytes are a s^2 + c s: the quadratic coefficient (L(2s) - 2 L(s)) / (2 s^2) is the fp32
    ReLU'd scores' 4 b heads, not 4 b (heads + width) as with the keys repeated per query."""
    seq = 16
    quadratic = (_saved_bytes(2 * seq) - 2 * _saved_bytes(seq)) / (2 * seq**2)
    assert quadratic == 4 * B * HEADS


def test_no_indexer_tensor_outlives_a_step_without_the_indexer_loss():
    """``indexer_loss_coeff`` 0 (sparse attention, the indexer untrained): forward and backward under
    saved-tensor hooks that hold what they pack (as activation offloading does) leave nothing saved behind;
    the indexer still chooses the keys (its weights change the output)."""
    torch.manual_seed(0)
    indexer = SparseIndexer(HIDDEN, LATENT, HEADS, WIDTH, ROPE, TOP_K)
    attn = LatentAttention(HIDDEN, 2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=ROPE, v_head_dim=4,
                           q_lora_rank=LATENT, indexer=indexer, indexer_loss_coeff=0.0).train()  # fmt: skip
    x, tables = torch.randn(B, 12, HIDDEN), RotaryEmbedding(ROPE, 10000.0)(torch.arange(12))
    tracker = SavedTensorTracker({p.untyped_storage().data_ptr() for p in attn.parameters()})
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        out = attn(x, tables)
        out.sum().backward()
    del out
    assert tracker.peak > 0 and tracker.live == 0, (tracker.peak, tracker.live)
    assert attn.last_indexer_loss is None
    assert all(p.grad is None for p in indexer.parameters())
    with torch.no_grad():  # other index keys, other choices: the sparse path ran
        before = attn(x, tables)
        indexer.wk.weight.normal_(0.0, 1.0)
        assert not torch.allclose(attn(x, tables), before)


def test_the_memory_script_measures_the_per_head_scores_at_deepseek_v32_size():
    """scripts/indexer_memory.py (the figures in docs/models.md): at DeepSeek-V3.2's indexer shape its
    quadratic coefficient is 4 b n_I = 512 bytes (2 sequences, 64 heads), not 4 b (n_I + d_I) = 1536."""
    script = runpy.run_path(
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "indexer_memory.py")
    )
    indexer = script["SparseIndexer"](*(script[k] for k in ("HIDDEN", "LATENT", "HEADS", "WIDTH", "ROPE")), top_k=8)
    seq = 16
    saved = [script["saved_bytes"](indexer, 2, n) for n in (seq, 2 * seq)]
    assert (saved[1] - 2 * saved[0]) / (2 * seq**2) == 4 * 2 * script["HEADS"]
