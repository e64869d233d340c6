"""Context parallelism without processes: the load-balanced layout, the ring's block math at one rank
(gradcheck in fp64 against finite differences, and equal to the reference attention), the kv-head
replication rule of Ulysses, and the errors for bad input."""

from __future__ import annotations

import pytest
import torch

from megacann import ops
from megacann.layers import SelfAttention, TransformerBlock, TransformerBlockConfig
from megacann.layers.context_parallel import (
    blockwise_attention,
    context_parallel_attention,
    context_parallel_chunk_ids,
    context_parallel_position_ids,
    context_parallel_split,
    ulysses_kv_repeat,
)
from megacann.ops import attention_blocks


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_shares_cover_the_sequence_with_equal_causal_work(cp):
    seq = 32
    tokens = torch.arange(seq).view(1, seq, 1).expand(2, seq, 3)
    shares = [context_parallel_position_ids(seq, cp, rank) for rank in range(cp)]
    assert sorted(torch.cat(shares).tolist()) == list(range(seq))
    chunk = seq // (2 * cp)
    for rank, positions in enumerate(shares):
        assert positions.numel() == seq // cp
        assert torch.equal(context_parallel_split(tokens, 1, cp, rank)[1, :, 2], positions)
        if cp > 1:
            first, second = context_parallel_chunk_ids(rank, cp)
            assert (first, second) == (rank, 2 * cp - 1 - rank)
            assert positions.tolist() == [
                *range(first * chunk, (first + 1) * chunk),
                *range(second * chunk, (second + 1) * chunk),
            ]
    work = {sum(p + 1 for p in positions.tolist()) for positions in shares}  # keys a causal query row sees
    assert len(work) == 1, work


def test_split_along_another_dim_and_its_gradient():
    x = torch.arange(24.0).view(8, 3).requires_grad_()
    part = context_parallel_split(x, dim=0, cp_size=2, cp_rank=1)
    assert part[:, 0].tolist() == [6.0, 9.0, 12.0, 15.0]  # chunks 1 and 2 of 4
    part.sum().backward()
    assert x.grad[:, 0].tolist() == [0, 0, 1, 1, 1, 1, 0, 0]


def test_layout_errors_name_the_numbers():
    with pytest.raises(ValueError, match=r"length 30\) into 2 x context_parallel_size 4 = 8 equal chunks"):
        context_parallel_split(torch.zeros(1, 30), 1, 4, 0)
    with pytest.raises(ValueError, match=r"length 12\) into 2 x context_parallel_size 4"):
        context_parallel_position_ids(12, 4, 1)
    with pytest.raises(ValueError, match=r"context-parallel rank 2 is outside \[0, context_parallel_size 2\)"):
        context_parallel_position_ids(8, 2, 2)


def _inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 4, 5, generator=gen, dtype=dtype).requires_grad_()
    k = torch.randn(2, 8, 2, 5, generator=gen, dtype=dtype).requires_grad_()
    v = torch.randn(2, 8, 2, 5, generator=gen, dtype=dtype).requires_grad_()
    # a one-token document (position 3) and documents that start mid-sequence
    segments = torch.tensor([[0, 0, 0, 1, 2, 2, 2, 3], [4, 4, 4, 4, 4, 4, 4, 4]])
    return q, k, v, segments


@pytest.mark.parametrize("tile", [1 << 22, 200])
def test_ring_block_math_gradcheck_fp64(monkeypatch, tile):
    monkeypatch.setattr(attention_blocks, "SCORE_TILE_ELEMENTS", tile)  # one tile, or uneven tiles of 3 rows
    q, k, v, segments = _inputs(torch.float64)
    assert torch.autograd.gradcheck(lambda *t: blockwise_attention(*t, segment_ids=segments), (q, k, v), fast_mode=True)
    assert torch.autograd.gradcheck(lambda *t: blockwise_attention(*t, scale=0.3), (q, k, v), fast_mode=True)


def test_ring_at_one_rank_equals_reference_attention_fp32():
    q, k, v, segments = _inputs(torch.float32)
    out = blockwise_attention(q, k, v, segments)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = ops.scaled_dot_product_attention(q, k, v, causal=True, segment_ids=segments)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "heads, kv_heads, cp, repeat",
    [(8, 8, 4, 1), (8, 4, 2, 1), (8, 2, 4, 2), (8, 1, 4, 4), (12, 3, 2, 4), (8, 2, 8, 4)],
)
def test_ulysses_replicates_kv_heads_only_when_needed(heads, kv_heads, cp, repeat):
    assert ulysses_kv_repeat(heads, kv_heads, cp) == repeat
    per_rank_q, per_rank_kv = heads // cp, kv_heads * repeat // cp
    assert (kv_heads * repeat) % cp == 0
    for rank in range(cp):  # every q head of the rank reads a kv head the rank received
        for local in range(per_rank_q):
            kv_global = (rank * per_rank_q + local) // (heads // kv_heads)
            kv_local = local // (per_rank_q // per_rank_kv)
            assert (rank * per_rank_kv + kv_local) // repeat == kv_global


def test_attention_input_errors():
    q = torch.zeros(1, 4, 4, 8)
    with pytest.raises(ValueError, match="context_parallel_algo 'rings' is not one of"):
        context_parallel_attention(q, q, q, algo="rings")
    with pytest.raises(ValueError, match=r"got q \[1, 4, 4, 8\], k \[1, 4, 4, 6\]"):
        context_parallel_attention(q, q[..., :6], q[..., :6])
    with pytest.raises(ValueError, match="query heads 4 are not a multiple of key/value heads 3"):
        context_parallel_attention(q, q[:, :, :3], q[:, :, :3])
    with pytest.raises(ValueError, match=r"segment_ids must be \[b, s_local\] = \[1, 4\]"):
        context_parallel_attention(q, q, q, torch.zeros(1, 8, dtype=torch.long))


def test_algorithm_option_is_checked_and_reaches_the_layer():
    with pytest.raises(ValueError, match="context_parallel_algo 'ulysess' is not one of"):
        SelfAttention(16, 4, context_parallel_algo="ulysess")
    with pytest.raises(ValueError, match="did you mean 'ulysses'"):
        TransformerBlockConfig(
            hidden_size=16, num_attention_heads=4, ffn_hidden_size=32, context_parallel_algo="ulysess"
        )
    block = TransformerBlock(
        TransformerBlockConfig(
            hidden_size=16, num_attention_heads=4, ffn_hidden_size=32, context_parallel_algo="allgather"
        )
    )
    assert block.self_attn.context_parallel_algo == "allgather"
