"""The generator at tensor parallel 2 with sequence parallelism (gloo, CPU, fp32) gives what one process
gives: the same greedy and seeded-sampled tokens, log-probabilities within 1e-5, for 4 prompts of
different lengths in one batch. Probes: the model really was built with sequence parallelism (and has it
back after generating), and each rank's cache holds half the kv heads. A model whose ranks read kv heads
unevenly (6 query heads, 3 kv heads: replicated kv projections) caches the 2 kv heads each rank reads and
generates the one-process tokens. Context parallelism is refused.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_on_ranks
from generation_helpers import (
    one_thread,  # noqa: F401 (an autouse fixture)
    prompts,
    tiny_hf_llama,
)

from megacann.generation import Generator, SamplingParams
from megacann.interop import from_pretrained_hf
from megacann.models import get_model_spec

NEW_TOKENS = 24
KV_HEADS = 2  # tiny_hf_llama's
SAMPLED = [
    SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, top_k=50, top_p=0.9, seed=seed, processed_logprobs=True)
    for seed in (5, 6, 7, 8)
]


def _generate_all(model) -> dict:
    generator = Generator(model, get_model_spec("llama"))
    greedy = generator.generate(prompts(), SamplingParams(max_new_tokens=NEW_TOKENS))
    cache_shape = tuple(generator.last_cache.layers[0].keys.shape)
    sampled = generator.generate(prompts(), SAMPLED)
    return {"greedy": greedy, "sampled": sampled, "cache_shape": cache_shape}


def _uneven_greedy(model) -> dict:
    """Greedy results of a model whose TP ranks read kv heads unevenly, and rank 0's cache shape."""
    generator = Generator(model, get_model_spec("llama"))
    results = generator.generate(prompts(), SamplingParams(max_new_tokens=NEW_TOKENS))
    return {"uneven": results, "uneven_cache_shape": tuple(generator.last_cache.layers[0].keys.shape)}


def _on_tp2_sp(path: str, uneven_path: str) -> dict:
    from megacann import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model = from_pretrained_hf(path, sequence_parallel=True).eval()
    projection = model.layers["0"].self_attn.q_proj
    out = {"sp_before": projection.sequence_parallel, **_generate_all(model)}
    out["sp_after"] = projection.sequence_parallel
    uneven = from_pretrained_hf(uneven_path).eval()
    out["kv_index"] = uneven.layers["0"].self_attn.kv_index.tolist()
    out.update(_uneven_greedy(uneven))
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=2)
    try:
        Generator(model, get_model_spec("llama"))
    except ValueError as error:
        out["cp_error"] = str(error)
    ps.destroy_model_parallel()
    return out


def test_tp2_with_sequence_parallelism_generates_what_one_process_does(tmp_path):
    pytest.importorskip("transformers")
    path = tiny_hf_llama(str(tmp_path / "hf"))
    # 6 query heads over 3 kv heads at tp 2: each rank's 3 query heads read 2 kv heads, one of them shared
    uneven_path = tiny_hf_llama(str(tmp_path / "uneven"), hidden_size=48, num_attention_heads=6, num_key_value_heads=3)
    reference = {
        **_generate_all(from_pretrained_hf(path).eval()),
        **_uneven_greedy(from_pretrained_hf(uneven_path).eval()),
    }
    ranks = run_on_ranks(_on_tp2_sp, world_size=2, args=(path, uneven_path), timeout=300)
    assert reference["cache_shape"][2] == KV_HEADS and reference["uneven_cache_shape"][2] == 3
    assert [rank["kv_index"] for rank in ranks] == [[0, 0, 1], [0, 1, 1]]
    for rank in ranks:
        assert rank["uneven_cache_shape"][2] == 2  # the replicated kv heads this rank's queries read
        for ours, expected in zip(rank["uneven"], reference["uneven"]):
            assert ours.tokens == expected.tokens
            torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(expected.logprobs), rtol=0, atol=1e-5)
        assert rank["sp_before"] and rank["sp_after"]
        assert rank["cache_shape"] == (4, 14 + NEW_TOKENS - 1, KV_HEADS // 2, reference["cache_shape"][3])
        assert "context parallelism (distributed.context_parallel_size 2) is refused" in rank["cp_error"]
        for kind in ("greedy", "sampled"):
            for ours, expected in zip(rank[kind], reference[kind]):
                assert ours.tokens == expected.tokens, kind
                torch.testing.assert_close(
                    torch.tensor(ours.logprobs), torch.tensor(expected.logprobs), rtol=0, atol=1e-5
                )
        for ours, expected in zip(rank["sampled"], reference["sampled"]):
            processed = torch.tensor(ours.processed_logprobs)
            torch.testing.assert_close(processed, torch.tensor(expected.processed_logprobs), rtol=0, atol=1e-5)
    assert len({token for result in reference["sampled"] for token in result.tokens}) > 20  # really sampled
