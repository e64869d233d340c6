"""LoRA on one process: the adapted model equals the base at initialisation, base weights are frozen, the
adapter computes ``W x + (alpha/r) B A x`` block by block, part targets on a fused projection equal LoRAs on
separate projections, merge equals the adapter forward, and bad settings are refused clearly."""

from __future__ import annotations

import functools

import pytest
import torch

from megacann.config import ModelConfig
from megacann.layers import (
    ColumnParallelLinear,
    TransformerBlock,
    TransformerBlockConfig,
    init_normal,
    initialize_weights,
    parameter_seed,
)
from megacann.layers.lora import (
    LoRAConfig,
    attach_lora,
    count_parameters,
    init_adapters_,
    is_lora_parameter,
    lora_adapters,
    lora_parameters,
    merge_lora,
    unmerge_lora,
)
from megacann.layers.sharding import init_sharded_
from megacann.models import GPTModel, LlamaModel

CFG = ModelConfig(
    hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=61, ffn_hidden_size=48
)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _ids(seed=0, shape=(2, 12)):
    return torch.randint(0, CFG.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def _randomise_b(model, seed=11, std=0.3):
    """Non-zero B (drawn by name), so the adapters change the output."""
    for name, p in lora_parameters(model):
        if name.endswith("lora_B"):
            init_sharded_(p, init_normal(std), 0, 1, parameter_seed(seed, name))


def _lora_model(lora: LoRAConfig, seed=3) -> LlamaModel:
    model = LlamaModel(CFG)
    initialize_weights(model, seed)
    attach_lora(model, lora)
    init_adapters_(model, functools.partial(parameter_seed, seed))
    return model


def test_adapted_model_equals_base_at_init_and_base_is_frozen():
    base = LlamaModel(CFG)
    initialize_weights(base, 3)
    ids = _ids()
    with torch.no_grad():
        expected = base(input_ids=ids)
    model = _lora_model(LoRAConfig(rank=4, alpha=8, dropout=0.1, target_modules="all-linear"))
    drawn = {name: p.detach().clone() for name, p in lora_parameters(model)}
    initialize_weights(model, 3)  # the whole-model initialiser draws adapters from their names alike
    assert all(torch.equal(p, drawn[name]) for name, p in lora_parameters(model))
    assert all(p.abs().sum() > 0 for name, p in drawn.items() if name.endswith("lora_A"))
    model.train()  # dropout on: B = 0 still makes every adapter output exactly zero
    assert torch.equal(model(input_ids=ids), expected)
    assert len(list(lora_adapters(model))) == 2 * 6  # q, k, v, o, gate_up (fused: gate and up parts), down
    loss = model(input_ids=ids, labels=_ids(1)).mean()
    loss.backward()
    for name, p in model.named_parameters():
        if is_lora_parameter(p):
            assert p.requires_grad and p.grad is not None, name
        else:
            assert not p.requires_grad and p.grad is None, name
    # B = 0: A's gradient is zero, B's is not
    grads = {name: p.grad for name, p in lora_parameters(model)}
    assert all(g.abs().sum() == 0 for n, g in grads.items() if n.endswith("lora_A"))
    assert all(g.abs().sum() > 0 for n, g in grads.items() if n.endswith("lora_B"))
    # trainable parameter count: per layer q, k, v, o, gate, up, down each r*(in + out)
    h, f, kv, r = 32, 48, 16, 4
    per_layer = r * ((h + h) + (h + kv) * 2 + (h + h) + (h + f) * 2 + (f + h))
    trainable, total = count_parameters(model)
    assert trainable == 2 * per_layer
    assert total == trainable + sum(p.numel() for p in base.parameters())


def _fused_column(targets, bias=True):
    layer = ColumnParallelLinear(16, 32, bias=bias, tp_blocks=(16, 8, 8))
    holder = torch.nn.ModuleDict({"qkv_proj": layer})
    attach_lora(holder, LoRAConfig(rank=3, alpha=6.0, target_modules=targets))
    torch.manual_seed(4)
    for p in layer.parameters():
        torch.nn.init.normal_(p.data, std=0.5)
    return layer


def test_column_adapter_computes_the_lora_formula_block_by_block():
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    scale = 6.0 / 3

    layer = _fused_column(("qkv_proj",))  # one LoRA on the whole fused matrix
    a, b = layer.adapter.lora_A, layer.adapter.lora_B
    assert tuple(a.shape) == (3, 16) and tuple(b.shape) == (32, 3)
    expected = x @ layer.weight.T + layer.bias + scale * (x @ a.T) @ b.T
    torch.testing.assert_close(layer(x), expected, rtol=1e-6, atol=1e-6)

    layer = _fused_column(("q_proj", "v_proj"))  # own LoRA for q and v, none for k
    a, b = layer.adapter.lora_A, layer.adapter.lora_B
    assert tuple(a.shape) == (6, 16) and tuple(b.shape) == (24, 3)
    a_q, a_v, b_q, b_v = a[:3], a[3:], b[:16], b[16:]
    base = x @ layer.weight.T + layer.bias
    expected = base.clone()
    expected[..., :16] += scale * (x @ a_q.T) @ b_q.T
    expected[..., 24:] += scale * (x @ a_v.T) @ b_v.T
    out = layer(x)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[..., 16:24], base[..., 16:24])  # k untouched


def _block(fused: bool) -> TransformerBlock:
    cfg = TransformerBlockConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=40, fused_qkv=fused,
        fused_gate_up=fused,
    )  # fmt: skip
    return TransformerBlock(cfg)


def test_part_targets_on_fused_projections_equal_loras_on_separate_projections():
    targets = LoRAConfig(rank=4, alpha=4.0, target_modules=("q_proj", "v_proj", "gate_proj", "down_proj"))
    separate, fused = _block(False), _block(True)
    attach_lora(separate, targets)
    attach_lora(fused, targets)
    torch.manual_seed(0)
    for p in separate.parameters():
        torch.nn.init.normal_(p.data, std=0.2)
    s = dict(separate.named_parameters())
    joined = {
        "self_attn.qkv_proj.weight": torch.cat([s[f"self_attn.{p}_proj.weight"] for p in "qkv"]),
        "self_attn.qkv_proj.adapter.lora_A": torch.cat([s[f"self_attn.{p}_proj.adapter.lora_A"] for p in "qv"]),
        "self_attn.qkv_proj.adapter.lora_B": torch.cat([s[f"self_attn.{p}_proj.adapter.lora_B"] for p in "qv"]),
        "mlp.gate_up_proj.weight": torch.cat([s["mlp.gate_proj.weight"], s["mlp.up_proj.weight"]]),
        "mlp.gate_up_proj.adapter.lora_A": s["mlp.gate_proj.adapter.lora_A"],
        "mlp.gate_up_proj.adapter.lora_B": s["mlp.gate_proj.adapter.lora_B"],
    }
    with torch.no_grad():
        for name, p in fused.named_parameters():
            p.copy_(joined[name] if name in joined else s[name])
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(fused(x), separate(x), rtol=1e-5, atol=1e-5)
    assert sum(p.numel() for _, p in lora_parameters(fused)) == sum(p.numel() for _, p in lora_parameters(separate))


def test_merge_equals_the_adapter_forward_and_unmerge_restores():
    model = _lora_model(LoRAConfig(rank=4, alpha=8, target_modules=("qkv_proj", "o_proj", "gate_up_proj")))
    _randomise_b(model)
    model.eval()
    ids = _ids()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        adapted = model(input_ids=ids)
        assert merge_lora(model) == 2 * 5  # q, k, v (unfused here), o, gate_up per layer
        merged = model(input_ids=ids)
        assert all(adapter(torch.zeros(1, 32)) is None for _, adapter in lora_adapters(model) if adapter.column)
        assert merge_lora(model) == 0  # already merged
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert sorted(changed) == sorted(
        f"layers.{i}.{m}.weight"
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_up_proj")
    )
    assert unmerge_lora(model) == 10
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, before[n], rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids), adapted, rtol=1e-5, atol=1e-5)


def test_dropout_acts_in_training_only():
    model = _lora_model(LoRAConfig(rank=4, alpha=8, dropout=0.5, target_modules=("v_proj", "down_proj")))
    _randomise_b(model)
    ids = _ids()
    with torch.no_grad():
        model.eval()
        a, b = model(input_ids=ids), model(input_ids=ids)
        model.train()
        torch.manual_seed(0)
        c = model(input_ids=ids)
        torch.manual_seed(0)
        d = model(input_ids=ids)
        torch.manual_seed(1)
        e = model(input_ids=ids)
    assert torch.equal(a, b) and torch.equal(c, d)
    assert not torch.allclose(a, c) and not torch.allclose(c, e)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(rank=0), "LoRA rank must be a positive integer, got 0"),
        (dict(alpha=0.0), "LoRA alpha must be positive"),
        (dict(dropout=1.0), r"LoRA dropout must be in \[0, 1\), got 1.0"),
        (dict(target_modules=("q_prj",)), "'q_prj' is not a projection name .* did you mean 'q_proj'"),
        (dict(target_modules=()), "LoRA target_modules is empty"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoRAConfig(**kwargs)


def test_targets_that_do_not_fit_the_model_are_refused():
    gpt = GPTModel(ModelConfig(type="gpt", hidden_size=32, num_layers=1, num_attention_heads=4, vocab_size=61))
    with pytest.raises(ValueError, match=r"\['gate_proj'\] match no layer .* \['down_proj', 'k_proj', 'o_proj'"):
        attach_lora(gpt, LoRAConfig(target_modules=("q_proj", "gate_proj")))
    with pytest.raises(ValueError, match=r"names both the fused 'qkv_proj' and its parts \['k_proj'\]"):
        attach_lora(_block(True), LoRAConfig(target_modules=("qkv_proj", "k_proj")))
    model = LlamaModel(CFG)
    attach_lora(model, LoRAConfig(target_modules=("o_proj",)))
    with pytest.raises(ValueError, match="layers.0.self_attn.o_proj already has an adapter"):
        attach_lora(model, LoRAConfig(target_modules=("o_proj",)))
    # a fused name on a model with separate projections selects each part
    names = attach_lora(LlamaModel(CFG), LoRAConfig(target_modules=("qkv_proj",)))
    assert names == [f"layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkv"]
