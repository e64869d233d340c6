"""DeepSeek-V4's attention while generating: a :class:`CompressedSparseAttention` with its decoding cache
(:mod:`megacann.generation.compressed_cache`), fed left-padded prompts of two lengths and then one token a
step, gives at every position what the layer gives each row's whole sequence without a cache (fp32), for
its three layer types, past the sliding window and across compression windows that close while decoding."""

from __future__ import annotations

import pytest
import torch
from layers_reference import rel_err

from megacann.generation import CompressedAttentionCacheLayer, KVCache, compressed_cache_bytes
from megacann.layers import CompressedSparseAttention

HIDDEN, HEADS, HEAD_DIM, WINDOW, TOL = 16, 4, 8, 5, 1e-5
RATES = {"compressed_sparse_attention": 3, "heavily_compressed_attention": 4}
PROMPTS, NEW_TOKENS = (9, 4), 12  # the second row left-padded by 5


def _layer(layer_type: str) -> CompressedSparseAttention:
    # 8 indexer heads: no two entries tie at score 0 (every head's ReLU off), a tie top-k would break by
    # the number of entries, which differs between the cache and a whole row
    layer = CompressedSparseAttention(
        HIDDEN, HEADS, HEAD_DIM, layer_type=layer_type, q_lora_rank=12, qk_rope_head_dim=4, o_groups=2,
        o_lora_rank=6, sliding_window=WINDOW, compress_rate=RATES.get(layer_type), index_n_heads=8,
        index_head_dim=8, index_topk=2,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 4},
    )  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # every parameter drawn, the sinks and the windows' position biases included
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return layer.eval()


@pytest.mark.parametrize("layer_type", ["sliding_attention", *RATES])
def test_cached_decoding_equals_whole_rows(layer_type):
    layer = _layer(layer_type)
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randn(1, n + NEW_TOKENS, HIDDEN, generator=gen) for n in PROMPTS]
    with torch.no_grad():
        whole = [layer(row)[0] for row in rows]  # each row alone, no cache: [length, h]
        longest, pad = max(PROMPTS), torch.tensor([max(PROMPTS) - n for n in PROMPTS])
        prompts = torch.randn(len(rows), longest, HIDDEN, generator=gen)  # padding: anything
        for r, (row, n) in enumerate(zip(rows, PROMPTS)):
            prompts[r, longest - n :] = row[0, :n]
        positions = (torch.arange(longest).unsqueeze(0) - pad.unsqueeze(1)).clamp(min=0)
        cache = KVCache(layer, len(rows), longest + NEW_TOKENS, pad)
        assert isinstance(cache.layers[0], CompressedAttentionCacheLayer)
        with cache.attached():
            out = layer(prompts, positions)
            cache.advance(longest)
            errors = [rel_err(out[r, longest - n :], whole[r][:n]) for r, n in enumerate(PROMPTS)]
            for step in range(NEW_TOKENS):
                tokens = torch.stack([row[0, n + step] for row, n in zip(rows, PROMPTS)]).unsqueeze(1)
                out = layer(tokens, torch.tensor([[n + step] for n in PROMPTS]))
                cache.advance(1)
                errors += [rel_err(out[r, 0], whole[r][n + step]) for r, n in enumerate(PROMPTS)]
    assert max(errors) <= TOL, [(i, f"{e:.1e}") for i, e in enumerate(errors) if e > TOL]
    assert layer.kv_cache is None  # detached after the block
    projections = {"sliding_attention": 0, "heavily_compressed_attention": 2 * HEAD_DIM}
    width = projections.get(layer_type, 2 * (2 * HEAD_DIM + 2 * 8))
    expected = compressed_cache_bytes(1, 2, longest + NEW_TOKENS, HEAD_DIM, WINDOW, width, torch.float32)
    assert cache.nbytes == expected
