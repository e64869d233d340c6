"""DPO under the V schedules (gloo, CPU, fp32): pipeline parallel 2 with ``zbv`` and ``dualpipev`` (its
pairs at once, and back to back with ``distributed.dualpipev_overlap: false``) train the one-process loss,
reward, reward-accuracy and gradient-norm trace, then evaluate held-out pairs as it does. The loss sits on
stage 0's chunk 1: the policy's and the reference pass's sequence log-probabilities are read there, with
the reference a frozen copy sharded like the policy, the base with its LoRA adapters disabled, or (zbv)
log-probabilities precomputed over the data by a forward-only V pass. A pair loss weighs every token of a
sequence by that sequence's gradient (not one value for all, as a mean over tokens would), which the split
backward's W must carry: each run ran Ws. At world 4, zbv with data parallel 2 (each rank half the pairs
of a step) and dualpipev with tensor parallel 2 + sequence parallelism (its pairs' collectives on two
threads at once) train the same trace. Machinery of tests/test_dpo_parallel.py; one spawn per world size."""

from __future__ import annotations

import pytest
from dist_harness import run_on_ranks
from finetune_helpers import LORA
from test_dpo_parallel import FIGURES, TP2, _runs
from test_pipeline_dualpipev_overlap import check_pairs_ran_at_once
from test_training_parity import assert_close_trace

pytestmark = pytest.mark.extended

M4 = "optim.grad_accum_steps=4"  # dualpipev needs m >= 2p
PP2 = "distributed.pipeline_parallel_size=2"
ZBV, DUALPIPEV = "distributed.pipeline_schedule=zbv", "distributed.pipeline_schedule=dualpipev"
RUNS_WORLD1 = {"copy": [M4], "lora": [M4, *LORA]}
RUNS_WORLD2 = {  # (overrides, one-process reference, reference kind)
    "pp2_zbv": ([PP2, ZBV, M4], "copy", "copy"),
    "pp2_zbv_lora": ([PP2, ZBV, M4, *LORA], "lora", "adapters_off"),
    "pp2_zbv_precomputed": ([PP2, ZBV, M4, "dpo.reference=precomputed"], "copy", "precomputed"),
    "pp2_dualpipev": ([PP2, DUALPIPEV, M4], "copy", "copy"),
    "pp2_dualpipev_lora": ([PP2, DUALPIPEV, M4, *LORA], "lora", "adapters_off"),
    "pp2_dualpipev_serial": ([PP2, DUALPIPEV, M4, "distributed.dualpipev_overlap=false"], "copy", "copy"),
}
DP2 = "data.batch_size=2"  # one pair per micro-batch and rank: 4 micro-batches x 2 ranks, the 8 pairs of a step
RUNS_WORLD4 = {
    "pp2_dp2_zbv": ([PP2, ZBV, M4, DP2], "copy", "copy"),
    "pp2_dp2_zbv_precomputed": ([PP2, ZBV, M4, DP2, "dpo.reference=precomputed"], "copy", "precomputed"),
    "pp2_tp2_dualpipev": ([PP2, *TP2, DUALPIPEV, M4], "copy", "copy"),
    "pp2_tp2_dualpipev_lora": ([PP2, *TP2, DUALPIPEV, M4, *LORA], "lora", "adapters_off"),
}
LAYOUTS = {"dp2": (1, 2, 2, 1, 1), "tp2": (2, 2, 1, 1, 1)}  # (tp, pp, dp, cp, ep) by the run's second part


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    return run_on_ranks(_runs, 1, args=(RUNS_WORLD1, str(tmp_path_factory.mktemp("v1")), True), timeout=300)[0]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    runs = {name: overrides for name, (overrides, _, _) in RUNS_WORLD2.items()}
    return run_on_ranks(_runs, 2, args=(runs, str(tmp_path_factory.mktemp("v2")), True), timeout=600)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    runs = {name: overrides for name, (overrides, _, _) in RUNS_WORLD4.items()}
    return run_on_ranks(_runs, 4, args=(runs, str(tmp_path_factory.mktemp("v4")), True), timeout=900)


@pytest.mark.parametrize("run", [*sorted(RUNS_WORLD2), *RUNS_WORLD4])
def test_dpo_under_the_v_schedules_trains_like_one_process(request, world1, run):
    overrides, reference, kind = {**RUNS_WORLD2, **RUNS_WORLD4}[run]
    ranks = request.getfixturevalue("world4" if run in RUNS_WORLD4 else "world2")
    ref = world1[reference]["trace"]
    for rank in ranks:  # every rank logs the same figures
        got = rank[run]
        assert got["layout"] == LAYOUTS.get(run.split("_")[1], (1, 2, 1, 1, 1)) and got["kind"] == kind
        assert got["copy_sharded"] == (kind == "copy")
        trace = got["trace"]
        assert_close_trace(trace["loss"], ref["loss"], 1e-5)
        assert_close_trace(trace["grad_norm"], ref["grad_norm"], 1e-5)
        for key in FIGURES[1:]:  # beta x differences of log-probability sums (~10 each): compared absolutely
            assert len(trace[key]) == len(ref[key])
            for a, e in zip(trace[key], ref[key]):
                assert abs(a - e) <= 1e-5, (key, trace[key], ref[key])
        assert trace["reward_accuracy"] == ref["reward_accuracy"]
        assert got["weights_run"] > 0  # the backward was split into B and W on every stage
        evaluated, expected = got["eval"], world1[reference]["eval"]  # forward-only V passes (held-out pairs)
        assert evaluated.keys() == expected.keys() and expected["eval_reward_margin"] != 0.0
        assert_close_trace([evaluated["eval_loss"]], [expected["eval_loss"]], 1e-5)
        assert abs(evaluated["eval_reward_margin"] - expected["eval_reward_margin"]) <= 1e-5
        assert evaluated["eval_reward_accuracy"] == expected["eval_reward_accuracy"]
    assert ref["reward_margin"][0] == 0.0 and all(abs(m) > 1e-4 for m in ref["reward_margin"][1:])
    overlapped = DUALPIPEV in overrides and "distributed.dualpipev_overlap=false" not in overrides
    if overlapped:  # distributed.dualpipev_overlap auto: each stage's pairs ran at once
        from megacann.pipeline.v_schedules import dualpipev_pairs

        assert sorted(rank[run]["stage"] for rank in ranks) == sorted([0, 1] * (len(ranks) // 2))
        for rank in ranks:
            steps = len(ref["loss"])
            probe = rank[run]["probe"]
            assert len(probe) % steps == 0
            check_pairs_ran_at_once(probe, steps * len(dualpipev_pairs(2, rank[run]["stage"], 4)))
    else:
        assert all(not rank[run]["probe"] for rank in ranks)
