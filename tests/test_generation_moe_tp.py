"""deepseek_v3, deepseek_v32 and gpt_oss generating at tensor parallel 2, with and without sequence
parallelism (gloo, CPU, fp32): their MoE layers take the decode step's whole, replicated input as their
rank's share (the generator's MoE-under-TP path), and greedy and seeded sampling give the tokens and
log-probabilities (1e-5) of one process for 4 prompts of different lengths in one batch.

Probes: each model was built with sequence parallelism or without it (and has the same after generating),
its MoE layers split over the 2 ranks; every rank holds half the query heads; DeepSeek-V3's and V3.2's
latent caches hold the whole latent (``kv_lora_rank + qk_rope_head_dim`` values a token) on every rank,
V3.2's the indexer's keys beside it, gpt-oss's key caches half the kv heads, a rolling window on its
sliding layers; each rank's cache bytes equal the formulas.
"""

from __future__ import annotations

import pytest
import torch
from deepseek_helpers import tiny_hf_deepseek
from dist_harness import run_on_ranks
from generation_helpers import (
    assert_same_results,
    one_thread,  # noqa: F401 (an autouse fixture)
    prompts,
)
from gpt_oss_helpers import SHAPE as GPT_OSS_SHAPE
from gpt_oss_helpers import tiny_hf_gpt_oss
from test_deepseek_v32_models import tiny_hf_deepseek_v32

from megacann.generation import Generator, SamplingParams, kv_cache_bytes, latent_cache_bytes
from megacann.interop import from_pretrained_hf
from megacann.layers import MoELayer
from megacann.models import get_model_spec

NEW_TOKENS = 24
SLOTS = max(map(len, prompts())) + NEW_TOKENS - 1
SAMPLED = [
    SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, top_k=50, top_p=0.9, seed=seed, processed_logprobs=True)
    for seed in (5, 6, 7, 8)
]
FAMILIES = ("deepseek_v3", "deepseek_v32", "gpt_oss")


def _cache_shapes(generator: Generator) -> list[tuple]:
    """Each layer's first cache tensor's shape (latents, or keys) in the last call's cache."""
    return [tuple(layer.entries[0].shape) for layer in generator.last_cache.layers]


def _generate_all(model, family: str) -> dict:
    generator = Generator(model, get_model_spec(family))
    greedy = generator.generate(prompts(), SamplingParams(max_new_tokens=NEW_TOKENS))
    shapes, nbytes = _cache_shapes(generator), generator.last_cache.nbytes
    sampled = generator.generate(prompts(), SAMPLED)
    heads = model.layers["1"].self_attn.local_heads
    return {"greedy": greedy, "sampled": sampled, "shapes": shapes, "nbytes": nbytes, "heads": heads}


def _on_tp2(path: str, family: str, sequence_parallel: bool) -> dict:
    from megacann import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model = from_pretrained_hf(path, sequence_parallel=sequence_parallel).eval()
    linear = model.layers["1"].self_attn.o_proj  # row-parallel: reduce-scatters the sequence under SP
    moe = [m for m in model.modules() if isinstance(m, MoELayer)]
    out = {"sp_before": linear.sequence_parallel, "moe_tp": {m.tp_size for m in moe}}
    out.update(_generate_all(model, family))
    out["sp_after"] = linear.sequence_parallel
    ps.destroy_model_parallel()
    return out


def _tiny(family: str, path: str) -> str:
    if family == "deepseek_v3":
        return tiny_hf_deepseek(path, "yarn", max_position_embeddings=128)
    if family == "deepseek_v32":
        return tiny_hf_deepseek_v32(path, max_position_embeddings=128)
    return tiny_hf_gpt_oss(path)


def _expected_cache(family: str, model, tp: int) -> tuple[list[tuple], int]:
    """The cache shapes and bytes one rank of ``tp`` holds, from the formulas."""
    c = model.config
    if family.startswith("deepseek"):  # v3.2: the indexer's keys (one head) beside the latents
        width = c.kv_lora_rank + c.qk_rope_head_dim
        index_keys = 4 * 4 * SLOTS * c.index_head_dim * 4 if family == "deepseek_v32" else 0
        return [(4, SLOTS, width)] * 4, index_keys + latent_cache_bytes(
            4, 4, SLOTS, c.kv_lora_rank, c.qk_rope_head_dim, torch.float32
        )
    window, heads, head_dim = (
        GPT_OSS_SHAPE["sliding_window"],
        GPT_OSS_SHAPE["num_key_value_heads"] // tp,
        GPT_OSS_SHAPE["head_dim"],
    )
    sliding, full = (4, window, heads, head_dim), (4, SLOTS, heads, head_dim)
    nbytes = kv_cache_bytes(2, 4, SLOTS, heads, head_dim, torch.float32, sliding_window=window)
    return [sliding, full] * 2, nbytes + kv_cache_bytes(2, 4, SLOTS, heads, head_dim, torch.float32)


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "no_sp"])
@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_generates_what_one_process_does(tmp_path, family, sequence_parallel):
    pytest.importorskip("transformers")
    path = _tiny(family, str(tmp_path / "hf"))
    model = from_pretrained_hf(path).eval()
    reference = _generate_all(model, family)
    assert (reference["shapes"], reference["nbytes"]) == _expected_cache(family, model, 1)
    ranks = run_on_ranks(_on_tp2, world_size=2, args=(path, family, sequence_parallel), timeout=300)
    shapes, nbytes = _expected_cache(family, model, 2)
    for rank in ranks:
        assert (rank["sp_before"], rank["sp_after"], rank["moe_tp"]) == (sequence_parallel, sequence_parallel, {2})
        assert rank["heads"] == reference["heads"] // 2 == 2
        assert (rank["shapes"], rank["nbytes"]) == (shapes, nbytes)
        for kind in ("greedy", "sampled"):
            assert_same_results(rank[kind], reference[kind])
    assert len({token for result in reference["sampled"] for token in result.tokens}) > 20  # really sampled
