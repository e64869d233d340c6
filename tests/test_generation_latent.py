"""Generation of DeepSeek-V3 (multi-head latent attention) through its latent cache (fp32, CPU).

Tiny random DeepseekV3ForCausalLM written by transformers (layer 0 dense, layers 1-3 mixture of experts,
so routing runs at every decode step), both variants (one q_proj with rotate-half RoPE; low-rank q with
interleaved RoPE and YaRN): greedy generation equals transformers' ``generate`` token for token for 64 new
tokens of 4 prompts of different lengths in one left-padded batch, log-probabilities within 1e-5. Probes:
only the prefill expands latents into keys and values, every decode step attends with the up-projections
absorbed; the cache holds ``kv_lora_rank + qk_rope_head_dim`` values per token per layer, its measured
bytes equal :func:`latent_cache_bytes` and are a fraction of what full keys and values would take. LoRA
adapters on the up-projection, active and unmerged, generate what their merged weights do. A model with a
multi-token prediction depth caches nothing for it and generates what it does without it. A latent
attention layer decoding token by token through its cache gives its whole causal forward's outputs, at
one process and at tp 2 (each rank caching the whole latent for its 2 of the 4 heads).
"""

from __future__ import annotations

import pytest
import torch
from deepseek_helpers import tiny_deepseek_with_mtp, tiny_hf_deepseek
from dist_harness import run_on_ranks
from generation_helpers import (
    NEW_TOKENS,
    hf_greedy,
    one_thread,  # noqa: F401 (an autouse fixture)
    prompts,
)

from megacann.generation import Generator, KVCache, SamplingParams, latent_cache_bytes
from megacann.interop import from_pretrained_hf
from megacann.layers import LatentAttention, MoELayer
from megacann.layers.lora import LoRAConfig, attach_lora, lora_parameters, merge_lora
from megacann.models import get_model_spec

LONG = {"max_position_embeddings": 128}  # the longest prompt (14) + 64 new tokens
SLOTS = max(map(len, prompts())) + NEW_TOKENS - 1  # the cache's tokens a row


def _generate(model, params=None) -> tuple[Generator, list]:
    generator = Generator(model, get_model_spec("deepseek_v3"))
    return generator, generator.generate(prompts(), params or SamplingParams(max_new_tokens=NEW_TOKENS))


def _assert_same(results, tokens, logprobs) -> None:
    for row, (result, expected, expected_logprobs) in enumerate(zip(results, tokens, logprobs)):
        assert result.tokens == list(expected), f"row {row}"
        torch.testing.assert_close(torch.tensor(result.logprobs), torch.as_tensor(expected_logprobs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", ["plain", "yarn"])
def test_greedy_generation_equals_transformers_generate_through_the_latent_cache(tmp_path, variant, monkeypatch):
    pytest.importorskip("transformers")
    path = tiny_hf_deepseek(str(tmp_path / "hf"), variant, **LONG)
    model = from_pretrained_hf(path).eval()
    assert sum(isinstance(m, MoELayer) for m in model.modules()) == 3  # routing at every decode step
    calls = {"expand_latent": 0, "absorbed_attention": 0}
    for name in calls:
        method = getattr(LatentAttention, name)

        def counting(self, *args, _method=method, _name=name):
            calls[_name] += 1
            return _method(self, *args)

        monkeypatch.setattr(LatentAttention, name, counting)
    generator, results = _generate(model)
    tokens, logprobs = hf_greedy(path, prompts())
    _assert_same(results, tokens.tolist(), logprobs)
    layers = model.config.num_layers
    # the prefill expands the latents once per layer; the 63 decode forwards never do
    assert calls == {"expand_latent": layers, "absorbed_attention": layers * (NEW_TOKENS - 1)}

    c = model.config
    cache = generator.last_cache
    assert [tuple(layer.latents.shape) for layer in cache.layers] == [
        (4, SLOTS, c.kv_lora_rank + c.qk_rope_head_dim)
    ] * 4
    assert cache.nbytes == latent_cache_bytes(layers, 4, SLOTS, c.kv_lora_rank, c.qk_rope_head_dim, torch.float32)
    assert cache.nbytes == layers * 4 * SLOTS * (24 + 8) * 4
    # full keys ([nope | rope] per head) and values (v_head_dim per head): 4 x (24 + 12) = 144 values a
    # token and layer, 4.5 times the 32 cached
    full = layers * 4 * SLOTS * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * 4
    assert full == 4.5 * cache.nbytes


def test_latent_cache_bytes_formula():
    # DeepSeek-V3's shape: 61 layers, kv_lora_rank 512, rope 64, bf16, 8 rows of 4096 tokens
    assert latent_cache_bytes(61, 8, 4096, 512, 64, torch.bfloat16) == 61 * 8 * 4096 * 576 * 2


def test_lora_adapters_on_the_up_projection_generate_unmerged_what_their_merged_weights_do(tmp_path):
    pytest.importorskip("transformers")
    path = tiny_hf_deepseek(str(tmp_path / "hf"), "plain", **LONG)
    model = from_pretrained_hf(path).eval()
    attach_lora(model, LoRAConfig(rank=4, target_modules=("q_proj", "kv_b_proj", "o_proj")))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, param in lora_parameters(model):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    params = SamplingParams(max_new_tokens=24)
    _, active = _generate(model, params)
    _, base = _generate(from_pretrained_hf(path).eval(), params)
    assert [r.tokens for r in base] != [r.tokens for r in active]  # the adapters act
    assert merge_lora(model) > 0
    _, merged = _generate(model, params)
    _assert_same(active, [r.tokens for r in merged], [r.logprobs for r in merged])


def test_multi_token_prediction_depths_are_not_cached(tmp_path):
    model = tiny_deepseek_with_mtp(str(tmp_path / "hf"))
    params = SamplingParams(max_new_tokens=24)
    generator, results = _generate(model, params)
    layers, depth = generator.last_cache.layers, [m for m in model.mtp.modules() if isinstance(m, LatentAttention)]
    assert len(layers) == 5 and generator.last_cache.attentions[4:] == depth
    assert [layer.nbytes > 0 for layer in layers] == [True] * 4 + [False]  # the depth never ran
    c, slots = model.config, max(map(len, prompts())) + 24 - 1
    assert generator.last_cache.nbytes == latent_cache_bytes(
        4, 4, slots, c.kv_lora_rank, c.qk_rope_head_dim, torch.float32
    )
    model.mtp = None
    _, without_depth = _generate(model, params)
    _assert_same(results, [r.tokens for r in without_depth], [r.logprobs for r in without_depth])


PROMPT, TOTAL = 5, 12  # a layer's prefill, then one token per forward


def _layer_outputs(model, hidden: torch.Tensor) -> dict:
    """Layer 0's latent attention over ``hidden`` ``[2, TOTAL, h]``: in one causal forward, and as a
    generation runs it (a prefill of PROMPT tokens, then one token per forward through a latent cache)."""
    attention, b = model.layers["0"].self_attn, hidden.shape[0]
    positions = torch.arange(TOTAL).expand(b, TOTAL)
    rotary = lambda start, end: model.rotary(positions[:, start:end], dtype=hidden.dtype)  # noqa: E731
    cache = KVCache(attention, b, TOTAL, torch.zeros(b, dtype=torch.long))
    with torch.no_grad():
        whole = attention(hidden, rotary(0, TOTAL))
        with cache.attached():
            steps = [attention(hidden[:, :PROMPT], rotary(0, PROMPT))]
            cache.advance(PROMPT)
            for t in range(PROMPT, TOTAL):
                steps.append(attention(hidden[:, t : t + 1], rotary(t, t + 1)))
                cache.advance(1)
    latents = cache.layers[0].latents
    return {"whole": whole, "cached": torch.cat(steps, 1), "latents": tuple(latents.shape)}


def _on_tp2(path: str, hidden: torch.Tensor) -> dict:
    from megacann import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model = from_pretrained_hf(path).eval()
    attention = model.layers["0"].self_attn
    out = {"local_heads": attention.local_heads, "up_rows": attention.kv_b_proj.weight.shape[0]}
    out.update(_layer_outputs(model, hidden))
    ps.destroy_model_parallel()
    return out


def test_latent_attention_decoding_at_tp2_equals_one_process_and_the_whole_forward(tmp_path):
    """The latent cache's tp 2 decoding on the attention layer itself, against its whole forward (the
    whole models at tp 2 through the generator: tests/test_generation_moe_tp.py)."""
    pytest.importorskip("transformers")
    path = tiny_hf_deepseek(str(tmp_path / "hf"), "yarn", **LONG)
    hidden = torch.randn(2, TOTAL, 64, generator=torch.Generator().manual_seed(4))
    reference = _layer_outputs(from_pretrained_hf(path).eval(), hidden)
    whole = reference["whole"]
    torch.testing.assert_close(reference["cached"], whole, rtol=1e-5, atol=1e-6)
    ranks = run_on_ranks(_on_tp2, world_size=2, args=(path, hidden), timeout=300)
    for rank in ranks:
        assert rank["local_heads"] == 2 and rank["up_rows"] == 2 * (16 + 12)  # 2 of the 4 heads' up-projection
        assert rank["latents"] == reference["latents"] == (2, TOTAL, 24 + 8)  # the whole latent on every rank
        torch.testing.assert_close(rank["whole"], whole, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rank["cached"], whole, rtol=1e-5, atol=1e-6)
