"""A schedule registered from outside megacann (tests/gpipe_schedule.py, GPipe: all forwards, then all
backwards) is a value of ``distributed.pipeline_schedule`` like the built-in ones: the recipe check lists
and checks it, the simulator runs its plans, and a pp 2 pipeline trains with it exactly as one process,
every rank running its plan (all forwards of the step before any backward)."""

import importlib
import sys

import pytest
from test_pipeline_zero_bubble_training import _check_run, _layouts, _references

from megacann.pipeline.schedule_spec import registered_schedules, unregister_schedule

IMPORTS = "experiment.imports=[gpipe_schedule]"
GPIPE_RUN = {"pp2_gpipe": ([IMPORTS, "distributed.pipeline_parallel_size=2", "optim.grad_accum_steps=4",
                            "distributed.pipeline_schedule=gpipe"], "m4")}  # fmt: skip


@pytest.fixture
def gpipe():
    """The schedule registered by importing its module, forgotten afterwards (the registry is global)."""
    module = importlib.import_module("gpipe_schedule")
    yield module
    unregister_schedule("gpipe")
    sys.modules.pop("gpipe_schedule", None)


def test_registered_schedule_is_checked_and_simulated(gpipe):
    from megacann.pipeline.rules import pipeline_bubble_fraction, schedule_error
    from megacann.pipeline.simulate import simulate_schedule

    assert registered_schedules()[-1] == "gpipe"
    assert "must be one of 1f1b, interleaved, zb1p, zbv, dualpipev, gpipe (or unset), got 'gpip'" in schedule_error(
        "gpip", 2, None
    )
    assert schedule_error("gpipe", 2, None) is None
    assert (
        schedule_error("gpipe", 2, 2)
        == "distributed.pipeline_schedule 'gpipe' runs one model chunk per stage, got virtual_size 2"
    )
    for p in range(2, 6):
        for m in range(1, 9):
            result = simulate_schedule(p, m, schedule="gpipe")  # raises PlanError on any inconsistency
            bubble = max(result.idle_fraction(s) for s in range(p))
            assert bubble == pytest.approx(pipeline_bubble_fraction(p, m), rel=1e-12), (p, m)
            assert result.peak_in_flight == [m] * p, (p, m)  # GPipe holds every micro-batch (1F1B: p - s)
            simulate_schedule(p, m, schedule="gpipe", forward_only=True)


def test_registry_refuses_a_name_twice(gpipe):
    from megacann.pipeline.schedule_spec import register_schedule

    with pytest.raises(ValueError, match="pipeline schedule 'gpipe' is registered already"):
        register_schedule(gpipe.GPIPE)


def test_gpipe_trains_pp2_like_one_process(tmp_path):
    references = _references({"m4"}, str(tmp_path / "ref"))
    got, _ = _layouts(2, GPIPE_RUN, {}, str(tmp_path / "pp"))
    run = got["pp2_gpipe"]
    _check_run(run, GPIPE_RUN["pp2_gpipe"], references, split=False)
    from megacann.pipeline.actions import Backward, Forward

    for rank in run["runs"]:  # GPipe really ran: every forward of the step before the first backward
        computes = [a for a in rank["trace"] if isinstance(a, (Forward, Backward))]
        assert [type(a) for a in computes] == [Forward] * 4 + [Backward] * 4, computes
