"""Training under data / tensor / sequence parallelism equals one process; accumulation equals a big batch."""

import pytest
import torch
from dist_harness import run_on_ranks

STEPS = 5
LAYOUTS_WORLD2 = {
    "dp2": [],
    "tp2": ["distributed.tensor_parallel_size=2"],
    "tp2_sp": ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"],
    "gpt_tp2_sp": ["model.type=gpt", "distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"],
}
REFERENCE_RUNS = {
    "base": [],
    "gpt": ["model.type=gpt"],
    "big_batch": ["data.batch_size=4", "optim.grad_accum_steps=1"],
    "small_micro": ["data.batch_size=1", "optim.grad_accum_steps=4"],
}
COMMON = ["optim.clip_grad=0.5"]  # small enough that clipping is active in every step


def _train_runs(runs: dict[str, list[str]]) -> dict:
    import torch.distributed as dist

    from megacann import parallel_state as ps
    from megacann.models.full_state import full_state_dict
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer
    from training_helpers import SyntheticData, tiny_config

    results = {}
    for name, overrides in runs.items():
        cfg = tiny_config(COMMON + overrides, world_size=dist.get_world_size())
        runtime = setup_runtime(cfg)
        data = SyntheticData(cfg, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
        trainer = Trainer(cfg, runtime, data=data)
        losses, norms = [], []
        for _ in range(STEPS):
            metrics = trainer.train_step()
            losses.append(metrics["loss"])
            norms.append(metrics["grad_norm"])
        params = full_state_dict(trainer.model_chunks)
        results[name] = {"losses": losses, "norms": norms, "params": params if dist.get_rank() == 0 else None}
        ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(_train_runs, 1, args=(REFERENCE_RUNS,), timeout=300)[0]


@pytest.fixture(scope="module")
def world2():
    return run_on_ranks(_train_runs, 2, args=(LAYOUTS_WORLD2,), timeout=400)[0]


def assert_close_trace(actual, expected, rel):
    for a, e in zip(actual, expected):
        assert abs(a - e) <= rel * abs(e), (actual, expected)


def assert_params_close(actual, expected, rel):
    assert actual.keys() == expected.keys()
    for name in expected:
        scale = expected[name].abs().max().item() + 1e-12
        diff = (actual[name] - expected[name]).abs().max().item()
        assert diff <= rel * scale, f"{name}: max diff {diff:.3e} vs scale {scale:.3e}"


@pytest.mark.parametrize("layout", sorted(LAYOUTS_WORLD2))
def test_two_rank_layouts_match_one_process(reference, world2, layout):
    ref = reference["gpt" if layout.startswith("gpt") else "base"]
    got = world2[layout]
    assert_close_trace(got["losses"], ref["losses"], 1e-5)
    assert_close_trace(got["norms"], ref["norms"], 1e-5)
    assert_params_close(got["params"], ref["params"], 1e-5)
    assert got["losses"][-1] < got["losses"][0]  # it trains


def test_accumulation_equals_one_big_batch(reference):
    big, small, base = reference["big_batch"], reference["small_micro"], reference["base"]
    for other in (small, base):
        assert_close_trace(other["losses"], big["losses"], 1e-5)
        assert_close_trace(other["norms"], big["norms"], 1e-5)
        assert_params_close(other["params"], big["params"], 1e-5)


def test_clipping_was_active(reference):
    assert all(n > 0.5 for n in reference["base"]["norms"]), reference["base"]["norms"]
    assert torch.isfinite(torch.tensor(reference["base"]["losses"])).all()
