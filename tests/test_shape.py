"""The shape of the source where its parts meet: the loop's door is four arguments wide, and no function takes more
than eight (a longer list is a record that wants a name: a settings object or a dataclass)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "surefit"
MOST = 8


def _functions(root: Path = SRC) -> dict[str, int]:
    """``path:[Class.]name`` -> its parameters (``self``/``cls`` not counted; ``*args`` and ``**kwargs`` count one)."""
    found: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = child.args
                    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                    owner = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
                    key = f"{path.relative_to(root).as_posix()}:{owner}{child.name}"
                    found[key] = max(found.get(key, 0), len(names) + bool(a.vararg) + bool(a.kwarg))
    return found


def test_fit_takes_at_most_four_arguments():
    assert _functions()["training/loop.py:fit"] <= 4


def test_no_function_takes_more_than_eight_parameters():
    functions = _functions()
    wide = {k: n for k, n in functions.items() if n > MOST}
    assert not wide, "bundle these into a record or settings object"


def test_the_count_sees_keyword_only_and_variadic_parameters_and_methods(tmp_path):
    (tmp_path / "m.py").write_text("def g(a, /, b, *c, d, e=1, **f): pass\n"
                                   "class K:\n    def h(self, x, *, y): pass\n", encoding="utf-8")
    assert _functions(tmp_path) == {"m.py:g": 6, "m.py:K.h": 2}
