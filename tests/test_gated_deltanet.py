"""Gated DeltaNet on one process: the layer equals transformers' Qwen3.5 ``Qwen3_5GatedDeltaNet`` with the
same weights (output and every gradient); the chunked op equals the token-by-token reference (outputs,
final states and gradients, fp32 and fp64, lengths that are not multiples of the chunk); the reference
equals transformers' own recurrence; packed documents equal the documents run one by one (op and layer,
gradients included); a decoding cache fed token by token equals the full forward; bad inputs are
refused by name."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from layers_reference import rel_err
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet, torch_recurrent_gated_delta_rule

from megacann import ops
from megacann.layers import GatedDeltaNet
from megacann.ops import gated_delta

HIDDEN, KEY_HEADS, VALUE_HEADS, DK, DV, KERNEL = 32, 2, 4, 8, 6, 4  # two value heads per key head


def _randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _rule_inputs(b, s, heads=3, dk=16, dv=8, seed=0, dtype=torch.float32):
    """q, k (unit norm), v, g (<= 0), beta in (0, 1): the op's inputs as a layer makes them. The decay is
    slow (exp(g) about 0.97 a token), so the state a chunk hands the next still matters 64 tokens on."""
    q = F.normalize(_randn(b, s, heads, dk, seed=seed, dtype=dtype), dim=-1)
    k = F.normalize(_randn(b, s, heads, dk, seed=seed + 1, dtype=dtype), dim=-1)
    v = _randn(b, s, heads, dv, seed=seed + 2, dtype=dtype)
    g = -0.05 * F.softplus(_randn(b, s, heads, seed=seed + 3, dtype=dtype))
    beta = _randn(b, s, heads, seed=seed + 4, dtype=dtype).sigmoid()
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float rounding: relative error (norms) under 1e-6. Not bitwise: a GEMM over the packed
    tokens and one over a document alone may block their sums differently."""
    return rel_err(a, b, floor=1e-6) < 1e-6


def _run(fn, inputs, initial=None, cu_seqlens=None):
    """Output, final state and the gradients of inputs (and initial state) under a fixed random loss."""
    out, final = fn(*inputs, scale=None, initial_state=initial, output_final_state=True, cu_seqlens=cu_seqlens)
    loss = (out * _randn(*out.shape, seed=99, dtype=out.dtype)).sum() + (final * 0.5).sum()
    leaves = list(inputs) + ([initial] if initial is not None else [])
    return out, final, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("seq_len", [2, 37, 64, 150])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_chunked_equals_the_reference(seq_len, dtype, tol):
    inputs = _rule_inputs(2, seq_len, dtype=dtype)
    initial = _randn(2, 3, 16, 8, seed=7, dtype=dtype).requires_grad_()
    chunked = _run(gated_delta.gated_delta_chunked, inputs, initial)
    reference = _run(gated_delta.gated_delta_reference, inputs, initial)
    assert rel_err(chunked[0], reference[0]) < tol
    assert rel_err(chunked[1], reference[1]) < tol
    for got, want in zip(chunked[2], reference[2]):
        assert rel_err(got, want, floor=1e-30) < tol
    assert chunked[0].dtype == dtype and chunked[1].dtype == dtype


def test_the_reference_equals_transformers_recurrence():
    q, k, v, g, beta = (t.detach() for t in _rule_inputs(2, 40))
    initial = _randn(2, 3, 16, 8, seed=7)
    ours, our_state = gated_delta.gated_delta_reference(
        q, k, v, g, beta, scale=None, initial_state=initial, output_final_state=True, cu_seqlens=None
    )
    theirs, their_state = torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=initial, output_final_state=True
    )
    assert rel_err(ours, theirs) < 1e-6 and rel_err(our_state, their_state) < 1e-6


LENGTHS = [70, 5, 0, 75, 64]  # sequences across chunk edges, one empty, one exactly a chunk


@pytest.mark.parametrize("impl", ["chunked", "reference"])
def test_packed_sequences_equal_each_run_alone(impl):
    fn = {"chunked": gated_delta.gated_delta_chunked, "reference": gated_delta.gated_delta_reference}[impl]
    inputs = _rule_inputs(1, sum(LENGTHS))
    initial = _randn(len(LENGTHS), 3, 16, 8, seed=5).requires_grad_()
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    out, final, grads = _run(fn, inputs, initial, cu_seqlens)
    weights = _randn(*out.shape, seed=99)
    start = 0
    for n, length in enumerate(LENGTHS):
        piece = [t[:, start : start + length].detach().requires_grad_() for t in inputs]
        alone_init = initial[n : n + 1].detach().requires_grad_()
        alone, alone_final = fn(*piece, scale=None, initial_state=alone_init, output_final_state=True, cu_seqlens=None)
        assert _same(out[:, start : start + length], alone)
        assert _same(final[n], alone_final[0])
        if length:
            loss = (alone * weights[:, start : start + length]).sum() + (alone_final * 0.5).sum()
            alone_grads = torch.autograd.grad(loss, piece + [alone_init])
            for got, want in zip(grads[:5], alone_grads[:5]):
                assert _same(got[:, start : start + length], want)
            assert _same(grads[5][n], alone_grads[5][0])
        start += length


def _tiny_pair(seed: int = 0) -> tuple[Qwen3_5GatedDeltaNet, GatedDeltaNet]:
    """transformers' block on a tiny Qwen3.5 config with random weights, and megacann's with the same.
    ``A_log`` is drawn small (decay rates 0.001 to 0.02) so that state crosses chunks of 64 tokens."""
    config = Qwen3_5TextConfig(
        hidden_size=HIDDEN,
        linear_num_key_heads=KEY_HEADS,
        linear_num_value_heads=VALUE_HEADS,
        linear_key_head_dim=DK,
        linear_value_head_dim=DV,
        linear_conv_kernel_dim=KERNEL,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    torch.manual_seed(seed)
    theirs = Qwen3_5GatedDeltaNet(config, 0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.3)
        theirs.A_log.uniform_(0.001, 0.02).log_()
    ours = GatedDeltaNet(HIDDEN, KEY_HEADS, VALUE_HEADS, DK, DV, KERNEL, config.rms_norm_eps)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def test_layer_equals_transformers_qwen3_5_gated_deltanet():
    theirs, ours = _tiny_pair()
    assert sorted(n for n, _ in ours.named_parameters()) == sorted(n for n, _ in theirs.named_parameters())
    x = _randn(2, 150, HIDDEN, seed=3)
    weights = _randn(2, 150, HIDDEN, seed=4)
    results = []
    for module in (theirs, ours):
        xi = x.clone().requires_grad_()
        out = module(xi)
        (out * weights).sum().backward()
        results.append((out, xi.grad, {n: p.grad for n, p in module.named_parameters()}))
    (out_t, dx_t, grads_t), (out_o, dx_o, grads_o) = results
    assert rel_err(out_o, out_t) < 1e-5
    assert rel_err(dx_o, dx_t) < 1e-5
    for name, grad in grads_t.items():
        assert rel_err(grads_o[name], grad) < 1e-5, name


def test_packed_documents_equal_the_documents_one_by_one():
    _, layer = _tiny_pair(seed=1)
    lengths = [3, 70, 1, 46]  # the convolution's taps and the chunk edges both cross documents
    x = _randn(1, sum(lengths), HIDDEN, seed=5).requires_grad_()
    segments = torch.repeat_interleave(torch.tensor([4, 9, 2, 7]), torch.tensor(lengths)).unsqueeze(0)
    weights = _randn(*x.shape, seed=6)
    packed = layer(x, segment_ids=segments)
    (packed * weights).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    start, alone_dx = 0, []
    for length in lengths:
        piece = x[:, start : start + length].detach().requires_grad_()
        alone = layer(piece)
        assert _same(packed[:, start : start + length], alone)
        (alone * weights[:, start : start + length]).sum().backward()
        alone_dx.append(piece.grad)
        start += length
    assert _same(x.grad, torch.cat(alone_dx, dim=1))
    for name, param in layer.named_parameters():
        assert _same(packed_grads[name], param.grad), name


def test_packed_rows_of_a_batch_are_independent():
    _, layer = _tiny_pair(seed=2)
    x = _randn(2, 20, HIDDEN, seed=8)
    segments = torch.tensor([[0] * 12 + [1] * 8, [3] * 20])
    packed = layer(x, segment_ids=segments)
    assert _same(packed[1], layer(x[1:])[0])
    assert _same(packed[0, 12:], layer(x[:1, 12:])[0])


def test_decoding_token_by_token_equals_the_full_forward():
    _, layer = _tiny_pair(seed=3)
    x = _randn(2, 30, HIDDEN, seed=9)
    with torch.no_grad():
        full = layer(x)
        cache = layer.new_cache(2)
        prompt = layer(x[:, :20], cache=cache)  # prefill, then one token at a time
        steps = [layer(x[:, t : t + 1], cache=cache) for t in range(20, 30)]
        assert cache.recurrent_state.shape == (2, VALUE_HEADS, DK, DV) and cache.conv_state.shape == (2, 3, 56)
        fresh = layer.new_cache(2)  # from the first token on
        every = [layer(x[:, t : t + 1], cache=fresh) for t in range(30)]
    assert rel_err(torch.cat([prompt, *steps], dim=1), full) < 1e-5
    assert rel_err(torch.cat(every, dim=1), full) < 1e-5


def test_cpu_uses_the_chunked_form_and_npu_says_it_runs_the_reference(caplog, monkeypatch):
    assert ops.selected("gated_delta_rule", "cpu") == "chunked"
    assert ops.implementations("gated_delta_rule") == ["fla", "chunked", "reference"]
    monkeypatch.setattr(gated_delta, "_NOTED", set())
    with caplog.at_level(logging.WARNING, logger="megacann.ops"):
        gated_delta.note_npu_route("npu")
        gated_delta.note_npu_route("npu")
        gated_delta.note_npu_route("cpu")
    assert [r.getMessage() for r in caplog.records] == [
        "megacann.ops: gated_delta_rule runs its PyTorch reference on npu (token by token): torch_npu "
        "provides no gated-delta kernel megacann can verify"
    ]


def test_the_fla_route_hands_the_op_to_flash_linear_attention(monkeypatch):
    """No GPU here: a stand-in ``fla.ops.gated_delta_rule`` (running the reference) checks what the route
    passes on: the chunked kernel for training and prefill, the recurrent one for a step without
    gradient, one dtype for q, k, v and beta, the decay in fp32, ``cu_seqlens`` as int64."""
    calls = []

    def stand_in(name):
        def kernel(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
            dtypes = {t.dtype for t in (q, k, v, beta)}
            calls.append((name, dtypes, g.dtype, None if cu_seqlens is None else cu_seqlens.dtype, scale))
            options = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state)
            return gated_delta.gated_delta_reference(q, k, v, g, beta, cu_seqlens=cu_seqlens, **options)

        return kernel

    module = types.ModuleType("fla.ops.gated_delta_rule")
    module.chunk_gated_delta_rule = stand_in("chunk")
    module.fused_recurrent_gated_delta_rule = stand_in("recurrent")
    for name, value in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops"))):
        monkeypatch.setitem(sys.modules, name, value)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", module)
    q, k, v, g, beta = (t.detach() for t in _rule_inputs(1, 10))
    packed = dict(scale=None, initial_state=None, output_final_state=True, cu_seqlens=torch.tensor([0, 3, 10]))
    out, state = gated_delta.gated_delta_fla(q, k, v.to(torch.float64), g, beta, **packed)
    want, want_state = gated_delta.gated_delta_reference(q, k, v.to(torch.float64), g, beta, **packed)
    assert torch.equal(out, want) and torch.equal(state, want_state) and out.dtype == torch.float64
    with torch.no_grad():
        step = dict(scale=0.5, initial_state=state[1:].float(), output_final_state=True, cu_seqlens=None)
        gated_delta.gated_delta_fla(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], **step)
    assert calls == [
        ("chunk", {torch.float64}, torch.float32, torch.int64, 16**-0.5),
        ("recurrent", {torch.float32}, torch.float32, None, 0.5),
    ]


def test_bad_inputs_are_refused_by_name():
    q, k, v, g, beta = (t.detach() for t in _rule_inputs(2, 10))
    with pytest.raises(ValueError, match="cu_seqlens packs sequences into one row, but the batch has 2 rows"):
        ops.gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 10]))
    with pytest.raises(ValueError, match=r"cu_seqlens must rise from 0 to the sequence length 10, got \[0, 4\]"):
        ops.gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"initial_state has shape \(1, 3, 16, 8\), expected \(2, 3, 16, 8\)"):
        ops.gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(1, 3, 16, 8))
    with pytest.raises(ValueError, match="linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"):
        GatedDeltaNet(HIDDEN, 2, 3, DK, DV)
    _, layer = _tiny_pair()
    with pytest.raises(ValueError, match="a decoding cache takes one sequence per row"):
        layer(_randn(1, 4, HIDDEN, seed=1), segment_ids=torch.zeros(1, 4, dtype=torch.long), cache=layer.new_cache(1))
