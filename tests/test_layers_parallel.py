"""Every parallel layer equals its dense one-process equivalent (forward, input grad, weight grads) for
tp in {1, 2, 4} on gloo, and starts from the same weights under every TP size.

One spawn per TP size runs all checks (``_parity_checks``); the tests below assert on its results.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import LazyRuns, run_on_ranks
from layers_reference import (
    dense_attention,
    dense_block,
    full_grads,
    full_weights,
    gather_dim,
    rel_err,
    split_dim,
)

from megacann import collectives
from megacann import parallel_state as ps
from megacann.layers import (
    ColumnParallelLinear,
    RotaryEmbedding,
    RowParallelLinear,
    SelfAttention,
    TransformerBlock,
    TransformerBlockConfig,
    VocabParallelEmbedding,
    mappings,
    model_parallel_manual_seed,
    vocab_parallel_cross_entropy,
)
from megacann.layers.embedding import pad_vocab_size
from megacann.layers.sharding import ParamSharding, get_sharding, shard_tensor, unshard_tensors

TOL = 1e-5
VOCAB, DIVISIBLE = 70, 8
EDGE_IDS = [0, 69, 23, 24, 39, 40, 47, 48, 1, 68, 5, 30, 50, 60, 10, 20]  # shard edges for tp 2 and 4
SEGMENTS = [[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0, 0, 0]]


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _dense_leaves(module):
    return {k: v.requires_grad_() for k, v in full_weights(module).items()}


def _record(errs, name, out, ref, dx, ref_dx, module, dense_w):
    errs[f"{name}/out"] = rel_err(out, ref)
    if dx is not None:
        errs[f"{name}/dx"] = rel_err(dx, ref_dx)
    for key, grad in full_grads(module).items():
        errs[f"{name}/d.{key}"] = rel_err(grad, dense_w[key].grad)


def _positions():
    """Positions restarting at each packed document."""
    rows = []
    for row in SEGMENTS:
        start, positions = 0, []
        for i, seg in enumerate(row):
            if i and row[i - 1] != seg:
                start = i
            positions.append(i - start)
        rows.append(positions)
    return torch.tensor(rows)


# -- checks (run on every rank) -----------------------------------------------------------------------


def _check_mappings(errs):
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    weight = sum(range(1, tp + 1))
    x = _randn(2, 8, 4, seed=1)
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
            w = _dense_leaves(layer)
            if not gather and blocks is None:
                inits["column"] = {k: v.detach().clone() for k, v in w.items()}
            x = _randn(2, 5, 12, seed=2).requires_grad_()
            xd = x.detach().clone().requires_grad_()
            ref = F.linear(xd, w["weight"], w["bias"])
            gout = _randn(*ref.shape, seed=3)
            ref.backward(gout)
            out = layer(x)
            if gather:
                out.backward(gout)
            else:
                out.backward(shard_tensor(gout, layout, rank, tp))
                out = unshard_tensors([t for t in gather_dim(out, 0).chunk(tp, 0)], layout)
            _record(errs, name, out, ref, x.grad, xd.grad, layer, w)


def _check_row(errs, inits):
    for parallel_input in (True, False):
        name = f"row/input_is_parallel={parallel_input}"
        model_parallel_manual_seed(12)
        layer = RowParallelLinear(16, 12, bias=True, input_is_parallel=parallel_input)
        w = _dense_leaves(layer)
        if parallel_input:
            inits["row"] = {k: v.detach().clone() for k, v in w.items()}
        x_full = _randn(2, 5, 16, seed=4)
        x = (split_dim(x_full, -1) if parallel_input else x_full).clone().requires_grad_()
        xd = x_full.clone().requires_grad_()
        ref = F.linear(xd, w["weight"], w["bias"])
        gout = _randn(*ref.shape, seed=5)
        ref.backward(gout)
        out = layer(x)
        out.backward(gout)
        dx = gather_dim(x.grad, -1) if parallel_input else x.grad
        _record(errs, name, out, ref, dx, xd.grad, layer, w)


def _check_embedding(errs, inits):
    ids = torch.tensor(EDGE_IDS).view(2, 8)
    for sp in (False, True):
        name = f"embedding/sp={sp}"
        model_parallel_manual_seed(13)
        layer = VocabParallelEmbedding(VOCAB, 6, make_vocab_size_divisible_by=DIVISIBLE, sequence_parallel=sp)
        w = _dense_leaves(layer)
        if not sp:
            inits["embedding"] = {k: v.detach().clone() for k, v in w.items()}
        padding_rows = torch.arange(layer.vocab_start, layer.vocab_end) >= VOCAB
        errs[f"{name}/padding_rows_zero"] = layer.weight.detach()[padding_rows].abs().sum().item()
        ref = F.embedding(ids, w["weight"])
        gout = _randn(*ref.shape, seed=6)
        ref.backward(gout)
        out = layer(ids)
        if sp:
            out.backward(split_dim(gout, 1))
            out = gather_dim(out, 1)
        else:
            out.backward(gout)
        _record(errs, name, out, ref, None, None, layer, w)


def _check_cross_entropy(errs):
    tp = ps.get_tensor_model_parallel_world_size()
    target = torch.tensor([[0, 69, 23, 24, -100, 47], [48, 39, 40, -100, 5, 68]])
    cases = ((VOCAB, 0.0, False), (VOCAB, 0.1, True), (pad_vocab_size(VOCAB, 4, DIVISIBLE), 0.2, False))
    for vocab, smoothing, inplace in cases:
        padded = pad_vocab_size(vocab, tp, DIVISIBLE)
        name = f"cross_entropy/vocab={vocab}/padded={padded}/smoothing={smoothing}/inplace={inplace}"
        full = _randn(2, 6, padded, seed=7) * 3  # padding columns hold garbage that must not count
        dense = full.clone().requires_grad_()
        ref = F.cross_entropy(
            dense[..., :vocab].reshape(-1, vocab),
            target.view(-1),
            ignore_index=-100,
            label_smoothing=smoothing,
            reduction="none",
        ).view_as(target)
        gloss = _randn(2, 6, seed=8)
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


ATTENTION_CASES = {
    "gqa_kv2": dict(hidden=32, heads=8, kv=2, sp=False, fused=False, bias=False),
    "gqa_kv2_sp": dict(hidden=32, heads=8, kv=2, sp=True, fused=False, bias=False),
    "mqa": dict(hidden=32, heads=8, kv=1, sp=False, fused=False, bias=True),
    "uneven_kv3": dict(hidden=48, heads=12, kv=3, sp=True, fused=False, bias=False),
    "fused_kv4_sp": dict(hidden=32, heads=8, kv=4, sp=True, fused=True, bias=True),
}


def _check_attention(errs, inits):
    seg = torch.tensor(SEGMENTS)
    for case, c in ATTENTION_CASES.items():
        name = f"attention/{case}"
        model_parallel_manual_seed(14)
        layer = SelfAttention(
            c["hidden"],
            c["heads"],
            c["kv"],
            qkv_bias=c["bias"],
            output_bias=c["bias"],
            sequence_parallel=c["sp"],
            fused_qkv=c["fused"],
        )
        w = _dense_leaves(layer)
        if case == "gqa_kv2":
            inits["attention"] = {k: v.detach().clone() for k, v in w.items()}
        head_dim = c["hidden"] // c["heads"]
        cos, sin = RotaryEmbedding(head_dim, theta=500.0)(_positions())
        x_full = _randn(2, 8, c["hidden"], seed=9)
        xd = x_full.clone().requires_grad_()
        ref = dense_attention(xd, w, c["heads"], c["kv"], head_dim, cos, sin, seg)
        gout = _randn(*ref.shape, seed=10)
        ref.backward(gout)
        x = (split_dim(x_full, 1) if c["sp"] else x_full).clone().requires_grad_()
        out = layer(x, (cos, sin), seg)
        if c["sp"]:
            out.backward(split_dim(gout, 1))
            out, dx = gather_dim(out, 1), gather_dim(x.grad, 1)
        else:
            out.backward(gout)
            dx = x.grad
        _record(errs, name, out, ref, dx, xd.grad, layer, w)


BLOCK_CASES = {
    "llama": dict(hidden_size=32, num_attention_heads=8, num_key_value_heads=2, ffn_hidden_size=48),
    "llama_sp": dict(
        hidden_size=32,
        num_attention_heads=8,
        num_key_value_heads=2,
        ffn_hidden_size=48,
        sequence_parallel=True,
        fused_gate_up=False,
    ),
    "gpt": dict(
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        normalization="layernorm",
        norm_eps=1e-5,
        activation="gelu_tanh",
        add_bias_linear=True,
        position_embedding="none",
        fused_qkv=True,
    ),
    "gpt_sp": dict(
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        normalization="layernorm",
        activation="gelu",
        add_bias_linear=True,
        position_embedding="none",
        sequence_parallel=True,
    ),
}


def _check_block(errs, inits):
    seg = torch.tensor(SEGMENTS)
    for case, kwargs in BLOCK_CASES.items():
        name = f"block/{case}"
        cfg = TransformerBlockConfig(**kwargs, output_layer_init_std=0.01)
        model_parallel_manual_seed(15)
        block = TransformerBlock(cfg)
        w = _dense_leaves(block)
        if case == "llama":
            inits["block"] = {k: v.detach().clone() for k, v in w.items()}
        cos = sin = None
        rotary = None
        if cfg.position_embedding == "rope":
            cos, sin = RotaryEmbedding(cfg.attention_head_dim)(_positions())
            rotary = _positions() if case == "llama" else (cos, sin)  # position ids or tables
        x_full = _randn(2, 8, 32, seed=16)
        xd = x_full.clone().requires_grad_()
        ref = dense_block(xd, w, cfg, cos, sin, seg)
        gout = _randn(*ref.shape, seed=17)
        ref.backward(gout)
        x = (split_dim(x_full, 1) if cfg.sequence_parallel else x_full).clone().requires_grad_()
        out = block(x, rotary, seg)
        if cfg.sequence_parallel:
            out.backward(split_dim(gout, 1))
            out, dx = gather_dim(out, 1), gather_dim(x.grad, 1)
        else:
            out.backward(gout)
            dx = x.grad
        _record(errs, name, out, ref, dx, xd.grad, block, w)
        # partial-grad marks: norms (and row biases) under SP, replicated kv projections when kv < tp
        for pname, p in block.named_parameters():
            partial = get_sharding(p).tp_partial_grad
            expect = (
                cfg.sequence_parallel
                and ("layernorm" in pname or pname.endswith("o_proj.bias") or pname.endswith("down_proj.bias"))
            ) or (
                ps.get_tensor_model_parallel_world_size() > cfg.kv_heads
                and pname.split(".")[-2] in ("k_proj", "v_proj")
            )
            errs[f"{name}/partial_mark.{pname}"] = float(partial != expect)


def _parity_checks():
    torch.manual_seed(0)
    ps.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    errs, inits = {}, {}
    _check_mappings(errs)
    _check_column(errs, inits)
    _check_row(errs, inits)
    _check_embedding(errs, inits)
    _check_cross_entropy(errs)
    _check_attention(errs, inits)
    _check_block(errs, inits)
    ps.destroy_model_parallel()
    # plain numpy arrays: torch tensors would travel as shared memory that dies with the rank process
    inits = {layer: {k: v.numpy() for k, v in ws.items()} for layer, ws in inits.items()}
    return {"errors": errs, "inits": inits if dist.get_rank() == 0 else None}


@pytest.fixture(scope="module")
def results():
    """Results per TP size, computed once for the module when a selected test asks for that size (tp 4 is
    extended)."""
    return LazyRuns(lambda tp: run_on_ranks(_parity_checks, world_size=tp, timeout=240)[0])


def _assert_small(errors: dict[str, float], prefix: str, tp: int):
    picked = {k: v for k, v in errors.items() if k.startswith(prefix)}
    assert picked, f"no results for {prefix}"
    bad = {k: v for k, v in picked.items() if not v <= TOL}
    assert not bad, f"tp={tp}: relative errors above {TOL}: {bad}"


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.extended)])
@pytest.mark.parametrize(
    "layer",
    [
        "mappings",
        "column",
        "row",
        "embedding",
        "cross_entropy",
        "attention/gqa",
        "attention/mqa",
        "attention/uneven",
        "attention/fused",
        "block/llama",
        "block/gpt",
    ],
)
def test_layer_matches_dense(results, layer, tp):
    _assert_small(results[tp]["errors"], layer, tp)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_initial_weights_match_one_process(results, tp):
    one, many = results[1]["inits"], results[tp]["inits"]
    assert one.keys() == many.keys()
    for layer in one:
        for name, tensor in one[layer].items():
            assert (many[layer][name] == tensor).all(), f"{layer}.{name} differs between tp=1 and tp={tp}"
