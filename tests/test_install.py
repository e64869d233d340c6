"""Tests that catch a broken install: the suite's megacann is the installed distribution (tests/conftest.py
keeps the source tree off sys.path), which provides the five console scripts; each starts from any directory
with a user's environment (no PYTHONPATH). The scripts' real work is exercised elsewhere the same way
(training, resuming and converting in test_reliability_runs.py, preprocessing in test_first_contact.py and
test_data_preprocess.py, planning here)."""

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from cli_helpers import ROOT, console_script, user_env

import megacann

SCRIPTS = {
    "megacann-train": "megacann.cli:train_main",
    "megacann-preprocess": "megacann.data.preprocess:main",
    "megacann-convert": "megacann.convert:main",
    "megacann-plan": "megacann.cli:plan_main",
    "megacann-generate": "megacann.generate:main",
}


def test_megacann_here_is_the_installed_distribution():
    dist = importlib.metadata.distribution("megacann")
    assert dist.version == megacann.__version__
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts == SCRIPTS
    for ep in dist.entry_points:
        assert callable(ep.load()), ep
    package = Path(megacann.__file__).resolve().parent
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if direct.get("dir_info", {}).get("editable"):  # pip install -e: the distribution points at its checkout
        assert package.parent == Path(unquote(urlparse(direct["url"]).path)).resolve()
    else:
        assert package == Path(dist.locate_file("megacann")).resolve()
    assert all(os.path.abspath(p or os.curdir) != ROOT for p in sys.path)  # not found through the source tree


@pytest.mark.extended
def test_console_scripts_start_from_any_directory(tmp_path):
    for name in SCRIPTS:
        proc = subprocess.run(
            [console_script(name), "--help"], cwd=tmp_path, capture_output=True, text=True, env=user_env(), timeout=120
        )
        assert proc.returncode == 0, (name, proc.stderr)
        assert proc.stdout.startswith(f"usage: {name} "), proc.stdout
    recipe = os.path.join(ROOT, "examples", "configs", "llama", "tiny.yaml")
    plan = subprocess.run(
        [console_script("megacann-plan"), "--config", recipe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=user_env(),
        timeout=120,
    )
    assert plan.returncode == 0, plan.stderr
    assert plan.stdout.startswith(f"== megacann plan: llama_tiny ({recipe})")
    assert "7,096,576 parameters" in plan.stdout
