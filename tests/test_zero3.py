"""ZeRO-3 (``distributed.zero_optimization: 3``) and hybrid sharding (``distributed.zero_shard_group_size``)
train like one process (gloo, CPU, fp32, relative 1e-5), resume bit for bit, hold 1/N of the weights,
gradients and optimizer state (bytes read from the tensors), and write layout-free checkpoints.

Default tier: one world-2 spawn (plain dp 2, ZeRO-3 with prefetch and small buckets, LoRA with full
recompute under ZeRO-3 and its plain twin) and the recipe checks. Extended: the one-process references,
world 4 (dp 4, tp 2 + SP, pp 2 tied (1F1B and interleaved), cp 2, LoRA, hybrid sharding 2 x 2 at stages 2
and 3, checkpoints ZeRO-3 dp 4 <-> ZeRO-1 tp 2 x pp 2) and the MoE family at ep 2.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_on_ranks
from test_training_parity import assert_close_trace, assert_params_close
from tiny_recipes import TINY_MOE
from zero3_checks import (
    CP2,
    HYBRID2,
    LORA,
    PP2,
    PREFETCH,
    RECOMPUTE,
    SMALL_BUCKETS,
    STEPS,
    TP2_SP,
    Z3,
    accum,
    assert_formula,
    round_trips,
    train_runs,
)

from megacann.config import ConfigError

RUNS_WORLD2 = {
    "plain": accum(2),
    "zero3": Z3 + SMALL_BUCKETS + PREFETCH + accum(2),
    "plain_lora": LORA + accum(2),
    "zero3_lora_recompute": Z3 + LORA + RECOMPUTE + PREFETCH + accum(2),
}
PAIRS_WORLD2 = [("zero3", "plain"), ("zero3_lora_recompute", "plain_lora")]
REFERENCES = {"one": accum(1), "one_tied": accum(1) + PP2[1:], "one_lora": accum(1) + LORA}
Z2 = ["distributed.zero_optimization=2"]
RUNS_WORLD4 = {
    "zero3_dp4": Z3 + SMALL_BUCKETS + PREFETCH + accum(4),
    "zero3_tp2_sp": Z3 + TP2_SP + PREFETCH + accum(2),
    "zero3_pp2": Z3 + PP2 + PREFETCH + accum(2),
    "zero3_pp2_interleaved": Z3 + PP2 + ["distributed.virtual_pipeline_size=2"] + accum(2),
    "zero3_cp2": Z3 + CP2 + PREFETCH + accum(2),
    "zero3_lora_dp4": Z3 + LORA + accum(4),
    "zero3_hybrid": Z3 + HYBRID2 + PREFETCH + accum(4),
    "zero2_hybrid": Z2 + HYBRID2 + accum(4),
}
REFERENCE_OF = {"zero3_pp2": "one_tied", "zero3_pp2_interleaved": "one_tied", "zero3_lora_dp4": "one_lora"}
TP2_PP2_Z1 = ["distributed.tensor_parallel_size=2", "distributed.pipeline_parallel_size=2"]
TP2_PP2_Z1 += ["distributed.zero_optimization=1"] + accum(1)
ROUND_TRIPS = {
    "zero3_dp4_to_zero1_tp2_pp2": (Z3 + PREFETCH + accum(4), TP2_PP2_Z1),
    "zero1_tp2_pp2_to_zero3_dp4": (TP2_PP2_Z1, Z3 + accum(4)),
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("zero3_ckpt"))
    return run_on_ranks(train_runs, 2, args=(RUNS_WORLD2, ("zero3",), root), timeout=400)


def test_zero3_matches_plain_data_parallel_dp2(world2):
    for run, ref in PAIRS_WORLD2:
        got, expected = world2[0][run], world2[0][ref]
        assert len(got["losses"]) == STEPS
        assert_close_trace(got["losses"], expected["losses"], 1e-5)
        assert_close_trace(got["norms"], expected["norms"], 1e-5)
        assert_params_close(got["params"], expected["params"], 1e-5)
        assert got["eval"]["eval_loss"] == pytest.approx(expected["eval"]["eval_loss"], rel=1e-5)


def test_zero3_holds_one_shard_of_everything(world2):
    """Per rank, after a step: weights, gradients and Adam's moments each numel / 2 elements (the padded
    buffer); no weight is whole; during the forward at most the chunk's own weights, one block and the
    prefetched next one are."""
    for rank in world2:
        run = rank["zero3"]
        assert [n for _, n, _ in run["buffers"]] == [2]
        assert_formula(run)
        root, *blocks = run["unit_numels"]
        assert len(blocks) == 4 and len(set(blocks)) == 1  # one unit per transformer block, alike
        # before a block runs: the chunk's own weights, that block and (prefetch) the next one are whole
        assert run["peak_gathered"] == root + 2 * blocks[0] < run["whole_numel"]
        plain = rank["plain"]["memory"]
        assert run["memory"]["params"] < plain["params"] // 2 + 2 * 64 and plain["grads"] == plain["params"]
        lora = rank["zero3_lora_recompute"]
        assert_formula(lora)
        frozen_numel, group, shard = lora["frozen_numel"][0]
        assert group == 2 and shard == frozen_numel // 2 > 0  # the frozen base is sharded too


def test_zero3_resumes_bitwise(world2):
    assert world2[0]["zero3"]["resume_bitwise"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["distributed.zero_optimization=4"], "distributed.zero_optimization must be false, true, 1, 2 or 3"),
        (["distributed.zero_shard_group_size=2"], "needs distributed.zero_optimization 1, 2 or 3"),
        (Z3 + ["distributed.zero_shard_group_size=3"], "zero_shard_group_size 3 must divide the data-parallel"),
        (Z3 + ["distributed.zero_shard_group_size=0"], "zero_shard_group_size must be a positive integer"),
        (Z3 + ["precision.compile=true"], "distributed.zero_optimization 3 gathers and frees weights"),
    ],
)
def test_recipe_refuses_what_is_not_built(overrides, message):
    from training_helpers import tiny_config

    with pytest.raises(ConfigError, match=message):
        tiny_config(overrides, world_size=4)


# -- extended: one process, world 4, MoE ------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(train_runs, 1, args=(REFERENCES,), timeout=400)[0]


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("zero3_w4"))
    return run_on_ranks(_world4, 4, args=(root,), timeout=900)


def _world4(root: str) -> dict:
    import os

    results = train_runs(RUNS_WORLD4, ("zero3_dp4", "zero3_hybrid"), os.path.join(root, "resume"))
    results["round_trips"] = round_trips(ROUND_TRIPS, os.path.join(root, "round_trips"))
    return results


def _whole(world: list[dict], run: str) -> dict:
    params = {}
    for rank in world:
        params.update(rank[run]["params"] or {})
    return {**world[0][run], "params": params}


@pytest.mark.extended
def test_zero3_dp2_matches_one_process(reference, world2):
    for run, ref in (("zero3", "one"), ("zero3_lora_recompute", "one_lora")):
        assert_close_trace(world2[0][run]["losses"], reference[ref]["losses"], 1e-5)
        assert_close_trace(world2[0][run]["norms"], reference[ref]["norms"], 1e-5)


@pytest.mark.extended
@pytest.mark.parametrize("run", sorted(RUNS_WORLD4))
def test_zero3_world4_layouts_match_one_process(reference, world4, run):
    got, ref = _whole(world4, run), reference[REFERENCE_OF.get(run, "one")]
    if "pp2" in run:  # the last stage's tied copy of the embedding stayed equal to the first stage's
        tied = got["params"].pop("lm_head.weight")
        assert torch.equal(tied, got["params"]["embed_tokens.weight"])
    assert len(got["losses"]) == STEPS
    assert_close_trace(got["losses"], ref["losses"], 1e-5)
    assert_close_trace(got["norms"], ref["norms"], 1e-5)
    assert_params_close(got["params"], ref["params"], 1e-4)  # Adam amplifies rounding (tp/cp sum in other orders)


@pytest.mark.extended
def test_zero3_world4_shards_and_resumes(world4):
    for rank in world4:
        for run in RUNS_WORLD4:
            facts = rank[run]
            expect = {"zero3_tp2_sp": 2, "zero3_pp2": 2, "zero3_pp2_interleaved": 2, "zero3_cp2": 4}.get(run, 4)
            if "hybrid" in run:
                expect = 2  # sharded over a group of 2, replicated over the 2 groups
            assert {n for _, n, _ in facts["buffers"]} == {expect}, run
            if run.startswith("zero3"):
                assert_formula(facts)
    assert world4[0]["zero3_dp4"]["resume_bitwise"] and world4[0]["zero3_hybrid"]["resume_bitwise"]


@pytest.mark.extended
def test_checkpoints_stay_layout_free(world4):
    """Saved at ZeRO-3 on dp 4, loaded at ZeRO-1 on tp 2 x pp 2, and the reverse: the loaded run continues
    with the losses the saving run had."""
    for name, got in world4[0]["round_trips"].items():
        assert got["step_loaded"] == 2 and len(got["target"]) == 2, name
        assert_close_trace(got["target"], got["source"], 1e-5)


MOE = [
    *TINY_MOE,
    "model.moe_shared_experts=1",
    "distributed.expert_parallel_size=2",
]
RUNS_MOE = {"moe_ep2": MOE + accum(4), "moe_ep2_zero3": MOE + Z3 + PREFETCH + accum(4)}


@pytest.mark.extended
def test_zero3_moe_ep2_shards_experts_over_their_group(tmp_path):
    world = run_on_ranks(train_runs, 4, args=(RUNS_MOE, ("moe_ep2_zero3",), str(tmp_path)), timeout=600)
    got, ref = _whole(world, "moe_ep2_zero3"), _whole(world, "moe_ep2")
    assert_close_trace(got["losses"], ref["losses"], 1e-5)
    assert_close_trace(got["norms"], ref["norms"], 1e-5)
    assert_params_close(got["params"], ref["params"], 1e-4)
    for rank in world:  # dense weights over the 4 data-parallel ranks, experts over their 2
        assert sorted(n for _, n, _ in rank["moe_ep2_zero3"]["buffers"]) == [2, 4]
        assert_formula(rank["moe_ep2_zero3"])
    assert world[0]["moe_ep2_zero3"]["resume_bitwise"]
