"""Generation of DeepSeek-V3.2 (latent attention whose keys a lightning indexer picks) through the latent
cache with the indexer's keys beside it (fp32, CPU).

A tiny random DeepseekV32ForCausalLM written by transformers (index_topk 6, fewer than every prompt but
the first, so the prefill and every decode step leave tokens out): greedy generation equals transformers'
``generate`` token for token for 64 new tokens of 4 prompts of different lengths in one left-padded batch,
log-probabilities within 1e-5. Probes: each layer caches one index key of ``index_head_dim`` values a
token beside its latent; every decode query reads exactly ``min(top_k, its row's tokens)`` cached tokens,
none of them padding; decoding densely instead (the indexer's warm-up mode) gives other tokens.
"""

from __future__ import annotations

import pytest
import torch
from generation_helpers import (
    NEW_TOKENS,
    hf_greedy,
    one_thread,  # noqa: F401 (an autouse fixture)
    prompts,
)
from test_deepseek_v32_models import TOPK, V32_SHAPE, tiny_hf_deepseek_v32

from megacann.generation import Generator, SamplingParams
from megacann.interop import from_pretrained_hf
from megacann.layers import LatentAttention
from megacann.models import get_model_spec

SLOTS = max(map(len, prompts())) + NEW_TOKENS - 1


def _generate(model) -> tuple[Generator, list]:
    generator = Generator(model, get_model_spec("deepseek_v32"))
    return generator, generator.generate(prompts(), SamplingParams(max_new_tokens=NEW_TOKENS))


def test_greedy_generation_equals_transformers_generate_with_the_indexer_keys_cached(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    path = tiny_hf_deepseek_v32(str(tmp_path / "hf"), max_position_embeddings=128)
    model = from_pretrained_hf(path).eval()
    absorbed, reads = LatentAttention.absorbed_attention, []

    def recording(self, q_nope, q_rope, cached, mask):
        reads.append(mask)
        return absorbed(self, q_nope, q_rope, cached, mask)

    monkeypatch.setattr(LatentAttention, "absorbed_attention", recording)
    generator, results = _generate(model)
    monkeypatch.undo()
    tokens, logprobs = hf_greedy(path, prompts())
    for row, (result, expected) in enumerate(zip(results, tokens.tolist())):
        assert result.tokens == expected, f"row {row}"
        torch.testing.assert_close(torch.tensor(result.logprobs), logprobs[row], rtol=0, atol=1e-5)

    layers = generator.last_cache.layers
    width = V32_SHAPE["kv_lora_rank"] + V32_SHAPE["qk_rope_head_dim"]
    assert [(tuple(layer.latents.shape), tuple(layer.index_keys.shape)) for layer in layers] == [
        ((4, SLOTS, width), (4, SLOTS, V32_SHAPE["index_head_dim"]))
    ] * 4
    assert len(reads) == 4 * (NEW_TOKENS - 1)
    pad = 14 - torch.tensor([len(p) for p in prompts()])
    for step, mask in enumerate(reads):
        length = 14 + step // 4 + 1  # slots written once this step's token is stored
        real = length - pad
        assert mask.sum(-1).flatten().tolist() == torch.clamp(real, max=TOPK).tolist()
        assert not any(mask[row, ..., : int(pad[row])].any() for row in range(4))  # never padding

    for layer in model.modules():
        if isinstance(layer, LatentAttention):
            layer.indexer_dense = True
    _, dense = _generate(model)
    assert [r.tokens for r in dense] != [r.tokens for r in results]  # the indexer's choice matters
