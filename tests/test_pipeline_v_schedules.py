"""V-shaped schedules as plans, without processes: zbv and dualpipev pair up and deliver under the
simulator for pp 2 to 4 and many micro-batch counts; the V placement (stage s: blocks s and 2p - 1 - s,
stage 0 with embedding and head); DualPipeV's phases; the recipe key's refusals (tied embeddings and
multi-token prediction accepted); the dry run."""

import re

import pytest
from training_helpers import tiny_config

from megacann.config import ConfigError
from megacann.dry_run import describe
from megacann.pipeline import chunk_placements, stage_layer_ids
from megacann.pipeline.plan import Backward, BackwardInput, BackwardWeight, Forward, build_plan
from megacann.pipeline.rules import loss_stage, schedule_error
from megacann.pipeline.simulate import PlanError, schedule_summary, simulate, simulate_schedule
from megacann.pipeline.v_schedules import Transfer, VExchange, dualpipev_orders

ZBV_SHAPES = [(p, m) for p in (2, 3, 4) for m in range(1, 3 * p + 1)]
DUALPIPEV_SHAPES = [(p, m) for p in (2, 3, 4) for m in range(2 * p, 3 * p + 2)]
PP2 = ["distributed.pipeline_parallel_size=2"]


@pytest.mark.parametrize("forward_only", [False, True])
def test_v_plans_pair_up_and_deliver(forward_only):
    for schedule, shapes in (("zbv", ZBV_SHAPES), ("dualpipev", DUALPIPEV_SHAPES)):
        for p, m in shapes:
            result = simulate_schedule(p, m, schedule=schedule, forward_only=forward_only)  # PlanError on a fault
            assert len(result.finish) == p


def test_v_plans_run_every_f_b_w_once_per_chunk():
    for schedule, shapes in (("zbv", ZBV_SHAPES), ("dualpipev", DUALPIPEV_SHAPES)):
        for p, m in shapes:
            for stage in range(p):
                plan = build_plan(p, stage, m, schedule=schedule)
                for chunk in (0, 1):
                    forwards = [a.micro_batch for a in plan if isinstance(a, Forward) and a.chunk == chunk]
                    backs = [
                        a.micro_batch for a in plan if isinstance(a, (Backward, BackwardInput)) and a.chunk == chunk
                    ]
                    weights = [a.micro_batch for a in plan if isinstance(a, BackwardWeight) and a.chunk == chunk]
                    assert forwards == backs == list(range(m)), (schedule, p, m, stage)
                    split = [a.micro_batch for a in plan if isinstance(a, BackwardInput) and a.chunk == chunk]
                    assert weights == split
                transfers = [t for a in plan if isinstance(a, VExchange) for t in a.transfers]
                assert all(0 <= stage + t.peer < p for t in transfers)  # a line, no wrap-around


def test_v_transfers_go_both_ways_and_stay_on_the_last_stage():
    """Stage 0 sends chunk 0's activations down and receives chunk 1's from below; the last stage hands
    chunk 0's output to chunk 1 in place, so it sends no activation at all for chunk 0."""
    plans = [build_plan(2, s, 4, schedule="zbv") for s in range(2)]
    sent = [
        {(t.peer, t.kind, t.chunk) for a in plan if isinstance(a, VExchange) for t in a.transfers if t.send}
        for plan in plans
    ]
    assert sent[0] == {(1, "activation", 0), (1, "gradient", 1)}
    assert sent[1] == {(-1, "activation", 1), (-1, "gradient", 0)}
    with pytest.raises(PlanError, match="made no activation to send"):
        bad = [plans[0], [VExchange((Transfer(-1, True, "activation", 0),))] + plans[1]]
        simulate(bad, v_shape=True)


def test_v_placement():
    assert stage_layer_ids(8, 2, 0, 2, 0, v_shape=True) == [0, 1]
    assert stage_layer_ids(8, 2, 0, 2, 1, v_shape=True) == [6, 7]
    assert stage_layer_ids(8, 2, 1, 2, 1, v_shape=True) == [4, 5]
    assert stage_layer_ids(6, 2, 0, 2, 1, [1, 2, 2, 1], v_shape=True) == [5]
    cfg = tiny_config(
        [
            *PP2,
            "distributed.pipeline_schedule=zbv",
            "model.num_layers=6",
            "distributed.pipeline_layers=[1,2,2,1]",
            "optim.grad_accum_steps=4",
        ],
        world_size=2,
    )
    first, last = chunk_placements(cfg, 0), chunk_placements(cfg, 1)
    assert [(c.layer_ids, c.pre_process, c.post_process) for c in first] == [((0,), True, False), ((5,), False, True)]
    assert [(c.layer_ids, c.pre_process, c.post_process) for c in last] == [
        ((1, 2), False, False),
        ((3, 4), False, False),
    ]


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16)])
def test_zbv_idles_less_than_zb1p_with_the_memory_of_1f1b(p, m):
    """A V chunk does half a stage's work: with F = B = W per stage, ZB-V finishes before ZB-H1 and 1F1B,
    and holds at most 2p chunk activations (p micro-batches of a stage's layers, 1F1B's stage 0)."""
    zbv, zb1p, one_f_one_b = (
        simulate_schedule(p, m, schedule="zbv"),
        simulate_schedule(p, m, schedule="zb1p"),
        (simulate_schedule(p, m)),
    )
    assert zbv.makespan < zb1p.makespan < one_f_one_b.makespan
    assert max(zbv.peak_in_flight) <= 2 * p


def test_zbv_exact_timeline():
    result = simulate_schedule(2, 4, schedule="zbv")
    assert result.makespan == 12.5 and result.busy == [12.0, 12.0]


def test_dualpipev_phases():
    """Rank r: 2(p - r - 1) warm-up forwards of chunk 0; 2p - r - 1 deferred Ws, the last r + 1 at the
    end; m - 2p + r + 1 main steps pairing a forward with a backward of another micro-batch."""
    p, m = 4, 10
    for r, order in enumerate(dualpipev_orders(p, m)):
        assert all(item == (Forward(0, i),) for i, item in enumerate(order[: 2 * (p - r - 1)]))
        assert sum(isinstance(item[0], BackwardWeight) for item in order) == 2 * p - r - 1
        assert all(isinstance(item[0], BackwardWeight) for item in order[-(r + 1) :])
        pairs = [item for item in order if len(item) == 2]
        assert len(pairs) == 2 * (m - 2 * p + r + 1) + (p - r - 1)
        assert all(
            isinstance(f, Forward) and isinstance(b, Backward) and f.micro_batch != b.micro_batch or f.chunk != b.chunk
            for f, b in pairs
        )


def test_v_schedules_are_validated():
    assert schedule_error("zbv", 2, None) is None and schedule_error("dualpipev", 4, 2) is None
    assert "virtual_pipeline_size is 3: unset it or set it to 2" in schedule_error("zbv", 4, 3)
    assert "'zbv' needs pipeline_parallel_size > 1, got 1" in schedule_error("zbv", 1, None)
    with pytest.raises(
        ConfigError,
        match=r"'dualpipev' needs at least 2 x pipeline_parallel_size = 4 micro-batches "
        r"\(optim.grad_accum_steps\), got 2",
    ):
        tiny_config([*PP2, "distributed.pipeline_schedule=dualpipev", "optim.grad_accum_steps=2"], world_size=2)
    with pytest.raises(ValueError, match="at least 2 x pipeline_parallel_size = 8"):
        build_plan(4, 0, 7, schedule="dualpipev")
    with pytest.raises(
        ConfigError,
        match=r"distributed.pipeline_layers \[2, 2\] must list 4 stage sizes .*"
        "2 chunks per stage of pipeline_schedule zbv",
    ):
        tiny_config([*PP2, "distributed.pipeline_schedule=zbv", "distributed.pipeline_layers=[2,2]"], world_size=2)
    dpo = ["train_mode=dpo", "data.path=unused.jsonl"]  # its log-probabilities read where the loss is
    for accepted in (["model.tie_word_embeddings=true"], ["model.mtp_num_layers=1"], dpo):  # stage 0 sums its copies
        for schedule in ("zbv", "dualpipev"):
            overrides = [*PP2, f"distributed.pipeline_schedule={schedule}", "optim.grad_accum_steps=4", *accepted]
            cfg = tiny_config(overrides, world_size=2)
            assert [c.post_process for c in chunk_placements(cfg, 0)] == [False, True]
            assert loss_stage(schedule, 2) == 0
    assert [loss_stage(s, 4) for s in ("1f1b", "interleaved", "zb1p", None)] == [3] * 4 and loss_stage(None, 1) == 0
    with pytest.raises(ConfigError, match="virtual_pipeline_size is 4"):
        tiny_config(
            [*PP2, "distributed.pipeline_schedule=zbv", "distributed.virtual_pipeline_size=4", "model.num_layers=8"],
            world_size=2,
        )
    cfg = tiny_config(
        [*PP2, "distributed.pipeline_schedule=zbv", "distributed.virtual_pipeline_size=2", "optim.grad_accum_steps=4"],
        world_size=2,
    )
    assert [c.post_process for c in chunk_placements(cfg, 0)] == [False, True]


def test_dry_run_prints_the_v_schedules():
    for schedule, m in (("zbv", 4), ("dualpipev", 8)):
        cfg = tiny_config(
            [
                "distributed.pipeline_parallel_size=4",
                f"distributed.pipeline_schedule={schedule}",
                f"optim.grad_accum_steps={m}",
                "model.num_layers=8",
            ],
            world_size=4,
        )
        text = describe(cfg)
        bubble, peaks = schedule_summary(4, m, None, schedule)
        assert f"-- pipeline: 4 stages, {schedule} (" in text and f"bubble {bubble:.1%}" in text
        assert re.search(
            r"stage 0 \(ranks 0\): chunk 0: embedding, layer 0 \| chunk 1: layer 7, final norm, "
            rf"lm_head, loss; at most {peaks[0]} micro-batch chunks in flight",
            text,
        )
        assert re.search(r"stage 3 \(ranks 3\): chunk 0: layer 3 \| chunk 1: layer 4;", text)
        assert f"pipeline: {schedule}, {m} micro-batches, bubble {bubble:.1%}" in text  # the memory estimate's
    uneven = tiny_config(
        [
            *PP2,
            "distributed.pipeline_schedule=zbv",
            "model.num_layers=6",
            "distributed.pipeline_layers=[1,2,2,1]",
            "optim.grad_accum_steps=4",
        ],
        world_size=2,
    )
    text = describe(uneven)  # the memory estimate places the V's blocks too
    assert re.search(r"\n0 .* embedding \+ layer 0 \| layer 5 \+ output layer\n1 .* layers 1-2 \| layers 3-4\n", text)


def test_dry_run_places_the_tied_head_and_mtp_beside_the_embedding():
    zbv = [*PP2, "distributed.pipeline_schedule=zbv", "optim.grad_accum_steps=4"]
    tied = describe(tiny_config([*zbv, "model.tie_word_embeddings=true"], world_size=2))
    assert re.search(
        r"stage 0 \(ranks 0\): chunk 0: embedding, layer 0 \| chunk 1: layer 3, final norm, lm_head \(copy of "
        r"chunk 0's tied embedding, gradients summed with it on this stage\), loss;",
        tied,
    )
    mtp = describe(tiny_config([*zbv, "model.mtp_num_layers=1"], world_size=2))
    assert "lm_head, loss, 1 multi-token prediction depth, its embedding a copy of chunk 0's;" in mtp
