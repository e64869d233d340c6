"""Every requirement in setup.py's ``install_requires`` is imported somewhere under megacann/ (a dependency
nobody imports is only weight and risk for the user's install)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import megacann

SETUP = Path(__file__).resolve().parent.parent / "setup.py"
PACKAGE = Path(megacann.__file__).resolve().parent
MODULE_OF = {"pyyaml": "yaml"}  # distribution name -> the module it installs, where they differ
EXPECTED = {"torch", "numpy", "pyyaml", "einops", "tokenizers", "safetensors"}


def install_requires() -> list[str]:
    """The distribution names in setup.py's ``install_requires`` (version specifiers dropped)."""
    for node in ast.walk(ast.parse(SETUP.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return [re.split(r"[\s<>=!~;\[]", ast.literal_eval(item))[0].lower() for item in node.value.elts]
    raise AssertionError("setup.py has no install_requires")


def imported_modules() -> set[str]:
    """Top-level names of every module imported by megacann's sources (lazy imports inside functions too)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def test_the_declared_requirements():
    assert set(install_requires()) == EXPECTED


@pytest.mark.parametrize("requirement", sorted(EXPECTED))
def test_every_requirement_is_imported(requirement):
    module = MODULE_OF.get(requirement, requirement.replace("-", "_"))
    assert module in imported_modules(), f"{requirement} is in install_requires but no module imports {module}"
