"""bf16, the production dtype: each parallel layout trains the loss trace of one process in bf16.

The bound comes from bf16's round-off: 8 significant bits, unit round-off u = 2^-8. Layouts differ from one
process only in where partial sums are rounded to bf16 (a split matmul, a reduction over ranks, another
accumulation order), each such rounding moves an activation by at most u relative, and the loss, a mean
over thousands of token losses, averages those independent errors down rather than adding them up. So the
traces must agree within RELATIVE_BOUND = 2u (7.8e-3) at every step, over STEPS steps whose loss falls by
far more than that (asserted: at least 10 times the bound), so that a wrong gradient (a missing reduction,
a wrong scale), which changes every update, would leave the bound within a few steps. fp32 layouts are held
to 1e-5 elsewhere (tests/test_training_parity.py, tests/test_layout_fuzz.py).
"""

import pytest
from dist_harness import run_on_ranks
from layout_fuzz import MOE, Layout, check_layout, run_layouts

pytestmark = pytest.mark.extended

UNIT_ROUNDOFF = 2.0**-8
RELATIVE_BOUND = 2 * UNIT_ROUNDOFF
STEPS = 10
BF16 = ["model.precision=bf16", "optim.lr=1e-2", "optim.clip_grad=1.0"]
TP2, SP = "distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"
LAYOUTS = [
    Layout(0, 2, BF16, [TP2, SP], steps=STEPS, label="tp2_sp"),
    Layout(0, 2, BF16, ["distributed.context_parallel_size=2"], steps=STEPS, label="cp2_ring"),
    Layout(
        0,
        2,
        [*BF16, *MOE, "model.moe_aux_loss_coeff=1e-2"],
        ["distributed.expert_parallel_size=2"],
        dp=2,
        steps=STEPS,
        label="ep2",
    ),
    Layout(0, 2, BF16, ["distributed.zero_optimization=1"], dp=2, steps=STEPS, label="zero1_dp2"),
    Layout(0, 2, BF16, ["distributed.zero_optimization=2"], dp=2, steps=STEPS, label="zero2_dp2"),
    Layout(0, 2, BF16, ["distributed.pipeline_parallel_size=2"], steps=STEPS, label="pp2"),
]


@pytest.fixture(scope="module")
def runs():
    got = run_on_ranks(run_layouts, 2, args=(LAYOUTS, False), timeout=1200)[0]
    ref = run_on_ranks(run_layouts, 1, args=(LAYOUTS, True), timeout=1200)[0]
    return got, ref


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_bf16_layout_trains_like_one_process_in_bf16(runs, layout):
    got, ref = runs[0][layout.name], runs[1][layout.name]
    assert check_layout(layout, got, ref, rel=RELATIVE_BOUND) == []
    losses = ref["losses"]
    assert len(losses) == STEPS
    assert losses[0] - min(losses) > 10 * RELATIVE_BOUND * losses[0], f"the trace barely moves: {losses}"
    worst = max(abs(a - e) / abs(e) for a, e in zip(got["losses"], losses))
    print(f"{layout.name}: largest relative loss difference {worst:.2e} (bound {RELATIVE_BOUND:.2e})")
