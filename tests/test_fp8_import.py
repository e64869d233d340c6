"""Block-scaled fp8 Hugging Face checkpoints (DeepSeek-V3's published format) read by megacann's weight import.

A tiny deepseek_v3 model is written by megacann, and the test quantises its linear weights itself
(float8_e4m3fn, one float32 scale per block of BLOCK, shapes that are no multiple of it so that the last
blocks of rows and columns are partial; the block is not square so that a row / column mix-up shows). After
import (``from_pretrained_hf``, ``model.init_from``'s loader, ``megacann-convert from-hf``) megacann's
weights equal the test's own block-by-block dequantisation exactly, and the logits equal those of the model
loaded from that dequantised checkpoint; the export holds the dequantised weights and no quantisation.
Every malformed checkpoint is refused by its message.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megacann.config import ConfigError, MegacannConfig, config_from_dict
from megacann.config.hf_config import read_hf_config
from megacann.interop.hf import from_pretrained_hf, hf_family, hf_weights_reader, save_pretrained_hf
from megacann.interop.model_source import apply_model_source
from megacann.interop.reading import load_source_weights
from megacann.interop.sources import HUGGINGFACE, WeightSource
from megacann.models import ChunkPlacement, get_model_spec, prepare_model_config

BLOCK = [16, 12]
QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": BLOCK}
# 2 layers (a dense one, an MoE one), widths 40 / 56 / 24 / 20: no multiple of 16 or 12
SHAPE = {
    "model_type": "deepseek_v3",
    "vocab_size": 64,
    "hidden_size": 40,
    "intermediate_size": 56,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "q_lora_rank": 24,
    "kv_lora_rank": 20,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 12,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 0,
}
IDS = torch.randint(0, SHAPE["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
FP8_MAX = 448.0  # the largest float8_e4m3fn


def blocks(shape):
    """(row slice, column slice, scale index) of every BLOCK-sized tile of a weight of ``shape``."""
    for i in range(math.ceil(shape[0] / BLOCK[0])):
        for j in range(math.ceil(shape[1] / BLOCK[1])):
            yield slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1]), (i, j)


def quantize(weight):
    """The test's fp8 quantiser: each tile divided by its absolute maximum / 448, its scale kept."""
    q = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(math.ceil(weight.shape[0] / BLOCK[0]), math.ceil(weight.shape[1] / BLOCK[1]))
    for rows, cols, ij in blocks(weight.shape):
        scale[ij] = weight[rows, cols].abs().max() / FP8_MAX
        q[rows, cols] = (weight[rows, cols] / scale[ij]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q, scale):
    """The test's own dequantisation, tile by tile."""
    return dequantize_with(q, scale, BLOCK)


def dequantize_with(q, scale, block):
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = q[rows, cols].to(torch.float32) * scale[i, j]
    return out


def write_hf(path, tensors, config):
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def fp8_checkpoint(root, shape: dict = SHAPE) -> dict:
    """A tiny deepseek_v3 of ``shape`` drawn by megacann (norms and routing biases randomised), written under
    ``root``: ``fp8``: the quantised checkpoint; ``deq``: the same dequantised by the test (plain fp32);
    ``tensors``: deq's tensors; ``original``: the weights before quantisation; ``quantised``: the names the
    test quantised (every ``*_proj.weight``)."""
    with open(root / "config.json", "w") as f:
        json.dump(shape, f)
    spec = get_model_spec("deepseek_v3")
    cfg = MegacannConfig(model=spec.hf.config_from_hf(str(root / "config.json")))
    prepare_model_config(cfg, spec)
    torch.manual_seed(0)
    model = spec.build(cfg, ChunkPlacement(tuple(range(shape["num_hidden_layers"]))))
    with torch.no_grad():
        for name, param in model.named_parameters():  # not the ones and zeros they start at
            if "norm" in name:
                param.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(param.numel()))
            elif name.endswith("expert_bias"):  # small beside the scores: each token routed by its own
                param.uniform_(-0.05, 0.05, generator=torch.Generator().manual_seed(param.numel()))
    save_pretrained_hf([model], str(root / "orig"), model.config)
    original = load_file(str(root / "orig" / "model.safetensors"))
    with open(root / "orig" / "config.json") as f:
        config = json.load(f)
    fp8, deq = {}, {}
    for name, tensor in original.items():
        if name.endswith("_proj.weight"):  # attention, dense MLP, experts, shared experts (not the router)
            fp8[name], fp8[name + "_scale_inv"] = quantize(tensor)
            deq[name] = dequantize(fp8[name], fp8[name + "_scale_inv"])
        else:
            fp8[name] = deq[name] = tensor
    quantised = sorted(n for n in original if n.endswith("_proj.weight"))
    assert any(original[n].shape[0] % BLOCK[0] and original[n].shape[1] % BLOCK[1] for n in quantised)
    return {
        "fp8": write_hf(root / "fp8", fp8, {**config, "quantization_config": QUANT}),
        "deq": write_hf(root / "deq", deq, config),
        "tensors": deq,
        "original": original,
        "quantised": quantised,
        "root": root,
    }


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return fp8_checkpoint(tmp_path_factory.mktemp("fp8"))


def test_import_dequantises_each_weight_exactly_and_gives_the_same_logits(ckpt):
    ours = from_pretrained_hf(ckpt["fp8"]).eval()
    reference = from_pretrained_hf(ckpt["deq"]).eval()
    names = [n for n, _ in reference.named_parameters()]
    assert [n for n, _ in ours.named_parameters()] == names
    for name, param in ours.named_parameters():
        assert torch.equal(param, reference.get_parameter(name)), name
    deq, original = ckpt["tensors"], ckpt["original"]
    kv_b = "model.layers.1.self_attn.kv_b_proj.weight"  # [40, 20]: partial blocks both ways
    assert torch.equal(ours.get_parameter("layers.1.self_attn.kv_b_proj.weight"), deq[kv_b])
    expert = "model.layers.1.mlp.experts.2.{}_proj.weight"
    fused = torch.cat([deq[expert.format("gate")], deq[expert.format("up")]])
    assert torch.equal(ours.get_parameter("layers.1.mlp.experts.2.gate_up_proj.weight"), fused)
    # the scales were applied: fp8 rounding away from the original weights, by at most e4m3's half step
    error = (deq[kv_b] - original[kv_b]).abs()
    assert 0 < error.max() <= original[kv_b].abs().max() / 16
    with torch.no_grad():
        assert torch.equal(ours(input_ids=IDS), reference(input_ids=IDS))

    # model.init_from: the recipe's architecture from the fp8 directory, then its loader (each rank's shards,
    # tensor by tensor) into a model of other weights
    recipe = config_from_dict({"model": {"init_from": ckpt["fp8"]}})  # no model.type: the source's
    apply_model_source(recipe)
    assert (
        recipe.model.type == "deepseek_v3"
        and recipe.model.kv_lora_rank == SHAPE["kv_lora_rank"]
        and recipe.model.rotary_interleaved
    )
    with torch.no_grad():
        for param in ours.parameters():
            param.zero_()
    load_source_weights([ours], WeightSource(HUGGINGFACE, ckpt["fp8"]), ours.config)
    for name, param in ours.named_parameters():
        assert torch.equal(param, reference.get_parameter(name)), name
    # straight into another dtype: one rounding of the fp32 product
    reader = hf_weights_reader(ckpt["fp8"], torch.bfloat16)
    assert torch.equal(reader(kv_b), deq[kv_b].to(torch.bfloat16))
    assert reader("model.norm.weight").dtype == torch.float32  # unquantised tensors come as stored


def test_each_import_parses_config_json_once(ckpt, monkeypatch):
    """hf_family's parsed config.json is what the family's adapter (here DeepSeek-V3's, which also reads
    the defaults transformers assumes) and the weights reader take: from_pretrained_hf, read_weights and
    ``model.init_from``'s loader each read the file once."""
    import megacann.config.hf_config
    import megacann.interop.hf
    import megacann.models.hf_deepseek
    from megacann.interop.reading import read_weights

    reads = []
    for module in (megacann.config.hf_config, megacann.interop.hf, megacann.models.hf_deepseek):
        monkeypatch.setattr(module, "read_hf_config", lambda file: reads.append(file) or read_hf_config(file))
    config_file = os.path.join(ckpt["fp8"], "config.json")
    model = from_pretrained_hf(ckpt["fp8"])
    assert reads == [config_file]
    _, cfg = read_weights(ckpt["fp8"])
    assert reads == [config_file] * 2
    load_source_weights([model], WeightSource(HUGGINGFACE, ckpt["fp8"]), cfg)
    assert reads == [config_file] * 3


def test_convert_round_trip_writes_the_dequantised_weights_unquantised(ckpt, capsys):
    from megacann.convert import main as convert

    root = ckpt["root"]
    assert convert(["from-hf", ckpt["fp8"], str(root / "whole")]) == 0
    assert convert(["to-hf", str(root / "whole"), str(root / "back")]) == 0
    back = load_file(str(root / "back" / "model.safetensors"))
    assert sorted(back) == sorted(ckpt["tensors"])  # no weight_scale_inv
    for name, tensor in ckpt["tensors"].items():
        assert back[name].dtype == torch.float32 and torch.equal(back[name], tensor), name
    with open(root / "back" / "config.json") as f:
        assert "quantization_config" not in json.load(f)
    assert "quantization_config" not in capsys.readouterr().err  # read without a note

    transformers = pytest.importorskip("transformers")
    theirs = transformers.DeepseekV3ForCausalLM.from_pretrained(str(root / "back"), attn_implementation="eager")
    ours = from_pretrained_hf(ckpt["fp8"]).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs.eval()(IDS).logits, ours(input_ids=IDS), atol=1e-4, rtol=0)


def test_to_hf_can_write_block_scaled_fp8_that_both_importers_read_back(ckpt, capsys):
    """``to-hf --fp8-block``: the projections quantised as the test's own quantiser does (bitwise), the rest
    as stored; megacann reads the directory back with the logits of the test's dequantised checkpoint, and
    transformers (which dequantises fine-grained fp8 on a CPU) with its own logits of that checkpoint."""
    from megacann.convert import main as convert

    root = ckpt["root"]
    assert convert(["from-hf", str(root / "orig"), str(root / "orig_whole")]) == 0
    assert convert(["to-hf", str(root / "orig_whole"), str(root / "fp8_export"), "--fp8-block", *map(str, BLOCK)]) == 0
    exported = load_file(str(root / "fp8_export" / "model.safetensors"))
    for name, tensor in ckpt["original"].items():
        if name.endswith(("_proj.weight", "_proj_with_mqa.weight")):  # DeepSeek's kv_a_proj_with_mqa too
            q, scale = quantize(tensor)
            assert exported[name].dtype == torch.float8_e4m3fn, name
            assert torch.equal(exported[name].view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(exported[name + "_scale_inv"], scale), name
        else:
            assert torch.equal(exported[name], tensor), name
    with open(root / "fp8_export" / "config.json") as f:
        assert json.load(f)["quantization_config"] == QUANT
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv" in exported
    assert "model.layers.1.mlp.gate.weight_scale_inv" not in exported  # the router stays unquantised
    ours = from_pretrained_hf(str(root / "fp8_export")).eval()
    again = from_pretrained_hf(str(root / "fp8_export")).eval()
    with torch.no_grad():  # megacann's reading: each weight its fp8 value times its block's scale
        for name, param in ours.named_parameters():
            assert torch.equal(param, again.get_parameter(name)), name
        kv_a = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
        expected = dequantize(exported[kv_a], exported[kv_a + "_scale_inv"])
        assert torch.equal(ours.get_parameter("layers.1.self_attn.kv_a_proj_with_mqa.weight"), expected)

    # transformers reads whole blocks only: blocks of [4, 4] divide every width of the tiny model
    transformers = pytest.importorskip("transformers")
    assert convert(["to-hf", str(root / "orig_whole"), str(root / "fp8_4x4"), "--fp8-block", "4", "4"]) == 0
    four = load_file(str(root / "fp8_4x4" / "model.safetensors"))
    deq4 = {
        n: dequantize_with(four[n], four[n + "_scale_inv"], (4, 4)) if n + "_scale_inv" in four else t
        for n, t in four.items()
        if not n.endswith("_scale_inv")
    }
    with open(root / "orig" / "config.json") as f:
        write_hf(root / "deq_4x4", deq4, json.load(f))
    kwargs = {"attn_implementation": "eager", "dtype": torch.float32}
    theirs = transformers.DeepseekV3ForCausalLM.from_pretrained(str(root / "fp8_4x4"), **kwargs).eval()
    dequantised = transformers.DeepseekV3ForCausalLM.from_pretrained(str(root / "deq_4x4"), **kwargs).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(IDS).logits, dequantised(IDS).logits, atol=1e-4, rtol=0)
        assert not torch.allclose(
            theirs(IDS).logits,
            transformers.DeepseekV3ForCausalLM.from_pretrained(str(root / "orig"), **kwargs).eval()(IDS).logits,
            atol=1e-4,
            rtol=0,
        )  # quantised, not the original

    assert convert(["to-hf", str(root / "orig_whole"), str(root / "bad"), "--fp8-block", "0", "128"]) == 1
    assert "--fp8-block [0, 128] is not two positive integers" in capsys.readouterr().err


# -- refusals --------------------------------------------------------------------------------------------

FP8_W = torch.ones(20, 14).to(torch.float8_e4m3fn)  # blocks of [16, 12]: scales [2, 2]


@pytest.mark.parametrize(
    "tensors,settings,read,message",
    [
        ({"a.weight": FP8_W}, QUANT, "a.weight", r"fp8 weight 'a.weight' has no block scale 'a.weight_scale_inv'"),
        (
            {"a.weight": FP8_W, "b.weight_scale_inv": torch.ones(2, 2)},
            QUANT,
            "a.weight",
            r"block scale 'b.weight_scale_inv' has no weight 'b.weight' beside it",
        ),
        (
            {"a.weight": FP8_W, "a.weight_scale_inv": torch.ones(2, 1)},
            QUANT,
            "a.weight",
            r"block scale 'a.weight_scale_inv' is torch.float32 of shape \[2, 1\]; expected a float tensor of "
            r"shape \[2, 2\] \(weight \[20, 14\] in blocks of \[16, 12\]",
        ),
        (
            {"a.weight": torch.ones(20, 14), "a.weight_scale_inv": torch.ones(2, 2)},
            QUANT,
            "a.weight",
            r"tensor 'a.weight' is stored as torch.float32 but has a block scale 'a.weight_scale_inv'",
        ),
        (
            {"a.weight": torch.ones(20, 14).to(torch.float8_e5m2), "a.weight_scale_inv": torch.ones(2, 2)},
            QUANT,
            "a.weight",
            r"tensor 'a.weight' is torch.float8_e5m2 of shape \[20, 14\]; quant_method 'fp8' \(fmt e4m3\) stores",
        ),
        (
            {"a.weight": FP8_W},
            None,
            "a.weight",
            r"tensor 'a.weight' is stored as torch.float8_e4m3fn, but config.json has no quantization_config",
        ),
    ],
    ids=["weight-without-scale", "scale-without-weight", "scale-shape", "scale-on-float", "e5m2", "no-config"],
)
def test_malformed_fp8_tensors_are_refused_naming_file_and_key(tmp_path, tensors, settings, read, message):
    from megacann.checkpoint.metadata import CheckpointError

    config = {**SHAPE, **({"quantization_config": settings} if settings else {})}
    path = write_hf(tmp_path / "hf", tensors, config)
    with pytest.raises(CheckpointError, match=f"^{re.escape(path)}/model.safetensors: {message}"):
        hf_weights_reader(path)(read)


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"quant_method": "gptq", "bits": 4}, r"quant_method 'gptq' is not supported: megacann reads block-scaled"),
        ({"quant_method": "bitsandbytes"}, r"quant_method 'bitsandbytes' is not supported"),
        ({**QUANT, "fmt": "e5m2"}, r"fmt 'e5m2' is not supported \(expected 'e4m3'"),
        ({**QUANT, "activation_scheme": "static"}, r"activation_scheme 'static' is not supported \(expected 'dynamic'"),
        ({**QUANT, "scale_fmt": "ue8m0"}, r"scale_fmt 'ue8m0' is not supported \(expected 'float'"),
        ({**QUANT, "weight_block_size": [128]}, r"weight_block_size \[128\] is not two positive integers"),
        ({**QUANT, "weight_block_size": [0, 128]}, r"weight_block_size \[0, 128\] is not two positive integers"),
        ({**QUANT, "weight_block_size": [128.0, 128]}, r"weight_block_size \[128.0, 128\] is not two positive"),
        ({**QUANT, "weight_block_size": [True, 128]}, r"weight_block_size \[True, 128\] is not two positive"),
        ({k: v for k, v in QUANT.items() if k != "weight_block_size"}, r"weight_block_size None is not two"),
        ({**QUANT, "group_size": 64}, r"unknown setting\(s\) \['group_size'\] of quant_method 'fp8'"),
        ("fp8", r"'fp8' is not an object of quantisation settings"),
    ],
)
def test_unreadable_quantization_configs_are_refused_by_name(tmp_path, settings, message):
    path = write_hf(tmp_path / "hf", {"a.weight": torch.ones(2, 2)}, {**SHAPE, "quantization_config": settings})
    with pytest.raises(ConfigError, match=f"^{re.escape(path)}/config.json: quantization_config.*{message}"):
        hf_family(path)  # what init_from and megacann-convert read first
    with pytest.raises(ConfigError, match=message):
        hf_weights_reader(path)


def test_a_checkpoint_missing_one_scale_fails_the_converter_by_name(ckpt, tmp_path, capsys):
    from megacann.convert import main as convert

    broken = str(tmp_path / "broken")
    shutil.copytree(ckpt["fp8"], broken)
    tensors = load_file(os.path.join(broken, "model.safetensors"))
    del tensors["model.layers.0.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, os.path.join(broken, "model.safetensors"), metadata={"format": "pt"})
    assert convert(["from-hf", broken, str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"{broken}/model.safetensors: fp8 weight 'model.layers.0.mlp.down_proj.weight' has no block scale" in err
