"""A run stopped after a checkpoint and resumed gives the loss trace of the run that never stopped, bit for bit
(one process in every precision; at two ranks one fp32 case a layout, the other precisions and Adam extended)."""

import os

import pytest
import torch
from dist_harness import run_on_ranks

STOP, STEPS = 3, 6
BF16 = ["model.precision=bf16"]
# saves every step in the background while training goes on; rotation keeps two
ASYNC = ["logging.async_save=true", "logging.ckpt_interval=1", "logging.keep_last=2"]
CASES_WORLD1 = {
    "one_fp32": [],
    "one_bf16": BF16,
    "one_fp16": ["model.precision=fp16"],
    "one_fp32_async": ASYNC,
    "one_sgd": ["optim.name=sgd", "optim.lr=0.1"],  # momentum buffers are optimizer state too
    # FP8 delayed scaling: each layer's amax history is model state too
    "one_fp8_delayed": [
        "precision.fp8=tensorwise",
        "precision.fp8_scaling=delayed",
        "precision.fp8_amax_history_len=4",
    ],
}
CASES_WORLD2 = {
    "dp2_fp32": [],
    "dp2_bf16_async": BF16 + ASYNC,
    "tp2_fp32": ["distributed.tensor_parallel_size=2"],
    "tp2_bf16": ["distributed.tensor_parallel_size=2"] + BF16,
    "pp2_fp32": ["distributed.pipeline_parallel_size=2"],
    "pp2_bf16_tied": ["distributed.pipeline_parallel_size=2", "model.tie_word_embeddings=true"] + BF16,
    "zero1_dp2_fp32": ["distributed.zero_optimization=1"],
    "zero1_dp2_bf16": ["distributed.zero_optimization=1"] + BF16,
    "zero1_dp2_adam": ["distributed.zero_optimization=1", "optim.name=adam"],
    "zero2_dp2_overlap": [  # gathers may be in flight when a save or a load comes
        "distributed.zero_optimization=2",
        "distributed.overlap_grad_reduce=true",
        "distributed.overlap_param_gather=true",
    ],
}
# the README tier keeps one fp32 case of each layout; the precision and optimizer variants run in the extended tier
EXTENDED_WORLD2 = {"dp2_bf16_async", "tp2_bf16", "pp2_bf16_tied", "zero1_dp2_bf16", "zero1_dp2_adam"}


def _resume_matrix(cases: dict, root: str) -> dict:
    import torch.distributed as dist
    from checkpoint_helpers import make_trainer, run_steps, weights

    results = {}
    for name, overrides in cases.items():
        straight = make_trainer(["logging.ckpt_interval=0"] + overrides, f"{root}/{name}/straight", STEPS)
        trace = run_steps(straight, STEPS)
        expected = weights(straight)

        out = f"{root}/{name}/stopped"
        first = make_trainer([f"logging.ckpt_interval={STOP}"] + overrides, out, STEPS)
        head = run_steps(first, STOP)
        first.save_checkpoint()  # what fit() does at the interval; then the process "dies"
        first.checkpointer.wait()

        second = make_trainer([f"logging.ckpt_interval={STOP}"] + overrides, out, STEPS)
        path = second.resume()  # automatic: output_dir holds a complete checkpoint
        history = second.fit()
        tail = [(r["loss"], r["grad_norm"]) for r in history if "loss" in r]
        got = weights(second)
        if dist.get_rank() == 0:
            results[name] = {
                "expected": trace,
                "got": head + tail,
                "path": path,
                "same_weights": all(torch.equal(got[k], expected[k]) for k in expected),
                "weights": got,
                "final": sorted(os.listdir(out)),
            }
    return results


def _check(results: dict, name: str) -> None:
    result = results[name]
    assert result["path"].endswith(f"checkpoint_{STOP}")
    assert result["got"] == result["expected"], f"{name}: resumed trace differs\n{result['got']}\n{result['expected']}"
    assert result["same_weights"], f"{name}: final weights differ"
    assert f"checkpoint_{STEPS}" in result["final"] and "latest" in result["final"]
    if "async" in name:  # saved at steps 4, 5, 6 while training went on; keep_last 2
        assert [n for n in result["final"] if n.startswith("checkpoint_")] == ["checkpoint_5", "checkpoint_6"]


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    return run_on_ranks(_resume_matrix, 1, args=(CASES_WORLD1, str(tmp_path_factory.mktemp("w1"))), timeout=300)[0]


def _world2_matrix(tmp_path_factory, names: set) -> dict:
    cases = {name: CASES_WORLD2[name] for name in sorted(names)}
    return run_on_ranks(_resume_matrix, 2, args=(cases, str(tmp_path_factory.mktemp("w2"))), timeout=400)[0]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _world2_matrix(tmp_path_factory, set(CASES_WORLD2) - EXTENDED_WORLD2)


@pytest.fixture(scope="module")
def world2_extended(tmp_path_factory):
    return _world2_matrix(tmp_path_factory, EXTENDED_WORLD2)


@pytest.mark.parametrize("name", sorted(CASES_WORLD1))
def test_resume_is_bitwise_one_process(world1, name):
    _check(world1, name)


@pytest.mark.parametrize("name", sorted(set(CASES_WORLD2) - EXTENDED_WORLD2))
def test_resume_is_bitwise_two_ranks(world2, name):
    _check(world2, name)


@pytest.mark.extended
@pytest.mark.parametrize("name", sorted(EXTENDED_WORLD2))
def test_resume_is_bitwise_two_ranks_in_other_precisions(world2_extended, name):
    _check(world2_extended, name)
