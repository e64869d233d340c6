"""Zero-bubble schedules as plans, without processes: zb1p (ZB-H1) pairs up and delivers under the
simulator for many shapes, keeps the 1F1B order and peak in-flight count, idles less than 1F1B; the
``distributed.pipeline_schedule`` key is validated with messages naming it; the dry run prints it."""

import re

import pytest
from training_helpers import tiny_config

from megacann.config import ConfigError
from megacann.dry_run import describe
from megacann.pipeline.plan import Backward, BackwardInput, BackwardWeight, Exchange, Forward, build_plan
from megacann.pipeline.rules import schedule_error
from megacann.pipeline.simulate import schedule_summary, simulate_schedule

SHAPES = [(p, m) for p in (2, 3, 4, 5, 8) for m in range(1, 3 * p + 1)]
PP2 = ["distributed.pipeline_parallel_size=2"]


@pytest.mark.parametrize("forward_only", [False, True])
def test_zb1p_plans_pair_up_and_deliver(forward_only):
    for p, m in SHAPES:
        simulate_schedule(p, m, schedule="zb1p", forward_only=forward_only)  # raises PlanError on any fault


def test_zb1p_is_1f1b_with_the_backward_split():
    """Dropping the Ws and renaming B to Backward gives the 1F1B plan; each W follows its own B."""
    for p, m in SHAPES:
        for stage in range(p):
            zb = build_plan(p, stage, m, schedule="zb1p")
            merged = [Backward(a.chunk, a.micro_batch) if isinstance(a, BackwardInput) else a for a in zb]
            assert [a for a in merged if not isinstance(a, BackwardWeight)] == build_plan(p, stage, m)
            order = [a.micro_batch for a in zb if isinstance(a, BackwardWeight)]
            assert order == list(range(m))


@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 8), (4, 2), (8, 16)])
def test_zb1p_idles_less_than_1f1b_with_the_same_memory(p, m):
    """Forward, B and W take one unit each (a fused backward two): the gradient travels back at the pace
    of B alone. The peak in-flight count is 1F1B's, min(p - s, m) on stage s."""
    one_f_one_b = simulate_schedule(p, m)
    zb = simulate_schedule(p, m, schedule="zb1p")
    assert zb.makespan < one_f_one_b.makespan
    assert zb.peak_in_flight == one_f_one_b.peak_in_flight == [min(p - s, m) for s in range(p)]
    bubble, peaks = schedule_summary(p, m, None, "zb1p")
    assert bubble == pytest.approx(max(zb.idle_fraction(s) for s in range(p)))
    assert peaks == zb.peak_in_flight


def test_zb1p_exact_timeline():
    """pp 2, 4 micro-batches, F = B = W = 1: stage 1 runs 12 units after waiting 1 for the first
    activation, stage 0 then finishes one B behind: 14 units, against 15 for 1F1B."""
    result = simulate_schedule(2, 4, schedule="zb1p")
    assert result.finish == [14.0, 13.0] and result.busy == [12.0, 12.0]
    assert simulate_schedule(2, 4).makespan == 15.0


def test_unknown_schedules_are_refused():
    assert schedule_error(None, 4, None) is None
    assert schedule_error("zb1p", 4, None) is None
    assert "must be one of 1f1b, interleaved, zb1p, zbv, dualpipev" in schedule_error("gpipe", 4, None)
    assert schedule_error("zbv", 4, 2) is None and schedule_error("dualpipev", 4, None) is None  # see test_pipeline_v_*
    assert "virtual_pipeline_size is 2: unset it, or use 'interleaved'" in schedule_error("zb1p", 4, 2)
    assert "'interleaved' needs distributed.virtual_pipeline_size >= 2" in schedule_error("interleaved", 4, None)
    assert "needs pipeline_parallel_size > 1, got 1" in schedule_error("zb1p", 1, None)


def test_recipe_key_is_validated():
    with pytest.raises(ConfigError, match=r"<recipe>: distributed.pipeline_schedule must be one of .* got 'zb2'"):
        tiny_config([*PP2, "distributed.pipeline_schedule=zb2"], world_size=2)
    with pytest.raises(ConfigError, match="pipeline_schedule 'zb1p' runs one model chunk per stage"):
        tiny_config([*PP2, "distributed.pipeline_schedule=zb1p", "distributed.virtual_pipeline_size=2"], world_size=2)
    with pytest.raises(ConfigError, match="'dualpipev' needs at least 2 x pipeline_parallel_size = 4 micro-batches"):
        tiny_config([*PP2, "distributed.pipeline_schedule=dualpipev"], world_size=2)
    cfg = tiny_config([*PP2, "distributed.pipeline_schedule=zb1p", "optim.grad_accum_steps=4"], world_size=2)
    assert cfg.distributed.pipeline_schedule == "zb1p"
    assert tiny_config([*PP2, "distributed.pipeline_schedule=1f1b"], world_size=2).distributed.pipeline_schedule


def test_dry_run_prints_the_schedule_bubble_and_in_flight():
    cfg = tiny_config(
        ["distributed.pipeline_parallel_size=4", "distributed.pipeline_schedule=zb1p", "optim.grad_accum_steps=8"],
        world_size=4,
    )
    text = describe(cfg)
    bubble, peaks = schedule_summary(4, 8, None, "zb1p")
    assert "-- pipeline: 4 stages, zb1p (ZB-H1 zero bubble" in text and f"bubble {bubble:.1%}" in text
    for stage in range(4):
        assert re.search(rf"stage {stage} \(ranks {stage}\): .*; at most {peaks[stage]} micro-batch chunks", text)
    assert peaks == [4, 3, 2, 1]


def test_split_actions_need_their_counterparts():
    from megacann.pipeline.simulate import PlanError, simulate

    plans = [build_plan(2, s, 2, schedule="zb1p") for s in range(2)]
    no_w = [plans[0], [a for a in plans[1] if a != BackwardWeight(0, 1)]]
    with pytest.raises(PlanError, match="never used"):
        simulate(no_w)
    early_w = [plans[0], [BackwardWeight(0, 0)] + [a for a in plans[1] if a != BackwardWeight(0, 0)]]
    with pytest.raises(PlanError, match="W of chunk 0, micro-batch 0 is not the oldest B"):
        simulate(early_w)
    assert all(isinstance(a, (Forward, BackwardInput, BackwardWeight, Exchange)) for a in plans[0])


def test_bubble_advice_uses_the_simulated_zb1p_bubble():
    from megacann.pipeline import check_pipeline_config

    pp4 = ["distributed.pipeline_parallel_size=4", "distributed.pipeline_schedule=zb1p"]
    (advice,) = check_pipeline_config(tiny_config([*pp4, "optim.grad_accum_steps=2"], world_size=4))
    bubble = schedule_summary(4, 2, None, "zb1p")[0]
    assert f"pipeline bubble {bubble:.0%} > 25%: zb1p with pipeline_parallel_size 4" in advice
    assert check_pipeline_config(tiny_config([*pp4, "optim.grad_accum_steps=8"], world_size=4)) == []  # 20%
    assert build_plan(4, 1, 3, forward_only=True, schedule="zb1p") == build_plan(4, 1, 3, forward_only=True)
