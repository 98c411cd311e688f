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
# A backticked snake_case name with at least one underscore, optionally behind a path of
# `::`-separated segments (a module, a type, or a file such as `safekeeper/tests/x.rs`). Which
# of these are Rust references is `rust_refs`'s choice.
RUST_REF = re.compile(r"`((?:[\w/.-]+::)*)([a-z][a-z0-9]*(?:_[a-z0-9]+)+)`")


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


def rust_functions_by_file() -> dict[Path, set[str]]:
    """The names of the Rust functions of every file of every crate (sources, tests, benches),
    by path relative to the repository."""
    out: dict[Path, set[str]] = {}
    for crate in crate_dirs():
        for path in crate.rglob("*.rs"):
            if "target" in path.relative_to(ROOT).parts:
                continue
            out[path.relative_to(ROOT)] = set(re.findall(r"\bfn (\w+)\s*[(<]", path.read_text()))
    return out


def crate_names() -> dict[str, Path]:
    """Each crate's name as Rust paths spell it (`sk_core`) -> its directory."""
    out = {}
    for d in crate_dirs():
        name = tomllib.loads((d / "Cargo.toml").read_text())["package"]["name"]
        out[name.replace("-", "_")] = d.relative_to(ROOT)
    return out


def rust_refs(text: str) -> list[tuple[str, str]]:
    """The Rust functions `text` cites, as (path, name): every name behind a path (a test in a
    `tests` module, a file's test, a function by module or type), whatever its length, and bare
    names of four or more words (test names are; a shorter bare name is a field, a tool or a
    flag: `flush_lsn`, `pg_receivewal`). Pytest references are not Rust ones."""
    return [
        (path, name)
        for path, name in RUST_REF.findall(PYTEST_REF.sub("", text))
        if path or name.count("_") >= 3
    ]


def rust_ref_exists(path: str, name: str, by_file: dict[Path, set[str]]) -> bool:
    """Whether function `name` exists where `path` says: in that file (`x/tests/y.rs::`), in
    that crate (`sk_core::...`), or anywhere (a bare name, or a path from a module or type)."""
    segments = path.split("::")[:-1]
    if segments and segments[0].endswith(".rs"):
        return name in by_file.get(Path(segments[0]), set())
    crate = crate_names().get(segments[0]) if segments else None
    return any(
        name in names
        for file, names in by_file.items()
        if crate is None or file.is_relative_to(crate)
    )


def test_every_crate_is_searched():
    crates = {d.relative_to(ROOT).as_posix() for d in crate_dirs()}
    assert {"libs/pg_wal", "libs/pq_proto", "libs/sk_core", "safekeeper", "walproposer"} <= crates
    assert all((ROOT / c / "Cargo.toml").exists() for c in crates)


def test_the_contract_names_fifteen_promises():
    assert sorted(promise_sections()) == list(range(1, 16))


def test_every_promise_names_tests_that_exist():
    sections = promise_sections()
    marked = pytest_promises()
    by_file = rust_functions_by_file()
    problems = []
    for n, text in sections.items():
        named = 0
        for file, test in PYTEST_REF.findall(text):
            named += 1
            if (file, test) not in marked:
                problems.append(f"promise {n}: {file}::{test} does not exist")
            elif n not in marked[(file, test)]:
                problems.append(f"promise {n}: {file}::{test} lacks @pytest.mark.promise({n})")
        for path, test in rust_refs(text):
            named += 1
            if not rust_ref_exists(path, test, by_file):
                problems.append(f"promise {n}: Rust test {path}{test} does not exist")
        if named == 0:
            problems.append(f"promise {n} names no test")
    assert not problems, "\n".join(problems)


def test_short_and_pathed_rust_names_are_checked():
    """The contract cites short test names (`vote_survives_reboot`) by path: they are checked
    like long ones, in the file or crate the path names; short bare names are not tests."""
    refs = rust_refs(
        "`sk_core::safekeeper::tests::vote_survives_reboot`, `flush_lsn`, `pg_receivewal`, "
        "`safekeeper/tests/wal_service.rs::garbage_copy_data_gets_a_protocol_error`, "
        "`model_file_stores_on_simulated_fs_survive_power_loss`, "
        "`test_runner/test_daemon.py::test_sigterm_exits_zero_promptly`"
    )
    assert refs == [
        ("sk_core::safekeeper::tests::", "vote_survives_reboot"),
        ("safekeeper/tests/wal_service.rs::", "garbage_copy_data_gets_a_protocol_error"),
        ("", "model_file_stores_on_simulated_fs_survive_power_loss"),
    ], refs
    by_file = rust_functions_by_file()
    assert all(rust_ref_exists(p, n, by_file) for p, n in refs)
    # A name that exists elsewhere is not found in the wrong file or crate, nor a missing one.
    assert not rust_ref_exists("safekeeper/tests/wal_service.rs::", "vote_survives_reboot", by_file)
    assert not rust_ref_exists("walproposer::tests::", "vote_survives_reboot", by_file)
    assert not rust_ref_exists("sk_core::safekeeper::tests::", "vote_survives_reboots", by_file)


def test_every_marked_test_is_named_under_its_promise():
    sections = promise_sections()
    problems = [
        f"{file}::{test} is marked promise({n}) but promise {n} does not name it"
        for (file, test), marks in pytest_promises().items()
        for n in marks
        if f"`test_runner/{file}::{test}`" not in sections.get(n, "")
    ]
    assert not problems, "\n".join(problems)


def test_every_promise_has_a_mutant_in_every_ci_run():
    """Issue 27: each promise's enforcing line is removed by a mutant that CI runs every time
    (`ci = true` in scripts/mutants.toml), and every mutant names a promise of the contract."""
    mutants = tomllib.loads((ROOT / "scripts" / "mutants.toml").read_text())["mutant"]
    promises = set(promise_sections())
    named = {m["promise"] for m in mutants}
    assert named <= promises, f"mutants of promises the contract lacks: {named - promises}"
    in_ci = {m["promise"] for m in mutants if m["ci"]}
    assert in_ci == promises, f"promises without a mutant in every CI run: {promises - in_ci}"
