"""Generation of Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet layers beside gated full attention) through the
recurrent cache (fp32, CPU).

Tiny random Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM written by transformers (linear, linear, full,
linear): greedy generation equals transformers' ``generate`` token for token for 64 new tokens of 4 prompts
of different lengths in one left-padded batch (transformers zeroes the padding's inputs to the linear
layers, so a row's state starts at its first real token), log-probabilities within 1e-5. Probes: the three
Gated DeltaNet layers are served by the recurrent cache, the full layer by keys and values; every linear
layer holds one ``[rows, heads, dk, dv]`` state and ``kernel - 1`` convolution inputs a row, whose bytes
equal :func:`recurrent_cache_bytes` at any length. Requests that end early leave the batch (their rows
dropped from every state) and the others go on unchanged. At tp 2 with sequence parallelism greedy and
seeded sampling give the one-process tokens and log-probabilities (1e-5), each rank holding half the heads'
states and convolution channels.
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_harness import run_on_ranks
from generation_helpers import (
    NEW_TOKENS,
    assert_same_results,
    hf_greedy,
    one_thread,  # noqa: F401 (an autouse fixture)
    prompts,
)
from qwen3_5_helpers import SHAPE, tiny_hf_qwen3_5

from megacann.generation import (
    Generator,
    RecurrentCacheLayer,
    SamplingParams,
    kv_cache_bytes,
    recurrent_cache_bytes,
)
from megacann.generation.kv_cache import KVCacheLayer
from megacann.interop import from_pretrained_hf
from megacann.models import get_model_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the longest prompt (14) + 64 new tokens; weights of spread 0.05: at the family tests' 0.1, transformers'
# own fp32 log-probabilities stray up to 1.7e-5 from megacann's fp64 ones (measured), more than the bound
LONG = {"max_position_embeddings": 128, "std": 0.05}
SLOTS = max(map(len, prompts())) + NEW_TOKENS - 1
FAMILY = {False: "qwen3_5", True: "qwen3_5_moe"}
KEY_DIM = SHAPE["linear_num_key_heads"] * SHAPE["linear_key_head_dim"]
CHANNELS = 2 * KEY_DIM + SHAPE["linear_num_value_heads"] * SHAPE["linear_value_head_dim"]  # q | k | v
STATE = (SHAPE["linear_num_value_heads"], SHAPE["linear_key_head_dim"], SHAPE["linear_value_head_dim"])
TAIL = SHAPE["linear_conv_kernel_dim"] - 1


def _generate(model, moe: bool, params) -> tuple[Generator, list]:
    generator = Generator(model, get_model_spec(FAMILY[moe]))
    return generator, generator.generate(prompts(), params)


def _assert_same(results, tokens, logprobs) -> None:
    for row, (result, expected, expected_logprobs) in enumerate(zip(results, tokens, logprobs)):
        assert result.tokens == list(expected), f"row {row}"
        torch.testing.assert_close(torch.tensor(result.logprobs), torch.as_tensor(expected_logprobs), rtol=0, atol=1e-5)


def _state_shapes(generator: Generator) -> list[tuple]:
    """Each Gated DeltaNet layer's (recurrent state, convolution tail) shapes in the last call's cache."""
    layers = [layer for layer in generator.last_cache.layers if isinstance(layer, RecurrentCacheLayer)]
    return [(tuple(layer.state.recurrent_state.shape), tuple(layer.state.conv_state.shape)) for layer in layers]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_greedy_generation_equals_transformers_generate_through_the_recurrent_cache(tmp_path, moe):
    pytest.importorskip("transformers")
    path = tiny_hf_qwen3_5(str(tmp_path / "hf"), moe=moe, **LONG)
    model = from_pretrained_hf(path).eval()
    generator, results = _generate(model, moe, SamplingParams(max_new_tokens=NEW_TOKENS))
    tokens, logprobs = hf_greedy(path, prompts())
    _assert_same(results, tokens.tolist(), logprobs)

    cache = generator.last_cache
    assert [type(layer) for layer in cache.layers] == [RecurrentCacheLayer] * 2 + [KVCacheLayer, RecurrentCacheLayer]
    assert _state_shapes(generator) == [((4, *STATE), (4, TAIL, CHANNELS))] * 3
    assert cache.layers[0].state.recurrent_state.dtype == torch.float32
    full = kv_cache_bytes(1, 4, SLOTS, SHAPE["num_key_value_heads"], SHAPE["head_dim"], torch.float32)
    linear = recurrent_cache_bytes(3, 4, *STATE, CHANNELS, TAIL + 1, torch.float32)
    assert linear == 3 * 4 * (4 * 8 * 12 + 3 * 80) * 4
    assert cache.nbytes == linear + full
    # a shorter generation: the keys and values shrink with the length, the states do not
    generator.generate(prompts(), SamplingParams(max_new_tokens=8))
    assert generator.last_cache.nbytes == linear + kv_cache_bytes(
        1, 4, 14 + 7, SHAPE["num_key_value_heads"], SHAPE["head_dim"], torch.float32
    )

    # requests ending early leave the batch; the others' states lose nothing
    lengths = [5, NEW_TOKENS, 17, 40]
    shapes_seen = []
    keep_rows = RecurrentCacheLayer.keep_rows

    def recording(self, rows):
        keep_rows(self, rows)
        shapes_seen.append(tuple(self.state.recurrent_state.shape))

    RecurrentCacheLayer.keep_rows = recording
    try:
        _, early = _generate(model, moe, [SamplingParams(max_new_tokens=n) for n in lengths])
    finally:
        RecurrentCacheLayer.keep_rows = keep_rows
    assert shapes_seen == [(3, *STATE)] * 3 + [(2, *STATE)] * 3 + [(1, *STATE)] * 3
    _assert_same(
        early, [row[:n] for row, n in zip(tokens.tolist(), lengths)], [row[:n] for row, n in zip(logprobs, lengths)]
    )


def test_recurrent_cache_bytes_formula():
    # Qwen3.5-27B-like linear layers: 48 of them, 16 key heads and 48 value heads of 128, kernel 4, bf16 tail
    state, tail = 48 * 128 * 128 * 4, 3 * (2 * 16 * 128 + 48 * 128) * 2
    assert recurrent_cache_bytes(48, 8, 48, 128, 128, 2 * 16 * 128 + 48 * 128, 4, torch.bfloat16) == 48 * 8 * (
        state + tail
    )


NEW_TP = 24
SAMPLED = [
    SamplingParams(max_new_tokens=NEW_TP, temperature=0.8, top_k=50, top_p=0.9, seed=seed, processed_logprobs=True)
    for seed in (5, 6, 7, 8)
]


def _greedy_and_sampled(model, moe: bool) -> dict:
    generator, greedy = _generate(model, moe, SamplingParams(max_new_tokens=NEW_TP))
    shapes = _state_shapes(generator)
    _, sampled = _generate(model, moe, SAMPLED)
    return {"greedy": greedy, "sampled": sampled, "shapes": shapes}


def _on_tp2_sp(path: str, moe: bool) -> dict:
    from megacann import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model = from_pretrained_hf(path, sequence_parallel=True).eval()
    projection = model.layers["0"].self_attn.in_proj_qkv
    out = {"sp_before": projection.sequence_parallel, **_greedy_and_sampled(model, moe)}
    out["sp_after"] = projection.sequence_parallel
    ps.destroy_model_parallel()
    return out


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_tp2_with_sequence_parallelism_generates_what_one_process_does(tmp_path, moe):
    pytest.importorskip("transformers")
    path = tiny_hf_qwen3_5(str(tmp_path / "hf"), moe=moe, **LONG)
    reference = _greedy_and_sampled(from_pretrained_hf(path).eval(), moe)
    assert reference["shapes"] == [((4, *STATE), (4, TAIL, CHANNELS))] * 3
    ranks = run_on_ranks(_on_tp2_sp, world_size=2, args=(path, moe), timeout=300)
    half_state = (4, STATE[0] // 2, *STATE[1:])
    for rank in ranks:
        assert rank["sp_before"] and rank["sp_after"]
        assert rank["shapes"] == [(half_state, (4, TAIL, CHANNELS // 2))] * 3  # this rank's heads only
        for kind in ("greedy", "sampled"):
            assert_same_results(rank[kind], reference[kind])
    assert len({token for result in reference["sampled"] for token in result.tokens}) > 20  # really sampled


def test_the_planned_generation_cache_equals_the_measured_one():
    """``--dry_run`` / ``megacann-plan``'s generation_eval cache for the qwen3_5 tiny recipe (three Gated
    DeltaNet layers, one full attention) equals the bytes a generation of that size allocates."""
    from megacann.config import load_config
    from megacann.models import ChunkPlacement
    from megacann.planning.generation import generation_cache_bytes, generation_cache_lines

    overrides = ["data.seq_length=6", "generation_eval.batch_size=3", "generation_eval.max_new_tokens=4"]
    cfg = load_config(os.path.join(ROOT, "examples/configs/qwen3_5/tiny.yaml"), overrides + ["model.vocab_size=260"])
    model = get_model_spec("qwen3_5").build_chunk(cfg, ChunkPlacement(tuple(range(4))), "cpu").eval()
    generator = Generator(model, get_model_spec("qwen3_5"))
    generator.generate(prompts((6, 2, 6)), SamplingParams(max_new_tokens=4))
    states = recurrent_cache_bytes(3, 3, 8, 32, 32, 2 * 4 * 32 + 8 * 32, 4, torch.float32)
    assert (
        generation_cache_bytes(cfg, 1)
        == generator.last_cache.nbytes
        == states + kv_cache_bytes(1, 3, 6 + 3, 2, 64, torch.float32)
    )
    cfg.generation_eval.interval = 5
    (line,) = generation_cache_lines(cfg, 2)
    assert "tp 2: 3 layers of Gated DeltaNet states of 4 heads x 32 x 32" in line  # this rank's half of the heads
    assert f"a row: {states // 2:,} bytes; 1 layers of keys and values of 1 kv heads x head dim 64: " in line


def test_qwen3_next_generates_through_the_same_layer_cache(tmp_path):
    """Qwen3-Next builds on the same Gated DeltaNet layer (its checkpoint's fused projections regrouped on
    load), so it generates through the layer's cache with no code of its own: greedy equals transformers."""
    pytest.importorskip("transformers")
    from qwen3_next_helpers import tiny_hf_qwen3_next

    path = tiny_hf_qwen3_next(str(tmp_path / "hf"), **LONG)
    model = from_pretrained_hf(path).eval()
    generator = Generator(model, get_model_spec("qwen3_next"))
    results = generator.generate(prompts(), SamplingParams(max_new_tokens=NEW_TOKENS))
    tokens, logprobs = hf_greedy(path, prompts())
    _assert_same(results, tokens.tolist(), logprobs)
    assert sum(isinstance(layer, RecurrentCacheLayer) for layer in generator.last_cache.layers) == 3
