"""``optim.name`` picks the optimizer it names: the trainer builds that class, and its first update is that
optimizer's own rule (written out below from the published algorithms, not taken from megacann), so no two
names step alike and a name that silently fell back to another optimizer fails."""

from __future__ import annotations

import pytest
import torch
from training_helpers import SyntheticData, tiny_config

from megacann.optimizer.registry_adamw import RegistryAdamW

EPS, WEIGHT_DECAY = 1e-8, 0.1
CLASSES = {"adamw": RegistryAdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
DECAYED, PLAIN = "layers.0.mlp.down_proj.weight", "layers.0.input_layernorm.weight"  # 2-D decayed; 1-D not


def _first_update(g: torch.Tensor, w: torch.Tensor, name: str, lr: float, decay: float) -> torch.Tensor:
    """The weight after one step from ``w`` with gradient ``g`` (fresh state, bias-corrected moments: at the
    first step Adam's m / sqrt(v) is g / |g|; SGD's momentum buffer is the gradient itself)."""
    if name == "adamw":  # decoupled decay
        return w * (1 - lr * decay) - lr * g / (g.abs() + EPS)
    g = g + decay * w  # Adam and SGD: decay added to the gradient (L2)
    if name == "adam":
        return w - lr * g / (g.abs() + EPS)
    return w - lr * g


def _one_step(name: str) -> dict:
    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    cfg = tiny_config([f"optim.name={name}", "optim.clip_grad=0", f"optim.adam_eps={EPS}"])
    assert cfg.optim.weight_decay == WEIGHT_DECAY  # the tiny recipe's, which the rules above are given
    trainer = Trainer(cfg, setup_runtime(cfg), data=SyntheticData(cfg, 0, 1))
    params = dict(trainer.model_chunks[0].named_parameters())
    before = {k: params[k].detach().clone() for k in (DECAYED, PLAIN)}
    metrics = trainer.train_step()
    after = {k: params[k].detach().clone() for k in (DECAYED, PLAIN)}
    grads = {k: params[k].main_grad.detach().clone() for k in (DECAYED, PLAIN)}  # the step's reduced gradient
    inner = type(trainer.optimizer.optimizer)
    ps.destroy_model_parallel()
    return {"class": inner, "lr": metrics["lr"], "before": before, "after": after, "grads": grads}


@pytest.fixture(scope="module")
def steps() -> dict:
    return {name: _one_step(name) for name in CLASSES}


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_optim_name_builds_its_class_and_steps_by_its_rule(steps, name):
    got = steps[name]
    assert got["class"] is CLASSES[name], got["class"]
    for key, decay in ((DECAYED, WEIGHT_DECAY), (PLAIN, 0.0)):
        expected = _first_update(got["grads"][key], got["before"][key], name, got["lr"], decay)
        # Adam's first step is lr * g / (|g| + eps): where the gradient with L2 decay cancels to about eps,
        # that ratio turns on the last bits of the cancelling sum, so those few elements are left out
        effective = got["grads"][key] + (decay * got["before"][key] if name != "adamw" else 0)
        kept = effective.abs() > 1e3 * EPS if name != "sgd" else torch.ones_like(effective, dtype=torch.bool)
        assert kept.float().mean() > 0.9, (name, key)  # nearly every element still checked
        # one fp32 rounding of the weight apart at most (4e-9 at these magnitudes; updates are 1e-5 to 1e-2)
        torch.testing.assert_close(got["after"][key][kept], expected[kept], rtol=1e-6, atol=1e-8, msg=f"{name} {key}")
        assert not torch.equal(got["after"][key], got["before"][key])


def test_no_two_names_step_alike(steps):
    names = sorted(CLASSES)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            delta_a = steps[a]["after"][DECAYED] - steps[a]["before"][DECAYED]
            delta_b = steps[b]["after"][DECAYED] - steps[b]["before"][DECAYED]
            assert (delta_a - delta_b).norm() > 0.1 * delta_a.norm(), (a, b)
