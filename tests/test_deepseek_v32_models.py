"""The deepseek_v32 family on one process (CPU, fp32): transformers' DeepseekV32ForCausalLM logits both ways
(from_pretrained_hf, save_pretrained_hf, megacann-convert from-hf / to-hf) with a sequence longer than
index_topk; top-k covering the sequence equal to DeepSeek-V3's dense path exactly; the indexer's KL loss
against a formula written here; the warm-up training only the indexers; what the family refuses; the
parameter count of the published DeepSeek-V3.2 configuration against transformers' model."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from deepseek_helpers import SHAPE, VARIANTS
from test_deepseek_models import PUBLISHED as PUBLISHED_V3
from training_helpers import tiny_config

from megacann.config import ConfigError
from megacann.interop.hf import from_pretrained_hf, save_pretrained_hf

transformers = pytest.importorskip("transformers")
SEQ = 20
TOPK = 6  # < SEQ: from query 6 on, the indexer leaves keys out
IDS = torch.randint(0, SHAPE["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(1))
# DeepSeek-V3's tiny shape (low-rank q, YaRN) with an indexer of 8 heads of width 16 (its first 8 rotated)
V32_SHAPE = {
    **{k: v for k, v in {**SHAPE, **VARIANTS["yarn"]}.items() if k not in ("num_mtp_layers", "rope_interleave")},
    "index_n_heads": 8,
    "index_head_dim": 16,
    "index_topk": TOPK,
}


def tiny_hf_deepseek_v32(path: str, seed: int = 3, **settings) -> str:
    """A tiny DeepseekV32ForCausalLM written by transformers, its norms (the indexers' LayerNorm biases too)
    and routing biases randomised, its indexers' projections drawn wider."""
    config = transformers.DeepseekV32Config(**{**V32_SHAPE, **settings})
    torch.manual_seed(seed)
    model = transformers.DeepseekV32ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm.weight" in name or "layernorm" in name:
                param.uniform_(0.5, 1.5)
            elif "k_norm.bias" in name:
                param.uniform_(-0.5, 0.5)
            elif ".indexer.w" in name:  # sharper index scores than the 0.02 draw: a loss far from 0
                param.normal_(0.0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.05, 0.05)
    model.save_pretrained(path)
    return path


def hf_logits(path: str, ids: torch.Tensor = IDS) -> torch.Tensor:
    model = transformers.DeepseekV32ForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(ids).logits


def test_hf_logits_parity_both_ways_and_through_convert(tmp_path):
    from megacann.convert import main as convert

    hf_dir = tiny_hf_deepseek_v32(str(tmp_path / "hf"))
    expected = hf_logits(hf_dir)
    dense = hf_logits(tiny_hf_deepseek_v32(str(tmp_path / "dense"), index_topk=SEQ))
    assert (expected - dense).abs().max() > 1e-2  # the sparsity bites: the same weights read densely differ
    ours = from_pretrained_hf(hf_dir).eval()
    assert ours.config.type == "deepseek_v32" and ours.config.index_topk == TOPK
    indexer = ours.layers["2"].self_attn.indexer
    assert indexer.wq_b.weight.shape == (8 * 16, 32) and indexer.k_norm.bias.abs().max() > 0
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=IDS), expected, atol=1e-4, rtol=0)

    save_pretrained_hf([ours], str(tmp_path / "back"), ours.config)
    assert convert(["from-hf", hf_dir, str(tmp_path / "whole")]) == 0
    assert convert(["to-hf", str(tmp_path / "whole"), str(tmp_path / "converted")]) == 0
    reference = transformers.DeepseekV32ForCausalLM.from_pretrained(hf_dir).state_dict()
    for out in ("back", "converted"):
        assert json.loads((tmp_path / out / "config.json").read_text())["index_topk"] == TOPK
        torch.testing.assert_close(hf_logits(str(tmp_path / out)), expected, atol=1e-4, rtol=0)
        again = transformers.DeepseekV32ForCausalLM.from_pretrained(str(tmp_path / out)).state_dict()
        assert again.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(again[name], tensor), (out, name)


def _as_deepseek_v3(model):
    """A deepseek_v3 model with ``model``'s weights but no indexers."""
    from megacann.models import DeepseekV3Model
    from megacann.models.deepseek_config import DeepseekV3ModelConfig

    fields = {f.name for f in dataclasses.fields(DeepseekV3ModelConfig)} - {"type"}
    v3 = DeepseekV3Model(DeepseekV3ModelConfig(**{k: getattr(model.config, k) for k in fields})).eval()
    missing, unexpected = v3.load_state_dict(model.state_dict(), strict=False)
    assert not missing and unexpected and all(".indexer." in name for name in unexpected)
    return v3


@pytest.mark.parametrize("training", [False, True])
def test_topk_covering_the_sequence_is_deepseek_v3_exactly(tmp_path, training):
    ours = from_pretrained_hf(tiny_hf_deepseek_v32(str(tmp_path / "hf"), index_topk=SEQ)).train(training)
    v3 = _as_deepseek_v3(ours).train(training)
    torch.testing.assert_close(ours(input_ids=IDS), v3(input_ids=IDS), atol=0, rtol=0)
    if training:  # the indexer still learned (its loss kept) while the attention stayed dense
        assert ours.layers["0"].self_attn.last_indexer_loss is not None


# -- the indexer's loss ----------------------------------------------------------------------------------


def _rotate_half(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """RoPE on pairs (i, i + d/2) of ``x`` [b, s, heads, d] by ``angles`` [s, d/2]."""
    half = x.shape[-1] // 2
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]
    return torch.cat([x[..., :half] * cos - x[..., half:] * sin, x[..., half:] * cos + x[..., :half] * sin], -1)


def test_indexer_loss_is_kl_from_attention_to_index_distribution_over_chosen_keys():
    """The loss against the paper's formula written here: index scores sum_j w_j relu(q_j . k_t / sqrt(d)),
    each query's top-k, the attention heads' probabilities over those keys summed and renormalised (p), and
    mean_s sum_t p log(p / softmax(scores over the chosen)). Its gradient reaches the indexer alone."""
    from megacann.layers import LatentAttention
    from megacann.layers.rotary import RotaryEmbedding
    from megacann.layers.sparse_indexer import SparseIndexer

    torch.manual_seed(0)
    b, s, h, heads, width, rope, k_top = 2, 12, 32, 4, 8, 4, 5
    indexer = SparseIndexer(h, 16, heads, width, rope, k_top)
    attn = LatentAttention(h, 2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=rope, v_head_dim=4,
                           q_lora_rank=16, indexer=indexer, indexer_loss_coeff=0.5).train()  # fmt: skip
    with torch.no_grad():  # weights wide enough that both distributions are far from uniform and each other
        for name, param in attn.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.5)
        indexer.k_norm.bias.uniform_(-0.5, 0.5)
    rotary = RotaryEmbedding(rope, 10000.0)
    x = torch.randn(b, s, h)
    tables = rotary(torch.arange(s))
    attn(x, tables)
    loss = attn.last_indexer_loss

    with torch.no_grad():  # the reference, from the weights
        angles = torch.arange(s)[:, None] * 10000.0 ** (-torch.arange(0, rope, 2) / rope)
        latent = attn.q_a_layernorm(x @ attn.q_a_proj.weight.t())
        q = (latent @ indexer.wq_b.weight.t()).view(b, s, heads, width)
        q = torch.cat([_rotate_half(q[..., :rope], angles), q[..., rope:]], -1)
        k = torch.nn.functional.layer_norm(x @ indexer.wk.weight.t(), (width,), indexer.k_norm.weight,
                                           indexer.k_norm.bias, 1e-6)  # fmt: skip
        k = torch.cat([_rotate_half(k[:, :, None, :rope], angles)[:, :, 0], k[..., rope:]], -1)
        w = (x @ indexer.weights_proj.weight.t()) / heads**0.5
        scores = torch.einsum("bsj,bsjt->bst", w, torch.relu(torch.einsum("bsjd,btd->bsjt", q, k) / width**0.5))
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        top = scores.masked_fill(~causal, float("-inf")).topk(k_top, -1).indices
        chosen = torch.zeros(b, s, s, dtype=torch.bool).scatter(-1, top, True) & causal
        mq, mk, _ = attn._project(x, tables)
        logits = torch.einsum("bshd,bthd->bhst", mq, mk) * attn.softmax_scale
        p = torch.softmax(logits.masked_fill(~chosen[:, None], float("-inf")), -1).sum(1)
        p = p / p.sum(-1, keepdim=True)
        log_q = torch.log_softmax(scores.masked_fill(~chosen, float("-inf")), -1)
        kl = torch.where(chosen, p * (torch.log(p) - log_q), torch.zeros(())).sum(-1).mean()
    assert chosen[:, k_top:].sum(-1).eq(k_top).all() and (~chosen & causal).any()  # keys were left out
    assert kl > 0.1
    torch.testing.assert_close(loss, 0.5 * kl, atol=1e-6, rtol=1e-5)

    loss.backward()
    for name, param in attn.named_parameters():
        assert (param.grad is not None and param.grad.abs().sum() > 0) == name.startswith("indexer."), name


def test_warmup_trains_only_the_indexers_over_dense_attention(tmp_path):
    """``indexer_warmup``: every weight but the indexers' frozen; the attention dense (the logits of the
    same weights with top-k covering the sequence); the indexers' weights move with their loss."""
    from training_helpers import synthetic_data_factory

    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    hf_dir = tiny_hf_deepseek_v32(str(tmp_path / "hf"))
    model = {"type": "deepseek_v32", "precision": "fp32", "init_from": hf_dir, "indexer_warmup": True}
    from finetune_helpers import recipe

    cfg = recipe([f"experiment.output_dir={tmp_path / 'out'}", "data.seq_length=16", "data.tokenizer=byte",
                  "optim.max_steps=2", "optim.lr=1e-2"], model=model)  # fmt: skip
    trainer = Trainer(cfg, setup_runtime(cfg), data_factory=synthetic_data_factory(cfg))
    chunk = trainer.model_chunks[0]
    before = {name: p.detach().clone() for name, p in chunk.named_parameters()}
    trainable = {name for name, p in chunk.named_parameters() if p.requires_grad}
    assert trainable and all(".indexer." in name for name in trainable)
    metrics = [trainer.train_step() for _ in range(2)]
    assert all(m["indexer_kl"] > 0 for m in metrics), metrics
    for name, param in chunk.named_parameters():
        assert torch.equal(param, before[name]) != (name in trainable), name
    chunk.eval()
    dense = from_pretrained_hf(tiny_hf_deepseek_v32(str(tmp_path / "dense"), index_topk=SEQ)).eval()
    dense.load_state_dict(chunk.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(chunk(input_ids=IDS), dense(input_ids=IDS), atol=0, rtol=0)


# -- what the family refuses ---------------------------------------------------------------------------

DS = ["model.type=deepseek_v32", "model.num_experts=8", "model.moe_ffn_hidden_size=32", "model.kv_lora_rank=16"]
DS += ["model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=8", "model.num_key_value_heads=4"]
DS += ["model.q_lora_rank=16", "model.index_n_heads=4", "model.index_head_dim=16", "model.index_topk=8"]
DS += ["model.rotary_interleaved=true"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (DS + ["distributed.context_parallel_size=2"],  # the default algorithm, ring
         r"distributed.context_parallel_algo 'ring' is refused for model.type deepseek_v32 at context_parallel_size 2: "
         r"its indexer picks each query's keys from the whole sequence, which only 'allgather' holds on every rank"),
        (DS + ["distributed.context_parallel_algo=ulysses", "distributed.context_parallel_size=2"],
         r"context_parallel_algo 'ulysses' is refused for model.type deepseek_v32 .*\(set "
         r"distributed.context_parallel_algo=allgather\)"),
        (DS + ["model.q_lora_rank=null"], r"model.q_lora_rank null is refused"),
        (DS + ["model.rotary_interleaved=false"], r"model.rotary_interleaved false is refused"),
        (DS + ["model.indexer_warmup=true", "model.indexer_loss_coeff=0"], r"indexer_loss_coeff 0.* under indexer_warmup"),
        (DS + ["model.index_head_dim=4"], r"model.index_head_dim 4 must be >= qk_rope_head_dim 8"),
        (DS + ["model.index_topk=0"], r"model.index_topk must be >= 1, got 0"),
    ],
)  # fmt: skip
def test_recipe_refusals_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(overrides, world_size=2 if "_size=2" in overrides[-1] else 1)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"layer_types": ["indexed_attention"] * 3 + ["full_attention"]}, r"layer_types .*'full_attention'.* not implemented"),
        ({"mlp_layer_types": ["sparse"] * 4}, r"mlp_layer_types .* not implemented by megacann's deepseek_v32"),
        ({"rope_interleave": False}, r"rope_interleave False is refused"),
        ({"q_lora_rank": None}, r"q_lora_rank null is refused"),
    ],
)  # fmt: skip
def test_config_json_the_family_does_not_implement_is_refused(tmp_path, change, message):
    from megacann.models import get_model_spec

    config = {**V32_SHAPE, "model_type": "deepseek_v32", **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        get_model_spec("deepseek_v32").hf.config_from_hf(str(tmp_path / "config.json"))


# -- sizes ---------------------------------------------------------------------------------------------

# deepseek-ai/DeepSeek-V3.2-Exp's config.json (the keys that decide shapes, as on the Hugging Face Hub):
# DeepSeek-V3's and the indexer's
PUBLISHED = {
    **PUBLISHED_V3["deepseek/deepseek_v3_671b.yaml"],
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
}
EXPECTED = (
    683_501_956_608,
    39_105_867_264,
)  # what the dry run prints: total, active (transformers' counts, with the MTP depth)


def test_published_recipe_counts_what_transformers_counts(tmp_path):
    """transformers' DeepseekV32ForCausalLM on the meta device (no MTP module: the depth, stored as one more
    decoder layer, is a layer like the last, indexer included, plus enorm, hnorm, eh_proj and its norm)."""
    from published_config_checks import check_recipe_matches_published

    with torch.device("meta"):
        model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**PUBLISHED))
    h, total = PUBLISHED["hidden_size"], sum(p.numel() for p in model.parameters())
    total += sum(p.numel() for p in model.model.layers[-1].parameters()) + 3 * h + 2 * h * h
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    idle = (256 - 8) * sum(p.numel() for p in experts[0].parameters()) // 256
    active = total - (len(experts) + 1) * idle
    assert (total, active) == EXPECTED
    cfg, from_hf = check_recipe_matches_published(
        tmp_path, "deepseek_v32/deepseek_v32_671b.yaml", PUBLISHED, total, active
    )
    assert (from_hf.index_n_heads, from_hf.index_head_dim, from_hf.index_topk) == (64, 128, 2048)
    assert from_hf.rope_scaling["factor"] == cfg.model.rope_scaling["factor"] == 40


def test_multi_token_prediction_depth_has_an_indexer_whose_loss_counts():
    """A depth's layer is one like the last, indexer included, and its loss joins the layers' in
    ``indexer_kl`` (DeepSeek's checkpoints store that indexer as decoder layer ``num_hidden_layers``)."""
    from megacann.models import DeepseekV32Model
    from megacann.models.deepseek_v32 import indexer_loss
    from megacann.models.deepseek_v32_config import DeepseekV32ModelConfig

    sizes = dict(hidden_size=64, num_layers=2, num_attention_heads=4, ffn_hidden_size=96, num_experts=4,
                 moe_ffn_hidden_size=32, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                 v_head_dim=8, index_n_heads=4, index_head_dim=16, index_topk=6, first_k_dense_replace=1,
                 mtp_num_layers=1, vocab_size=260, precision="fp32")  # fmt: skip
    torch.manual_seed(0)
    model = DeepseekV32Model(DeepseekV32ModelConfig(**sizes)).train()
    ids = torch.randint(0, 260, (2, 12))
    model(input_ids=ids, labels=ids)
    depth = model.mtp.layers[0].transformer_layer.self_attn
    losses = [model.layers[i].self_attn.last_indexer_loss for i in ("0", "1")] + [depth.last_indexer_loss]
    assert depth.indexer is not None and all(loss is not None and loss > 0 for loss in losses)
    torch.testing.assert_close(indexer_loss(model), sum(losses), atol=0, rtol=0)
