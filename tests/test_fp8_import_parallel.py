"""A block-scaled fp8 DeepSeek-V3 checkpoint (tests/test_fp8_import.py's, its vocabulary widened to the byte
tokenizer's) started from by ``model.init_from`` under tensor parallelism 2 (with and without sequence
parallelism), expert parallelism 2, and both at once (world 4: tp 2 x ep 2 within dp 2) trains its first
steps with the losses and gradient norms of one process loading the same checkpoint (gloo, CPU, fp32, 1e-5
relative). Each rank dequantises whole tensors and keeps its shard: the latent attention's up-projections
split by heads, the experts spread. Machinery of tests/test_deepseek_parallel.py; one spawn per world size.
"""

from __future__ import annotations

import pytest
from dist_harness import run_on_ranks
from test_deepseek_parallel import _world
from test_fp8_import import SHAPE, fp8_checkpoint
from test_qwen_parallel import ACCUM2, LAYOUTS, SEQ
from test_training_parity import assert_close_trace

pytestmark = pytest.mark.extended

TP2 = "distributed.tensor_parallel_size=2"
EP2 = "distributed.expert_parallel_size=2"
RUNS_WORLD2 = {"tp2": [TP2, ACCUM2], "tp2_sp": LAYOUTS["tp2_sp"], "ep2": LAYOUTS["ep2"]}
RUNS_WORLD4 = {"tp2_ep2": [TP2, EP2, "optim.grad_accum_steps=1"]}  # dp 2, the experts spread over it


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return {"fp8": fp8_checkpoint(tmp_path_factory.mktemp("fp8"), {**SHAPE, "vocab_size": 260})["fp8"]}


def _spawn(world: int, runs: dict, fp8_dir: dict, root) -> list:
    named = {name: ("fp8", overrides) for name, overrides in runs.items()}
    return run_on_ranks(_world, world, args=(named, fp8_dir, str(root)), timeout=900)


@pytest.fixture(scope="module")
def world1(fp8_dir, tmp_path_factory):
    return _spawn(1, {"one": [ACCUM2]}, fp8_dir, tmp_path_factory.mktemp("w1"))[0]["one"]


@pytest.fixture(scope="module")
def world2(fp8_dir, tmp_path_factory):
    return _spawn(2, RUNS_WORLD2, fp8_dir, tmp_path_factory.mktemp("w2"))


@pytest.fixture(scope="module")
def world4(fp8_dir, tmp_path_factory):
    return _spawn(4, RUNS_WORLD4, fp8_dir, tmp_path_factory.mktemp("w4"))


@pytest.mark.parametrize("layout", [*RUNS_WORLD2, *RUNS_WORLD4])
def test_fp8_checkpoint_trains_at_tp_and_ep_like_one_process(request, world1, layout):
    ranks = request.getfixturevalue("world4" if layout in RUNS_WORLD4 else "world2")
    # q_b_proj: 2 heads x (8 + 4) rows over a 24-wide q latent; kv_b_proj: 2 x (8 + 12) over 20; q_a_proj whole
    assert world1["shards"] == ((24, 24), (40, 20), (24, 40)) and world1["experts"] == [0, 1, 2, 3]
    assert world1["tokens"] == [SEQ] and world1["norms"][0] > 0
    for rank in ranks:
        assert_close_trace(rank[layout]["losses"], world1["losses"], 1e-5)
        assert_close_trace(rank[layout]["norms"], world1["norms"], 1e-5)
    facts = [rank[layout] for rank in ranks]
    tp = layout.startswith("tp2")
    assert {f["shards"] for f in facts} == {((12, 24), (20, 20), (24, 40)) if tp else world1["shards"]}
    assert {f["tokens"][0] for f in facts} == {SEQ // 2 if layout == "tp2_sp" else SEQ}
    experts = {"tp2": [[0, 1, 2, 3]] * 2, "ep2": [[0, 1], [2, 3]], "tp2_ep2": [[0, 1]] * 2 + [[2, 3]] * 2}
    assert [f["experts"] for f in facts] == experts.get(layout, experts["tp2"])  # tp ranks are neighbours
