"""megacann-plan's layout search tries the pipeline schedules: the fastest one that fits, with the dry run's
bubble and memory (tests/test_planner.py checks those estimates against measurement)."""

from __future__ import annotations

import dataclasses

import pytest
from training_helpers import tiny_config

from megacann.config import ConfigError
from megacann.dry_run import describe
from megacann.pipeline.simulate import schedule_summary
from megacann.planning import estimate_stages, layout_of
from megacann.planning.activations import boundary_tensor_bytes
from megacann.planning.estimate import bubble_fraction
from megacann.planning.report import stage_table
from megacann.planning.search import (
    SPLIT_BACKWARD_COST,
    _bubble_bound,
    fastest_schedule,
    layout_config,
    schedule_config,
    schedule_variants,
    time_factor,
)

LAYERS = ["model.num_layers=8"]


def _base(m: int, *overrides: str):
    """A tiny recipe at pp 4 with m micro-batches, validated as 1F1B, and its layout."""
    cfg = tiny_config([*LAYERS, *overrides, "distributed.pipeline_parallel_size=4", f"optim.grad_accum_steps={m}"], 4)
    layout = dataclasses.replace(layout_of(cfg), schedule="1f1b")
    return layout_config(cfg, layout, 4), layout


def _largest(cfg, layout) -> float:
    return max(s.total for s in estimate_stages(cfg, layout))


def _variant(cfg, layout, schedule):
    variant = next(v for v in schedule_variants(layout) if v.schedule == schedule)
    return variant, schedule_config(cfg, variant)


def test_a_large_bubble_picks_zbv_where_memory_allows():
    cfg, base = _base(4)
    layout, chosen_cfg, stages = fastest_schedule(cfg, base, 1e12)
    assert layout.schedule == "zbv" and chosen_cfg.distributed.pipeline_schedule == "zbv"
    # p 4, m 4: zbv's simulated bubble 11.1% against 1F1B's 3/7, interleaved's 27.3%, zb1p's 33.3%
    assert bubble_fraction(layout) == pytest.approx(1 / 9) and bubble_fraction(base) == pytest.approx(3 / 7)
    assert time_factor(chosen_cfg, layout) == pytest.approx((1 + SPLIT_BACKWARD_COST) / (1 - 1 / 9))
    assert time_factor(chosen_cfg, layout) < min(
        time_factor(c, v) for v, c in (_variant(cfg, base, s) for s in ("1f1b", "interleaved", "zb1p"))
    )


def test_memory_the_bind_keeps_the_schedules_of_1f1b_memory():
    cfg, base = _base(4)
    one_f_one_b = _largest(cfg, base)
    zbv, zbv_cfg = _variant(cfg, base, "zbv")
    interleaved, interleaved_cfg = _variant(cfg, base, "interleaved")
    zb1p, zb1p_cfg = _variant(cfg, base, "zb1p")
    # the V holds the head beside the embedding on stage 0, interleaving more chunks in flight: both need more
    assert _largest(zbv_cfg, zbv) > one_f_one_b and _largest(interleaved_cfg, interleaved) > one_f_one_b
    # ZB-H1 keeps 1F1B's activations in flight, and at stage 0's peak one micro-batch's received gradient
    # waits from its B to its W (the first chunk's B has no input: nothing else; megacann.planning.deferred)
    zb1p_largest = _largest(zb1p_cfg, zb1p)
    assert zb1p_largest == one_f_one_b + boundary_tensor_bytes(zb1p_cfg, zb1p)
    layout, _, stages = fastest_schedule(cfg, base, zb1p_largest)
    assert layout.schedule == "zb1p" and max(s.total for s in stages) == zb1p_largest
    assert [s.in_flight for s in stages] == [4, 3, 2, 1]
    assert fastest_schedule(cfg, base, one_f_one_b)[0].schedule == "1f1b"  # that gradient does not fit
    # a byte less: only with the optimizer in host memory, and then the fastest schedule fits again
    offloaded, _, _ = fastest_schedule(cfg, base, one_f_one_b - 1)
    assert offloaded.offload_optimizer and offloaded.schedule == "zbv"


def test_a_small_bubble_keeps_1f1b():
    # 4 layers at pp 4: the V and interleaving need 8; zb1p against 1F1B, the split backward costing 2%
    cfg, base = _base(4, "model.num_layers=4")
    assert [v.schedule for v in _fits(cfg, base)] == ["1f1b", "zb1p"]
    layout, chosen, _ = fastest_schedule(cfg, base, 1e12)
    assert layout.schedule == "zb1p" and time_factor(chosen, layout) == pytest.approx(1.02 / (1 - 1 / 3))
    cfg, base = _base(256, "model.num_layers=4")  # 1F1B's bubble 3/259 = 1.2% costs less than the split
    layout, chosen, _ = fastest_schedule(cfg, base, 1e12)
    assert layout.schedule == "1f1b" and time_factor(chosen, layout) == pytest.approx(1 / (1 - 3 / 259))
    cfg, base = _base(256)  # with 8 layers interleaving (bubble 0.6%, no split) is the fastest
    assert fastest_schedule(cfg, base, 1e12)[0].schedule == "interleaved"


def _fits(cfg, base):
    out = []
    for v in schedule_variants(base):
        try:
            schedule_config(cfg, v)
        except ConfigError:
            continue
        out.append(v)
    return out


def test_the_trainer_s_refusals_hold_in_the_search():
    for builds in (["model.tie_word_embeddings=true", "model.mtp_num_layers=1"], ["train_mode=dpo", "data.path=x"]):
        cfg, base = _base(4, *builds)  # the V builds tied embeddings, MTP and DPO (loss on stage 0's chunk 1)
        assert fastest_schedule(cfg, base, 1e12)[0].schedule == "zbv", builds
    cfg, base = _base(6)  # dualpipev needs m >= 2p, interleaved m a multiple of p
    assert [v.schedule for v in schedule_variants(base)] == ["1f1b", "interleaved", "zb1p", "zbv", "dualpipev"]
    with pytest.raises(ConfigError, match="dualpipev"):
        schedule_config(cfg, _variant_layout(base, "dualpipev"))
    with pytest.raises(ConfigError, match="multiple of pipeline_parallel_size"):
        schedule_config(cfg, _variant_layout(base, "interleaved"))


def _variant_layout(base, schedule):
    return next(v for v in schedule_variants(base) if v.schedule == schedule)


def test_the_search_estimate_is_the_dry_run_s():
    cfg, base = _base(4)
    layout, chosen_cfg, stages = fastest_schedule(cfg, base, 1e12)
    assert layout_of(chosen_cfg) == layout  # the recipe the report names sets the layout it estimated
    text = describe(chosen_cfg)
    assert all(row in text for row in stage_table(stages)[1:])  # the dry run's per-device table, row for row
    bubble = schedule_summary(4, 4, None, "zbv")[0]
    assert f"pipeline: zbv, 4 micro-batches, bubble {bubble:.1%}" in text
    assert f"bubble {bubble:.1%}" in text.split("-- memory per device")[0]  # the pipeline section's figure


def test_the_bubble_bound_never_exceeds_the_simulated_bubble():
    """The search times a split schedule by this bound until it simulates it: it must not overshoot."""
    for p in (2, 3, 4):
        for m in range(1, 2 * p + 2):
            for schedule in ("zb1p", "zbv", "dualpipev"):
                if schedule == "dualpipev" and m < 2 * p:
                    continue
                layout = dataclasses.replace(_layout(p, m), schedule=schedule)
                assert _bubble_bound(layout) <= schedule_summary(p, m, None, schedule)[0] + 1e-12
    assert _bubble_bound(dataclasses.replace(_layout(4, 8), schedule="zbv")) == pytest.approx(1.5 / 25.5)


def _layout(p: int, m: int):
    from megacann.planning.formulas import Layout

    return Layout(pp=p, num_microbatches=m)
