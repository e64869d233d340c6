"""The import direction between megacann's packages: a lower layer never imports a higher one.

Every module under megacann/ is parsed (nothing is imported), and every ``import`` in it counts, at any
nesting: a lazy import inside a function ties the packages together just the same. The layering
(README, "Layout"): the floor (errors, accelerator, host_memory, parallel_state, rank_layout, communication_lanes,
collectives, constants), then config, ops, layers, models (the contract and the families), data, pipeline, optimizer,
checkpoint (training state only), interop (weights in and out), generation (which knows models only through
the contract and the layers), training, and the tools on top.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

import megacann

PACKAGE = Path(megacann.__file__).resolve().parent

FLOOR = {
    "errors",
    "accelerator",
    "host_memory",
    "parallel_state",
    "rank_layout",
    "communication_lanes",
    "collectives",
    "constants",
    "lazy_exports",
}
TOOLS = {"planning", "dry_run", "launch", "cli", "convert", "generate", "train", "comm_check", "env_report"}
ABOVE_DATA = {"pipeline", "optimizer", "checkpoint", "interop", "generation", "training"}

# what each package may import from megacann: ALLOWED lists all it may use, FORBIDDEN what it may not
ALLOWED = {"config": FLOOR | {"config"}}
FORBIDDEN = {
    "ops": {"layers", "models", "data"} | ABOVE_DATA | TOOLS,
    "layers": {"models", "data"} | ABOVE_DATA | TOOLS,
    "data": {"layers", "models"} | ABOVE_DATA | TOOLS,
    "optimizer": {"pipeline", "models", "data", "checkpoint", "interop", "generation", "training"} | TOOLS,
    "checkpoint": {"data", "models", "interop", "generation", "training", "pipeline"} | TOOLS,
    "generation": {"data", "optimizer", "checkpoint", "interop", "training"} | TOOLS,
}


class Import(NamedTuple):
    file: str  # relative to the package, e.g. "data/gpt_dataset.py"
    line: int
    module: str  # the megacann module imported, e.g. "megacann.layers.loss"

    @property
    def target(self) -> str:
        """The top-level part of megacann it reaches: a package ("layers") or a module ("errors")."""
        return self.module.split(".")[1]


def module_name(path: Path, root: Path) -> str:
    parts = ("megacann", *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def megacann_imports(source: str, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, imported megacann module) for every import statement in ``source``, however deeply nested;
    ``from megacann import x`` counts as importing ``megacann.x``, relative imports are resolved."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            # "from megacann import x" and "from . import x" name modules; "from megacann.x import y" a name in x
            names = [f"{base}.{alias.name}" for alias in node.names] if base == "megacann" else [base]
        else:
            continue
        for name in names:
            if name.startswith("megacann."):
                yield node.lineno, name


def all_imports() -> list[Import]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path, PACKAGE)
        for line, imported in megacann_imports(path.read_text(), name, path.name == "__init__.py"):
            found.append(Import(path.relative_to(PACKAGE).as_posix(), line, imported))
    return found


def violations(package: str, imports: list[Import]) -> list[Import]:
    """The imports of ``package``'s modules that its rule refuses."""
    wrong = []
    for imp in imports:
        if imp.file.split("/")[0] != package or imp.target == package:
            continue
        if package in ALLOWED and imp.target not in ALLOWED[package] or imp.target in FORBIDDEN.get(package, ()):
            wrong.append(imp)
    return wrong


def describe(wrong: list[Import], package: str) -> str:
    rule = (
        f"may import only {sorted(ALLOWED[package])}"
        if package in ALLOWED
        else f"may not import {sorted(FORBIDDEN[package])}"
    )
    lines = [f"megacann/{imp.file}:{imp.line} imports {imp.module}" for imp in wrong]
    return f"megacann/{package}/ {rule} from megacann:\n" + "\n".join(lines)


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return all_imports()


@pytest.mark.parametrize("package", sorted({*ALLOWED, *FORBIDDEN}))
def test_lower_layers_do_not_import_higher_ones(package, imports):
    assert (PACKAGE / package).is_dir(), f"megacann/{package}/ is gone: update the layering rules"
    wrong = violations(package, imports)
    assert not wrong, describe(wrong, package)


def test_every_import_statement_is_seen():
    """The scan sees imports inside functions and classes, relative ones and ``from megacann import x``."""
    source = """
import os
import megacann.data.loader as loader
from megacann import parallel_state as ps, layers
from . import sibling
from ..models import spec

def lazy():
    if True:
        from megacann.pipeline.executor import run_plan

class Holder:
    def method(self):
        import megacann.training
"""
    found = sorted(megacann_imports(source, "megacann.optimizer.zero.grad_buffer", is_package=False))
    assert found == [
        (3, "megacann.data.loader"),
        (4, "megacann.layers"),
        (4, "megacann.parallel_state"),
        (5, "megacann.optimizer.zero"),
        (6, "megacann.optimizer.models"),
        (10, "megacann.pipeline.executor"),
        (14, "megacann.training"),
    ]
    package = sorted(megacann_imports("from . import x\nfrom .y import z\n", "megacann.data", is_package=True))
    assert package == [(1, "megacann.data"), (2, "megacann.data.y")]
