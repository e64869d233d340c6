"""Generation of DeepSeek-V4 (hyper-connected streams; sliding, compressed sparse and heavily compressed
attention; hash-routed and top-k experts) through its decoding cache (fp32, CPU).

A tiny random DeepseekV4ForCausalLM written by transformers (deepseek_v4_helpers: every layer kind, both
routings; a window of 8 keys, compression rates 4 and 8; 2 indexer heads, so the indexer's scores often
tie at 0, every head's ReLU off) generates greedily, in one left-padded batch of 4 prompts of different
lengths, what transformers' ``generate`` gives each prompt alone, token for token for 64 new tokens,
log-probabilities within 1e-5. The reference is each prompt alone because transformers' own left-padded
batch is not: its compressors pool the padding into the rows' windows (checked: its tokens differ from
the prompts alone). Probes: every layer kind decodes, each through the cache of its kind
(the rolling window of 8 slots, the compressor projections of the whole row on the compressed kinds, the
bytes of the formula); the indexer ranked rows owning different numbers of entries.

Extended tier (gloo): at tensor parallel 2 with sequence parallelism, and on 2 pipeline stages (a trainer's
model started from the checkpoint), greedy and seeded sampling give one process's tokens and
log-probabilities (1e-5); at tp 2 every rank holds half the heads and caches what one process caches (the
one KV head and the compressor projections are whole on every rank); each stage holds and caches two of
the four layers.
"""

from __future__ import annotations

import pytest
import torch
from deepseek_v4_helpers import SHAPE, tiny_hf_v4
from dist_harness import run_on_ranks
from generation_helpers import (
    NEW_TOKENS,
    assert_same_results,
    hf_greedy,
    one_thread,  # noqa: F401 (an autouse fixture)
    prompts,
)
from test_generation_moe_tp import NEW_TOKENS as TP_TOKENS
from test_generation_moe_tp import SAMPLED

from megacann.generation import Generator, SamplingParams, compressed_cache_bytes
from megacann.interop import from_pretrained_hf
from megacann.layers import CompressedSparseAttention, MoELayer
from megacann.layers.compressed_indexer import CompressedIndexer
from megacann.models import get_model_spec

SLOTS = max(map(len, prompts())) + NEW_TOKENS - 1
HEAD_DIM, WINDOW, INDEX_DIM = SHAPE["head_dim"], SHAPE["sliding_window"], SHAPE["index_head_dim"]
# each token's compressor projections (candidates and gates; overlapping windows on CSA, with the indexer's)
PROJECTIONS = {
    "sliding_attention": 0,
    "heavily_compressed_attention": 2 * HEAD_DIM,
    "compressed_sparse_attention": 2 * (2 * HEAD_DIM + 2 * INDEX_DIM),
}


def test_greedy_generation_equals_transformers_generate_of_each_prompt(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    path = tiny_hf_v4(str(tmp_path / "hf"), swiglu_limit=10.0)
    model = from_pretrained_hf(path).eval()
    forward_rows, ranked = CompressedIndexer.forward_rows, []

    def recording(self, hidden, q_residual, position_ids, rotary, keys, row_entries):
        ranked.append(row_entries.tolist())
        return forward_rows(self, hidden, q_residual, position_ids, rotary, keys, row_entries)

    monkeypatch.setattr(CompressedIndexer, "forward_rows", recording)
    generator = Generator(model, get_model_spec("deepseek_v4"))
    results = generator.generate(prompts(), SamplingParams(max_new_tokens=NEW_TOKENS))
    monkeypatch.undo()
    alone = []
    for row, prompt in enumerate(prompts()):
        tokens, logprobs = hf_greedy(path, [prompt])
        assert results[row].tokens == tokens[0].tolist(), f"row {row}"
        torch.testing.assert_close(torch.tensor(results[row].logprobs), logprobs[0], rtol=0, atol=1e-5)
        alone.append(tokens[0].tolist())
    assert hf_greedy(path, prompts())[0].tolist() != alone  # transformers' padded batch: not the reference

    kinds = [m.layer_type for m in model.modules() if isinstance(m, CompressedSparseAttention)]
    assert kinds == SHAPE["layer_types"]  # every kind present
    cache = generator.last_cache
    assert [layer.local.entries[0].shape[1] for layer in cache.layers] == [WINDOW] * 4
    assert [None if layer.history is None else layer.history.entries[0].shape[1] for layer in cache.layers] == [
        None if kind == "sliding_attention" else SLOTS for kind in kinds
    ]
    expected = sum(
        compressed_cache_bytes(1, 4, SLOTS, HEAD_DIM, WINDOW, PROJECTIONS[kind], torch.float32) for kind in kinds
    )
    assert cache.nbytes == expected
    # two CSA layers a forward (the prefill and 63 steps); the prefill's rows own 0 to 3 entries (rate 4)
    assert len(ranked) == 2 * NEW_TOKENS and ranked[0] == [len(p) // 4 for p in prompts()]


def _generate_all(model) -> dict:
    generator = Generator(model, get_model_spec("deepseek_v4"))
    greedy = generator.generate(prompts(), SamplingParams(max_new_tokens=TP_TOKENS))
    nbytes, cached = generator.last_cache.nbytes, len(generator.last_cache.layers)
    sampled = generator.generate(prompts(), SAMPLED)
    heads = next(iter(model.layers.values())).self_attn.local_heads
    return {"greedy": greedy, "sampled": sampled, "nbytes": nbytes, "cached": cached, "heads": heads}


def _on_tp2(path: str) -> dict:
    from megacann import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model = from_pretrained_hf(path, sequence_parallel=True).eval()
    out = {"sp": model.sequence_parallel, "moe_tp": {m.tp_size for m in model.modules() if isinstance(m, MoELayer)}}
    out.update(_generate_all(model))
    ps.destroy_model_parallel()
    return out


@pytest.mark.extended
def test_tp2_sp_generates_what_one_process_does(tmp_path):
    pytest.importorskip("transformers")
    path = tiny_hf_v4(str(tmp_path / "hf"), swiglu_limit=10.0)
    reference = _generate_all(from_pretrained_hf(path).eval())
    for rank in run_on_ranks(_on_tp2, world_size=2, args=(path,), timeout=300):
        assert (rank["sp"], rank["moe_tp"], rank["heads"]) == (True, {2}, reference["heads"] // 2)
        assert rank["nbytes"] == reference["nbytes"]
        for kind in ("greedy", "sampled"):
            assert_same_results(rank[kind], reference[kind])
    assert len({token for result in reference["sampled"] for token in result.tokens}) > 20  # really sampled


def _on_pp2(path: str, root: str) -> dict:
    import torch.distributed as dist
    from finetune_helpers import recipe
    from training_helpers import synthetic_data_factory

    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    model = {"type": "deepseek_v4", "precision": "fp32", "init_from": path}
    overrides = ["distributed.pipeline_parallel_size=2", f"experiment.output_dir={root}", "data.tokenizer=byte"]
    cfg = recipe(overrides, model=model, world_size=dist.get_world_size())
    trainer = Trainer(cfg, setup_runtime(cfg), data_factory=synthetic_data_factory(cfg))
    chunk = trainer.model_chunks[0].eval()
    return {**_generate_all(chunk), "layers": sorted(int(i) for i in chunk.layers)}


@pytest.mark.extended
def test_pp2_generates_what_one_process_does(tmp_path):
    pytest.importorskip("transformers")
    path = tiny_hf_v4(str(tmp_path / "hf"), swiglu_limit=10.0)
    reference = _generate_all(from_pretrained_hf(path).eval())
    stages = run_on_ranks(_on_pp2, world_size=2, args=(path, str(tmp_path / "run")), timeout=300)
    assert [(stage["layers"], stage["cached"]) for stage in stages] == [([0, 1], 2), ([2, 3], 2)]
    for stage in stages:
        for kind in ("greedy", "sampled"):
            assert_same_results(stage[kind], reference[kind])
