"""The training loop, its runtime set-up, metrics and plots."""

from megacann.training.trainer import Trainer, TrainState, train

__all__ = ["TrainState", "Trainer", "train"]
