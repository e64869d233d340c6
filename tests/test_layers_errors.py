"""Sizes that do not divide the TP size raise ValueError naming the sizes; bad options name the fix.

Layers are built under a pretend TP size of 4 (process-group state set by hand, no communication: the
constructors only read the TP rank and size)."""

from __future__ import annotations

import pytest
import torch

from megacann import parallel_state as ps
from megacann.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SelfAttention,
    SwiGLUMLP,
    TransformerBlockConfig,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from megacann.layers.embedding import pad_vocab_size


@pytest.fixture
def tp4():
    ps._STATE = ps._State(ps.rank_layout(4, tensor_model_parallel_size=4), rank=1, groups={})
    try:
        yield
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize(
    "build,numbers",
    [
        (lambda: ColumnParallelLinear(8, 6), ["ColumnParallelLinear", "6", "tensor_model_parallel_size 4"]),
        (lambda: ColumnParallelLinear(8, 12, tp_blocks=(8, 8)), ["(8, 8)", "12"]),
        (lambda: ColumnParallelLinear(8, 12, tp_blocks=(6, 6)), ["size 6", "tensor_model_parallel_size 4"]),
        (lambda: RowParallelLinear(10, 8), ["RowParallelLinear", "input_size 10", "tensor_model_parallel_size 4"]),
        (lambda: SelfAttention(24, 6, 2), ["num_attention_heads 6", "tensor_model_parallel_size 4"]),
        (lambda: SelfAttention(32, 8, 3), ["num_attention_heads 8", "num_key_value_heads 3"]),
        (lambda: SelfAttention(32, 8, 2, fused_qkv=True), ["num_key_value_heads 2", "fused_qkv=False"]),
        (lambda: SwiGLUMLP(8, 6), ["size 6", "tensor_model_parallel_size 4"]),
    ],
)
def test_sizes_that_do_not_divide_name_them(tp4, build, numbers):
    with pytest.raises(ValueError) as err:
        build()
    for text in numbers:
        assert text in str(err.value)


def test_layers_under_pretend_tp4_hold_their_shard(tp4):
    col = ColumnParallelLinear(8, 12, tp_blocks=(8, 4))
    assert tuple(col.weight.shape) == (3, 8)
    row = RowParallelLinear(8, 12)
    assert tuple(row.weight.shape) == (12, 2)
    emb = VocabParallelEmbedding(70, 4, make_vocab_size_divisible_by=8)
    assert emb.padded_vocab_size == 96 and (emb.vocab_start, emb.vocab_end) == (24, 48)
    attn = SelfAttention(32, 8, 2)  # kv heads < tp: replicated, each rank computes the one it reads
    assert attn.k_proj.weight.shape[0] == 8 and attn.local_kv_heads == 1 and attn.kv_rows == (0, 4)


def test_pad_vocab_size():
    assert pad_vocab_size(32000, 1) == 32000
    assert pad_vocab_size(32001, 1) == 32128
    assert pad_vocab_size(50257, 8) == 51200
    assert pad_vocab_size(70, 4, 8) == 96
    with pytest.raises(ValueError, match="vocab_size=0"):
        pad_vocab_size(0, 2)


def test_options_are_checked():
    with pytest.raises(ValueError, match="did you mean 'rmsnorm'"):
        TransformerBlockConfig(8, 2, 16, normalization="rmsnrom")
    with pytest.raises(ValueError, match="hidden_dropout"):
        TransformerBlockConfig(8, 2, 16, hidden_dropout=1.5)
    with pytest.raises(ValueError, match="sequence_parallel=True requires input_is_parallel"):
        RowParallelLinear(8, 8, input_is_parallel=False, sequence_parallel=True)
    with pytest.raises(ValueError, match="vocab_size 300 exceeds the 256 logit columns"):
        vocab_parallel_cross_entropy(torch.zeros(2, 256), torch.zeros(2, dtype=torch.long), vocab_size=300)
