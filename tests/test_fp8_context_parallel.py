"""``precision.fp8`` under context parallelism: every layer's tokens are split over the context-parallel
ranks, so a scale whose block spans the tokens (every tensorwise scale; under rowwise, the rows of the
weight gradient's operands, which run along the tokens) has its amax reduced over the cp group; mxfp8's
1 x 32 tiles along the tokens need none when each chunk of the sequence holds whole tiles. cp 2 equals the
same recipe in one process at the bounds of tests/test_fp8_training.py (its docstring says why whole
traces are held to 1e-3 / 1e-2, not 1e-5), with probes that each rank multiplied half the tokens and that
skipping the cp reduction breaks the equality.
"""

from __future__ import annotations

import pytest
from test_fp8_training import _close, _run_all
from training_helpers import tiny_config

from megacann.config import ConfigError

pytestmark = pytest.mark.extended  # a slow multi-rank check: `make test-extended` runs it

CP2 = "distributed.context_parallel_size=2"
TENSORWISE, ROWWISE = ["precision.fp8=tensorwise"], ["precision.fp8=rowwise", "precision.fp8_grad_format=e4m3"]
MXFP8 = [
    "precision.fp8=mxfp8",
    "data.seq_length=128",
    "model.max_position_embeddings=128",
]  # chunks of 128 / 4 = 32 tokens: whole MX tiles
RUNS = {
    "tensorwise": (1, TENSORWISE),
    "tensorwise_cp2": (2, [*TENSORWISE, CP2]),
    "tensorwise_cp2_tokens_unreduced": (2, [*TENSORWISE, CP2]),
    "rowwise": (1, ROWWISE),
    "rowwise_cp2": (2, [*ROWWISE, CP2]),
    "rowwise_cp2_tokens_unreduced": (2, [*ROWWISE, CP2]),
    "mxfp8": (1, MXFP8),
    "mxfp8_cp2": (2, [*MXFP8, CP2]),
}
MATCHES = {"tensorwise_cp2": "tensorwise", "rowwise_cp2": "rowwise", "mxfp8_cp2": "mxfp8"}


@pytest.fixture(scope="module")
def runs() -> dict:
    return _run_all(RUNS)


@pytest.mark.parametrize("layout", sorted(MATCHES))
def test_fp8_under_context_parallelism_equals_one_process(runs, layout):
    got, ref = runs[layout], runs[MATCHES[layout]]
    assert _close(got["losses"][:1], ref["losses"][:1], 1e-5), (got["losses"], ref["losses"])
    # and the first step's gradient norm (measured: equal to the last bit), which a rowwise weight gradient
    # scaled per rank would move (test below)
    assert _close(got["norms"][:1], ref["norms"][:1], 1e-5), (got["norms"], ref["norms"])
    assert _close(got["losses"], ref["losses"], 1e-3) and _close(got["norms"], ref["norms"], 1e-2)
    if layout.startswith("tensorwise"):  # every rank scaled every operand as one process did
        assert len(got["scales"]) == 48 and _close(got["scales"], ref["scales"], 1e-6)
    # context parallelism was in force: each rank multiplied half of the micro-batch's tokens, in FP8
    assert got["first_rows"] * 2 == ref["first_rows"] == 2 * (128 if "mxfp8" in layout else 32)
    assert got["fp8_layers"] == ref["fp8_layers"] and len(got["fp8_layers"]) == 24
    assert got["fp8_calls"] == [ref["fp8_calls"][0]] * 2 and ref["fp8_calls"][0] > 0


def test_a_skipped_context_parallel_reduction_breaks_parity(runs):
    broken, ref = runs["tensorwise_cp2_tokens_unreduced"], runs["tensorwise"]
    assert max(abs(a - b) / b for a, b in zip(broken["scales"], ref["scales"])) > 0.01
    assert not _close(broken["losses"][:1], ref["losses"][:1], 1e-5)
    # rowwise: the forward's per-token scales need no reduction; the weight gradients' per-feature ones do
    broken, ref = runs["rowwise_cp2_tokens_unreduced"], runs["rowwise"]
    assert _close(broken["losses"][:1], ref["losses"][:1], 1e-5)
    # (measured: with the reduction the first two gradient norms equal one process's to the last bit; without
    # it the first moves by 3e-5, and the second step's loss by 1e-5)
    assert _close(runs["rowwise_cp2"]["norms"][:2], ref["norms"][:2], 1e-6)
    assert not _close(broken["norms"][:1], ref["norms"][:1], 1e-5), (broken["norms"], ref["norms"])


def test_tiles_that_straddle_context_parallel_chunks_are_refused():
    with pytest.raises(
        ConfigError,
        match="precision.fp8=blockwise with distributed.context_parallel_size 2 needs each of the sequence's 4 "
        "chunks to hold whole 128-token tiles, but data.seq_length 32 gives chunks of 8",
    ):
        tiny_config(["precision.fp8=blockwise", CP2], world_size=2)
    tiny_config(["precision.fp8=tensorwise", CP2], world_size=2)  # no tiles along the tokens: fine
