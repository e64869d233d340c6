"""Generation on pipeline stages with micro-batches of requests (gloo, CPU, fp32): the batch split into
``num_microbatches`` groups that flow through the stages one after another in every forward round (the
prefill, then each decode step), each group with its own padding and cache rows.

- pp 2 with 2 and 3 micro-batches (5 requests: an uneven split), greedy and seeded sampling, requests
  ending at different lengths: the tokens and both log-probabilities (1e-5) of one process with one
  micro-batch, and of one process with 3 micro-batches. Probes: each stage's forwards, in order, have the
  rows and widths of the groups (a group's rows leave as its requests end); each micro-batch has its own
  cache; the stages overlapped: inside its pass of micro-batch ``m`` the last stage waits (up to 60 s)
  until the first stage has started ``m + 1``, which it can only do without waiting for the last stage.
- ep 2 + pp 2 (world 4, a MoE model over data parallel 2, each replica its own requests and lengths): the
  one-process results; the replica that finishes first, and each replica's micro-batch that finishes
  first, idle in step (counted) instead of hanging; so does a replica with no request at all.
- pp 2 with 2 chunks a stage, interleaved (the loop) and in the V of zbv and dualpipev, 1 and 2
  micro-batches, greedy and seeded sampling: the one-process results. Probes: each rank's chunks hold
  layers 0 and 2 (stage 0) and 1 and 3 (stage 1) on the loop, 0 and 3, and 1 and 2 in the V, whose stage 0
  computes the logits; every micro-batch forward runs the rank's chunk 0 then chunk 1 (layer indices of
  each call); each micro-batch's cache holds one attention layer of each chunk; one chunk alone is refused.
- qwen3_5 (Gated DeltaNet layers) and deepseek_v32 (sparse latent attention) from tiny Hugging Face
  checkpoints at pp 2 (extended tier): the one-process results.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from dist_harness import run_on_ranks
from generation_helpers import assert_same_results, one_thread, prompts  # noqa: F401 (one_thread: autouse)
from test_generation_layouts import MOE, _trainer

from megacann.generation import SamplingParams

PROMPTS = prompts(lengths=(3, 9, 14, 6, 11), vocab=200)
LENGTHS = (10, 4, 10, 7, 10)  # requests 1 and 3 end early: their rows leave their micro-batch
PP2 = ["distributed.pipeline_parallel_size=2"]


def _params(kind: str, lengths: tuple[int, ...] = LENGTHS) -> list[SamplingParams]:
    if kind == "greedy":
        return [SamplingParams(max_new_tokens=n) for n in lengths]
    return [
        SamplingParams(max_new_tokens=n, temperature=0.9, top_k=40, top_p=0.9, seed=21 + i, processed_logprobs=True)
        for i, n in enumerate(lengths)
    ]


def _groups(count: int, microbatches: int) -> list[list[int]]:
    """The requests of each micro-batch, as the test expects them: contiguous, the first ones larger."""
    sizes = [count // microbatches + (g < count % microbatches) for g in range(microbatches)]
    starts = [sum(sizes[:g]) for g in range(microbatches)]
    return [list(range(start, start + size)) for start, size in zip(starts, sizes)]


def _expected_forwards(microbatches: int) -> list[tuple[int, int]]:
    """Each forward's ``(rows, tokens a row)`` on every stage: round by round, group by group, the prefill
    at the group's longest prompt, then one token for each request with tokens still to come."""
    groups, out = _groups(len(PROMPTS), microbatches), []
    for step in range(max(LENGTHS)):
        for group in groups:
            rows = [r for r in group if LENGTHS[r] > step]
            if rows:
                out.append((len(rows), max(len(PROMPTS[r]) for r in group) if step == 0 else 1))
    return out


def _watched(spec, folder: str, microbatches: int):
    """``spec`` with a decode path that records each forward's ``ids`` shape and, on the last of 2 stages,
    waits inside its pass of micro-batch ``m`` (first two rounds, not a round's last group) for the first
    stage to start ``m + 1``; and the lists it fills: shapes, and whether each wait saw it."""
    import dataclasses

    from megacann import parallel_state as ps

    stage, shapes, overlapped = ps.get_pipeline_model_parallel_rank(), [], []

    def decode(chunk, ids, positions, hidden_states=None):
        call = len(shapes)
        shapes.append(tuple(ids.shape))
        if stage == 0:
            open(os.path.join(folder, f"started_{call}"), "w").close()
        elif call < 2 * microbatches and call % microbatches != microbatches - 1:
            marker, deadline = os.path.join(folder, f"started_{call + 1}"), time.monotonic() + 60
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.01)
            overlapped.append(os.path.exists(marker))
        return spec.decode(chunk, ids, positions, hidden_states=hidden_states)

    return dataclasses.replace(spec, decode=decode), shapes, overlapped


def _on_pp2(folder: str) -> dict:
    from megacann import parallel_state as ps
    from megacann.generation import Generator

    out = {}
    trainer = _trainer(PP2)
    chunk = trainer.model_chunks[0]
    for microbatches in (2, 3):
        for kind in ("greedy", "sampled"):
            watch = os.path.join(folder, f"{microbatches}_{kind}")  # the two stages' shared markers
            os.makedirs(watch, exist_ok=True)
            spec, shapes, overlapped = _watched(trainer.model_spec, watch, microbatches)
            generator = Generator(chunk, spec, num_microbatches=microbatches)
            results = generator.generate(PROMPTS, _params(kind))
            caches = [(len(cache.layers), cache.max_len) for cache in generator.last_caches]
            out[microbatches, kind] = {"results": results, "shapes": shapes, "overlapped": overlapped, "caches": caches}
    out["layers"] = sorted(int(i) for i in chunk.layers)
    ps.destroy_model_parallel()
    return out


def _one_process() -> dict:
    from megacann.generation import Generator

    trainer = _trainer([])
    out = {}
    for microbatches in (1, 3):
        generator = Generator(trainer.model_chunks[0], trainer.model_spec, num_microbatches=microbatches)
        for kind in ("greedy", "sampled"):
            out[microbatches, kind] = generator.generate(PROMPTS, _params(kind))
    return out


@pytest.fixture(scope="module")
def pp2(tmp_path_factory) -> tuple[dict, list[dict]]:
    reference = run_on_ranks(_one_process, 1, timeout=300)[0]
    ranks = run_on_ranks(_on_pp2, 2, args=(str(tmp_path_factory.mktemp("handshake")),), timeout=600)
    return reference, ranks


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
@pytest.mark.parametrize("microbatches", [2, 3])
def test_micro_batches_on_stages_equal_one_process(pp2, microbatches, kind):
    reference, ranks = pp2
    assert [len(r.tokens) for r in reference[1, kind]] == list(LENGTHS)
    assert_same_results(reference[3, kind], reference[1, kind])  # micro-batches without stages, too
    for rank in ranks:
        assert_same_results(rank[microbatches, kind]["results"], reference[1, kind])
    if kind == "sampled":
        assert len({t for r in reference[1, kind] for t in r.tokens}) > 20  # really sampled


@pytest.mark.parametrize("microbatches", [2, 3])
def test_each_micro_batch_flows_through_the_stages_with_its_own_cache(pp2, microbatches):
    _, (first, last) = pp2
    assert (first["layers"], last["layers"]) == ([0, 1], [2, 3])
    groups = _groups(len(PROMPTS), microbatches)
    assert [len(g) for g in groups] == ([3, 2] if microbatches == 2 else [2, 2, 1])  # uneven
    # a group's cache: 2 layers a stage, its longest prompt plus its largest max_new_tokens minus one slots
    slots = [max(len(PROMPTS[r]) for r in group) + max(LENGTHS[r] for r in group) - 1 for group in groups]
    for stage in (first, last):
        for kind in ("greedy", "sampled"):
            run = stage[microbatches, kind]
            assert run["shapes"] == _expected_forwards(microbatches)
            assert run["caches"] == [(2, n) for n in slots]
    # the last stage saw the first start micro-batch m + 1 while it was still running m
    assert last[microbatches, "greedy"]["overlapped"] == [True] * (2 * (microbatches - 1))
    assert first[microbatches, "greedy"]["overlapped"] == []


def test_num_microbatches_not_a_positive_integer_is_refused():
    from megacann.generation import Generator
    from megacann.models import get_model_spec

    for bad in (0, -2, 1.5, True):
        with pytest.raises(
            ValueError, match=rf"generation option num_microbatches must be an integer >= 1, got {bad}$"
        ):
            Generator(torch.nn.Linear(2, 2), get_model_spec("llama"), num_microbatches=bad)


# ep 2 + pp 2: data-parallel replica 0's requests end after 3 tokens, replica 1's after 12 and 7
EP_LENGTHS = (3, 3, 12, 7)
EP_PROMPTS = PROMPTS[:4]


def _ep2_pp2() -> dict:
    from megacann import parallel_state as ps
    from megacann.generation import Generator
    from megacann.layers import MoELayer

    trainer = _trainer([*MOE, *PP2, "distributed.expert_parallel_size=2"])
    chunk, replica = trainer.model_chunks[0], ps.get_data_parallel_rank()
    mine = slice(2 * replica, 2 * replica + 2)
    generator = Generator(chunk, trainer.model_spec)  # 2 micro-batches: pp size
    results = generator.generate(EP_PROMPTS[mine], _params("sampled", EP_LENGTHS)[mine])
    moe = [m for m in chunk.modules() if isinstance(m, MoELayer)]
    out = {
        "results": results,
        "replica": replica,
        "stage": ps.get_pipeline_model_parallel_rank(),
        "layers": sorted(int(i) for i in chunk.layers),
        "experts": sorted(int(e) for e in moe[0].experts),
        "idle_steps": generator.lockstep.idle_steps,
        "microbatches": len(generator.last_caches),
    }
    # replica 0 without requests: it idles beside replica 1's 2 micro-batches, round by round
    idle_before = generator.lockstep.idle_steps
    out["alone"] = generator.generate(*((EP_PROMPTS[2:], _params("sampled", EP_LENGTHS)[2:]) if replica else ([], [])))
    out["alone_idle_steps"] = generator.lockstep.idle_steps - idle_before
    ps.destroy_model_parallel()
    return out


def _moe_one_process() -> list:
    from megacann.generation import Generator

    trainer = _trainer(MOE)
    return Generator(trainer.model_chunks[0], trainer.model_spec).generate(EP_PROMPTS, _params("sampled", EP_LENGTHS))


def test_expert_and_pipeline_parallel_generation_stays_in_lockstep():
    reference = run_on_ranks(_moe_one_process, 1, timeout=300)[0]
    ranks = run_on_ranks(_ep2_pp2, 4, timeout=600)
    assert [len(r.tokens) for r in reference] == list(EP_LENGTHS)
    assert sorted((r["replica"], r["stage"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank in ranks:
        replica, stage = rank["replica"], rank["stage"]
        assert_same_results(rank["results"], reference[2 * replica : 2 * replica + 2])
        assert rank["layers"] == [[0, 1], [2, 3]][stage] and rank["microbatches"] == 2
        # expert parallel within the replicas of a stage: 2 of the 4 experts, the replica's half
        assert rank["experts"] == [[0, 1], [2, 3]][replica]
        # 12 rounds (the prefill, 11 decode steps), 2 micro-batches each: replica 0's two idle from round 3
        # on; replica 1's second (7 tokens) from round 7 on
        assert rank["idle_steps"] == [(12 - 3) * 2, 12 - 7][replica]
        # a replica with no request at all: both its micro-batches idle in each of the other's 12 rounds
        assert_same_results(rank["alone"], reference[2:] if replica else [])
        assert rank["alone_idle_steps"] == [12 * 2, 12 - 7][replica]


# -- families with their own cached layers, from tiny Hugging Face checkpoints --------------------------

HF_PROMPTS = prompts(lengths=(3, 9, 14, 6, 11), vocab=260)


def _hf_family_generations(family: str, hf_dir: str, root: str) -> dict:
    """Greedy and seeded sampling of the 5 requests by ``family`` built from ``hf_dir`` (``model.init_from``)
    at this world's layout: pp 2 with 2 micro-batches on 2 ranks, one process with one on 1."""
    import torch.distributed as dist
    from finetune_helpers import recipe
    from training_helpers import synthetic_data_factory

    from megacann import parallel_state as ps
    from megacann.generation import Generator
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    ps.destroy_model_parallel()
    world = dist.get_world_size()
    layout = PP2 if world == 2 else []
    overrides = ["data.tokenizer=byte", "data.seq_length=16", "optim.grad_accum_steps=2", *layout]
    model = {"type": family, "precision": "fp32", "init_from": hf_dir}
    cfg = recipe([*overrides, f"experiment.output_dir={root}/{world}"], model=model, world_size=world)
    trainer = Trainer(cfg, setup_runtime(cfg), data_factory=synthetic_data_factory(cfg))
    chunk = trainer.model_chunks[0]
    generator = Generator(chunk, trainer.model_spec)
    out = {kind: generator.generate(HF_PROMPTS, _params(kind)) for kind in ("greedy", "sampled")}
    out["layers"] = sorted(int(i) for i in chunk.layers)
    out["cached"] = sorted(type(layer).__name__ for layer in generator.last_caches[0].layers)
    out["microbatches"] = len(generator.last_caches)
    ps.destroy_model_parallel()
    return out


@pytest.mark.extended
@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v32"])
def test_families_with_their_own_caches_generate_on_stages(tmp_path, family):
    pytest.importorskip("transformers")
    if family == "qwen3_5":
        from qwen3_5_helpers import tiny_hf_qwen3_5

        hf_dir = tiny_hf_qwen3_5(str(tmp_path / "hf"), std=0.05)
        cached = [["RecurrentCacheLayer", "RecurrentCacheLayer"], ["KVCacheLayer", "RecurrentCacheLayer"]]
    else:
        from test_deepseek_v32_models import tiny_hf_deepseek_v32

        hf_dir = tiny_hf_deepseek_v32(str(tmp_path / "hf"), index_topk=6)
        cached = [["LatentCacheLayer"] * 2] * 2
    args = (family, hf_dir, str(tmp_path / "runs"))
    reference = run_on_ranks(_hf_family_generations, 1, args=args, timeout=300)[0]
    ranks = run_on_ranks(_hf_family_generations, 2, args=args, timeout=600)
    assert reference["layers"] == [0, 1, 2, 3] and reference["microbatches"] == 1
    for stage, rank in enumerate(ranks):
        assert rank["layers"] == [[0, 1], [2, 3]][stage] and rank["microbatches"] == 2
        assert rank["cached"] == cached[stage]
        for kind in ("greedy", "sampled"):
            assert_same_results(rank[kind], reference[kind])
    assert len({t for r in reference["sampled"] for t in r.tokens}) > 20  # really sampled


# -- interleaved chunks: pp 2 x 2 virtual chunks, each rank runs its two chunks in the pipeline's order ---

VPP2 = [*PP2, "distributed.virtual_pipeline_size=2", "optim.grad_accum_steps=2"]
# the V placement (two chunks a stage: stage 0 holds segments 0 and 3, stage 1 segments 1 and 2)
TWO_CHUNKS = {
    "interleaved": VPP2,
    "zbv": [*PP2, "distributed.pipeline_schedule=zbv", "optim.grad_accum_steps=2"],
    "dualpipev": [*PP2, "distributed.pipeline_schedule=dualpipev", "optim.grad_accum_steps=4"],
}
CHUNK_LAYERS = {  # each stage's chunks' layers, and which stage holds the head
    "interleaved": (([[0], [2]], [[1], [3]]), [False, True]),
    "zbv": (([[0], [3]], [[1], [2]]), [True, False]),
    "dualpipev": (([[0], [3]], [[1], [2]]), [True, False]),
}


def _on_two_chunks(overrides: list[str]) -> dict:
    """Greedy and seeded sampling with 1 and 2 micro-batches, every forward's chunk (its layer indices)
    recorded in order."""
    import dataclasses

    from megacann import parallel_state as ps
    from megacann.generation import Generator

    trainer = _trainer(overrides)
    chunks, ran = trainer.model_chunks, []

    def decode(chunk, ids, positions, hidden_states=None):
        ran.append(sorted(int(i) for i in chunk.layers))
        return trainer.model_spec.decode(chunk, ids, positions, hidden_states=hidden_states)

    spec = dataclasses.replace(trainer.model_spec, decode=decode)
    out = {"chunks": [sorted(int(i) for i in chunk.layers) for chunk in chunks]}
    for microbatches in (1, 2):
        generator = Generator(chunks, spec, num_microbatches=microbatches)
        for kind in ("greedy", "sampled"):
            ran.clear()
            results = generator.generate(PROMPTS, _params(kind))
            cached = [
                [sum(a in set(c.modules()) for a in cache.attentions) for c in chunks]
                for cache in generator.last_caches
            ]
            out[microbatches, kind] = {"results": results, "ran": list(ran), "cached": cached}
        out["head"] = generator.stages.last
    try:
        Generator(chunks[0], trainer.model_spec)
    except ValueError as error:
        out["one_chunk"] = str(error)
    ps.destroy_model_parallel()
    return out


# the V placements in the extended tier (the README tier is near its budget)
@pytest.fixture(
    scope="module", params=["interleaved", *(pytest.param(v, marks=pytest.mark.extended) for v in ("zbv", "dualpipev"))]
)
def two_chunks(request) -> tuple[str, list[dict]]:
    """(placement, each rank's runs): the interleaved schedule's loop, and the V of zbv and dualpipev."""
    return request.param, run_on_ranks(_on_two_chunks, 2, args=(TWO_CHUNKS[request.param],), timeout=600)


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_two_chunks_a_stage_generate_as_one_process(pp2, two_chunks, microbatches, kind):
    reference, _ = pp2
    for rank in two_chunks[1]:
        assert_same_results(rank[microbatches, kind]["results"], reference[1, kind])


@pytest.mark.parametrize("microbatches", [1, 2])
def test_each_rank_runs_its_two_chunks_in_turn_with_their_own_caches(two_chunks, microbatches):
    placement, (first, last) = two_chunks
    # the loop: chunk v of stage k holds layer 2v + k; the V: chunk 0 of stage k layer k, chunk 1 layer 3 - k
    layers, head = CHUNK_LAYERS[placement]
    assert (first["chunks"], last["chunks"]) == layers
    assert [first["head"], last["head"]] == head  # the stage that computes the logits and shares the choices
    forwards = len(_expected_forwards(microbatches))  # micro-batch forwards in the whole generation
    for stage in (first, last):
        for kind in ("greedy", "sampled"):
            run = stage[microbatches, kind]
            assert run["ran"] == stage["chunks"] * forwards  # each micro-batch's forward: chunk 0, then chunk 1
            assert run["cached"] == [[1, 1]] * microbatches  # each micro-batch caches both chunks' layer
    refusal = {
        "interleaved": "distributed.virtual_pipeline_size 2 needs all 2 model chunks of this rank, in order; got 1",
        "zbv": "generation in the V placement (zbv, dualpipev) needs this rank's 2 chunks; got 1",
    }
    assert refusal.get(placement, refusal["zbv"]) in first["one_chunk"], first["one_chunk"]
