"""bf16, the production dtype: each parallel layout trains the loss trace of one process in bf16.

The bound comes from bf16's round-off: 8 significant bits, unit round-off u = 2^-8. A layout differs from
one process only in where partial sums are rounded to bf16 (a split matmul, a reduction over ranks, another
accumulation order); each rounding moves a value by at most u relative, and the loss, a mean over many token
losses, averages these independent errors rather than adding them. So the loss traces must agree within
LOSS_BOUND = 2u (7.8e-3) at every step. The first step's gradient norm (equal weights on both sides), whose
square adds up the rounding of every gradient, agrees within NORM_BOUND = 4u; later norms are not compared:
once the weights differ by a few roundings, the norm of a tiny model's noisy gradient moves by a few percent
(2.7e-2 was measured under cp 2 while its loss stayed within 8e-4). Measured on CPU: loss at most 9e-4,
first-step norm at most 1.1e-4.

The task is memorisation (8 distinct samples), so the loss falls steadily (asserted: by more than 10 times
the bound) instead of wandering, and a wrong update shows: a control run whose learning rate is 10% off, an
error far smaller than a missing reduction or a wrong gradient scale, must leave the bound. fp32 layouts are
held to 1e-5 elsewhere (tests/test_training_parity.py, tests/test_layout_fuzz.py).
"""

import pytest
from dist_harness import run_on_ranks
from layout_fuzz import MOE, Layout, check_layout, run_layouts

pytestmark = pytest.mark.extended

UNIT_ROUNDOFF = 2.0**-8
LOSS_BOUND, NORM_BOUND = 2 * UNIT_ROUNDOFF, 4 * UNIT_ROUNDOFF
STEPS, LR = 12, 3e-3
BF16 = ["model.precision=bf16", f"optim.lr={LR}", "optim.clip_grad=1.0"]
TP2, SP = "distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"
MOE_BF16 = [*BF16, *MOE, "model.moe_aux_loss_coeff=1e-2"]


def _layout(label: str, parallel: list[str], model: list[str] = BF16, dp: int = 1) -> Layout:
    return Layout(0, 2, model, parallel, dp=dp, steps=STEPS, label=label, distinct=8)


LAYOUTS = [
    _layout("tp2_sp", [TP2, SP]),
    _layout("cp2_ring", ["distributed.context_parallel_size=2"]),
    _layout("ep2", ["distributed.expert_parallel_size=2"], MOE_BF16, dp=2),
    _layout("zero1_dp2", ["distributed.zero_optimization=1"], dp=2),
    _layout("zero2_dp2", ["distributed.zero_optimization=2"], dp=2),
    _layout("pp2", ["distributed.pipeline_parallel_size=2"]),
]
CONTROL = _layout("control_lr_10pct_off", [TP2, SP, f"optim.lr={LR * 1.1}"])


@pytest.fixture(scope="module")
def runs():
    layouts = [*LAYOUTS, CONTROL]
    got = run_on_ranks(run_layouts, 2, args=(layouts, False), timeout=1800)[0]
    ref = run_on_ranks(run_layouts, 1, args=(layouts, True), timeout=1800)[0]
    return got, ref


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_bf16_layout_trains_like_one_process_in_bf16(runs, layout):
    got, ref = runs[0][layout.name], runs[1][layout.name]
    assert check_layout(layout, got, ref, rel=LOSS_BOUND, norm_rel=float("inf")) == []
    first, expected = got["norms"][0], ref["norms"][0]
    assert abs(first - expected) <= NORM_BOUND * expected, (got["norms"], ref["norms"])
    losses = ref["losses"]
    assert len(losses) == STEPS
    assert losses[0] - losses[-1] > 10 * LOSS_BOUND * losses[0], f"the trace barely moves: {losses}"
    worst = max(abs(a - e) / abs(e) for a, e in zip(got["losses"], losses))
    print(f"{layout.name}: largest relative loss difference {worst:.2e} (bound {LOSS_BOUND:.2e})")


def test_the_bound_sees_an_update_ten_percent_off(runs):
    got, ref = runs[0][CONTROL.name], runs[1][CONTROL.name]
    problems = check_layout(CONTROL, got, ref, rel=LOSS_BOUND, norm_rel=float("inf"))
    assert any(p.startswith("losses differ") for p in problems), (got["losses"], ref["losses"])
