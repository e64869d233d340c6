"""Device selection and the facts the trainer asks of a device."""

import os
import subprocess
import sys

import pytest

from megacann import accelerator as acc


def test_cpu_is_picked_here_with_gloo(monkeypatch):
    monkeypatch.delenv("MEGACANN_DEVICE", raising=False)
    assert acc.detect_device_type() == "cpu"
    a = acc.Accelerator(acc.resolve_device_type())
    assert a.device_type == "cpu" and a.backend == "gloo"
    assert str(a.current_device()) == "cpu"
    assert a.memory_allocated() > 0 and a.max_memory_allocated() >= a.memory_allocated()
    assert a.peak_bf16_flops() is None  # unknown device: no MFU
    assert a.is_bf16_supported()
    a.synchronize()
    a.set_rng_state(a.get_rng_state())


def test_environment_beats_recipe_and_bad_names_are_named(monkeypatch):
    monkeypatch.setenv("MEGACANN_DEVICE", "cpu")
    assert acc.resolve_device_type("cuda") == "cpu"
    monkeypatch.delenv("MEGACANN_DEVICE")
    with pytest.raises(ValueError, match="distributed.device='tpu'"):
        acc.resolve_device_type("tpu")
    monkeypatch.setenv("MEGACANN_DEVICE", "gpu")
    with pytest.raises(ValueError, match="MEGACANN_DEVICE='gpu'"):
        acc.resolve_device_type()
    monkeypatch.setenv("MEGACANN_DEVICE", "npu")
    monkeypatch.setattr(acc, "_ACCELERATOR", None)  # as in a fresh process (an earlier test may have made one)
    with pytest.raises(RuntimeError, match="torch_npu"):
        acc.get_accelerator()


def test_peak_flops_table():
    assert acc.lookup_peak_flops("NVIDIA H200") == 989e12
    assert acc.lookup_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert acc.lookup_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert acc.lookup_peak_flops("Mystery Chip 9000") is None


def _run(code, extra_path=None, env=None):
    """``code`` in a fresh interpreter with the installed megacann; ``extra_path`` holds stand-in modules."""
    full = {**os.environ, **(env or {})}
    full.pop("PYTHONPATH", None)
    if extra_path:
        full["PYTHONPATH"] = extra_path
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120)


def test_broken_torch_npu_is_reported_not_fatal(tmp_path):
    # a torch_npu that raises RuntimeError on import, like a CUDA build of torch with torch_npu installed
    (tmp_path / "torch_npu.py").write_text("raise RuntimeError('libascendcl.so: cannot open shared object')\n")
    code = "from megacann import accelerator as a; print(a.detect_device_type())"
    proc = _run(code, extra_path=str(tmp_path), env={"MEGACANN_DEVICE": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "cpu"
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in proc.stderr


def test_import_without_optional_packages():
    blocked = ["torch_npu", "wandb", "tensorboard", "transformers", "matplotlib", "sentencepiece"]
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        "import megacann, megacann.config, megacann.accelerator, megacann.parallel_state, megacann.cli\n"
        "import megacann.dry_run\n"
        "print('ok')\n"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
