"""The import graph: layers import downward only, and no module imports itself back through others.

Every ``import`` and ``from ... import`` of a surefit module is read with ``ast``, wherever it stands (module level,
inside a function, under ``if TYPE_CHECKING``): a lazy import is still a dependency a reader has to follow. So is a
module imported by name (``importlib.import_module``): in a file that uses importlib, every string naming a surefit
module counts, and an f-string ``"surefit.pkg.{name}"`` counts as every module of that package.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Highest first. A module may import its own layer or any layer below it (docs/architecture.md draws this).
LAYERS: list[tuple[str, ...]] = [
    ("surefit", "surefit.__main__", "surefit.cli", "surefit.api", "surefit.cli.launch"),
    ("surefit.tasks",),
    ("surefit.doctor",),
    ("surefit.training", "surefit.run_folder", "surefit.run_folder.report"),
    ("surefit.data", "surefit.eval", "surefit.models", "surefit.models.gguf", "surefit.models.lowbit"),
    ("surefit.config", "surefit.config.checks", "surefit.config.yaml_files", "surefit.config.task_configs", "surefit.config.dpo_config",
     "surefit.errors",
     "surefit.units", "surefit.startup", "surefit.startup.cache", "surefit.threads", "surefit.cgroups"),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    parts = name.split(".")
    return (SRC / Path(*parts)).with_suffix(".py").is_file() or (SRC / Path(*parts) / "__init__.py").is_file()


def _by_name(tree: ast.AST) -> set[str]:
    """Modules a file may import by name: string constants naming one, f-strings under a package's dotted name."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("surefit."):
            if _is_module(node.value):
                found.add(node.value)
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            prefix = str(node.values[0].value)
            package = SRC / Path(*prefix.rstrip(".").split("."))
            if prefix.startswith("surefit.") and prefix.endswith(".") and package.is_dir():
                found |= {f"{prefix}{p.stem if p.suffix else p.name}" for p in package.iterdir()
                          if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    return found


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if any(isinstance(n, ast.Name | ast.alias) and "importlib" in (getattr(n, "id", "") or getattr(n, "name", ""))
           for n in ast.walk(tree)):
        found |= _by_name(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("surefit"):
            found.add(node.module)
            # ``from surefit.training import loss`` imports the module surefit.training.loss
            for alias in node.names:
                if (SRC / Path(*node.module.split(".")) / f"{alias.name}.py").is_file():
                    found.add(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import; use the absolute surefit.* name")
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name == "surefit" or a.name.startswith("surefit.")}
    return found


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted((SRC / "surefit").rglob("*.py"))}


def _layer(module: str) -> int:
    best, layer = -1, None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, layer = len(prefix), i
    assert layer is not None, f"{module} is in no layer: add it to LAYERS in tests/test_layers.py"
    return layer


def test_every_module_is_in_a_layer_and_imports_only_its_own_layer_or_lower():
    graph = _graph()
    upward = [f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
              for m, deps in graph.items() for d in sorted(deps) if d in graph and _layer(d) < _layer(m)]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_the_import_graph_has_no_cycles():
    graph = _graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if d not in graph or d == m:
                continue
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    # A package's __init__ that re-exports a submodule, imported by that submodule, is still a circle a reader meets.
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# Speed-ups are optional: a task chooses them and hands them in (the fused head to the loss, the activation store to
# the loop and the planner); nothing else imports them. The one import left: the planner counts what the store keeps
# with lora_fast's own packing types (Packed, keep_saved), which move into the core with that store's memory work.
SPEEDUPS = "surefit.training.speedups"
CHOOSERS = ("surefit.tasks",)
STILL_IMPORTED = {"surefit.training.plan -> surefit.training.speedups.lora_fast"}


def test_only_the_tasks_import_the_speedups():
    graph = _graph()
    found = {f"{m} -> {d}" for m, deps in graph.items() for d in deps
             if (d == SPEEDUPS or d.startswith(SPEEDUPS + ".")) and not m.startswith((SPEEDUPS, *CHOOSERS))}
    # Equal, not a subset: an import removed must leave this list too, so that it cannot come back unseen.
    assert found == STILL_IMPORTED, "modules that import a speed-up instead of being handed it:\n" + "\n".join(
        sorted(found ^ STILL_IMPORTED))


def test_the_checks_see_the_imports_they_claim(tmp_path):
    """The reader itself: a lazy import inside a function and a ``from package import module`` both count."""
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from surefit.training import loss\n    import surefit.tasks.sft\n", encoding="utf-8")
    assert {"surefit.training", "surefit.training.loss", "surefit.tasks.sft"} <= _imports(f)
    f.write_text('import importlib\nNAMES = ("surefit.doctor.core",)\n'
                 'def h(x):\n    return importlib.import_module(f"surefit.training.{x}")\n', encoding="utf-8")
    assert {"surefit.doctor.core", "surefit.training.loss", "surefit.training.speedups"} <= _imports(f)
    assert _layer("surefit.tasks.sft") < _layer("surefit.training.loss") < _layer("surefit.errors")


def _private_uses(path: Path, own: str = "") -> list[str]:
    """``from surefit.x import _name`` and ``module._name`` (a surefit module bound to a name) in one file."""
    own = own or _module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules: dict[str, str] = {}  # local name -> the surefit module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("surefit"):
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__") and node.module != own:
                    found.append(f"{own} line {node.lineno}: from {node.module} import {a.name}")
                if _is_module(f"{node.module}.{a.name}"):
                    modules[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("surefit") and a.asname:
                    modules[a.asname] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            if node.attr.startswith("_") and not node.attr.startswith("__") and modules[node.value.id] != own:
                found.append(f"{own} line {node.lineno}: {modules[node.value.id]}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    """A name shared between modules is public (no leading underscore) or not shared."""
    found = [u for p in sorted((SRC / "surefit").rglob("*.py")) for u in _private_uses(p)]
    assert not found, "private names used across modules (make them public or stop sharing them):\n" + "\n".join(found)


def test_the_private_name_check_sees_both_spellings(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from surefit.data.readers.common import _hidden\nfrom surefit.training import loss\n"
                 "x = loss._secret\n", encoding="utf-8")
    uses = _private_uses(f, own="surefit.example")
    assert [u.split(": ")[1] for u in uses] == ["from surefit.data.readers.common import _hidden",
                                                 "surefit.training.loss._secret"]
