"""megacann-plan and the dry run count DPO's reference policy: a frozen copy's weights (sharded like the
policy, no gradients or optimizer state) against the bytes of the real copy's tensors; the base with
adapters off, a precomputed reference and SimPO add nothing."""

from __future__ import annotations

import pytest
from dist_harness import run_on_ranks
from finetune_helpers import COMMON, LORA, recipe

from megacann.planning import estimate_stages, layout_of

DPO = [*COMMON, "train_mode=dpo", "data.path=unused.jsonl", "data.batch_size=2", "model.num_layers=4"]


def _measured(overrides: list[str], world_size: int = 1) -> tuple[int, int, float, float]:
    """(pipeline stage, tensor-parallel rank, bytes of the policy's weights, of the reference copy's) on
    this rank; the copy's parameters are checked frozen (no gradient buffers or optimizer state for them)."""
    from megacann import parallel_state as ps
    from megacann.optimizer.memory import storage_bytes
    from megacann.training.trainer import Trainer

    trainer = Trainer(recipe(overrides, world_size=world_size), data=[])
    reference = trainer.objective.reference or []
    assert not any(p.requires_grad for chunk in reference for p in chunk.parameters())
    out = (
        ps.get_pipeline_model_parallel_rank(),
        ps.get_tensor_model_parallel_rank(),
        float(storage_bytes(p for chunk in trainer.model_chunks for p in chunk.parameters())),
        float(storage_bytes(p for chunk in reference for p in chunk.parameters())),
    )
    ps.destroy_model_parallel()
    return out


def _check(overrides: list[str], measured, world_size: int = 1) -> None:
    cfg = recipe(overrides, world_size=world_size)
    stages = estimate_stages(cfg, layout_of(cfg))
    for stage, _, weights, reference in measured:
        if "lora=true" not in overrides:  # the planner leaves LoRA's adapters out of the weights
            assert stages[stage].weights == weights
        assert stages[stage].reference == reference  # weights only, in the model's dtype
        assert stages[stage].total == pytest.approx(stages[stage].static + reference + stages[stage].activations)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_reference_copy_is_planned_to_the_byte_on_one_rank(precision):
    overrides = [*DPO, f"model.precision={precision}", "dpo.reference=copy"]
    measured = _measured(overrides)
    assert measured[3] == measured[2] > 0  # one rank: the copy is the policy's size
    _check(overrides, [measured])


@pytest.mark.parametrize(
    "extra", [[*LORA], [*LORA, "dpo.reference=precomputed"], ["dpo.reference=precomputed"], ["dpo.loss_type=simpo"]]
)
def test_no_copy_adds_nothing(extra):
    overrides = [*DPO, *extra]
    measured = _measured(overrides)
    assert measured[3] == 0.0
    _check(overrides, [measured])


def test_dry_run_names_the_reference():
    from megacann.dry_run import describe

    copy = describe(recipe([*DPO, "dpo.reference=copy"]))
    assert "DPO reference: a frozen copy of the starting weights, sharded like the policy" in copy
    header = next(line for line in copy.splitlines() if "params/device" in line)
    assert "reference" in header  # the per-stage table has the copy's column
    off = describe(recipe([*DPO, *LORA]))
    assert "the policy's frozen base with the adapters off: no memory of its own" in off
    assert "DPO reference" not in describe(recipe([*COMMON, "model.num_layers=4"]))


@pytest.mark.extended
def test_reference_copy_is_sharded_like_the_policy_on_four_ranks():
    overrides = [
        *DPO,
        "dpo.reference=copy",
        "distributed.tensor_parallel_size=2",
        "distributed.pipeline_parallel_size=2",
        "optim.grad_accum_steps=2",
    ]
    measured = run_on_ranks(_measured, 4, args=(overrides, 4), timeout=300)
    assert sorted((m[0], m[1]) for m in measured) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # tp 2 x pp 2 really on
    assert all(0 < m[3] == m[2] for m in measured)
    _check(overrides, measured, world_size=4)
