"""Shared pytest fixtures: build the release binaries once, start daemons per test, and always
stop them (also when a test fails)."""

from __future__ import annotations

import pytest

from fixtures.daemon import Safekeeper, build_release


@pytest.fixture(scope="session", autouse=True)
def release_binaries() -> None:
    build_release()


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
