"""On a CUDA device (skipped elsewhere): the RNG tracker forks the CUDA generator, recompute restores it,
and a block on the GPU computes what the same block computes on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megacann import accelerator
from megacann.layers import TransformerBlock, TransformerBlockConfig, get_rng_tracker, model_parallel_manual_seed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setenv("MEGACANN_DEVICE", "cuda")
    monkeypatch.setattr(accelerator, "_ACCELERATOR", None)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    get_rng_tracker().reset()
    yield
    get_rng_tracker().reset()


def _config(**kw) -> TransformerBlockConfig:
    return TransformerBlockConfig(
        hidden_size=64, num_attention_heads=8, num_key_value_heads=2, ffn_hidden_size=128, **kw
    )


def test_tracker_forks_the_cuda_generator(on_cuda):
    model_parallel_manual_seed(3)
    ones = torch.ones(4096, device="cuda")
    cpu_state = torch.get_rng_state()
    states = get_rng_tracker().get_states()
    with get_rng_tracker().fork():
        forked = F.dropout(ones, 0.5)
    default = F.dropout(ones, 0.5)
    assert not torch.equal(forked, default)
    assert torch.equal(torch.get_rng_state(), cpu_state)  # the CPU generator is not the one forked
    get_rng_tracker().set_states(states)
    with get_rng_tracker().fork():
        assert torch.equal(F.dropout(ones, 0.5), forked)


def _step(recompute: str):
    model_parallel_manual_seed(5)
    block = TransformerBlock(_config(hidden_dropout=0.2, attention_dropout=0.2, recompute=recompute))
    assert block.mlp.down_proj.weight.device.type == "cuda"  # parameters land on the accelerator
    model_parallel_manual_seed(6)
    x = torch.randn(2, 16, 64, device="cuda", requires_grad=True)
    out = block(block(x))
    out.sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


def test_recompute_on_cuda_gives_identical_grads(on_cuda):
    base = _step("none")
    for recompute in ("selective", "full"):
        got = _step(recompute)
        assert torch.equal(got[0], base[0]) and torch.allclose(got[1], base[1], rtol=1e-5, atol=1e-7)
        for name, grad in base[2].items():
            assert torch.allclose(got[2][name], grad, rtol=1e-5, atol=1e-7), (recompute, name)


def test_block_on_cuda_matches_cpu(on_cuda):
    seg = torch.tensor([[0] * 5 + [1] * 11, [0] * 16])
    results = []
    for device in ("cpu", "cuda"):
        model_parallel_manual_seed(7)  # the weights are drawn on the CPU: identical on both devices
        block = TransformerBlock(_config(), device=device)
        x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
        out = block(x, None, seg.to(device))
        out.square().sum().backward()
        results.append((out.detach().cpu(), x.grad.cpu(), block.self_attn.k_proj.weight.grad.cpu()))
    for cpu, gpu in zip(*results):
        assert torch.allclose(gpu, cpu, rtol=1e-4, atol=1e-5)
