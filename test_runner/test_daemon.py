"""Daemon life cycle: status, metrics, graceful shutdown, the data directory lock."""

from __future__ import annotations

import subprocess

import pytest
import requests

from fixtures.daemon import Safekeeper


def test_status_reports_identity(safekeeper_factory):
    sk = safekeeper_factory(node_id=7).start()
    st = requests.get(f"{sk.http}/v1/status", timeout=5).json()
    assert st["id"] == 7
    assert st["version"]
    assert st["uptime_seconds"] >= 0
    assert st["datadir"] == str(sk.datadir)


def test_metrics_expose_process_jemalloc_and_profile_counters(safekeeper):
    requests.get(f"{safekeeper.http}/profile/cpu?seconds=0", timeout=5)
    text = requests.get(f"{safekeeper.http}/metrics", timeout=5).text
    for name in [
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "jemalloc_allocated_bytes",
        "jemalloc_active_bytes",
        "jemalloc_resident_bytes",
        "jemalloc_mapped_bytes",
        "jemalloc_retained_bytes",
    ]:
        assert f"\n{name} " in text, name
    assert 'profile_requests_total{outcome="bad_request",profile="cpu"} 1' in text


@pytest.mark.promise(9)
def test_sigterm_exits_zero_promptly(safekeeper):
    # The promise's bound is the deadline `stop` waits for the exit (it raises past it): an idle
    # daemon has nothing to wait for. What is checked is how it stopped: exit 0 through the whole
    # shutdown path, and neither of its grace periods ran out (the daemon logs when one does).
    assert safekeeper.stop(timeout=5) == 0
    log = safekeeper.log()
    assert "SIGTERM received, shutting down" in log, log[-2000:]
    assert "safekeeper stopped" in log, log[-2000:]
    assert "did not finish within" not in log and "did not stop in time" not in log, log[-2000:]


def test_datadir_lock_refuses_second_daemon(safekeeper):
    second = Safekeeper(datadir=safekeeper.datadir, node_id=2)
    proc = second.spawn()
    assert proc.wait(timeout=20) == 1
    log = second.log()
    assert "in use by another safekeeper" in log
    assert str(safekeeper.proc.pid) in log
    # The first one is unaffected.
    assert requests.get(f"{safekeeper.http}/v1/status", timeout=5).ok


@pytest.mark.promise(14)
def test_node_id_is_kept_in_the_data_directory(safekeeper_factory):
    """Issue 26, defect 7: the id follows the data. A restart without --id is the stored node,
    not node 1; a different --id refuses to start naming both ids."""
    sk = safekeeper_factory(node_id=5).start()
    assert (sk.datadir / "safekeeper.id").read_text() == "5\n"
    assert sk.stop() == 0
    sk.node_id = 6
    proc = sk.spawn()
    assert proc.wait(timeout=20) == 1
    log = sk.log()
    assert "belongs to safekeeper id 5" in log and "--id 6" in log, log[-2000:]
    sk.node_id = None
    sk.start()
    assert requests.get(f"{sk.http}/v1/status", timeout=5).json()["id"] == 5
    assert sk.stop() == 0


def test_help_lists_flags():
    out = subprocess.run(
        [str(Safekeeper(datadir=None).binary), "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in ["--id", "--datadir", "--listen-pg", "--listen-http", "--no-sync"]:
        assert flag in out
