"""``precision.fp8`` under the split-backward pipeline schedules: an FP8 product's weight gradient (its
quantisations and its GEMM) waits for the W pass like a plain product's (megacann.ops.weight_grad), and pp 2
with zb1p, zbv and dualpipev equals the same recipe in one process at the bounds of tests/test_fp8_training.py (its docstring
says why whole traces are held to 1e-3 / 1e-2), with a probe that no FP8 weight gradient was quantised
while B collected and all of them were afterwards.
"""

from __future__ import annotations

import pytest
from test_fp8_training import STEPS, _close, _run_all

PP2, M4 = ["precision.fp8=tensorwise", "distributed.pipeline_parallel_size=2"], "optim.grad_accum_steps=4"
RUNS = {  # 4 micro-batches: zb1p then splits the backward of pp 2
    "tensorwise_accum4": (1, ["precision.fp8=tensorwise", M4]),
    "tensorwise_pp2_zb1p": (2, [*PP2, M4, "distributed.pipeline_schedule=zb1p"]),
    "tensorwise_pp2_1f1b": (2, [*PP2, M4, "distributed.pipeline_schedule=1f1b"]),
    # V-shaped: each stage holds two chunks of one block (stage 0: blocks 0 and 3, stage 1: blocks 1 and 2)
    "tensorwise_pp2_zbv": (2, [*PP2, M4, "distributed.pipeline_schedule=zbv"]),
    "tensorwise_pp2_dualpipev": (2, [*PP2, M4, "distributed.pipeline_schedule=dualpipev"]),
}


@pytest.fixture(scope="module")
def runs() -> dict:
    return _run_all(RUNS)


def test_fp8_under_zb1p_equals_one_process_with_weight_gradients_deferred(runs):
    got, ref = runs["tensorwise_pp2_zb1p"], runs["tensorwise_accum4"]
    assert _close(got["losses"][:1], ref["losses"][:1], 1e-5), (got["losses"], ref["losses"])
    assert _close(got["losses"], ref["losses"], 1e-3) and _close(got["norms"], ref["norms"], 1e-2)
    # stage 0's 2 blocks of the first micro-batch scaled their operands as one process's first 2 blocks
    assert _close(got["scales"][:24], ref["scales"][:24], 1e-6)
    # each stage ran its 2 blocks' 6 FP8 products per micro-batch; no FP8 weight gradient was quantised
    # while a B collected, all of them afterwards; the last stage split its backward (its deferred closures:
    # the FP8 products' among them); the first stage, whose input needs no gradient, deferred none (measured)
    products = STEPS * 4 * 6 * 2
    assert got["fp8_calls"] == [products] * 2
    (first_b, first_rest, first_deferred), (last_b, last_rest, last_deferred) = got["weight_grads"]
    assert (first_b, first_rest, last_b, last_rest) == (0, products, 0, products), got["weight_grads"]
    assert first_deferred == 0 and last_deferred >= products, got["weight_grads"]
    # without a split backward nothing is deferred
    assert runs["tensorwise_pp2_1f1b"]["weight_grads"] == [(0, products, 0)] * 2


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_fp8_under_the_v_schedules_equals_one_process_with_weight_gradients_deferred(runs, schedule):
    got, ref = runs[f"tensorwise_pp2_{schedule}"], runs["tensorwise_accum4"]
    assert _close(got["losses"][:1], ref["losses"][:1], 1e-5), (got["losses"], ref["losses"])
    assert _close(got["losses"], ref["losses"], 1e-3) and _close(got["norms"], ref["norms"], 1e-2)
    # stage 0's first chunk (block 0) of the first micro-batch scaled its operands as one process's block 0
    assert _close(got["scales"][:12], ref["scales"][:12], 1e-6)
    # each stage ran its 2 blocks' 6 FP8 products per micro-batch; no FP8 weight gradient was quantised
    # while a B collected, all of them afterwards, and both stages deferred closures to W
    products = STEPS * 4 * 6 * 2
    assert got["fp8_calls"] == [products] * 2
    for in_b, elsewhere, deferred in got["weight_grads"]:
        assert (in_b, elsewhere) == (0, products) and deferred > 0, got["weight_grads"]
