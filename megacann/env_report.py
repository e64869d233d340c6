"""What this machine runs megacann with: Python, torch, torch_npu / CANN or CUDA, optional packages, and the
visible devices with their memory, each version judged against what megacann needs and was tested with."""

from __future__ import annotations

import glob
import importlib.metadata
import os
import platform
import sys
from dataclasses import dataclass
from typing import Optional

# Versions megacann's test suite ran with (CI: CPU build of torch), and the minimums setup.py asks for.
TESTED_WITH = {"python": "3.11", "torch": "2.13.0"}
MINIMUM = {"python": (3, 9), "torch": (2, 7)}  # torch: the floor of setup.py's install_requires
OPTIONAL_PACKAGES = ("tokenizers", "transformers", "safetensors", "wandb", "tensorboard", "matplotlib")
CANN_INFO_GLOBS = (
    "{home}/*-linux/ascend_toolkit_install.info",
    "{home}/latest/*-linux/ascend_toolkit_install.info",
)


@dataclass
class Item:
    name: str
    value: str
    verdict: str = ""  # "", "ok", or what is wrong / untested

    def line(self) -> str:
        return f"{self.name:<14} {self.value}" + (f"  [{self.verdict}]" if self.verdict else "")


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _judge(name: str, version: str) -> str:
    if _version_tuple(version)[:2] < MINIMUM[name]:
        return f"too old: megacann needs {name} >= {'.'.join(map(str, MINIMUM[name]))}"
    tested = TESTED_WITH[name]
    base = version.split("+")[0]
    return "tested" if base == tested or base.startswith(tested + ".") else f"untested here (tested with {tested})"


def _package_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cann_version() -> Optional[str]:
    """The CANN toolkit version from its install record (ASCEND_HOME_PATH or the default install place)."""
    homes = [
        os.environ.get("ASCEND_HOME_PATH", ""),
        "/usr/local/Ascend/ascend-toolkit/latest",
        "/usr/local/Ascend/cann",
    ]
    for home in filter(None, homes):
        for pattern in CANN_INFO_GLOBS:
            for path in sorted(glob.glob(pattern.format(home=home))):
                with open(path, errors="replace") as f:
                    for line in f:
                        if line.startswith("version="):
                            return line.split("=", 1)[1].strip()
    return None


def torch_npu_verdict(npu: str, torch_version: str) -> str:
    """``too old`` below :data:`megacann.ops.npu_api.MINIMUM_TORCH_NPU`, ``mismatch`` when built for another
    torch, else ``matches torch``."""
    from megacann.ops.npu_api import MINIMUM_TORCH_NPU

    if _version_tuple(npu) < _version_tuple(MINIMUM_TORCH_NPU):
        return f"too old: megacann needs torch_npu >= {MINIMUM_TORCH_NPU}"
    if _version_tuple(npu)[:3] != _version_tuple(torch_version)[:3]:
        return f"mismatch: torch_npu {npu} is built for another torch than {torch_version}"
    return "matches torch"


def cann_release(text: str) -> tuple[int, int, int, int]:
    """A CANN version in release order: ``8.0.RC1`` < ``8.0.RC2`` < ``8.0.0`` < ``8.0.1`` < ``8.1.RC1``; a
    version of two numbers (``7.0``) stands for its whole line (after all of its releases)."""
    parts = text.strip().upper().split(".")
    major, minor = int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    if len(parts) < 3:
        return (major, minor, 2, 0)
    third = parts[2]
    digits = int("".join(ch for ch in third if ch.isdigit()) or 0)
    return (major, minor, 0, digits) if third.startswith("RC") else (major, minor, 1, digits)


def cann_verdict(cann: Optional[str]) -> str:
    """Whether the CANN toolkit is one megacann is meant for (:data:`megacann.ops.npu_api.MINIMUM_CANN`),
    and what an older one lacks (:data:`megacann.ops.npu_api.CANN_GAPS`)."""
    from megacann.ops.npu_api import CANN_GAPS, MINIMUM_CANN

    if not cann:
        return "source CANN's set_env.sh (see docs/operations.md)"
    try:
        release = cann_release(cann)
    except ValueError:
        return f"unrecognised version (megacann is meant for CANN >= {MINIMUM_CANN})"
    if release >= cann_release(MINIMUM_CANN):
        return "ok"
    gaps = "; ".join(what for newest, what in CANN_GAPS if release <= cann_release(newest))
    return f"too old: megacann is meant for CANN >= {MINIMUM_CANN}" + (f"; this one: {gaps}" if gaps else "")


def software_items() -> list[Item]:
    import torch

    python = platform.python_version()
    items = [Item("python", f"{python} ({sys.executable})", _judge("python", python))]
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    items.append(Item("torch", f"{torch.__version__} ({build})", _judge("torch", torch.__version__)))
    npu = _package_version("torch_npu") or _package_version("torch-npu")
    if npu:
        items.append(Item("torch_npu", npu, torch_npu_verdict(npu, torch.__version__)))
        cann = cann_version()
        items.append(Item("CANN", cann or "not found", cann_verdict(cann)))
    else:
        items.append(Item("torch_npu", "not installed", ""))
    for name in OPTIONAL_PACKAGES:
        items.append(Item(name, _package_version(name) or "not installed"))
    return items


def _meminfo_gib() -> Optional[float]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def device_items() -> list[Item]:
    """The device megacann would pick here, and every visible device of that kind with its memory."""
    import torch

    from megacann.accelerator import resolve_device_type

    device_type = resolve_device_type()
    items = [Item("device", device_type, "MEGACANN_DEVICE" if os.environ.get("MEGACANN_DEVICE") else "auto-detected")]
    if device_type == "cpu":
        ram = _meminfo_gib()
        items.append(Item("cpu", f"{os.cpu_count()} cores" + (f", {ram:.1f} GiB RAM" if ram else "")))
        return items
    module = getattr(torch, device_type)
    for index in range(module.device_count()):
        props = module.get_device_properties(index)
        items.append(Item(f"{device_type}:{index}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB"))
    return items


def environment_report() -> list[Item]:
    return software_items() + device_items()
