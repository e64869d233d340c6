"""The generator at the training layouts, inside a training process (the trainer's own model chunks, no
conversion), on 2 gloo ranks (CPU, fp32): seeded sampling (temperature, top-k, top-p, a seed per request)
gives the tokens and log-probabilities (both kinds, 1e-5) of the same model generating in one process, at

- tp 2 with sequence parallelism (probe: each rank caches 1 of the 2 kv heads; SP on before and after);
- pipeline parallel 2 (probe: the stages hold layers 0-1 and 2-3 and cache 2 layers each, the first has
  no head and the last no embedding);
- expert parallel 2 over data parallel 2, a MoE model (probe: each rank holds 2 of the 4 experts of a
  layer); the ranks hold different prompts and ask for different max_new_tokens, so one finishes
  steps before the other and idles in step with it (counted) instead of hanging; a rank with no
  request at all idles beside the other's prefill and each of its decode steps;
- tp 2 with a MoE model, with and without sequence parallelism (probe: each rank caches 1 kv head; the
  MoE layers' TP group has 2 ranks);
- ZeRO-3 over data parallel 2, different prompts a rank (probe: no weight is whole before and after a
  call, all are whole during it, and each bucket is gathered once in a call of many decode steps).

examples/custom_model.py's family generates through its decode path (the contract): greedily what
recomputing each whole sequence without a cache gives, and at pp 2 and tp 2 + SP what one process gives.
Interleaved pipeline chunks and a family whose decode path takes no hidden states are refused by name
on pipeline stages.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_on_ranks
from generation_helpers import one_thread, prompts  # noqa: F401 (one_thread: an autouse fixture)
from test_custom_model import load_example
from training_helpers import tiny_config

from megacann.generation import SamplingParams

VOCAB = 200  # tiny_config's
NEW_TOKENS = 10
CUSTOM = ["model.type=parallel_lm", "model.tie_word_embeddings=true"]
MOE = ["model.type=moe", "model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32"]
LAYOUTS = {  # name: (recipe overrides at 2 ranks, the one-process recipe giving the same model)
    "tp2_sp": (["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"], []),
    "pp2": (["distributed.pipeline_parallel_size=2"], []),
    "ep2": ([*MOE, "distributed.expert_parallel_size=2"], MOE),
    "ep2_one_rank_idle": ([*MOE, "distributed.expert_parallel_size=2"], MOE),  # rank 0 has no request
    "tp2_moe": ([*MOE, "distributed.tensor_parallel_size=2"], MOE),
    "tp2_sp_moe": ([*MOE, "distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"], MOE),
    "zero3_dp2": (["distributed.zero_optimization=3", "optim.grad_accum_steps=1"], []),
    # examples/custom_model.py's family, through the contract (its decode path takes hidden states)
    "custom_pp2": ([*CUSTOM, "distributed.pipeline_parallel_size=2"], CUSTOM),
    "custom_tp2_sp": ([*CUSTOM, "distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"], CUSTOM),
}
SPLIT_BY_RANK = {"ep2", "zero3_dp2"}  # data-parallel layouts: each rank generates for its own prompts
PROMPTS = prompts(lengths=(3, 9, 14, 6), vocab=VOCAB)


def sampled(max_new_tokens: tuple[int, ...] = (NEW_TOKENS,) * 4) -> list[SamplingParams]:
    """Temperature, top-k and top-p, a seed per request, with the processed log-probabilities."""
    return [
        SamplingParams(max_new_tokens=n, temperature=0.9, top_k=40, top_p=0.9, seed=11 + i, processed_logprobs=True)
        for i, n in enumerate(max_new_tokens)
    ]


# ep 2: rank 0's two requests end after 3 tokens, rank 1's after 12 and 7 (9 idle steps on rank 0)
EP_LENGTHS = (3, 3, 12, 7)


def _requests(layout: str, rank: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """The prompts and params this rank generates for at ``layout`` (all four, its half, or none)."""
    params = sampled(EP_LENGTHS if layout == "ep2" else (NEW_TOKENS,) * 4)
    if layout == "ep2_one_rank_idle":
        return ([], []) if rank == 0 else (PROMPTS, params)
    if layout not in SPLIT_BY_RANK:
        return PROMPTS, params
    half = slice(2 * rank, 2 * rank + 2)
    return PROMPTS[half], params[half]


def _trainer(overrides: list[str]):
    import torch.distributed as dist
    from training_helpers import SyntheticData

    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    load_example()  # registers the custom family (parallel_lm)
    ps.destroy_model_parallel()
    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = tiny_config(overrides, world_size=world)
    trainer = Trainer(cfg, setup_runtime(cfg), data=SyntheticData(cfg, 0, 1))
    return trainer


def _as_lists(results) -> list[tuple[list[int], list[float], list[float]]]:
    return [(r.tokens, r.logprobs, r.processed_logprobs) for r in results]


def _zero3_probe(trainer, generator, batch, params) -> dict:
    """Whole weight elements before, during (each token) and after a call, and the gathers in it."""
    from zero3_checks import storages

    import megacann.optimizer.zero.sharded_params as sharded

    stores = storages(trainer.optimizer)
    whole = lambda: sum(s.gathered_numel() for s in stores)  # noqa: E731
    during: list[int] = []
    gathers = []
    real = sharded.all_gather_flat

    def counted(full, own, group, async_op=False):
        gathers.append(full.numel())
        return real(full, own, group, async_op=async_op)

    sharded.all_gather_flat = counted
    before = whole()
    try:
        results = generator.generate(batch, params, on_token=lambda request, token: during.append(whole()))
    finally:
        sharded.all_gather_flat = real
    return {
        "results": results,
        "whole_before": before,
        "whole_during": sorted(set(during)),
        "whole_after": whole(),
        "total": sum(b.numel for s in stores for b in s.layout.buckets),
        "gathers": sorted(gathers),
        "buckets": sorted(b.numel for s in stores for b in s.layout.buckets),
    }


def _generate_at_layouts(layouts: dict) -> dict:
    """Each layout's results (this rank's requests) and probes, in one process per rank."""
    import torch.distributed as dist

    from megacann import parallel_state as ps
    from megacann.generation import Generator
    from megacann.layers import MoELayer

    rank = dist.get_rank()
    out = {}
    for layout, (overrides, _) in layouts.items():
        trainer = _trainer(overrides)
        chunk = trainer.model_chunks[0]
        generator = Generator(chunk, trainer.model_spec)
        batch, params = _requests(layout, rank)
        probe: dict = {"layers": sorted(int(i) for i in chunk.layers)}
        probe["sp_before"] = any(getattr(m, "sequence_parallel", False) is True for m in chunk.modules())
        if layout == "zero3_dp2":
            probe.update(_zero3_probe(trainer, generator, batch, params))
            results = probe.pop("results")
        else:
            results = generator.generate(batch, params)
        probe["sp_after"] = any(getattr(m, "sequence_parallel", False) is True for m in chunk.modules())
        cache = generator.last_cache  # None on a rank without requests
        probe["cache_layers"] = len(cache.layers) if cache else 0
        probe["kv_heads"] = cache.layers[0].keys.shape[2] if cache else None
        probe["head"], probe["embedding"] = hasattr(chunk, "lm_head"), hasattr(chunk, "embed_tokens")
        moe = [m for m in chunk.modules() if isinstance(m, MoELayer)]
        probe["experts"] = sorted(int(e) for e in moe[0].experts) if moe else None
        probe["moe_tp"] = moe[0].tp_size if moe else None
        probe["idle_steps"] = generator.lockstep.idle_steps
        out[layout] = {"results": _as_lists(results), **probe}
        ps.destroy_model_parallel()
    return out


def _one_process(layouts: dict) -> dict:
    """Every layout's one-process model generating all four requests (each layout's params)."""
    from megacann.generation import Generator

    out = {}
    for layout, (_, overrides) in layouts.items():
        trainer = _trainer(overrides)
        generator = Generator(trainer.model_chunks[0], trainer.model_spec)
        params = sampled(EP_LENGTHS if layout == "ep2" else (NEW_TOKENS,) * 4)
        out[layout] = _as_lists(generator.generate(PROMPTS, params))
    out["custom_recomputed"] = _greedy_without_cache(CUSTOM)
    out["custom_greedy"] = _as_lists(_trainer_generator(CUSTOM).generate(PROMPTS, SamplingParams(NEW_TOKENS)))
    return out


def _trainer_generator(overrides: list[str]):
    from megacann.generation import Generator

    trainer = _trainer(overrides)
    return Generator(trainer.model_chunks[0], trainer.model_spec)


def _greedy_without_cache(overrides: list[str]) -> list[tuple[list[int], list[float]]]:
    """Each prompt alone, its whole sequence recomputed by the family's decode path for every new token
    (no cache, no padding): the greedy tokens and their log-probabilities."""
    trainer = _trainer(overrides)
    chunk, decode = trainer.model_chunks[0].eval(), trainer.model_spec.decode
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            sequence, logprobs = list(prompt), []
            for _ in range(NEW_TOKENS):
                ids = torch.tensor([sequence])
                scores = decode(chunk, ids, torch.arange(len(sequence)).unsqueeze(0))[0, -1].float().log_softmax(-1)
                sequence.append(int(scores.argmax()))
                logprobs.append(float(scores.max()))
            out.append((sequence[len(prompt) :], logprobs))
    return out


@pytest.fixture(scope="module")
def layouts() -> tuple[dict, list[dict]]:
    reference = run_on_ranks(_one_process, 1, args=(LAYOUTS,), timeout=300)[0]
    ranks = run_on_ranks(_generate_at_layouts, 2, args=(LAYOUTS,), timeout=600)
    return reference, ranks


def _expected(reference: dict, layout: str, rank: int) -> list:
    if layout == "ep2_one_rank_idle":
        return [] if rank == 0 else reference[layout]
    return reference[layout][2 * rank : 2 * rank + 2] if layout in SPLIT_BY_RANK else reference[layout]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sampling_at_each_layout_equals_one_process(layouts, layout):
    reference, ranks = layouts
    for rank, got in enumerate(ranks):
        expected = _expected(reference, layout, rank)
        assert len(got[layout]["results"]) == len(expected)
        for (tokens, logprobs, processed), (ref_tokens, ref_logprobs, ref_processed) in zip(
            got[layout]["results"], expected
        ):
            assert tokens == ref_tokens, f"{layout} rank {rank}"
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), rtol=0, atol=1e-5)
            torch.testing.assert_close(torch.tensor(processed), torch.tensor(ref_processed), rtol=0, atol=1e-5)
    all_tokens = {t for tokens, _, _ in reference[layout] for t in tokens}
    assert len(all_tokens) > 10  # really sampled, not one repeated token


def test_the_custom_family_generates_through_its_decode_path(layouts):
    reference, _ = layouts
    for (tokens, logprobs, _), (expected, expected_logprobs) in zip(
        reference["custom_greedy"], reference["custom_recomputed"]
    ):
        assert tokens == expected
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs), rtol=0, atol=1e-5)


def test_each_layout_was_in_force(layouts):
    _, (first, second) = layouts
    # tp 2 + SP: half the kv heads cached a rank, SP back on after
    for rank in (first, second):
        assert rank["tp2_sp"]["kv_heads"] == 1 and rank["tp2_sp"]["sp_before"] and rank["tp2_sp"]["sp_after"]
        for moe in (rank["tp2_moe"], rank["tp2_sp_moe"]):
            assert moe["kv_heads"] == 1 and moe["moe_tp"] == 2
        assert rank["tp2_sp_moe"]["sp_before"] and rank["tp2_sp_moe"]["sp_after"]
    # pp 2: which layers each stage holds and caches; embedding on the first, head on the last
    assert (first["pp2"]["layers"], second["pp2"]["layers"]) == ([0, 1], [2, 3])
    assert first["pp2"]["cache_layers"] == second["pp2"]["cache_layers"] == 2
    assert (first["pp2"]["embedding"], first["pp2"]["head"]) == (True, False)
    assert (second["pp2"]["embedding"], second["pp2"]["head"]) == (False, True)
    assert (first["custom_pp2"]["layers"], second["custom_pp2"]["layers"]) == ([0, 1], [2, 3])
    assert first["custom_pp2"]["cache_layers"] == second["custom_pp2"]["cache_layers"] == 2
    for rank in (first, second):
        custom = rank["custom_tp2_sp"]
        assert custom["kv_heads"] == 1 and custom["sp_before"] and custom["sp_after"]
    # ep 2: two of the four experts a rank; rank 0 finished first and idled in step with rank 1
    assert (first["ep2"]["experts"], second["ep2"]["experts"]) == ([0, 1], [2, 3])
    assert [len(tokens) for tokens, _, _ in first["ep2"]["results"] + second["ep2"]["results"]] == list(EP_LENGTHS)
    assert (first["ep2"]["idle_steps"], second["ep2"]["idle_steps"]) == (max(EP_LENGTHS) - 3, 0)
    # a rank without requests idles beside the other's prefill and each of its decode steps
    idle = (first["ep2_one_rank_idle"], second["ep2_one_rank_idle"])
    assert (idle[0]["idle_steps"], idle[1]["idle_steps"]) == (NEW_TOKENS, 0)
    assert idle[0]["results"] == [] and len(idle[1]["results"]) == 4
    # ZeRO-3: sharded before and after, whole during, each bucket gathered once in a call
    for rank in (first, second):
        zero = rank["zero3_dp2"]
        assert zero["whole_before"] == zero["whole_after"] == 0
        assert zero["whole_during"] == [zero["total"]] and zero["total"] > 0
        assert zero["gathers"] == zero["buckets"]


def _refusals() -> dict:
    import dataclasses

    from megacann import parallel_state as ps
    from megacann.generation import Generator
    from megacann.models import get_model_spec

    errors = {}
    ps.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    llama = get_model_spec("llama")
    for name, spec in {
        "interleaved": llama,
        "no_hidden_states": dataclasses.replace(llama, name="plain", decode=lambda chunk, ids, positions: None),
    }.items():
        if name == "no_hidden_states":
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(pipeline_model_parallel_size=2)
        try:
            Generator(torch.nn.Linear(2, 2), spec)
        except ValueError as error:
            errors[name] = str(error)
    # chunks whose ends disagree with their placement: V ends (stage 0's second chunk holds the head) on
    # chunks not built for the V (no placement mark: the loop), and loop ends on chunks marked for the V
    from megacann.pipeline.placement import PLACEMENT_ATTR

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    stage = ps.get_pipeline_model_parallel_rank()
    for name, marked, v_ends in (("v_ends_unmarked", False, True), ("loop_ends_marked_v", True, False)):
        chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
        for v, chunk in enumerate(chunks):
            chunk.pre_process = stage == 0 and v == 0
            chunk.post_process = stage == 0 and v == 1 if v_ends else stage == 1 and v == 1
            if marked:
                setattr(chunk, PLACEMENT_ATTR, "v")
        try:
            Generator(chunks, llama)
        except ValueError as error:
            errors[name] = str(error)
    ps.destroy_model_parallel()
    return errors


def test_missing_or_misplaced_chunks_and_a_decode_path_without_hidden_states_are_refused_on_stages():
    errors = run_on_ranks(_refusals, 2, timeout=120)[0]
    assert errors["interleaved"] == (
        "generation on pipeline stages with distributed.virtual_pipeline_size 2 needs all 2 model chunks of this "
        "rank, in order; got 1"
    )
    built_by = "chunks built by megacann.pipeline.build_model_chunks say which"
    assert errors["v_ends_unmarked"] == (
        f"generation runs the chunks in their placement's order (loop: {built_by}); pipeline stage 0's chunks "
        "hold the embedding / head as [(True, False), (False, True)], not [(True, False), (False, False)]"
    )
    assert errors["loop_ends_marked_v"] == (
        f"generation runs the chunks in their placement's order (v: {built_by}); pipeline stage 0's chunks "
        "hold the embedding / head as [(True, False), (False, False)], not [(True, False), (False, True)]"
    )
    assert (
        "model family 'plain': its decode path (ModelSpec.decode) takes no hidden_states"
        in (errors["no_hidden_states"])
    )
