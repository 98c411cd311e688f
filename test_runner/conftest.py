"""Shared pytest fixtures: build the release binaries once, start daemons per test, and always
stop them (also when a test fails)."""

from __future__ import annotations

import os

import pytest
import requests

from fixtures.daemon import ExampleService, Safekeeper, build_release
from fixtures.pg import PgCluster


@pytest.fixture(scope="session", autouse=True)
def release_binaries() -> None:
    build_release()


@pytest.fixture(scope="session", autouse=True)
def shared_symbol_index(release_binaries, tmp_path_factory) -> None:
    """Profiles symbolize through an index of each binary, built at the first profile (~10 s of
    CPU for the safekeeper, more on a loaded machine) into the daemon's data directory. Every
    test has new data directories: share one index directory for the session, and build the
    safekeeper's index once here, so that no test's first profile waits for it under its own
    request timeout."""
    os.environ.setdefault("PROFILING_SYMBOL_INDEX_DIR", str(tmp_path_factory.mktemp("symidx")))
    sk = Safekeeper(datadir=tmp_path_factory.mktemp("symidx-sk") / "sk1", node_id=1)
    try:
        sk.start()
        requests.get(f"{sk.http}/profile/heap", timeout=300).raise_for_status()
    finally:
        sk.kill()


@pytest.fixture
def safekeeper_factory(tmp_path):
    started: list[Safekeeper] = []

    def make(node_id: int = 1, **kwargs) -> Safekeeper:
        sk = Safekeeper(datadir=tmp_path / f"sk{node_id}", node_id=node_id, **kwargs)
        started.append(sk)
        return sk

    yield make
    for sk in started:
        sk.kill()


@pytest.fixture
def safekeeper(safekeeper_factory) -> Safekeeper:
    return safekeeper_factory().start()


@pytest.fixture
def pg_factory():
    """Makes PostgreSQL clusters (`PgCluster(name)`), all stopped and removed at the end."""
    clusters: list[PgCluster] = []

    def make(name: str, major: int = 15) -> PgCluster:
        c = PgCluster(name, major)
        clusters.append(c)
        return c

    yield make
    for c in clusters:
        c.cleanup()


@pytest.fixture
def example_factory(tmp_path):
    started: list[ExampleService] = []

    def make(**kwargs) -> ExampleService:
        svc = ExampleService(workdir=tmp_path / f"example{len(started)}", **kwargs)
        started.append(svc)
        return svc

    yield make
    for svc in started:
        svc.kill()


@pytest.fixture(params=["safekeeper", "example"])
def profiled(request, safekeeper_factory, example_factory):
    """A running server with the profiling routes: the safekeeper, or the profiling crate's
    example service (the profiling tests run against both)."""
    if request.param == "safekeeper":
        return safekeeper_factory().start()
    return example_factory().start()
