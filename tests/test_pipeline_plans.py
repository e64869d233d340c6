"""Schedule plans, checked without processes: every stage's transfers pair up in order (as NCCL/HCCL need),
nothing deadlocks, every chunk gets the right micro-batch, and the ideal bubble is the textbook one."""

import pytest

from megacann.pipeline.plan import Backward, Exchange, Forward, build_plan, interleaved_plan, one_f_one_b_plan
from megacann.pipeline.simulate import PlanError, simulate, simulate_schedule

SHAPES = [
    (p, v, m) for p in (2, 3, 4, 5, 8) for v in (None, 2, 3, 4) for m in range(1, 3 * p + 1) if not v or m % p == 0
]


@pytest.mark.parametrize("forward_only", [False, True])
def test_every_plan_pairs_up_and_delivers(forward_only):
    for p, v, m in SHAPES:
        simulate_schedule(p, m, v, forward_only=forward_only)  # raises PlanError on any fault


@pytest.mark.parametrize(
    "p, v, m",
    [(2, None, 4), (4, None, 4), (4, None, 8), (4, None, 2), (8, None, 3), (2, 2, 4), (4, 2, 8), (4, 4, 8), (3, 2, 6)],
)
def test_ideal_bubble_is_the_textbook_one(p, v, m):
    """With forward 1/v and backward 2/v per chunk and free transfers, every stage idles for
    (p - 1)/v of the m + (p - 1)/v slots: (p - 1)/(m + p - 1) for 1F1B, divided by v when interleaved."""
    vv = v or 1
    result = simulate_schedule(p, m, v, forward_time=1 / vv, backward_time=2 / vv)
    theory = ((p - 1) / vv) / (m + (p - 1) / vv)
    for stage in range(p):
        assert result.idle_fraction(stage) == pytest.approx(theory, abs=1e-9), (stage, result)


def test_1f1b_warmup_and_order():
    plan = one_f_one_b_plan(4, 1, 6)
    computes = [a for a in plan if not isinstance(a, Exchange)]
    # stage 1 of 4: two warm-up forwards, then 1F1B, then the last two backwards
    assert computes[:3] == [Forward(0, 0), Forward(0, 1), Forward(0, 2)]
    assert computes[3] == Backward(0, 0)
    assert computes[-2:] == [Backward(0, 4), Backward(0, 5)]
    last = one_f_one_b_plan(4, 3, 6)
    assert [type(a) for a in last if not isinstance(a, Exchange)][:2] == [Forward, Backward]


def test_interleaved_chunk_order():
    plan = interleaved_plan(2, 0, 2, 4)
    forwards = [(a.chunk, a.micro_batch) for a in plan if isinstance(a, Forward)]
    assert forwards == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    backwards = [(a.chunk, a.micro_batch) for a in plan if isinstance(a, Backward)]
    assert backwards == [(1, 0), (1, 1), (0, 0), (0, 1), (1, 2), (1, 3), (0, 2), (0, 3)]


def test_interleaved_needs_a_multiple_of_the_pipeline_size():
    with pytest.raises(ValueError, match="multiple of pipeline_parallel_size 4, got 6"):
        build_plan(4, 0, 6, virtual_stages=2)
    with pytest.raises(ValueError, match="multiple of pipeline_parallel_size 4, got 2"):
        build_plan(4, 0, 2, virtual_stages=2)


def test_fewer_micro_batches_than_stages_work_with_1f1b():
    result = simulate_schedule(8, 2)
    assert result.idle_fraction(0) == pytest.approx(7 / 9)


def test_simulator_catches_a_missing_receive_and_a_misordered_pair():
    plans = [build_plan(2, s, 4) for s in range(2)]
    broken = [plans[0], [a for a in plans[1] if a != Exchange(recv_forward=0)]]
    with pytest.raises(PlanError, match="no input received|deadlock"):
        simulate(broken)
    # stage 1 asks for a gradient where stage 0 sends an activation: the pair's streams disagree
    swapped = [plans[0], [Exchange(recv_backward=0) if a == Exchange(recv_forward=0) else a for a in plans[1]]]
    with pytest.raises(PlanError):
        simulate(swapped)
