"""A test of the suite itself (issue 27): every test asserts something, and only the one helper
that fails under CI may skip.

- Every `test_*` function reaches an assertion: an `assert` statement, `pytest.raises` /
  `pytest.fail`, or a call to a function of this suite that does (followed through helpers, by
  name). A test that only runs code proves nothing about it.
- `pytest.skip` appears only in `fixtures.tools.missing`, which fails instead when `CI` is set:
  a skip CI could take would hide a test that never runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = sorted(p for p in HERE.rglob("*.py") if ".venv" not in p.parts)


def parsed() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for p in FILES}


def called_names(node: ast.AST) -> set[str]:
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Name):
                names.add(f.id)
            elif isinstance(f, ast.Attribute):
                names.add(f.attr)
    return names


def asserts_directly(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Assert):
            return True
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "pytest"
            and n.func.attr in ("raises", "fail")
        ):
            return True
    return False


def functions(trees: dict[Path, ast.Module]) -> dict[str, list[ast.AST]]:
    """Every function and method of the suite by name (several may share one)."""
    out: dict[str, list[ast.AST]] = {}
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                out.setdefault(n.name, []).append(n)
    return out


def asserting_functions(trees: dict[Path, ast.Module]) -> set[str]:
    """Names of the suite's functions that reach an assertion (a fixpoint over calls)."""
    funcs = functions(trees)
    yes = {name for name, defs in funcs.items() if any(asserts_directly(d) for d in defs)}
    # A class whose methods assert counts when it is called (constructed) or its methods are.
    changed = True
    while changed:
        changed = False
        for name, defs in funcs.items():
            if name in yes:
                continue
            if any(called_names(d) & yes for d in defs):
                yes.add(name)
                changed = True
    return yes


def test_every_test_reaches_an_assertion():
    trees = parsed()
    yes = asserting_functions(trees)
    bare = []
    for path, tree in trees.items():
        for n in tree.body:
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test_"):
                if not asserts_directly(n) and not (called_names(n) & yes):
                    bare.append(f"{path.name}::{n.name}")
    assert not bare, f"tests without any assertion: {bare}"
    # The lint can fail: a body without one is found.
    probe = ast.parse("def test_x():\n    run_something()\n").body[0]
    assert not asserts_directly(probe) and not (called_names(probe) & {"wait_until"})


def test_only_the_ci_aware_helper_skips():
    skips = []
    for path, tree in parsed().items():
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for n in ast.walk(fn):
                if (
                    isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Attribute)
                    and n.func.attr in ("skip", "skipif", "importorskip")
                    and isinstance(n.func.value, ast.Name | ast.Attribute)
                ):
                    where = f"{path.relative_to(HERE)}::{fn.name}"
                    if where != "fixtures/tools.py::missing":
                        skips.append(where)
    assert not skips, f"skips outside fixtures.tools.missing (CI could take them): {skips}"
    # Decorators too: a skip mark is a skip CI takes.
    marks = [
        f"{p.name}"
        for p in FILES
        if "mark.skip" in p.read_text() and p.name != "test_suite_lint.py"
    ]
    assert not marks, f"skip marks: {marks}"


def constant(expr: ast.AST) -> bool:
    """Whether `expr` reads nothing: no name, call, attribute or subscript (e.g. `True`,
    `1 == 1`, `"x" in "xy"`), so an assertion of it cannot depend on the system under test."""
    return not any(
        isinstance(n, ast.Name | ast.Call | ast.Attribute | ast.Subscript) for n in ast.walk(expr)
    )


def test_no_assertion_is_of_a_constant():
    found = []
    for path, tree in parsed().items():
        for n in ast.walk(tree):
            if isinstance(n, ast.Assert) and constant(n.test):
                found.append(f"{path.relative_to(HERE)}:{n.lineno}")
    assert not found, f"assertions that cannot fail (or always fail): {found}"
    # The lint can fail, and lets through what reads the system.
    assert constant(ast.parse("assert 1 == 1").body[0].test)
    assert not constant(ast.parse("assert r.ok").body[0].test)
