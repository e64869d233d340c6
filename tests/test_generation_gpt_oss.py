"""Generation of gpt-oss (attention sinks; sliding and full layers in turn) through the key/value cache
(fp32, CPU).

A tiny random GptOssForCausalLM written by transformers (4 layers: sliding, full, sliding, full; a window
of 5 keys, shorter than every row; random sinks; 4 experts of top 2 in every layer) generates greedily
what transformers' ``generate`` does, token for token, for 64 new tokens of 4 prompts of different
lengths in one left-padded batch, log-probabilities within 1e-5. Probes: every decode step's attention
receives the layer's sinks; the sliding layers keep a rolling cache of 5 slots, the full layers one of
the whole row; the cache's bytes equal the formula of each.
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
from gpt_oss_helpers import SHAPE, tiny_hf_gpt_oss

from megacann import ops
from megacann.generation import Generator, SamplingParams, kv_cache_bytes
from megacann.interop import from_pretrained_hf
from megacann.models import get_model_spec

WINDOW = SHAPE["sliding_window"]


def test_greedy_generation_equals_transformers_generate_with_sinks_and_windows(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    path = tiny_hf_gpt_oss(str(tmp_path / "hf"))
    model = from_pretrained_hf(path).eval()
    attention, decode_sinks = ops.decode_attention, []

    def recording_attention(q, k, v, **kwargs):  # every decode step (the prefill runs the training attention)
        decode_sinks.append(kwargs.get("sinks"))
        return attention(q, k, v, **kwargs)

    monkeypatch.setattr(ops, "decode_attention", recording_attention)
    generator = Generator(model, get_model_spec("gpt_oss"))
    results = generator.generate(prompts(), SamplingParams(max_new_tokens=NEW_TOKENS))
    monkeypatch.undo()
    tokens, logprobs = hf_greedy(path, prompts())
    for row, result in enumerate(results):
        assert result.tokens == tokens[row].tolist(), f"row {row}"
        torch.testing.assert_close(torch.tensor(result.logprobs), logprobs[row], rtol=0, atol=1e-5)

    layers = [model.layers[str(i)].self_attn for i in range(4)]
    assert len(decode_sinks) == 4 * (NEW_TOKENS - 1)
    assert all(sinks is layers[i % 4].sinks for i, sinks in enumerate(decode_sinks))
    slots = max(map(len, prompts())) + NEW_TOKENS - 1
    cache = generator.last_cache
    assert [layer.keys.shape[1] for layer in cache.layers] == [WINDOW, slots, WINDOW, slots]
    head = (SHAPE["num_key_value_heads"], SHAPE["head_dim"])
    sliding = kv_cache_bytes(2, 4, slots, *head, torch.float32, sliding_window=WINDOW)
    assert cache.nbytes == sliding + kv_cache_bytes(2, 4, slots, *head, torch.float32)
