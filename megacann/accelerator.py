"""Device abstraction: one object that knows whether we run on an Ascend NPU, a CUDA GPU or the CPU.

Choice order: the environment variable ``MEGACANN_DEVICE`` (a machine-local override), then the recipe's
``distributed.device``, then auto-detection (npu > cuda > cpu). torch_npu is imported only here, lazily,
and any failure to import it (ImportError without CANN, RuntimeError on a CUDA build of torch) means
"no NPU" with one clear message, never a crash.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Optional

import torch

DEVICE_TYPES = ("npu", "cuda", "cpu")
BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
# The recipe's precision names (model.precision, --dtype of megacann-convert) and their torch dtypes.
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Peak dense bf16 FLOP/s by device name (vendors' datasheet figures). Matched as substrings of
# the device name, first hit wins, so more specific names come first. Ascend figures differ per SKU and
# are not listed until taken from the vendor sheet of the chip in hand: set MEGACANN_PEAK_FLOPS instead.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
)

_NPU_HINT = (
    "torch_npu could not be imported ({err}); running without NPU support. If torch_npu is installed but "
    "CANN is not, set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to stop `import torch` from auto-loading it."
)


@functools.lru_cache(maxsize=1)
def import_torch_npu() -> Optional[Any]:
    """Return the torch_npu module, or None when it cannot be imported here (warns once)."""
    try:
        import torch_npu  # noqa: F401  (registers the npu device with torch)

        return torch_npu
    except ModuleNotFoundError:
        return None
    except Exception as err:  # ImportError (missing libhccl.so / libascendcl.so) or RuntimeError
        warnings.warn(_NPU_HINT.format(err=err), stacklevel=2)
        return None


def npu_available() -> bool:
    npu = import_torch_npu()
    return npu is not None and hasattr(torch, "npu") and torch.npu.is_available()


def detect_device_type() -> str:
    if npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _device_module(device_type: str):
    return getattr(torch, device_type) if device_type != "cpu" else None


def _read_proc_status_kib(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Accelerator:
    """The device one rank computes on, with the few operations the rest of megacann needs."""

    def __init__(self, device_type: str):
        if device_type not in DEVICE_TYPES:
            raise ValueError(f"unknown device type {device_type!r}; expected one of {DEVICE_TYPES}")
        if device_type == "npu" and not npu_available():
            raise RuntimeError("device 'npu' was requested but torch_npu is not importable or sees no NPU")
        if device_type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' was requested but torch.cuda.is_available() is False")
        self.device_type = device_type
        self._module = _device_module(device_type)
        self._index = 0

    def __repr__(self) -> str:
        return f"Accelerator({self.device_type}, backend={self.backend})"

    @property
    def backend(self) -> str:
        """The collective backend for this device: hccl, nccl or gloo."""
        return BACKENDS[self.device_type]

    def set_device(self, local_rank: int) -> None:
        self._index = local_rank
        if self._module is not None:
            self._module.set_device(local_rank)

    def current_device(self) -> torch.device:
        if self._module is None:
            return torch.device("cpu")
        return torch.device(self.device_type, self._module.current_device())

    def device_name(self) -> str:
        if self._module is None:
            return "cpu"
        return str(self._module.get_device_name(self._module.current_device()))

    def synchronize(self) -> None:
        if self._module is not None:
            self._module.synchronize()

    def is_bf16_supported(self) -> bool:
        if self.device_type == "cuda":
            return torch.cuda.is_bf16_supported()
        return True

    # -- memory ---------------------------------------------------------------------------------------
    def memory_allocated(self) -> int:
        """Bytes held by tensors on the device; on CPU the resident set size of the process."""
        if self._module is None:
            kib = _read_proc_status_kib("VmRSS")
            return (kib or 0) * 1024
        return int(self._module.memory_allocated())

    def max_memory_allocated(self) -> int:
        """Peak of memory_allocated since start (or the last reset); on CPU the peak RSS."""
        if self._module is None:
            kib = _read_proc_status_kib("VmHWM")
            return (kib or 0) * 1024
        return int(self._module.max_memory_allocated())

    def reset_peak_memory_stats(self) -> None:
        if self._module is not None:
            self._module.reset_peak_memory_stats()

    def memory_stats(self) -> dict[str, float]:
        """Memory figures in GiB for metrics lines."""
        gib = float(1 << 30)
        key = "rss" if self._module is None else "mem_allocated"
        return {f"{key}_gib": self.memory_allocated() / gib, f"{key}_peak_gib": self.max_memory_allocated() / gib}

    # -- RNG ------------------------------------------------------------------------------------------
    def get_rng_state(self) -> Optional[torch.Tensor]:
        """The device generator's state (None on CPU, whose generator is torch's default one)."""
        return None if self._module is None else self._module.get_rng_state()

    def set_rng_state(self, state: Optional[torch.Tensor]) -> None:
        if self._module is not None and state is not None:
            self._module.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        if self._module is not None:
            self._module.manual_seed(seed)

    # -- throughput -----------------------------------------------------------------------------------
    def peak_bf16_flops(self) -> Optional[float]:
        """Peak dense bf16 FLOP/s of this device, or None when unknown (MFU is then omitted)."""
        override = os.environ.get("MEGACANN_PEAK_FLOPS")
        if override:
            return float(override)
        if self.device_type == "cpu":
            return None
        return lookup_peak_flops(self.device_name())


def lookup_peak_flops(device_name: str) -> Optional[float]:
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return flops
    return None


_ACCELERATOR: Optional[Accelerator] = None


def resolve_device_type(requested: Optional[str] = None) -> str:
    """MEGACANN_DEVICE, else the requested (recipe) device, else auto-detection."""
    env = os.environ.get("MEGACANN_DEVICE")
    choice = (env or requested or "").strip().lower() or None
    if choice is not None and choice not in DEVICE_TYPES:
        source = "MEGACANN_DEVICE" if env else "distributed.device"
        raise ValueError(f"{source}={choice!r} is not a device type; expected one of {DEVICE_TYPES}")
    return choice or detect_device_type()


def get_accelerator(requested: Optional[str] = None) -> Accelerator:
    """The process-wide accelerator: created on first call; a later explicit request replaces it."""
    global _ACCELERATOR
    if _ACCELERATOR is not None and requested is None:
        return _ACCELERATOR
    device_type = resolve_device_type(requested)
    if _ACCELERATOR is None or _ACCELERATOR.device_type != device_type:
        _ACCELERATOR = Accelerator(device_type)
    return _ACCELERATOR
