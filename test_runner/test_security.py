"""Security: test-only routes never in the real binary, key and token files checked at start."""

from __future__ import annotations

import shutil
from pathlib import Path

import requests

from fixtures.daemon import DAEMON_BUILD, RELEASE_DIR, Safekeeper, cargo_release

TEST_ONLY_ROUTES = [
    ("PUT", "/v1/failpoints?name=wal-fsync-error&active=true"),
    ("PUT", "/v1/debug/retain_memory?mib=1"),
    ("DELETE", "/v1/debug/retain_memory"),
]


class AllFeaturesSafekeeper(Safekeeper):
    """The real `safekeeper` binary of an `--all-features` build, copied to `path`."""

    path: Path | None = None

    @property
    def binary(self) -> Path:
        return self.path


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
    # In the suite's own target directory: the library with every feature is the one
    # `safekeeper-testing` links, so this is one link, not a second release build. The binary
    # is copied out and the default one linked again at once (target/release/safekeeper stays
    # the build users run, also if this test fails).
    # (With the suite's package set, whose dependencies are built already.)
    try:
        cargo_release(*DAEMON_BUILD, "--all-features", "--bin", "safekeeper")
        copy = tmp_path / "safekeeper-all-features"
        shutil.copy2(RELEASE_DIR / "safekeeper", copy)
    finally:
        cargo_release(*DAEMON_BUILD, "--bin", "safekeeper")
    built = AllFeaturesSafekeeper(datadir=tmp_path / "sk1", node_id=1)
    built.path = copy
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
