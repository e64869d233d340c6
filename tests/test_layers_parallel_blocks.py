"""Attention and transformer blocks equal their dense one-process equivalents (forward, input grad, weight
grads) for tp in {1, 2, 4} on gloo, with and without sequence parallelism, over packed documents, and start
from the same weights under every TP size; each parameter carries the partial-gradient mark its layout needs.

One spawn per TP size runs all checks (tests/layer_parity.py); the tests below assert on its results.
The tensor-parallel primitives they are built of: tests/test_layers_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from layer_parity import SEGMENTS, assert_same_initial_weights, assert_small, dense_leaves, parity_runs, randn, record
from layers_reference import dense_attention, dense_block, gather_dim, split_dim

from megacann import parallel_state as ps
from megacann.layers import (
    RotaryEmbedding,
    SelfAttention,
    TransformerBlock,
    TransformerBlockConfig,
    model_parallel_manual_seed,
)
from megacann.layers.sharding import get_sharding


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


def _forward_backward(module, x_full, gout, sp: bool, *args):
    """``module(x, *args)`` on the whole input, or on this rank's share of the sequence under sequence parallelism, then
    backward of ``gout``; the output and the input's gradient as whole tensors."""
    x = (split_dim(x_full, 1) if sp else x_full).clone().requires_grad_()
    out = module(x, *args)
    if not sp:
        out.backward(gout)
        return out, x.grad
    out.backward(split_dim(gout, 1))
    return gather_dim(out, 1), gather_dim(x.grad, 1)


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
        w = dense_leaves(layer)
        if case == "gqa_kv2":
            inits["attention"] = {k: v.detach().clone() for k, v in w.items()}
        head_dim = c["hidden"] // c["heads"]
        cos, sin = RotaryEmbedding(head_dim, theta=500.0)(_positions())
        x_full = randn(2, 8, c["hidden"], seed=9)
        xd = x_full.clone().requires_grad_()
        ref = dense_attention(xd, w, c["heads"], c["kv"], head_dim, cos, sin, seg)
        gout = randn(*ref.shape, seed=10)
        ref.backward(gout)
        out, dx = _forward_backward(layer, x_full, gout, c["sp"], (cos, sin), seg)
        record(errs, name, out, ref, dx, xd.grad, layer, w)


LLAMA = dict(hidden_size=32, num_attention_heads=8, num_key_value_heads=2, ffn_hidden_size=48)
GPT = dict(
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    normalization="layernorm",
    add_bias_linear=True,
    position_embedding="none",
)
BLOCK_CASES = {
    "llama": LLAMA,
    "llama_sp": {**LLAMA, "sequence_parallel": True, "fused_gate_up": False},
    "gpt": {**GPT, "norm_eps": 1e-5, "activation": "gelu_tanh", "fused_qkv": True},
    "gpt_sp": {**GPT, "activation": "gelu", "sequence_parallel": True},
}


def _check_block(errs, inits):
    seg = torch.tensor(SEGMENTS)
    for case, kwargs in BLOCK_CASES.items():
        name = f"block/{case}"
        cfg = TransformerBlockConfig(**kwargs, output_layer_init_std=0.01)
        model_parallel_manual_seed(15)
        block = TransformerBlock(cfg)
        w = dense_leaves(block)
        if case == "llama":
            inits["block"] = {k: v.detach().clone() for k, v in w.items()}
        cos = sin = None
        rotary = None
        if cfg.position_embedding == "rope":
            cos, sin = RotaryEmbedding(cfg.attention_head_dim)(_positions())
            rotary = _positions() if case == "llama" else (cos, sin)  # position ids or tables
        x_full = randn(2, 8, 32, seed=16)
        xd = x_full.clone().requires_grad_()
        ref = dense_block(xd, w, cfg, cos, sin, seg)
        gout = randn(*ref.shape, seed=17)
        ref.backward(gout)
        out, dx = _forward_backward(block, x_full, gout, cfg.sequence_parallel, rotary, seg)
        record(errs, name, out, ref, dx, xd.grad, block, w)
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


CHECKS = (_check_attention, _check_block)


@pytest.fixture(scope="module")
def results():
    return parity_runs(CHECKS)


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.extended)])
@pytest.mark.parametrize(
    "layer", ["attention/gqa", "attention/mqa", "attention/uneven", "attention/fused", "block/llama", "block/gpt"]
)
def test_layer_matches_dense(results, layer, tp):
    assert_small(results[tp]["errors"], layer, tp)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_initial_weights_match_one_process(results, tp):
    assert_same_initial_weights(results, tp)
