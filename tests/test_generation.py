"""The generator on one process (fp32, CPU).

Each family read from a tiny Hugging Face model written by transformers generates greedily what
transformers' ``generate`` does, token for token, for 64 new tokens of 4 prompts of different lengths in
one left-padded batch, with the log-probabilities of transformers' unprocessed logits (1e-5); GPT (no
Hugging Face adapter) equals the model itself recomputing each whole unpadded sequence without a cache.
Mistral's window (5 keys) is shorter than every row, so its rolling cache of 5 slots really rolls. Requests
end at their own max_new_tokens, stop tokens and EOS, their rows leave the batch (the decode batch
shrinks) and the others' tokens do not change; the decode step attends with a one-row mask per query
(no ``[s, s]`` mask, built once a forward for every layer) and the prefill with none. Seeded sampling is the same alone or in a batch, top-k 1
is greedy, the processed distribution cuts what top-k / top-p / min-p say, and draws follow the
distribution. LoRA adapters active (not merged) generate what their merged weights do. The cache's bytes
equal the formula. Bad options and families without a decode path are
refused by name.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from generation_helpers import (
    NEW_TOKENS,
    VOCAB,
    hf_greedy,
    one_thread,  # noqa: F401 (an autouse fixture)
    prompts,
    tiny_hf_llama,
)
from qwen_helpers import tiny_hf_qwen
from test_mistral import WINDOW, tiny_hf_mistral
from training_helpers import tiny_hf_mixtral

from megacann import ops
from megacann.config import ModelConfig
from megacann.generation import Generator, SamplingParams, kv_cache_bytes, processed_logits
from megacann.generation.sampling import _uniform, choose, choose_rows, draw
from megacann.interop import from_pretrained_hf
from megacann.layers import SelfAttention, initialize_weights
from megacann.layers.lora import LoRAConfig, adapters_disabled, attach_lora, lora_parameters, merge_lora
from megacann.models import GPTModel, LlamaModel, get_model_spec

LONG = {"max_position_embeddings": 128}  # prompt + 64 new tokens fit every family's positions
WRITERS = {
    "llama": lambda path: tiny_hf_llama(path),
    "qwen2": lambda path: tiny_hf_qwen(path, "qwen2", **LONG),
    "qwen3": lambda path: tiny_hf_qwen(path, "qwen3", **LONG),
    "qwen3_moe": lambda path: tiny_hf_qwen(path, "qwen3_moe", **LONG),
    "mistral": lambda path: tiny_hf_mistral(path, vocab_size=VOCAB, **LONG),
    "moe": lambda path: tiny_hf_mixtral(path, vocab_size=VOCAB, **LONG),
}


def _generate(model, family: str, batch, params=None, **options):
    generator = Generator(model, get_model_spec(family), **options)
    return generator, generator.generate(batch, params or SamplingParams(max_new_tokens=NEW_TOKENS))


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_greedy_generation_equals_transformers_generate(tmp_path, family):
    pytest.importorskip("transformers")
    path = WRITERS[family](str(tmp_path / "hf"))
    batch = prompts()
    model = from_pretrained_hf(path).eval()
    generator, results = _generate(model, family, batch)
    tokens, logprobs = hf_greedy(path, batch)
    for row, result in enumerate(results):
        assert result.tokens == tokens[row].tolist(), f"{family} row {row}"
        assert result.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(result.logprobs), logprobs[row], rtol=0, atol=1e-5)
    layer = generator.last_cache.layers[0]
    config = model.config
    if family == "mistral":  # the rolling cache holds the window, not the 14 + 63 slots of a row
        assert layer.keys.shape[1] == WINDOW < max(map(len, batch))
    slots = max(map(len, batch)) + NEW_TOKENS - 1
    head_dim = model.layers["0"].self_attn.head_dim
    expected = kv_cache_bytes(
        config.num_layers, 4, slots, config.kv_heads, head_dim, torch.float32, getattr(config, "sliding_window", None)
    )
    assert generator.last_cache.nbytes == expected


def _recompute_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens by running the whole unpadded sequence again for each one (no cache)."""
    sequence, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(input_ids=torch.tensor([sequence]))[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(logits.log_softmax(-1)[token]))
            sequence.append(token)
    return sequence[len(prompt) :], logprobs


def test_gpt_generation_equals_recomputing_without_a_cache_and_without_dropout():
    model = GPTModel(
        ModelConfig(
            type="gpt",
            vocab_size=VOCAB,
            hidden_size=64,
            num_layers=2,
            num_attention_heads=4,
            ffn_hidden_size=128,
            max_position_embeddings=128,
            hidden_dropout=0.5,  # in training mode: the generator must switch dropout off
            attention_dropout=0.5,
        )
    )
    initialize_weights(model, 5)
    batch = prompts()
    _, results = _generate(model, "gpt", batch, SamplingParams(max_new_tokens=24))
    assert model.training  # back in the mode it was in
    model.eval()
    for prompt, result in zip(batch, results):
        tokens, logprobs = _recompute_greedy(model, prompt, 24)
        assert result.tokens == tokens
        torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(logprobs), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    return tiny_hf_llama(str(tmp_path_factory.mktemp("llama") / "hf"))


@pytest.fixture(scope="module")
def llama(llama_dir):
    return from_pretrained_hf(llama_dir).eval()


def test_lora_adapters_generate_unmerged_what_their_merged_weights_do(llama_dir):
    model = from_pretrained_hf(llama_dir).eval()
    attach_lora(model, LoRAConfig(rank=4, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, param in lora_parameters(model):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    params = SamplingParams(max_new_tokens=24)
    _, active = _generate(model, "llama", prompts(), params)
    with adapters_disabled([model]) as disabled:
        _, base = _generate(model, "llama", prompts(), params)
    assert disabled > 0 and [r.tokens for r in base] != [r.tokens for r in active]  # the adapters act
    assert merge_lora(model) == disabled
    _, merged = _generate(model, "llama", prompts(), params)
    for ours, expected in zip(active, merged):
        assert ours.tokens == expected.tokens
        torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(expected.logprobs), rtol=0, atol=1e-5)


def test_requests_end_on_their_own_and_leave_the_batch(llama, monkeypatch):
    batch = prompts()
    _, full = _generate(llama, "llama", batch, SamplingParams(max_new_tokens=20))
    stop_at = next(i for i, t in enumerate(full[1].tokens) if i >= 3 and t not in full[1].tokens[:i])
    eos_at = next(i for i, t in enumerate(full[2].tokens) if i >= 6 and t not in full[2].tokens[:i] + full[1].tokens)
    eos = full[2].tokens[eos_at]
    assert eos not in full[0].tokens[:5] and eos not in full[3].tokens  # the EOS ends only row 2
    params = [
        SamplingParams(max_new_tokens=5),
        SamplingParams(max_new_tokens=20, stop_token_ids=(full[1].tokens[stop_at],)),
        SamplingParams(max_new_tokens=20),
        SamplingParams(max_new_tokens=20),
    ]
    spec = get_model_spec("llama")
    batch_sizes, attention_calls = [], []

    def decode(chunk, ids, positions):
        batch_sizes.append(ids.shape[0])
        return spec.decode(chunk, ids, positions)

    attention = ops.scaled_dot_product_attention

    def recording_attention(q, k, v, **kwargs):
        mask = kwargs.get("attn_mask")
        attention_calls.append((q.shape[1], None if mask is None else tuple(mask.shape)))
        return attention(q, k, v, **kwargs)

    monkeypatch.setattr(ops, "scaled_dot_product_attention", recording_attention)
    decode_attention, decode_calls, decode_masks = ops.decode_attention, [], []

    def recording_decode_attention(q, k, v, **kwargs):
        decode_calls.append((q.shape[1], tuple(kwargs["attn_mask"].shape)))
        decode_masks.append(kwargs["attn_mask"])
        return decode_attention(q, k, v, **kwargs)

    monkeypatch.setattr(ops, "decode_attention", recording_decode_attention)
    generator = Generator(llama, dataclasses.replace(spec, decode=decode), eos_token_ids=(eos,))
    results = generator.generate(batch, params)
    assert [r.finish_reason for r in results] == ["length", "stop", "eos", "length"]
    ends = [5, stop_at + 1, eos_at + 1, 20]
    for result, reference, end in zip(results, full, ends):
        assert result.tokens == reference.tokens[:end]
        assert result.logprobs == pytest.approx(reference.logprobs[:end], abs=1e-5)
    # forward i (0: the prefill) gives token i + 1: a row ending at token n is not in forward n and after
    assert batch_sizes == [4 - (i >= 5) - (i >= stop_at + 1) - (i >= eos_at + 1) for i in range(20)]
    assert min(batch_sizes) == 1
    layers = llama.config.num_layers
    assert attention_calls == [(14, None)] * layers  # the prefill: padding as its own segment, no mask
    assert len(decode_calls) == layers * 19  # every decoding forward reads the cache through decode_attention
    assert all(s == 1 and mask[2] == 1 for s, mask in decode_calls)  # one mask row per query: no [s, s]
    # the mask is built once a forward, for the live rows, and read by every layer
    per_forward = [decode_masks[i : i + layers] for i in range(0, len(decode_masks), layers)]
    assert all(all(mask is masks[0] for mask in masks) for masks in per_forward)
    assert len({id(masks[0]) for masks in per_forward}) == 19
    assert [masks[0].shape[0] for masks in per_forward] == batch_sizes[1:]


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(llama):
    batch = prompts()
    sampled = [
        SamplingParams(max_new_tokens=16, temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, seed=s) for s in range(4)
    ]
    _, together = _generate(llama, "llama", batch, sampled)
    _, alone = _generate(llama, "llama", [batch[2]], sampled[2])
    assert together[2].tokens == alone[0].tokens
    assert together[2].logprobs == pytest.approx(alone[0].logprobs, abs=1e-5)
    _, reseeded = _generate(llama, "llama", [batch[2]], dataclasses.replace(sampled[2], seed=99))
    assert reseeded[0].tokens != alone[0].tokens
    _, greedy = _generate(llama, "llama", batch, SamplingParams(max_new_tokens=16))
    _, top1 = _generate(llama, "llama", batch, SamplingParams(max_new_tokens=16, temperature=2.0, top_k=1, seed=3))
    assert [r.tokens for r in top1] == [r.tokens for r in greedy]


@pytest.mark.parametrize("family", ["llama", "moe"])
def test_equal_prompts_sharing_one_prefill_row_generate_what_they_do_in_rows_of_their_own(request, family):
    model = (
        request.getfixturevalue(family)
        if family == "llama"
        else from_pretrained_hf(WRITERS["moe"](str(request.getfixturevalue("tmp_path") / "hf"))).eval()
    )
    batch = prompts()
    requests = [batch[i] for i in (2, 0, 2, 3, 0, 2, 1, 3)]  # prompts of different lengths, repeated
    sampled = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=s) for s in range(8)]
    attention = next(m for m in model.modules() if isinstance(m, SelfAttention))
    rows: list[int] = []  # each forward's rows at the first attention layer
    hook = attention.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    try:
        own = Generator(model, get_model_spec(family))
        alone, own_rows = own.generate(requests, sampled), list(rows)
        rows.clear()
        shared = Generator(model, get_model_spec(family), share_prompts=True)
        together = shared.generate(requests, sampled)
    finally:
        hook.remove()
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert [r.logprobs for r in together] == [r.logprobs for r in alone]
    assert [r.finish_reason for r in together] == [r.finish_reason for r in alone]
    assert own_rows[0] == 8 and rows[1:] == own_rows[1:]
    # one prefill row per distinct prompt (4), then each request decodes in its own row; off for MoE layers
    assert shared.share_prompts == (family == "llama") and rows[0] == (4 if family == "llama" else 8)


def test_processed_log_probabilities_are_those_of_the_distribution_drawn_from(llama):
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_k=5, seed=11, processed_logprobs=True)
    _, (result,) = _generate(llama, "llama", [prompts()[1]], params)
    sequence = prompts()[1] + result.tokens
    with torch.no_grad():
        logits = llama(input_ids=torch.tensor([sequence]))[0, len(prompts()[1]) - 1 : -1].float()
    for step, token in enumerate(result.tokens):
        assert result.logprobs[step] == pytest.approx(float(logits[step].log_softmax(-1)[token]), abs=1e-5)
        top5 = (logits[step] / 0.7).topk(5)
        assert token in top5.indices.tolist()
        expected = top5.values.log_softmax(-1)[top5.indices.tolist().index(token)]
        assert result.processed_logprobs[step] == pytest.approx(float(expected), abs=1e-5)


def test_processed_logits_cut_what_top_k_top_p_and_min_p_say():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    kept = {
        "top_k": (SamplingParams(temperature=1.0, top_k=3), [0, 1, 2]),
        "top_p": (SamplingParams(temperature=1.0, top_p=0.75), [0, 1]),  # 0.5 < 0.75 <= 0.5 + 0.3
        "min_p": (SamplingParams(temperature=1.0, min_p=0.5), [0, 1]),  # at least half the top probability
        "none": (SamplingParams(temperature=1.0), [0, 1, 2, 3]),
    }
    for name, (params, expected) in kept.items():
        scores = processed_logits(logits, params)
        assert torch.isfinite(scores).nonzero().flatten().tolist() == expected, name
    hot = processed_logits(logits, SamplingParams(temperature=2.0))
    torch.testing.assert_close(hot, logits / 2.0)


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    counts = torch.zeros(5)
    for seed in range(4000):
        counts[draw(probs.log(), seed, 7)] += 1
    torch.testing.assert_close(counts / 4000, probs, rtol=0, atol=0.03)
    assert counts[4] == 0
    assert draw(probs.log(), 3, 7) == draw(probs.log(), 3, 7)


def test_rows_drawn_together_get_the_tokens_each_row_draws_alone():
    torch.manual_seed(0)
    logits = torch.randn(40, 258) * torch.linspace(0.1, 12.0, 40).unsqueeze(1)  # flat to sharp rows
    logits[5, 100:] = float("-inf")  # a row whose tokens past 99 have probability 0
    kinds = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.6),
        SamplingParams(),  # greedy
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.9, top_p=0.8),
    ]
    for trial in range(30):  # seeds and token indices vary the uniforms drawn
        params = [dataclasses.replace(kinds[i % len(kinds)], seed=trial * 100 + i) for i in range(40)]
        indices = [(trial + i) % 9 for i in range(40)]
        alone = [choose(logits[i], params[i], indices[i]) for i in range(40)]
        assert choose_rows(logits, params, indices) == alone
        assert alone[5] < 100
        plain = [dataclasses.replace(kinds[0], seed=trial * 100 + i) for i in range(40)]
        assert choose_rows(logits, plain, indices) == [choose(logits[i], plain[i], indices[i]) for i in range(40)]
        warm = [dataclasses.replace(kinds[i % 3], seed=trial * 100 + i) for i in range(40)]  # temperatures only
        assert choose_rows(logits, warm, indices) == [choose(logits[i], warm[i], indices[i]) for i in range(40)]


def test_each_draw_is_splitmix64_of_the_request_seed_and_token_index():
    # SplitMix64's first output from state 0 (its published test value): the counter of seed 0, token 0
    assert _uniform(0, 0) == (0xE220A8397B1DCDAF >> 11) / 2**53
    seeds = [0, 7, 2**40 + 3, 2**62 + 11]
    draws = [_uniform(seed, index) for index in range(3) for seed in seeds]
    assert len(set(draws)) == len(draws) and all(0.0 <= u < 1.0 for u in draws)
    assert _uniform(3, 1_000_003 + 5) == _uniform(4, 5)  # one counter: seed * 1_000_003 + index
    many = torch.tensor([_uniform(11, i) for i in range(20000)], dtype=torch.float64)
    assert abs(many.mean().item() - 0.5) < 0.01 and abs(many.var().item() - 1 / 12) < 0.005


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("temperature", -0.5, "temperature must be >= 0"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
        ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
        ("top_k", -1, "top_k must be >= 0"),
        ("min_p", 2.0, r"min_p must be in \[0, 1\]"),
        ("max_new_tokens", 0, "max_new_tokens must be >= 1"),
    ],
)
def test_bad_sampling_options_are_refused_by_name(option, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{option: value})


def test_a_prompt_longer_than_the_cache_a_family_without_decoding_and_a_pipeline_stage_are_refused(llama):
    with pytest.raises(ValueError, match="a prompt of 14 tokens is longer than the cache's max_len 10"):
        _generate(llama, "llama", prompts(), max_len=10)
    with pytest.raises(ValueError, match=r"needs 77 cache slots a row, more than max_len 40"):
        _generate(llama, "llama", prompts(), max_len=40)
    no_decode = dataclasses.replace(get_model_spec("llama"), name="no_decode", decode=None)
    with pytest.raises(ValueError, match="model family 'no_decode' declares no decode path"):
        Generator(llama, no_decode)
    first_stage = LlamaModel(llama.config, layer_ids=[0], post_process=False)
    with pytest.raises(ValueError, match="without pipeline parallelism needs the whole model on this rank"):
        Generator(first_stage, get_model_spec("llama"))
    assert math.isclose(kv_cache_bytes(2, 3, 100, 4, 16, torch.bfloat16, sliding_window=8), 2 * 2 * 3 * 8 * 4 * 16 * 2)


def test_generation_runs_in_eval_mode_and_gives_each_module_its_mode_back():
    from megacann.generation.generator import evaluating

    class OwnTrain(torch.nn.Module):  # a class with its own train(): asked through it
        def __init__(self):
            super().__init__()
            self.calls, self.inner = [], torch.nn.Dropout(0.5)

        def train(self, mode: bool = True):
            self.calls.append(mode)
            return super().train(mode)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5), OwnTrain())
    model.train()
    model[1].eval()  # a submodule the user keeps in eval
    with evaluating(model):
        assert not any(m.training for m in model.modules())
    assert [m.training for m in model.modules()] == [True, True, False, True, True]
    assert model[2].calls == [True, False, True]  # model.train() above, then the block in and out
