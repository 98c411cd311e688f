"""Security: test-only routes never in the real binary, key and token files checked at start."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import requests

from fixtures.daemon import RELEASE_DIR, REPO, Safekeeper

TEST_ONLY_ROUTES = [
    ("PUT", "/v1/failpoints?name=wal-fsync-error&active=true"),
    ("PUT", "/v1/debug/retain_memory?mib=1"),
    ("DELETE", "/v1/debug/retain_memory"),
]

# The real binary built with every feature (`testing` included), in a target directory of its
# own so that target/release/safekeeper stays the build users run.
ALL_FEATURES_DIR = REPO / os.environ.get("CARGO_TARGET_DIR", "target") / "all-features"


class AllFeaturesSafekeeper(Safekeeper):
    """The real `safekeeper` binary of an `--all-features` build."""

    @property
    def binary(self) -> Path:
        return ALL_FEATURES_DIR / "release" / "safekeeper"


def assert_test_only_routes_404(real: Safekeeper, testing: Safekeeper) -> None:
    for method, route in TEST_ONLY_ROUTES:
        r = requests.request(method, f"{real.http}{route}", timeout=5)
        assert r.status_code == 404, (method, route, r.status_code, r.text)
        # The same route on the test build exists: the 404 above is the binary, not the route.
        r = requests.request(
            method, f"{testing.http}{route.replace('active=true', 'active=false')}", timeout=5
        )
        assert r.status_code != 404, (method, route, r.status_code, r.text)
    assert "test build" not in real.log()
    assert "test build" in testing.log()


def test_release_binary_answers_404_on_every_test_only_route(safekeeper_factory):
    real = safekeeper_factory(node_id=1, binary_name="safekeeper").start()
    testing = safekeeper_factory(node_id=2).start()
    assert_test_only_routes_404(real, testing)


def test_release_binary_built_with_all_features_answers_404_too(safekeeper_factory, tmp_path):
    """The README's promise: the real binary answers 404 on every test-only route even when
    built with `--all-features` (the `testing` feature compiles the routes in; only
    `safekeeper-testing` mounts them)."""
    subprocess.run(
        ["cargo", "build", "--release", "-p", "safekeeper", "--all-features"]
        + ["--bin", "safekeeper"],
        cwd=REPO,
        env={**os.environ, "CARGO_TARGET_DIR": str(ALL_FEATURES_DIR)},
        check=True,
        timeout=3600,
    )
    built = AllFeaturesSafekeeper(datadir=tmp_path / "sk1", node_id=1)
    # The feature is in this build: the test routes' code is in the binary (it is not in the
    # default build's target/release/safekeeper).
    assert b"/v1/debug/retain_memory" in built.binary.read_bytes()
    assert b"/v1/debug/retain_memory" not in (RELEASE_DIR / "safekeeper").read_bytes()
    testing = safekeeper_factory(node_id=2).start()
    try:
        built.start()
        assert_test_only_routes_404(built, testing)
    finally:
        built.kill()
