"""DeepSeek-V4 on one process (CPU, fp32): config.json read and written back as transformers' own, the
refusals of what megacann does not implement, the checkpoint's tensor names both ways, the decoder layer
(hyper-connections, norms, hash and top-k routed experts with the clamped SwiGLU) against transformers'
``DeepseekV4DecoderLayer`` with the same weights, the whole model's logits against transformers'
``DeepseekV4ForCausalLM`` through from_pretrained_hf, save_pretrained_hf and megacann-convert both ways,
the recipe refusals, and the parameter count against transformers' model on the meta device."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from deepseek_v4_helpers import SHAPE, hf_v4_logits, tiny_hf_v4, tiny_hf_v4_model
from published_config_checks import check_recipe_matches_published
from training_helpers import tiny_config

from megacann.config import ConfigError
from megacann.interop import from_pretrained_hf, save_pretrained_hf
from megacann.layers import MoELayer
from megacann.layers.moe import clamped_swiglu
from megacann.layers.sharding import get_sharding
from megacann.models import ChunkPlacement, get_model_spec
from megacann.models.deepseek_v4 import DeepseekV4Block, deepseek_v4_num_parameters, v4_moe_config
from megacann.models.deepseek_v4_config import v4_layer_types, v4_mlp_layer_types
from megacann.models.hf_deepseek_v4 import (
    checkpoint_parts,
    config_from_hf,
    from_hf_tensors,
    hf_config_dict,
    to_hf_tensors,
)
from megacann.models.moe import moe_layer_config

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf  # noqa: E402


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_v4_model()


def _config_file(tmp_path, **changes) -> str:
    raw = tiny_hf_v4_model().config.to_dict()
    raw.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return str(path)


# -- config.json ----------------------------------------------------------------------------------------


def test_config_json_read_and_written_as_transformers(tmp_path, hf_model):
    hf_model.config.save_pretrained(tmp_path)
    cfg = config_from_hf(str(tmp_path / "config.json"))
    assert (cfg.num_experts, cfg.moe_top_k, cfg.moe_ffn_hidden_size, cfg.moe_shared_experts) == (4, 2, 16, 1)
    assert cfg.layer_types == SHAPE["layer_types"] and cfg.mlp_layer_types == SHAPE["mlp_layer_types"]
    assert (cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.head_dim, cfg.partial_rotary_factor) == (2, 3, 16, 0.5)
    assert (cfg.rope_theta, cfg.compress_rope_theta, cfg.moe_router) == (10000.0, 160000.0, "sqrtsoftplus")
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 4.0
    written = hf_config_dict(cfg, torch.float32)
    again = transformers.DeepseekV4Config(
        **{k: v for k, v in written.items() if k not in ("architectures", "model_type")}
    )
    ours, theirs = again.to_dict(), hf_model.config.to_dict()
    assert {
        k: (v, theirs.get(k)) for k, v in ours.items() if theirs.get(k) != v and k not in ("architectures", "dtype")
    } == {}


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]},
         "layer_types[1] 'full_attention' is not implemented"),
        ({"mlp_layer_types": ["moe", "dense", "moe", "moe"]}, "mlp_layer_types[1] 'dense' is not implemented"),
        ({"mlp_layer_types": ["moe"]}, "mlp_layer_types must list one routing kind per layer (4)"),
        ({"scoring_func": "sparsemax"}, "scoring_func (model.moe_router) 'sparsemax' is not"),
        ({"compress_rates": {"sliding_attention": 4}}, "compress_rates {'sliding_attention': 4} is refused"),
        ({"n_shared_experts": 2}, "n_shared_experts (model.moe_shared_experts) 2 is refused"),
        ({"num_key_value_heads": 2}, "num_key_value_heads 2 is refused"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is refused"),
        ({"num_experts_per_tok": 1}, "with num_experts_per_tok 1 is refused"),
        ({"mlp_bias": True}, "mlp_bias True is not supported"),
        ({"rope_parameters": {"main": {"rope_type": "yarn", "factor": 2.0}, "compress": {}}},
         "rope_parameters.main.rope_type 'yarn' is refused"),
        ({"rope_parameters": {"main": {}, "compress": {"rope_type": "llama3", "factor": 2.0}}},
         "rope_parameters.compress.rope_type 'llama3' is not implemented"),
        ({"rope_parameters": {"main": {}, "compress": {}, "local": {}}}, "rope_parameters.local is not a rotary kind"),
    ],
)  # fmt: skip
def test_config_json_refusals_name_the_key_and_value(tmp_path, changes, message):
    path = _config_file(tmp_path, **changes)
    with pytest.raises(ConfigError) as err:
        config_from_hf(path)
    assert path in str(err.value) and message in str(err.value)


def test_legacy_keys_fold_as_transformers_folds_them(tmp_path):
    raw = {
        k: v for k, v in tiny_hf_v4_model().config.to_dict().items() if k not in ("mlp_layer_types", "compress_rates")
    }
    raw.update(num_hash_layers=1, compress_rate_csa=2, compress_rate_hca=16)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    cfg = config_from_hf(str(path))
    assert cfg.mlp_layer_types == ["hash_moe", "moe", "moe", "moe"]
    assert cfg.compress_rates == {"compressed_sparse_attention": 2, "heavily_compressed_attention": 16}


# -- the checkpoint's names -----------------------------------------------------------------------------


def test_checkpoint_names_both_ways(tmp_path, hf_model):
    hf_model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    written = load_file(str(tmp_path / "model.safetensors"))
    cfg = config_from_hf(str(tmp_path / "config.json"))
    module_names = {k.removeprefix("model."): v for k, v in hf_model.state_dict().items()}
    ours = [n for n in module_names if not n.startswith("layers.") or ".mlp." not in n]
    ours += [f"layers.{i}.mlp.{n}" for i in range(4) for n in _moe_names(i)]
    tensors = from_hf_tensors(ours, lambda name: written[name], cfg)
    for name in ours:  # every non-MoE tensor is the module's own, under its module name
        if name in module_names:
            assert torch.equal(tensors[name], module_names[name]), name
    experts = hf_model.model.layers[1].mlp.experts
    assert torch.equal(tensors["layers.1.mlp.experts.3.gate_up_proj.weight"], experts.gate_up_proj[3])
    assert torch.equal(tensors["layers.1.mlp.experts.3.down_proj.weight"], experts.down_proj[3])
    assert torch.equal(tensors["layers.0.mlp.router.token_to_experts"], hf_model.model.layers[0].mlp.gate.tid2eid)
    back = to_hf_tensors(tensors, cfg)
    assert sorted(back) == sorted(written)
    assert all(torch.equal(back[k], written[k]) for k in written)
    assert checkpoint_parts("layers.1.self_attn.compressor.indexer.kv_proj.weight") == [
        "model.layers.1.attn.indexer.compressor.wkv.weight"
    ]


def _moe_names(layer: int) -> list[str]:
    hashed = SHAPE["mlp_layer_types"][layer] == "hash_moe"
    names = ["router.weight", "router.token_to_experts" if hashed else "router.expert_bias"]
    names += [f"experts.{e}.{p}.weight" for e in range(4) for p in ("gate_up_proj", "down_proj")]
    return names + ["shared_experts.gate_up_proj.weight", "shared_experts.down_proj.weight"]


# -- the decoder layer ----------------------------------------------------------------------------------


def test_v4_clamped_swiglu_is_silu_of_the_clamped_gate_times_the_clamped_up():
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(2, 5, 6, generator=g) * 3, torch.randn(2, 5, 6, generator=g) * 3
    expected = torch.nn.functional.silu(gate.clamp(max=1.5)) * up.clamp(-1.5, 1.5)
    torch.testing.assert_close(clamped_swiglu(torch.cat([gate, up], -1), 1.5, 1.0, up_shift=0.0), expected)


class _TransformersAttention(torch.nn.Module):
    """transformers' attention of one layer called the way DeepseekV4Block calls megacann's: the rotary
    tables and the sliding-window causal mask made here as ``DeepseekV4Model`` makes them."""

    def __init__(self, attention: torch.nn.Module, rotary: torch.nn.Module, window: int):
        super().__init__()
        self.attention, self.rotary, self.window = attention, rotary, window

    def forward(self, x, position_ids, segment_ids):
        s = x.shape[1]
        i, j = torch.arange(s).view(-1, 1), torch.arange(s).view(1, -1)
        mask = torch.zeros(s, s).masked_fill(~((j <= i) & (i - j < self.window)), float("-inf"))
        tables = {kind: self.rotary(x, position_ids=position_ids, layer_type=kind) for kind in ("main", "compress")}
        return self.attention(x, tables, position_ids, mask.expand(x.shape[0], 1, s, s))[0]


def _block_like(layer: torch.nn.Module, layer_id: int, cfg, rotary) -> DeepseekV4Block:
    """A DeepseekV4Block around transformers' attention, holding copies of the layer's other weights."""
    base = moe_layer_config(
        cfg,
        SimpleNamespace(sequence_parallel=False, init_method_std=0.02, output_layer_init_std=0.02, params_dtype=None),
    )
    moe = MoELayer(v4_moe_config(cfg, layer_id, base))
    block = DeepseekV4Block(
        _TransformersAttention(layer.self_attn, rotary, cfg.sliding_window),
        moe, cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps, 0.02,
    )  # fmt: skip
    own = {k: v for k, v in layer.state_dict().items() if not k.startswith(("mlp.", "self_attn."))}
    mlp = layer.mlp
    own["mlp.router.weight"] = mlp.gate.weight
    if hasattr(mlp.gate, "tid2eid"):
        own["mlp.router.token_to_experts"] = mlp.gate.tid2eid
    else:
        own["mlp.router.expert_bias"] = mlp.gate.e_score_correction_bias
    for e in range(cfg.num_experts):
        own[f"mlp.experts.{e}.gate_up_proj.weight"] = mlp.experts.gate_up_proj[e]
        own[f"mlp.experts.{e}.down_proj.weight"] = mlp.experts.down_proj[e]
    shared = mlp.shared_experts
    own["mlp.shared_experts.gate_up_proj.weight"] = torch.cat([shared.gate_proj.weight, shared.up_proj.weight])
    own["mlp.shared_experts.down_proj.weight"] = shared.down_proj.weight
    missing, unexpected = block.load_state_dict(own, strict=False)
    assert unexpected == [] and all(k.startswith("self_attn.") for k in missing)
    return block


@pytest.mark.parametrize("layer_id", [0, 1, 2, 3])
def test_decoder_layer_equals_transformers_layer(tmp_path, hf_model, layer_id):
    hf_model.config.save_pretrained(tmp_path)
    cfg = config_from_hf(str(tmp_path / "config.json"))
    layer = hf_model.model.layers[layer_id]
    block = _block_like(layer, layer_id, cfg, hf_model.model.rotary_emb)
    g = torch.Generator().manual_seed(layer_id)
    b, s = 2, 24
    streams = torch.randn(b, s, cfg.hc_mult, cfg.hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    positions = torch.arange(s).expand(b, s)
    theirs_in, ours_in = streams.clone().requires_grad_(), streams.clone().requires_grad_()
    s_ = theirs_in.shape[1]
    i, j = torch.arange(s_).view(-1, 1), torch.arange(s_).view(1, -1)
    mask = torch.zeros(s_, s_).masked_fill(~((j <= i) & (i - j < cfg.sliding_window)), float("-inf"))
    tables = {k: hf_model.model.rotary_emb(streams, position_ids=positions, layer_type=k) for k in ("main", "compress")}
    theirs = layer(theirs_in, input_ids=ids, position_embeddings=tables, position_ids=positions,
                   attention_mask=mask.expand(b, 1, s, s))  # fmt: skip
    ours = block(ours_in, ids, positions, None)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    grad = torch.randn(ours.shape, generator=g)
    theirs.backward(grad)
    ours.backward(grad)
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-5, atol=1e-5)
    for name in ("attn_hc.fn", "ffn_hc.fn", "input_layernorm.weight"):
        ours_grad = block.get_parameter(name).grad
        torch.testing.assert_close(ours_grad, layer.get_parameter(name).grad, rtol=1e-5, atol=1e-5)


# -- the whole model ------------------------------------------------------------------------------------

IDS = torch.randint(0, SHAPE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))


def test_logits_equal_transformers_both_ways(tmp_path):
    from megacann.convert import main as convert

    hf_dir = tiny_hf_v4(str(tmp_path / "hf"))
    expected = hf_v4_logits(hf_dir, IDS)
    assert expected.std() > 0.1  # logits that differ enough to tell a mix-up
    ours = from_pretrained_hf(hf_dir).eval()
    kinds = [block.self_attn.layer_type for block in ours.layers.values()]
    assert kinds == SHAPE["layer_types"]  # every kind present, and both routings:
    assert [block.mlp.router.token_to_experts is not None for block in ours.layers.values()] == [1, 0, 0, 1]
    reference = transformers.DeepseekV4ForCausalLM.from_pretrained(hf_dir)
    table = reference.model.layers[3].mlp.gate.tid2eid
    assert torch.equal(ours.layers["3"].mlp.router.token_to_experts, table)  # the checkpoint's, not the spread
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=IDS), expected, atol=1e-4, rtol=0)

    save_pretrained_hf([ours], str(tmp_path / "back"), ours.config)
    assert convert(["from-hf", hf_dir, str(tmp_path / "whole")]) == 0
    assert convert(["to-hf", str(tmp_path / "whole"), str(tmp_path / "converted")]) == 0
    reference_state = reference.state_dict()
    for out in ("back", "converted"):
        torch.testing.assert_close(hf_v4_logits(str(tmp_path / out), IDS), expected, atol=1e-4, rtol=0)
        again = transformers.DeepseekV4ForCausalLM.from_pretrained(str(tmp_path / out)).state_dict()
        assert again.keys() == reference_state.keys()
        for name, tensor in reference_state.items():
            assert torch.equal(again[name], tensor), (out, name)


def test_init_from_reads_the_hash_tables_of_a_hugging_face_and_a_consolidated_directory(tmp_path):
    from megacann.convert import main as convert
    from megacann.interop.reading import load_source_weights
    from megacann.interop.sources import resolve_weight_source

    hf_dir = tiny_hf_v4(str(tmp_path / "hf"))
    assert convert(["from-hf", hf_dir, str(tmp_path / "whole")]) == 0
    reference = from_pretrained_hf(hf_dir)
    cfg = tiny_config(V4 + [f"model.vocab_size={SHAPE['vocab_size']}"])
    cfg.model = reference.config
    for source in ("hf", "whole"):
        model = get_model_spec("deepseek_v4").build(cfg, ChunkPlacement(tuple(range(4))))  # drawn, not loaded
        assert not torch.equal(
            model.layers["0"].mlp.router.token_to_experts, reference.layers["0"].mlp.router.token_to_experts
        )
        load_source_weights([model], resolve_weight_source(str(tmp_path / source)), cfg.model)
        for layer in ("0", "3"):  # the hash-routed layers
            ours, theirs = model.layers[layer].mlp.router, reference.layers[layer].mlp.router
            assert torch.equal(ours.token_to_experts, theirs.token_to_experts), (source, layer)
        assert torch.equal(model.layers["1"].attn_hc.fn, reference.layers["1"].attn_hc.fn)


V4 = [
    "model.type=deepseek_v4", "model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32",
    "model.moe_shared_experts=1", "model.num_key_value_heads=1", "model.head_dim=16", "model.q_lora_rank=16",
    "model.o_groups=2", "model.o_lora_rank=8", "model.index_n_heads=2", "model.index_head_dim=16",
    "model.index_topk=3", "model.hc_mult=2", "model.sliding_window=8", "model.partial_rotary_factor=0.5",
    "model.compress_rates={compressed_sparse_attention: 4, heavily_compressed_attention: 8}",
]  # fmt: skip


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["distributed.context_parallel_size=2", "distributed.context_parallel_algo=ring"],
         "distributed.context_parallel_algo 'ring' is refused for model.type deepseek_v4 at context_parallel_size 2"),
        (["model.mtp_num_layers=1"], "model.mtp_num_layers 1 is refused"),
        (["model.o_groups=1", "model.o_lora_rank=16", "distributed.tensor_parallel_size=2"],
         "model.o_groups 1 is not divisible by distributed.tensor_parallel_size 2"),
        (["model.mlp_layer_types=[moe, moe, hash, moe]"], "mlp_layer_types[2] 'hash' is not implemented"),
    ],
)  # fmt: skip
def test_recipe_refusals_name_the_key(overrides, message):
    world = 4 if any("parallel_size=2" in o for o in overrides) else 1
    with pytest.raises(ConfigError) as err:
        tiny_config(V4 + overrides, world_size=world)
    assert message in str(err.value)


# -- sizes ----------------------------------------------------------------------------------------------


def test_parameter_count_equals_transformers_on_meta(tmp_path, hf_model):
    hf_model.config.save_pretrained(tmp_path)
    cfg = config_from_hf(str(tmp_path / "config.json"))
    assert deepseek_v4_num_parameters(cfg) == sum(p.numel() for p in hf_model.parameters())
    per_expert = 3 * cfg.hidden_size * cfg.moe_ffn_hidden_size
    active = deepseek_v4_num_parameters(cfg) - cfg.num_layers * (cfg.num_experts - cfg.moe_top_k) * per_expert
    assert deepseek_v4_num_parameters(cfg, active=True) == active
    assert hf is not None


def test_parameter_formula_counts_the_built_model():
    cfg = tiny_config(V4)
    spec = get_model_spec("deepseek_v4")
    with torch.device("meta"):
        model = spec.build(cfg, ChunkPlacement(tuple(range(cfg.model.num_layers))), "meta")
    # the vocabulary unpadded; the routing bias is a frozen parameter here, a buffer in transformers
    counted = [p for name, p in model.named_parameters() if not name.endswith("router.expert_bias")]
    assert spec.total_parameters(cfg.model) == sum(math.prod(get_sharding(p).logical_shape) for p in counted)


# transformers 5.25's DeepseekV4Config defaults (its docstring names deepseek-ai/DeepSeek-V4-Flash-Base), the
# keys that decide shapes; the layer schedules are its defaults too (two heavily compressed layers, then
# compressed sparse and heavily compressed alternating; the first three layers hash-routed)
FLASH = {
    "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "partial_rotary_factor": 0.125,
    "vocab_size": 129280, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048, "hc_mult": 4, "index_n_heads": 64, "index_head_dim": 128, "sliding_window": 128,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "tie_word_embeddings": False, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6,
}  # fmt: skip
EXPECTED_FLASH = (284_325_869_015, 13_793_261_015)  # transformers' count below: total, active per token


def test_flash_recipe_counts_what_transformers_counts(tmp_path):
    config = transformers.DeepseekV4Config()
    assert {k: getattr(config, k) for k in FLASH} == FLASH
    with torch.device("meta"):
        model = transformers.DeepseekV4ForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    active = total - config.num_hidden_layers * (config.n_routed_experts - config.num_experts_per_tok) * per_expert
    assert (total, active) == EXPECTED_FLASH
    cfg, _ = check_recipe_matches_published(tmp_path, "deepseek_v4/deepseek_v4_flash.yaml", FLASH, total, active)
    assert v4_layer_types(cfg.model) == config.layer_types
    assert v4_mlp_layer_types(cfg.model) == config.mlp_layer_types
