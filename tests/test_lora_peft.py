"""PEFT format: adapters written by megacann load with ``peft.PeftModel.from_pretrained`` on the Hugging Face
base megacann exports and give megacann's logits (fp32, 1e-4), for separate and fused (shared-A and
per-part) projections; they read back into megacann (fused or not) with the same logits; adapter
directories megacann cannot honour are refused by name."""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import pytest
import torch

from megacann.config import ModelConfig
from megacann.interop.full_state import load_full_state_dict_
from megacann.interop.hf import SafetensorsReader, from_pretrained_hf, save_pretrained_hf
from megacann.interop.peft import (
    ADAPTER_CONFIG,
    PeftFormatError,
    load_peft_adapter,
    read_peft_tensors,
    save_peft_adapter,
)
from megacann.layers import init_normal, initialize_weights, parameter_seed
from megacann.layers.lora import LoRAConfig, attach_lora, init_adapters_, lora_parameters, unload_lora
from megacann.layers.sharding import init_sharded_
from megacann.models import GPTModel, LlamaModel, decoder
from megacann.models.hf_llama import from_hf_tensors

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

CFG = ModelConfig(
    hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=61,
    ffn_hidden_size=48, precision="fp32",
)  # fmt: skip
CASES = {  # name: (megacann fuses q/k/v, targets, HF modules expected in adapter_config.json)
    "separate": (False, ("q_proj", "v_proj", "gate_proj", "down_proj"), ["q_proj", "v_proj", "gate_proj", "down_proj"]),
    "fused_shared": (True, ("qkv_proj", "o_proj", "gate_up_proj"), ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]),
    "fused_parts": (True, ("k_proj", "v_proj", "up_proj", "down_proj"), ["k_proj", "v_proj", "up_proj", "down_proj"]),
}  # fmt: skip
IDS = torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))


def _base(fused_qkv: bool = False, seed: int = 3) -> LlamaModel:
    """The tiny LLaMA, with one fused qkv_proj per block if asked (the model config has no switch for it)."""
    with pytest.MonkeyPatch.context() as patch:
        if fused_qkv:
            original = decoder.block_config
            patch.setattr(decoder, "block_config", lambda *a, **k: replace(original(*a, **k), fused_qkv=True))
        model = LlamaModel(CFG)
    initialize_weights(model, seed)
    return model.eval()


def _randomise_adapters(model, seed=3):
    init_adapters_(model, functools.partial(parameter_seed, seed))
    for name, p in lora_parameters(model):
        if name.endswith("lora_B"):
            init_sharded_(p, init_normal(0.3), 0, 1, parameter_seed(seed + 1, name))


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS)


@pytest.mark.parametrize("case", sorted(CASES))
def test_peft_loads_megacann_adapters_with_the_same_logits(tmp_path, case):
    fused, targets, hf_targets = CASES[case]
    model = _base(fused)
    assert hasattr(model.layers["0"].self_attn, "qkv_proj") == fused
    save_pretrained_hf([model], str(tmp_path / "base"), model.config)
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=targets)
    attach_lora(model, lora)
    _randomise_adapters(model)
    ours = _logits(model)
    save_peft_adapter([model], str(tmp_path / "adapter"), lora, base_model_name_or_path=str(tmp_path / "base"))
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == hf_targets and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert len(read_peft_tensors(str(tmp_path / "adapter"))) == 2 * 2 * len(hf_targets)

    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "base"), attn_implementation="eager").eval()
    with torch.no_grad():
        base_logits = hf(IDS).logits
    peft_model = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        theirs = peft_model(IDS).logits
    assert (ours - base_logits).abs().max() > 0.05  # the adapters really act
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)

    # and back into megacann, on the exported base (whose q/k/v projections are separate)
    back = from_pretrained_hf(str(tmp_path / "base")).eval()
    read = load_peft_adapter(back, str(tmp_path / "adapter"))
    assert read.target_modules == tuple(hf_targets) and read.rank == 4
    assert all(not p.requires_grad for n, p in back.named_parameters() if ".adapter." not in n)
    torch.testing.assert_close(_logits(back), ours, rtol=0, atol=1e-5)


def test_a_peft_adapter_loads_into_fused_projections(tmp_path):
    """An adapter with separate q/k/v LoRAs (own A each) reads into one fused qkv_proj."""
    separate = _base()
    save_pretrained_hf([separate], str(tmp_path / "base"), separate.config)
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj"))
    attach_lora(separate, lora)
    _randomise_adapters(separate)
    save_peft_adapter([separate], str(tmp_path / "adapter"), lora)
    fused = _base(fused_qkv=True)
    load_full_state_dict_(
        [fused],
        from_hf_tensors(
            [n for n, _ in fused.named_parameters()], SafetensorsReader(str(tmp_path / "base")), fused.config
        ),
    )
    load_peft_adapter(fused, str(tmp_path / "adapter"))
    assert tuple(fused.layers["0"].self_attn.qkv_proj.adapter.lora_A.shape) == (12, 32)  # 3 parts, rank 4 each
    torch.testing.assert_close(_logits(fused), _logits(separate), rtol=0, atol=1e-5)


def test_merged_and_unloaded_model_exports_to_transformers_with_the_adapter_logits(tmp_path):
    model = _base(fused_qkv=True)
    attach_lora(model, LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "gate_up_proj", "o_proj")))
    _randomise_adapters(model)
    adapted = _logits(model)
    assert unload_lora(model, merge=True) == 2 * 3
    assert not any(".adapter." in name for name, _ in model.named_parameters())
    save_pretrained_hf([model], str(tmp_path), model.config)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS).logits, adapted, rtol=0, atol=1e-4)


def _write_adapter(path, **changes):
    model = _base()
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    attach_lora(model, lora)
    save_peft_adapter([model], str(path), lora)
    config_file = path / ADAPTER_CONFIG
    config = json.loads(config_file.read_text())
    config.update(changes)
    config_file.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"use_dora": True}, "use_dora=True is not supported"),
        ({"bias": "all"}, "bias='all' is not supported"),
        ({"peft_type": "IA3"}, "peft_type 'IA3'; only 'LORA' adapters are supported"),
        ({"target_modules": ".*attn.*"}, "target_modules '.*attn.*' is a pattern"),
        ({"target_modules": ["q_proj", "lm_head"]}, "'lm_head' is not a projection name"),
        ({"target_modules": ["q_proj"]}, r"tensors \['base_model.model.model.layers.0.self_attn.v_proj.lora_A"),
        ({"target_modules": ["q_proj", "v_proj", "o_proj"]}, "missing tensor 'base_model.model.model.layers.0.self_attn.o_proj"),
    ],
)  # fmt: skip
def test_adapters_megacann_cannot_honour_are_refused(tmp_path, changes, message):
    _write_adapter(tmp_path, **changes)
    with pytest.raises(PeftFormatError, match=message):
        load_peft_adapter(_base(), str(tmp_path))


def test_peft_export_is_refused_for_models_it_does_not_name(tmp_path):
    gpt = GPTModel(replace(CFG, type="gpt", num_key_value_heads=None))
    lora = LoRAConfig(target_modules=("q_proj",))
    attach_lora(gpt, lora)
    with pytest.raises(PeftFormatError, match="family 'gpt' has no Hugging Face adapter naming its projections"):
        save_peft_adapter([gpt], str(tmp_path), lora)
