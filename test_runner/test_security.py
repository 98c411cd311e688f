"""Security: test-only routes never in the real binary, key and token files checked at start."""

from __future__ import annotations

import requests

TEST_ONLY_ROUTES = [
    ("PUT", "/v1/failpoints?name=wal-fsync-error&active=true"),
    ("PUT", "/v1/debug/retain_memory?mib=1"),
    ("DELETE", "/v1/debug/retain_memory"),
]


def test_release_binary_answers_404_on_every_test_only_route(safekeeper_factory):
    real = safekeeper_factory(node_id=1, binary_name="safekeeper").start()
    testing = safekeeper_factory(node_id=2).start()
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
