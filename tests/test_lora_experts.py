"""LoRA on MoE experts, one process (fp32, CPU): every expert gets its own adapter, computed with grouped
matmuls. The adapted model equals its base at init (B = 0), the grouped computation equals each expert
alone, merging gives the adapter forward (part targets leave the other part's rows alone), unmerge and unload
restore the base, the router is never a target and the base is frozen. PEFT: megacann's Mixtral adapters
load in ``peft`` on the exported base with megacann's logits, and read back into megacann.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from layers_reference import rel_err
from lora_expert_helpers import FFN, IDS, TOL, E, H, model_logits, randomise_adapters, tiny_moe_model

from megacann.layers import parameter_seed
from megacann.layers.lora import (
    LoRAConfig,
    attach_lora,
    count_parameters,
    init_adapters_,
    lora_adapters,
    merge_lora,
    unload_lora,
    unmerge_lora,
)
from megacann.layers.sharding import get_sharding

# -- one process ------------------------------------------------------------------------------------------


def test_expert_adapters_start_at_the_base_merge_unmerge_and_unload():
    model = tiny_moe_model(moe_shared_experts=1)
    base, weights = model_logits(model), {n: p.detach().clone() for n, p in model.named_parameters()}
    names = attach_lora(model, LoRAConfig(rank=4, alpha=8.0, dropout=0.3, target_modules="all-linear"))
    experts = [n for n in names if ".experts." in n]
    assert len(experts) == 2 * E * 2 and "layers.1.mlp.experts.3.down_proj" in experts
    assert "layers.0.mlp.shared_experts.gate_up_proj" in names and not any("router" in n for n in names)
    adapter = dict(lora_adapters(model))["layers.0.mlp.experts.2.gate_up_proj"]
    assert get_sharding(adapter.lora_A).expert and get_sharding(adapter.lora_B).expert
    trainable, total = count_parameters(model)
    per_expert = 2 * 4 * H + 2 * FFN * 4 + 4 * FFN + H * 4  # gate and up parts (own A each), down
    attention = 4 * (H + H) + 2 * 4 * (H + H // 2) + 4 * (H + H)  # q, k, v, o with 2 of 4 heads for k/v
    shared = 2 * 4 * H + 2 * FFN * 4 + 4 * FFN + H * 4  # the shared expert is as wide, with its own parts
    assert trainable == 2 * (E * per_expert + attention + shared)
    assert total == trainable + sum(w.numel() for w in weights.values())
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".adapter." not in n)

    randomise_adapters(model)
    b_zero = tiny_moe_model(moe_shared_experts=1)
    attach_lora(b_zero, LoRAConfig(rank=4, alpha=8.0, target_modules="all-linear"))
    init_adapters_(b_zero, functools.partial(parameter_seed, 5))
    assert torch.equal(model_logits(b_zero.eval()), base)  # B = 0: exactly the base

    model.eval()
    adapted = model_logits(model)
    assert rel_err(adapted, base) > 1e-2
    torch.manual_seed(0)
    assert rel_err(model.train()(input_ids=IDS), adapted) > 1e-3  # dropout on the adapters' input acts
    model.eval()
    assert merge_lora(model) == len(names)
    assert rel_err(model_logits(model), adapted) < TOL
    unmerge_lora(model)
    assert all(rel_err(p, weights[n]) < 1e-6 for n, p in model.named_parameters() if n in weights)
    assert rel_err(model_logits(model), adapted) < TOL
    assert unload_lora(model) == len(names)
    assert sorted(n for n, _ in model.named_parameters()) == sorted(weights)
    assert rel_err(model_logits(model), adapted) < TOL


def test_part_targets_adapt_only_their_rows_and_grouped_equals_each_expert():
    model = tiny_moe_model()
    attach_lora(model, LoRAConfig(rank=4, alpha=8.0, target_modules=("up_proj",)))
    randomise_adapters(model)
    experts = model.layers["1"].mlp.experts
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(1))
    counts = [3, 0, 5, 2]  # an expert without tokens too
    with torch.no_grad():
        grouped = experts(x, counts)
        alone = torch.cat([expert(rows) for expert, rows in zip(experts.values(), x.split(counts))])
    assert rel_err(grouped, alone) < TOL
    before = experts["1"].gate_up_proj.weight.detach().clone()
    merge_lora(model)
    after = experts["1"].gate_up_proj.weight
    assert torch.equal(after[:FFN], before[:FFN]) and not torch.equal(after[FFN:], before[FFN:])  # gate, up rows
    assert all(a.down_proj.adapter is None for a in experts.values())  # not a target


def test_the_router_and_unknown_targets_are_refused():
    with pytest.raises(ValueError, match=r"'router' is not a projection name"):
        LoRAConfig(target_modules=("router",))
    model = tiny_moe_model()
    layer = model.layers["0"].mlp  # the MoE layer alone: expert projections, no attention
    with pytest.raises(
        ValueError,
        match=r"\['o_proj'\] match no layer of the model; its projections are \['down_proj', 'gate_up_proj'\]",
    ):
        attach_lora(layer, LoRAConfig(target_modules=("down_proj", "o_proj")))


# -- PEFT --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("targets", ["all-linear", ("o_proj", "down_proj")])
def test_mixtral_peft_adapter_loads_in_peft_and_back(tmp_path, targets):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from megacann.interop.hf import save_pretrained_hf
    from megacann.interop.peft import ADAPTER_CONFIG, load_peft_adapter, read_peft_tensors, save_peft_adapter

    model = tiny_moe_model()
    save_pretrained_hf([model], str(tmp_path / "base"), model.config)
    lora = LoRAConfig(rank=4, alpha=8.0, dropout=0.1, target_modules=targets)
    attach_lora(model, lora)
    randomise_adapters(model)
    expected = model_logits(model.eval())
    save_peft_adapter([model], str(tmp_path / "adapter"), lora)
    tensors = read_peft_tensors(str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    expert = "base_model.model.model.layers.1.block_sparse_moe.experts.3"
    assert torch.equal(
        tensors[f"{expert}.w2.lora_B.weight"], model.layers["1"].mlp.experts["3"].down_proj.adapter.lora_B
    )
    if targets == "all-linear":
        assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3"]
        a = model.layers["1"].mlp.experts["3"].gate_up_proj.adapter.lora_A  # gate and up: own A each
        assert torch.equal(tensors[f"{expert}.w1.lora_A.weight"], a[:4])
        assert torch.equal(tensors[f"{expert}.w3.lora_A.weight"], a[4:])
        assert len(tensors) == 2 * 2 * (4 + 3 * E)
    assert config["lora_dropout"] == 0.0  # PEFT's fused-expert wrappers refuse dropout (a training setting)

    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager").eval()
    with_adapter = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(IDS).logits, expected, rtol=0, atol=1e-4)

    back = tiny_moe_model()
    read = load_peft_adapter(back, str(tmp_path / "adapter")).target_modules  # Mixtral's w1/w3/w2 are gate/up/down
    hf_names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    assert sorted(read) == sorted(hf_names.get(t, t) for t in config["target_modules"])
    assert rel_err(model_logits(back.eval()), expected) < TOL


def test_expert_part_mixes_peft_cannot_fuse_round_trip_in_megacann_with_a_note(tmp_path, capsys):
    from megacann.config.advice import forget_advice
    from megacann.interop.full_state import full_state_dict
    from megacann.interop.lora_export import merge_adapter_tensors
    from megacann.interop.peft import load_peft_adapter, lora_full_tensors, save_peft_adapter

    forget_advice()
    model = tiny_moe_model()
    base = full_state_dict([model])
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=("gate_proj",))
    attach_lora(model, lora)
    randomise_adapters(model)
    save_peft_adapter([model], str(tmp_path), lora)
    assert (
        "PEFT on transformers 5 (fused experts) loads expert adapters only on gate+up+down" in capsys.readouterr().err
    )
    back = tiny_moe_model()
    load_peft_adapter(back, str(tmp_path))
    assert rel_err(model_logits(back.eval()), model_logits(model.eval())) < TOL
    bias = torch.arange(float(E))  # a routing bias the LoRA run moved and saved: carried into the merge
    adapters = {**lora_full_tensors([model]), "layers.0.mlp.router.expert_bias": bias}
    merged = merge_adapter_tensors(base, adapters, model.config, lora)
    assert merged.pop("layers.0.mlp.router.expert_bias") is bias
    merge_lora(model)
    after = full_state_dict([model])
    assert merged.keys() == base.keys()
    for name, tensor in merged.items():
        assert rel_err(tensor, after[name]) < 1e-6, name
