"""The tensor-parallel primitives equal their dense one-process equivalents (forward, input grad, weight grads)
for tp in {1, 2, 4} on gloo, and start from the same weights under every TP size: the sequence- and
tensor-parallel mappings, column- and row-parallel linears, the vocabulary-parallel embedding and cross entropy.

One spawn per TP size runs all checks (tests/layer_parity.py); the tests below assert on its results.
Attention and transformer blocks: tests/test_layers_parallel_blocks.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from layer_parity import assert_same_initial_weights, assert_small, dense_leaves, parity_runs, randn, record
from layers_reference import gather_dim, rel_err, split_dim

from megacann import collectives
from megacann import parallel_state as ps
from megacann.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mappings,
    model_parallel_manual_seed,
    vocab_parallel_cross_entropy,
)
from megacann.layers.embedding import pad_vocab_size
from megacann.layers.sharding import ParamSharding, shard_tensor, unshard_tensors

VOCAB, DIVISIBLE = 70, 8
EDGE_IDS = [0, 69, 23, 24, 39, 40, 47, 48, 1, 68, 5, 30, 50, 60, 10, 20]  # shard edges for tp 2 and 4


def _check_mappings(errs, inits):
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    weight = sum(range(1, tp + 1))
    x = randn(2, 8, 4, seed=1)
    for fallback in (False, True):  # True: a backend without flat all-gather / reduce-scatter
        real = collectives._all_gather_base, collectives._reduce_scatter_base
        if fallback:

            def unsupported(*args, **kwargs):
                raise RuntimeError("no support for _reduce_scatter_base in Gloo process group")

            collectives._all_gather_base = collectives._reduce_scatter_base = unsupported
        try:
            full = (x * (rank + 1)).requires_grad_()
            out = mappings.reduce_scatter_to_sequence_parallel_region(full)
            out.backward(split_dim(x, 1))
            local = split_dim(x, 1).clone().requires_grad_()
            gathered = mappings.gather_from_sequence_parallel_region(local)
            gathered.backward(x * (rank + 1))
        finally:
            collectives._all_gather_base, collectives._reduce_scatter_base = real
            collectives._MISSING.clear()
        errs[f"mappings/sp_reduce_scatter/fallback={fallback}"] = rel_err(out, split_dim(x, 1) * weight)
        errs[f"mappings/sp_reduce_scatter_grad/fallback={fallback}"] = rel_err(full.grad, x)
        errs[f"mappings/sp_gather/fallback={fallback}"] = rel_err(gathered, x)
        errs[f"mappings/sp_gather_grad/fallback={fallback}"] = rel_err(local.grad, split_dim(x, 1) * weight)
    full = x.clone().requires_grad_()
    out = mappings.scatter_to_sequence_parallel_region(full)
    out.backward(split_dim(x, 1))
    errs["mappings/sp_scatter"] = rel_err(out, split_dim(x, 1)) + rel_err(full.grad, x)
    full = x.clone().requires_grad_()
    out = mappings.copy_to_tensor_model_parallel_region(full)
    out.backward(x * (rank + 1))
    errs["mappings/copy"] = rel_err(out, x) + rel_err(full.grad, x * weight)
    full = (x * (rank + 1)).requires_grad_()
    out = mappings.reduce_from_tensor_model_parallel_region(full)
    out.backward(x)
    errs["mappings/reduce"] = rel_err(out, x * weight) + rel_err(full.grad, x)
    local = split_dim(x, -1).clone().requires_grad_()
    out = mappings.gather_from_tensor_model_parallel_region(local)
    out.backward(x)
    errs["mappings/gather_last"] = rel_err(out, x) + rel_err(local.grad, split_dim(x, -1))
    full = x.clone().requires_grad_()
    out = mappings.scatter_to_tensor_model_parallel_region(full)
    out.backward(split_dim(x, -1))
    errs["mappings/scatter_last"] = rel_err(out, split_dim(x, -1)) + rel_err(full.grad, x)


def _check_column(errs, inits):
    for gather in (False, True):
        for blocks in (None, (16, 8)):
            name = f"column/gather={gather}/blocks={blocks}"
            model_parallel_manual_seed(11)
            layer = ColumnParallelLinear(12, 24, bias=True, gather_output=gather, tp_blocks=blocks)
            layout = ParamSharding(full_shape=(2, 5, 24), tp_dim=2, tp_blocks=blocks)
            tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
            w = dense_leaves(layer)
            if not gather and blocks is None:
                inits["column"] = {k: v.detach().clone() for k, v in w.items()}
            x = randn(2, 5, 12, seed=2).requires_grad_()
            xd = x.detach().clone().requires_grad_()
            ref = F.linear(xd, w["weight"], w["bias"])
            gout = randn(*ref.shape, seed=3)
            ref.backward(gout)
            out = layer(x)
            if gather:
                out.backward(gout)
            else:
                out.backward(shard_tensor(gout, layout, rank, tp))
                out = unshard_tensors([t for t in gather_dim(out, 0).chunk(tp, 0)], layout)
            record(errs, name, out, ref, x.grad, xd.grad, layer, w)


def _check_row(errs, inits):
    for parallel_input in (True, False):
        name = f"row/input_is_parallel={parallel_input}"
        model_parallel_manual_seed(12)
        layer = RowParallelLinear(16, 12, bias=True, input_is_parallel=parallel_input)
        w = dense_leaves(layer)
        if parallel_input:
            inits["row"] = {k: v.detach().clone() for k, v in w.items()}
        x_full = randn(2, 5, 16, seed=4)
        x = (split_dim(x_full, -1) if parallel_input else x_full).clone().requires_grad_()
        xd = x_full.clone().requires_grad_()
        ref = F.linear(xd, w["weight"], w["bias"])
        gout = randn(*ref.shape, seed=5)
        ref.backward(gout)
        out = layer(x)
        out.backward(gout)
        dx = gather_dim(x.grad, -1) if parallel_input else x.grad
        record(errs, name, out, ref, dx, xd.grad, layer, w)


def _check_embedding(errs, inits):
    ids = torch.tensor(EDGE_IDS).view(2, 8)
    for sp in (False, True):
        name = f"embedding/sp={sp}"
        model_parallel_manual_seed(13)
        layer = VocabParallelEmbedding(VOCAB, 6, make_vocab_size_divisible_by=DIVISIBLE, sequence_parallel=sp)
        w = dense_leaves(layer)
        if not sp:
            inits["embedding"] = {k: v.detach().clone() for k, v in w.items()}
        padding_rows = torch.arange(layer.vocab_start, layer.vocab_end) >= VOCAB
        errs[f"{name}/padding_rows_zero"] = layer.weight.detach()[padding_rows].abs().sum().item()
        ref = F.embedding(ids, w["weight"])
        gout = randn(*ref.shape, seed=6)
        ref.backward(gout)
        out = layer(ids)
        if sp:
            out.backward(split_dim(gout, 1))
            out = gather_dim(out, 1)
        else:
            out.backward(gout)
        record(errs, name, out, ref, None, None, layer, w)


def _check_cross_entropy(errs, inits):
    tp = ps.get_tensor_model_parallel_world_size()
    target = torch.tensor([[0, 69, 23, 24, -100, 47], [48, 39, 40, -100, 5, 68]])
    cases = ((VOCAB, 0.0, False), (VOCAB, 0.1, True), (pad_vocab_size(VOCAB, 4, DIVISIBLE), 0.2, False))
    for vocab, smoothing, inplace in cases:
        padded = pad_vocab_size(vocab, tp, DIVISIBLE)
        name = f"cross_entropy/vocab={vocab}/padded={padded}/smoothing={smoothing}/inplace={inplace}"
        full = randn(2, 6, padded, seed=7) * 3  # padding columns hold garbage that must not count
        dense = full.clone().requires_grad_()
        ref = F.cross_entropy(
            dense[..., :vocab].reshape(-1, vocab),
            target.view(-1),
            ignore_index=-100,
            label_smoothing=smoothing,
            reduction="none",
        ).view_as(target)
        gloss = randn(2, 6, seed=8)
        ref.backward(gloss)
        local = split_dim(full, -1).clone().requires_grad_()
        logits = local * 1.0 if inplace else local  # in place needs a non-leaf it may overwrite
        loss = vocab_parallel_cross_entropy(
            logits, target, label_smoothing=smoothing, vocab_size=vocab if vocab != padded else None, inplace=inplace
        )
        loss.backward(gloss)
        errs[f"{name}/out"] = rel_err(loss, ref)
        errs[f"{name}/dx"] = rel_err(gather_dim(local.grad, -1), dense.grad)
        errs[f"{name}/ignored_zero"] = loss[target == -100].abs().sum().item()
        errs[f"{name}/fp32"] = 0.0 if loss.dtype == torch.float32 else 1.0


CHECKS = (_check_mappings, _check_column, _check_row, _check_embedding, _check_cross_entropy)


@pytest.fixture(scope="module")
def results():
    return parity_runs(CHECKS)


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.extended)])
@pytest.mark.parametrize("layer", ["mappings", "column", "row", "embedding", "cross_entropy"])
def test_layer_matches_dense(results, layer, tp):
    assert_small(results[tp]["errors"], layer, tp)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_initial_weights_match_one_process(results, tp):
    assert_same_initial_weights(results, tp)
