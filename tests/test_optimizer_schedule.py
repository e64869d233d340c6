"""LR schedule values at chosen steps, and the fp16 loss scaler."""

import math

import pytest

from megacann.config import OptimConfig
from megacann.optimizer.loss_scaler import DynamicLossScaler
from megacann.optimizer.lr_schedule import LRSchedule


def test_cosine_with_warmup_ratio():
    s = LRSchedule.from_config(OptimConfig(lr=1.0, max_steps=110, warmup_ratio=0.1, min_lr_ratio=0.1))
    assert s.warmup_steps == 11
    assert s.lr_at(0) == pytest.approx(1 / 11)
    assert s.lr_at(10) == pytest.approx(1.0)  # last warmup step reaches the peak
    assert s.lr_at(11) == pytest.approx(1.0)  # decay starts at the peak
    # halfway through the decay: min + (max - min) / 2
    assert s.lr_at(11 + 49) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 49 / 99)))
    assert s.lr_at(110) == pytest.approx(0.1)
    assert s.lr_at(500) == pytest.approx(0.1)


def test_linear_and_constant_and_explicit_warmup_steps():
    lin = LRSchedule.from_config(OptimConfig(lr=2.0, max_steps=20, warmup_steps=0, scheduler="linear"))
    assert lin.lr_at(0) == pytest.approx(2.0)
    assert lin.lr_at(10) == pytest.approx(2.0 - 1.8 * 0.5)
    assert lin.lr_at(20) == pytest.approx(0.2)
    const = LRSchedule.from_config(
        OptimConfig(lr=0.5, max_steps=20, warmup_steps=4, warmup_ratio=0.5, scheduler="constant")
    )
    assert const.warmup_steps == 4  # warmup_steps wins over warmup_ratio
    assert [const.lr_at(i) for i in range(5)] == pytest.approx([0.125, 0.25, 0.375, 0.5, 0.5])
    assert const.lr_at(19) == 0.5


def test_seed_recipe_schedule():
    s = LRSchedule.from_config(OptimConfig(lr=3e-4, max_steps=100000, warmup_ratio=0.03, min_lr_ratio=0.1))
    assert s.warmup_steps == 3000
    assert s.lr_at(2999) == pytest.approx(3e-4)
    assert s.lr_at(100000 - 1) == pytest.approx(3e-5, rel=1e-6)


def test_dynamic_loss_scaler():
    scaler = DynamicLossScaler(initial_scale=1024.0, window=3, min_scale=1.0)
    scaler.update(found_inf=True)
    assert scaler.scale == 512.0
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.scale == 1024.0
    scaler.update(False)
    state = scaler.state_dict()
    other = DynamicLossScaler()
    other.load_state_dict(state)
    assert other.scale == 1024.0 and other.clean_steps == 1
    tiny = DynamicLossScaler(initial_scale=2.0, min_scale=1.0)
    tiny.update(True)
    tiny.update(True)
    assert tiny.scale == 1.0
