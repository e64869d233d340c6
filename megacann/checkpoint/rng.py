"""Every random generator a rank draws from, captured and restored (one state per rank)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from megacann.accelerator import Accelerator


def capture_rng(accelerator: Accelerator) -> dict[str, Any]:
    """Python, NumPy, torch CPU, the accelerator's generator and the TP-aware tracker's streams."""
    from megacann.layers import get_rng_tracker

    device = accelerator.get_rng_state()
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "device": None if device is None else device.cpu(),
        "tracker": get_rng_tracker().get_states(),
    }


def restore_rng(accelerator: Accelerator, state: dict[str, Any]) -> None:
    from megacann.layers import get_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    accelerator.set_rng_state(state["device"])
    get_rng_tracker().set_states(state["tracker"])
