"""The import direction between megacann's packages: a lower layer never imports a higher one.

Every module under megacann/ is parsed (nothing is imported), and every ``import`` in it counts, at any
nesting: a lazy import inside a function ties the packages together just the same. The layering
(README, "Layout"): the floor (errors, accelerator, host_memory, parallel_state, rank_layout, communication_lanes,
collectives, constants), then config, ops, layers, models (the contract and the families), data, pipeline, optimizer,
checkpoint (training state only), interop (weights in and out), generation (which knows models only through
the contract and the layers), rl (prompts, rollouts by the generator, rewards, advantages), training, and the
tools on top. Three rules close the model contract on both
sides: models/ knows no file format (never imports interop/), layers/ need no recipe (never import config's
recipe class), and pipeline/ knows models only through the contract's modules.
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
TOOLS = {
    "planning",
    "dry_run",
    "launch",
    "cli",
    "convert",
    "generate",
    "evaluation",
    "train",
    "comm_check",
    "env_report",
}
ABOVE_DATA = {"pipeline", "optimizer", "checkpoint", "interop", "generation", "rl", "training"}

# what each package may import from megacann: ALLOWED lists all it may use, FORBIDDEN what it may not
ALLOWED = {"config": FLOOR | {"config"}}
FORBIDDEN = {
    "ops": {"layers", "models", "data"} | ABOVE_DATA | TOOLS,
    "layers": {"models", "data"} | ABOVE_DATA | TOOLS,
    "models": {"data"} | ABOVE_DATA | TOOLS,  # interop among them: a family knows no file format
    "data": {"layers", "models"} | ABOVE_DATA | TOOLS,
    "optimizer": {"pipeline", "models", "data", "checkpoint", "interop", "generation", "training"} | TOOLS,
    "checkpoint": {"data", "models", "interop", "generation", "training", "pipeline"} | TOOLS,
    "generation": {"data", "optimizer", "checkpoint", "interop", "rl", "training"} | TOOLS,
    "rl": {"pipeline", "optimizer", "checkpoint", "interop", "training"} | TOOLS,  # rollouts know the generator
}

# the model contract: what pipeline/ may import of megacann.models (the spec and registry; chunk outputs and loss)
CONTRACT_MODULES = {"megacann.models.spec", "megacann.models.contract"}
# the recipe: layers/ take their settings from a LayerContext, which models/ builds from a recipe
RECIPE_CLASSES = {"MegacannConfig"}


class Import(NamedTuple):
    file: str  # relative to the package, e.g. "data/gpt_dataset.py"
    line: int
    module: str  # the megacann module imported, e.g. "megacann.layers.loss"
    names: tuple[str, ...] = ()  # the names taken from it ("from megacann.config import MegacannConfig")

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
    for line, name, _ in megacann_imported_names(source, module, is_package):
        yield line, name


def megacann_imported_names(source: str, module: str, is_package: bool) -> Iterator[tuple[int, str, tuple[str, ...]]]:
    """(line, imported megacann module, names taken from it: none for a whole module) for every import
    statement in ``source`` (see :func:`megacann_imports`)."""
    for node in ast.walk(ast.parse(source)):
        taken: tuple[str, ...] = ()
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
            taken = () if base == "megacann" else tuple(alias.name for alias in node.names)
        else:
            continue
        for name in names:
            if name.startswith("megacann."):
                yield node.lineno, name, taken


def all_imports() -> list[Import]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path, PACKAGE)
        for line, imported, names in megacann_imported_names(path.read_text(), name, path.name == "__init__.py"):
            found.append(Import(path.relative_to(PACKAGE).as_posix(), line, imported, names))
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


def contract_violations(imports: list[Import]) -> list[Import]:
    """Imports of megacann.models by pipeline/ that go around the contract's modules."""
    return [
        imp
        for imp in imports
        if imp.file.startswith("pipeline/") and imp.target == "models" and imp.module not in CONTRACT_MODULES
    ]


def recipe_violations(imports: list[Import]) -> list[Import]:
    """Imports by layers/ of config's recipe class, by name or with the whole config package."""
    wrong = []
    for imp in imports:
        if not imp.file.startswith("layers/") or imp.target != "config":
            continue
        if not imp.names or RECIPE_CLASSES & set(imp.names):
            wrong.append(imp)
    return wrong


def listed(wrong: list[Import]) -> str:
    return "\n".join(f"megacann/{imp.file}:{imp.line} imports {imp.module} {list(imp.names)}" for imp in wrong)


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


def test_pipeline_knows_models_only_through_the_contract(imports):
    wrong = contract_violations(imports)
    assert not wrong, (
        f"megacann/pipeline/ may import of megacann.models only {sorted(CONTRACT_MODULES)}:\n{listed(wrong)}"
    )


def test_layers_need_no_recipe(imports):
    wrong = recipe_violations(imports)
    assert not wrong, (
        f"megacann/layers/ may not import the recipe ({sorted(RECIPE_CLASSES)}, nor megacann.config whole); "
        f"a recipe's layer context is made in models/ (layer_context_from_config):\n{listed(wrong)}"
    )


def test_the_contract_rules_catch_what_they_forbid():
    """Each rule refuses a made-up import that breaks it, and lets its allowed neighbour through."""
    cases = {
        "models/llama.py": "from megacann.interop.hf import save_pretrained_hf\n",
        "pipeline/executor.py": (
            "from megacann.models.step_loss import LossTotals\nfrom megacann import models\n"
            "from megacann.models.contract import LossTotals\nfrom megacann.models.spec import ModelSpec\n"
        ),
        "layers/context.py": (
            "from megacann.config import MegacannConfig\nimport megacann.config.schema\n"
            "from megacann.config.schema import ConfigError\n"
        ),
    }
    made_up = []
    for file, source in cases.items():
        module = "megacann." + file[: -len(".py")].replace("/", ".")
        made_up += [
            Import(file, line, name, names) for line, name, names in megacann_imported_names(source, module, False)
        ]
    assert [imp.module for imp in violations("models", made_up)] == ["megacann.interop.hf"]
    assert [(imp.line, imp.module) for imp in contract_violations(made_up)] == [
        (1, "megacann.models.step_loss"),
        (2, "megacann.models"),
    ]
    assert [(imp.line, imp.module) for imp in recipe_violations(made_up)] == [
        (1, "megacann.config"),
        (2, "megacann.config.schema"),
    ]


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


# The pipeline room: the schedule kinds build on the floor of the room alone, and nothing imports in a circle
PIPELINE_FLOOR = {"actions", "placement", "schedule_spec"}  # the plan's actions, where chunks sit, the spec
SCHEDULE_KINDS = {"one_f_one_b", "interleaved", "v_schedules"}  # one file per kind of schedule
SCHEDULE_NAMES = {"1f1b", "interleaved", "zb1p", "zbv", "dualpipev"}
# where a built-in schedule's name may stand as a string of its own: the kind that registers it, the spec's
# default for the key unset, and the layout search's starting schedule (config keeps only the string)
NAME_LITERALS_ALLOWED = {
    *(f"pipeline/{kind}.py" for kind in SCHEDULE_KINDS),
    "pipeline/schedule_spec.py",
    "planning/search.py",
}


def pipeline_graph() -> dict[str, set[str]]:
    """Module -> the pipeline modules it imports (any import, lazy ones too), by short name; ``from
    megacann.pipeline import p2p`` counts as importing the module p2p, not the package."""
    room = PACKAGE / "pipeline"
    modules = {path.stem for path in room.glob("*.py") if path.name != "__init__.py"}
    graph = {}
    for name in sorted(modules):
        edges = set()
        for node in ast.walk(ast.parse((room / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "megacann.pipeline":
                edges |= {alias.name for alias in node.names}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                full = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                edges |= {f.split(".")[2] for f in full if f.startswith("megacann.pipeline.")}
        graph[name] = edges
    return graph


def cycle_in(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (module names, the first repeated at the end), or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return []


def test_pipeline_modules_import_no_cycle():
    graph = pipeline_graph()
    assert {"plan", "rules", "simulate", *SCHEDULE_KINDS, *PIPELINE_FLOOR} <= set(graph)
    cycle = cycle_in(graph)
    assert not cycle, "megacann/pipeline/ imports in a circle: " + " -> ".join(cycle)


def test_cycle_finder_finds_one():
    assert cycle_in({"plan": {"rules"}, "rules": {"simulate"}, "simulate": {"plan"}}) == [
        "plan",
        "rules",
        "simulate",
        "plan",
    ]
    assert cycle_in({"plan": {"actions"}, "rules": {"plan", "actions"}, "actions": set()}) == []


def test_schedule_kinds_import_only_the_floor_of_the_room():
    """A schedule kind builds on the actions, the placements and the spec: never on the runner, the
    simulator, the rules or another kind (a new schedule is one such file and one registration)."""
    graph = pipeline_graph()
    for kind in sorted(SCHEDULE_KINDS):
        assert graph[kind] <= PIPELINE_FLOOR, (
            f"megacann/pipeline/{kind}.py imports {sorted(graph[kind] - PIPELINE_FLOOR)}"
        )
    for module in sorted(PIPELINE_FLOOR):
        assert graph[module] <= PIPELINE_FLOOR, f"megacann/pipeline/{module}.py imports {sorted(graph[module])}"


def test_schedule_names_stand_only_where_they_are_defined():
    """Everywhere else asks the spec (get_schedule / schedule_for) instead of comparing a name."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where in NAME_LITERALS_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in SCHEDULE_NAMES:
                wrong.append(f"megacann/{where}:{node.lineno} {node.value!r}")
    assert not wrong, "schedule names compared outside their spec:\n" + "\n".join(wrong)
