"""The import rules of docs/architecture.md: which part of the package may import which, read from the source
(every import statement, at module level or inside a function), and which parts stay importable without torch."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import flashflex_cli

PACKAGE = Path(flashflex_cli.__file__).parent
ROOT = "flashflex_cli"

# Modules any part may import: errors, units, number and file checks.
BASE = frozenset({"__init__", "errors", "units", "validate_numbers", "physical_limits", "fileio", "hostnames"})
# Each part and the parts it may import besides BASE (docs/architecture.md, "Import rules").
ALLOWED: dict[str, frozenset[str]] = {
    "model": frozenset(),
    "semantics": frozenset({"model"}),
    "hardware": frozenset({"model"}),
    "data": frozenset(),
    "plan": frozenset({"hardware", "model", "semantics"}),
    "layers": frozenset({"model", "plan"}),
    "hf": frozenset({"model", "semantics"}),
    "run_config": frozenset({"semantics"}),
    "cost": frozenset({"model", "semantics", "hardware", "plan", "layers"}),
    "planner": frozenset({"model", "semantics", "hardware", "plan", "layers", "cost"}),
    "runs": frozenset({"model", "semantics", "hardware", "plan", "layers", "cost"}),
    "runtime": frozenset({"model", "semantics", "hardware", "data", "plan", "layers", "hf", "run_config"}),
    "profiler": frozenset({"model", "semantics", "hardware", "layers", "runtime"}),
    "launch": frozenset({"model", "semantics", "hardware", "data", "plan", "layers", "hf", "run_config", "cost",
                         "planner"}),
    "commands": frozenset({"model", "semantics", "hardware", "data", "plan", "layers", "hf", "run_config", "cost",
                           "planner", "runs", "runtime", "profiler", "launch"}),
    "cli": frozenset({"commands"}),
}
# The runtime's own parts, lowest first, and the runtime parts each may import (docs/architecture.md): the device
# below the model, the model below parallelism, checkpoint I/O above both, the training loop on top.
RUNTIME_ALLOWED: dict[str, frozenset[str]] = {
    "device": frozenset(),
    "model": frozenset({"device"}),
    "parallel": frozenset({"device", "model"}),
    "checkpoint": frozenset({"device", "model", "parallel"}),
    "training": frozenset({"device", "model", "parallel", "checkpoint"}),
}
# Parts whose every module imports without torch: planning, costing and reading files need no torch.
TORCH_FREE = ("model", "semantics", "data", "plan", "layers", "cost", "planner", "runs", "launch", "run_config")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The module an ImportFrom names, absolute (`package`: the importing module's package)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(source: str, module: str, is_package: bool) -> set[str]:
    """Every flashflex_cli name `source` (module `module`) imports anywhere in it, as absolute dotted names:
    the module of each `from X import y` and X.y (y may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(node, package)
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] == ROOT and name != ROOT}


def _part(dotted: str) -> str:
    """The part of a dotted flashflex_cli name: its first component below the package."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


# Modules allowed one part more than their part's rule, each for a reason. The elastic worker is the launch module
# that runs inside a worker process: between rounds it re-plans (launch), within one it runs the runtime's worker.
EXCEPTIONS: dict[str, frozenset[str]] = {f"{ROOT}.launch.elastic_worker": frozenset({"runtime"})}


def _violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports of `source` (module `module`) its part's rule does not allow."""
    part = _part(module)
    allowed = BASE | {"__version__"} | ({part} if part in BASE else ALLOWED[part] | {part})
    allowed |= EXCEPTIONS.get(module, frozenset())
    return sorted(f"{module} imports {target}" for target in _imports(source, module, is_package)
                  if _part(target) not in allowed)


def _runtime_part(dotted: str) -> str | None:
    """The runtime part of a dotted name below flashflex_cli.runtime (None for runtime/__init__ itself)."""
    parts = dotted.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "runtime" else None


def _runtime_violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports of `source` (a module of the runtime) of a runtime part its part's rule does not allow."""
    mine = _runtime_part(module)
    if mine is None:
        return []
    allowed = RUNTIME_ALLOWED[mine] | {mine}
    return sorted(f"{module} imports {target}" for target in _imports(source, module, is_package)
                  if _runtime_part(target) is not None and _runtime_part(target) not in allowed)


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_part_has_a_rule() -> None:
    parts = {_part(_module_name(p)) for p in _sources()} - BASE - {"__main__"}
    assert parts <= set(ALLOWED), f"parts without an import rule: {sorted(parts - set(ALLOWED))}"


@pytest.mark.parametrize("part", sorted(ALLOWED) + ["base"])
def test_a_part_imports_only_what_its_rule_allows(part: str) -> None:
    mine = [p for p in _sources() if (_part(_module_name(p)) in BASE if part == "base" else
                                      _part(_module_name(p)) == part)]
    assert mine
    assert [line for p in mine for line in _violations(p.read_text(), _module_name(p), p.name == "__init__.py")] \
        == []


def test_every_runtime_part_has_a_rule() -> None:
    parts = {_runtime_part(_module_name(p)) for p in _sources()} - {None}
    assert parts == set(RUNTIME_ALLOWED), f"runtime parts without an import rule: {sorted(parts - set(RUNTIME_ALLOWED))}"


@pytest.mark.parametrize("part", sorted(RUNTIME_ALLOWED))
def test_a_runtime_part_imports_only_the_parts_below_it(part: str) -> None:
    mine = [p for p in _sources() if _runtime_part(_module_name(p)) == part]
    assert mine
    assert [line for p in mine
            for line in _runtime_violations(p.read_text(), _module_name(p), p.name == "__init__.py")] == []


@pytest.mark.parametrize(("module", "source", "bad"), [
    ("flashflex_cli.runtime.model.probe", "from ..training import engine\n", "training"),
    ("flashflex_cli.runtime.device.probe", "def f():\n    from ..parallel.groups import build_groups\n", "parallel"),
])
def test_the_runtime_checker_finds_a_forbidden_import(module: str, source: str, bad: str) -> None:
    assert {line.rsplit(" ", 1)[1].split(".")[2] for line in _runtime_violations(source, module)} == {bad}


@pytest.mark.parametrize(("module", "source", "bad"), [
    ("flashflex_cli.planner.search.probe", "from ...runtime import engine\n", "runtime"),
    ("flashflex_cli.runtime.probe", "def f():\n    from ..cost.estimate import estimate\n", "cost"),
    ("flashflex_cli.cost.probe", "import flashflex_cli.planner.search\n", "planner"),
    ("flashflex_cli.plan.probe", "from .. import cost\n", "cost"),
    ("flashflex_cli.launch.probe", "def f():\n    from ..runtime.training import worker\n", "runtime"),
    ("flashflex_cli.launch.local", "from ..runtime.training import heartbeat\n", "runtime"),
])
def test_the_checker_finds_a_forbidden_import(module: str, source: str, bad: str) -> None:
    """The rules can fail: a forbidden import, at module level or inside a function, is reported."""
    assert {line.rsplit(" ", 1)[1].split(".")[1] for line in _violations(source, module)} == {bad}


def _first_cycle(graph: dict[str, set[str]]) -> list[str]:
    """A cycle of `graph` (node -> nodes it imports) as [a, b, ..., a], or [] when there is none."""
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> list[str]:
        if node in stack:
            return stack[stack.index(node):] + [node]
        if node in done:
            return []
        for nxt in sorted(graph.get(node, ())):
            found = visit(nxt, stack + [node])
            if found:
                return found
        done.add(node)
        return []

    for start in sorted(graph):
        found = visit(start, [])
        if found:
            return found
    return []


def test_the_cycle_finder_finds_one() -> None:
    assert _first_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _first_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def _module_graph() -> dict[str, set[str]]:
    """Every package module -> the package modules it imports, by any import statement anywhere in it (module
    level, inside a function, under TYPE_CHECKING; `from package import module` counts as importing that
    module). A package's own __init__ is not counted as a target of its submodules."""
    graph: dict[str, set[str]] = defaultdict(set)
    names = {_module_name(p) for p in _sources()}
    for path in _sources():
        me = _module_name(path)
        for target in _imports(path.read_text(), me, path.name == "__init__.py"):
            if target in names and target != me and not me.startswith(target + "."):
                graph[me].add(target)
    return graph


def test_no_import_cycle_of_any_kind() -> None:
    """No two modules import each other, directly or through others, by any import (a cycle through a
    function-level import still makes the two modules one unit: neither can be read or moved alone)."""
    assert _first_cycle(_module_graph()) == []


def test_the_graph_sees_imports_inside_functions() -> None:
    """The cycle check can fail on a function-level import: the graph holds one the source really has."""
    graph = _module_graph()
    assert f"{ROOT}.runtime.training.worker" in graph[f"{ROOT}.launch.elastic_worker"]


@pytest.mark.parametrize("part", TORCH_FREE)
def test_parts_that_plan_and_cost_import_without_torch(part: str) -> None:
    package = __import__(f"{ROOT}.{part}", fromlist=["_"])
    modules = [package.__name__] + sorted(m.name for m in pkgutil.walk_packages(getattr(package, "__path__", []),
                                                                                f"{ROOT}.{part}."))
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"


# What the cost model and the runtime must agree on, imported by both from semantics/ (module: names each uses)
SHARED = {
    "semantics.schedule": {"cost.schedule": {"one_f_one_b"}, "runtime.parallel.pipeline": {"one_f_one_b"}},
    "semantics.buckets": {"cost.dp": {"KEY_NORM", "KEY_HEAD", "KEY_EMBED", "KEY_UNORDERED", "overlap_order"},
                          "runtime.parallel.grad_buckets": {"KEY_UNORDERED", "backward_key", "overlap_order"}},
    "semantics.boundary": {"cost.comm": {"chunk_route"}, "runtime.parallel.pipeline": {"ChunkPlan"}},
}


def _top_level_names(source: str) -> set[str]:
    """Names a module defines at its top level (functions, classes, assignments)."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


@pytest.mark.parametrize("shared", sorted(SHARED))
def test_the_cost_model_and_the_runtime_import_what_they_share_and_restate_none_of_it(shared: str) -> None:
    """The 1F1B order, the gradient-bucket keys and order and the lean-transfer chunk route have one home: each
    user imports them from it, and no module outside semantics/ defines a name of it again."""
    home = PACKAGE.joinpath(*shared.split(".")).with_suffix(".py")
    public = {n for n in _top_level_names(home.read_text()) if not n.startswith("_")}
    for user, names in SHARED[shared].items():
        path = PACKAGE.joinpath(*user.split(".")).with_suffix(".py")
        imported = _imports(path.read_text(), f"{ROOT}.{user}", False)
        missing = {n for n in names if f"{ROOT}.{shared}.{n}" not in imported}
        assert not missing, f"{user} does not import {sorted(missing)} from {shared}"
    restated = [f"{_module_name(p)}.{n}" for p in _sources() if _part(_module_name(p)) != "semantics"
                for n in sorted(_top_level_names(p.read_text()) & public)]
    assert not restated, f"defined again outside {shared}: {restated}"


def _private_imports(source: str, module: str | None, is_package: bool = False) -> list[str]:
    """`from X import _name` statements of `source` naming a private name of a flashflex_cli module X other than
    `module` itself (relative imports resolved against `module`; None: a file outside the package)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom) or (node.level and module is None):
            continue
        target = _absolute(node, module if is_package else module.rpartition(".")[0]) if node.level else \
            (node.module or "")
        if target.split(".")[0] != ROOT or target == module:
            continue
        found += [f"{target}.{alias.name}" for alias in node.names
                  if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_the_private_name_checker_finds_one() -> None:
    assert _private_imports("from ..cost.params import _LIMITS\n", f"{ROOT}.plan.probe") == \
        [f"{ROOT}.cost.params._LIMITS"]
    assert _private_imports("from flashflex_cli.cost import params\n", None) == []


def test_no_module_imports_another_modules_private_name() -> None:
    """A leading underscore means "only this module uses it": the package, its tests and its benchmarks import
    public names only."""
    repo = PACKAGE.parent.parent
    found = [f"{_module_name(p)}: {name}" for p in _sources()
             for name in _private_imports(p.read_text(), _module_name(p), p.name == "__init__.py")]
    found += [f"{p.relative_to(repo)}: {name}" for folder in ("tests", "benchmarks", "scripts")
              for p in sorted((repo / folder).rglob("*.py")) for name in _private_imports(p.read_text(), None)]
    assert found == []


def test_no_one_letter_module_alias() -> None:
    """`import x as F` says nothing of what F is (it meant torch's functional API in some modules and the
    model's FLOP counts in others)."""
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                found += [f"{_module_name(path)}: {alias.name} as {alias.asname}" for alias in node.names
                          if alias.asname is not None and len(alias.asname) == 1]
    assert found == []
