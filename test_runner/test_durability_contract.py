"""The durability contract (docs/durability.md) and the tests stay in step: every test the
contract names exists, every pytest test named under a promise carries that promise's marker,
and every marked test is named under its promise. No daemon needed."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "durability.md"
PROMISE = re.compile(r"^(\d+)\. \*\*", re.MULTILINE)
PYTEST_REF = re.compile(r"`test_runner/(test_\w+\.py)::(test_\w+)`")
# A Rust test: a backticked path whose last segment is a long snake_case name (test names are).
RUST_REF = re.compile(r"`(?:[\w/.]+::)*([a-z][a-z0-9]*(?:_[a-z0-9]+){3,})`")


def promise_sections() -> dict[int, str]:
    text = DOC.read_text()
    text = text[: text.index("\n## ", text.index("1. **"))]
    starts = list(PROMISE.finditer(text))
    return {
        int(m.group(1)): text[m.start() : starts[i + 1].start() if i + 1 < len(starts) else None]
        for i, m in enumerate(starts)
    }


def pytest_promises() -> dict[tuple[str, str], set[int]]:
    """(file, test) -> the promises its `@pytest.mark.promise(...)` markers name."""
    out: dict[tuple[str, str], set[int]] = {}
    for path in sorted((ROOT / "test_runner").glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                marks: set[int] = set()
                for dec in node.decorator_list:
                    if isinstance(dec, ast.Call) and ast.unparse(dec.func) == "pytest.mark.promise":
                        marks.update(int(ast.literal_eval(a)) for a in dec.args)
                out[(path.name, node.name)] = marks
    return out


def crate_dirs() -> list[Path]:
    """Every crate of the workspace: the members of the root `Cargo.toml`."""
    workspace = tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]
    return [ROOT / member for member in workspace["members"]]


def rust_functions() -> set[str]:
    """The names of every Rust function of every crate (sources, tests, benches)."""
    names: set[str] = set()
    for crate in crate_dirs():
        for path in crate.rglob("*.rs"):
            names.update(re.findall(r"\bfn (\w+)\s*[(<]", path.read_text()))
    return names


def test_every_crate_is_searched():
    crates = {d.relative_to(ROOT).as_posix() for d in crate_dirs()}
    assert {"libs/pg_wal", "libs/pq_proto", "libs/sk_core", "safekeeper", "walproposer"} <= crates
    assert all((ROOT / c / "Cargo.toml").exists() for c in crates)


def test_the_contract_names_fourteen_promises():
    assert sorted(promise_sections()) == list(range(1, 15))


def test_every_promise_names_tests_that_exist():
    sections = promise_sections()
    marked = pytest_promises()
    rust = rust_functions()
    problems = []
    for n, text in sections.items():
        named = 0
        for file, test in PYTEST_REF.findall(text):
            named += 1
            if (file, test) not in marked:
                problems.append(f"promise {n}: {file}::{test} does not exist")
            elif n not in marked[(file, test)]:
                problems.append(f"promise {n}: {file}::{test} lacks @pytest.mark.promise({n})")
        for test in RUST_REF.findall(PYTEST_REF.sub("", text)):
            named += 1
            if test not in rust:
                problems.append(f"promise {n}: Rust test {test} does not exist")
        if named == 0:
            problems.append(f"promise {n} names no test")
    assert not problems, "\n".join(problems)


def test_every_marked_test_is_named_under_its_promise():
    sections = promise_sections()
    problems = [
        f"{file}::{test} is marked promise({n}) but promise {n} does not name it"
        for (file, test), marks in pytest_promises().items()
        for n in marks
        if f"`test_runner/{file}::{test}`" not in sections.get(n, "")
    ]
    assert not problems, "\n".join(problems)
