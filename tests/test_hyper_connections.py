"""Hyper-connections (DeepSeek-V4's mHC) against transformers' own modules with the same weights.

transformers' ``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead`` get random weights; megacann's
layers load them by name. Outputs and every parameter's and the input's gradients agree in fp32; the
stream update after a block is checked against transformers' decoder-layer formula written out here."""

from __future__ import annotations

import pytest
import torch

from megacann.layers.hyper_connections import HyperConnection, HyperHead, expand_streams, sinkhorn_project
from megacann.layers.sharding import get_sharding

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf  # noqa: E402

HIDDEN, STREAMS, ITERATIONS = 16, 4, 20


def _hf_config():
    return transformers.DeepseekV4Config(
        hidden_size=HIDDEN, hc_mult=STREAMS, hc_sinkhorn_iters=ITERATIONS, hc_eps=1e-6, rms_norm_eps=1e-6
    )


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Every parameter random (normal, std 0.5), so the biases and scales matter too."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)


def _pair(hf_cls, ours_cls, **kwargs):
    reference = hf_cls(_hf_config()).float()
    _randomize(reference, 0)
    ours = ours_cls(HIDDEN, STREAMS, **kwargs)
    ours.load_state_dict(reference.state_dict())  # copied by name: transformers' names are ours
    return reference, ours


def _streams(seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, 5, STREAMS, HIDDEN, generator=generator)


def _assert_grads_equal(reference: torch.nn.Module, ours: torch.nn.Module) -> None:
    theirs = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, theirs[name].grad, rtol=1e-5, atol=1e-6, msg=name)


def test_hyper_connection_matches_transformers_outputs_and_gradients():
    reference, ours = _pair(hf.DeepseekV4HyperConnection, HyperConnection, sinkhorn_iterations=ITERATIONS)
    x_ref, x_ours = _streams().requires_grad_(True), _streams().requires_grad_(True)
    post_r, comb_r, collapsed_r = reference(x_ref)
    post, comb, collapsed = ours(x_ours)
    for got, expected in ((post, post_r), (comb, comb_r), (collapsed, collapsed_r)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    probe = torch.randn(collapsed.shape[:-1] + (STREAMS + STREAMS * STREAMS + HIDDEN,))
    pieces = (post_r, comb_r.flatten(-2), collapsed_r), (post, comb.flatten(-2), collapsed)
    for post_i, comb_i, collapsed_i in pieces:
        (torch.cat([post_i, comb_i, collapsed_i], -1) * probe).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    _assert_grads_equal(reference, ours)


def test_mix_is_transformers_decoder_update():
    """After a block: ``post_i · out + Σ_j comb[j, i] · stream_j`` (comb read transposed)."""
    _, ours = _pair(hf.DeepseekV4HyperConnection, HyperConnection)
    streams = _streams()
    post, comb, collapsed = ours(streams)
    block_output = torch.tanh(collapsed)
    expected = torch.einsum("bsi,bsh->bsih", post, block_output) + torch.einsum("bsji,bsjh->bsih", comb, streams)
    torch.testing.assert_close(HyperConnection.mix(streams, block_output, post, comb), expected, rtol=1e-6, atol=1e-6)


def test_hyper_head_matches_transformers_outputs_and_gradients():
    reference, ours = _pair(hf.DeepseekV4HyperHead, HyperHead)
    x_ref, x_ours = _streams(2).requires_grad_(True), _streams(2).requires_grad_(True)
    out_ref, out = reference(x_ref), ours(x_ours)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    probe = torch.randn(out.shape)
    (out_ref * probe).sum().backward()
    (out * probe).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    _assert_grads_equal(reference, ours)


def test_sinkhorn_projection_is_doubly_stochastic_and_expand_copies():
    weights = torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(3)) + 0.01
    projected = sinkhorn_project(weights, 50, 0.0)
    torch.testing.assert_close(projected.sum(-1), torch.ones(3, 4), rtol=0, atol=1e-6)
    torch.testing.assert_close(projected.sum(-2), torch.ones(3, 4), rtol=0, atol=1e-6)
    x = torch.randn(2, 3, 8)
    streams = expand_streams(x, 3)
    assert streams.shape == (2, 3, 3, 8) and all(torch.equal(streams[:, :, i], x) for i in range(3))


def test_sequence_parallel_marks_partial_gradients_and_bad_shape_is_refused():
    for module in (HyperConnection(8, 2, sequence_parallel=True), HyperHead(8, 2, sequence_parallel=True)):
        assert all(get_sharding(p).tp_partial_grad for p in module.parameters())
    assert not any(get_sharding(p).tp_partial_grad for p in HyperConnection(8, 2, sequence_parallel=False).parameters())
    with pytest.raises(ValueError, match=r"streams of shape \(2, 3, 3, 8\), expected \[b, s, 2, 8\]"):
        HyperConnection(8, 2)(torch.zeros(2, 3, 3, 8))
