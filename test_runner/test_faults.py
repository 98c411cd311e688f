"""Injected storage faults (failpoints of the `testing` build): a failed fsync aborts the
process and nothing undurable is claimed after restart; a full disk fails appends while the
daemon keeps serving, and ingestion resumes when space returns. Promises 6 and 7 of
docs/durability.md."""

from __future__ import annotations

import json
import subprocess

import pytest
import requests

from fixtures.daemon import RELEASE_DIR, lsn_int, max_acked, wait_until
from fixtures.tools import before, missing, receivewal


def spawn_proposer(sk, ack_log, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(RELEASE_DIR / "walproposer"), "--safekeepers", f"127.0.0.1:{sk.pg_port}"]
        + ["--ack-log", str(ack_log), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def failpoint(sk, name: str, active: bool) -> None:
    r = requests.put(
        f"{sk.http}/v1/failpoints",
        params={"name": name, "active": str(active).lower()},
        timeout=5,
    )
    assert r.ok, r.text


def test_unknown_failpoint_is_refused(safekeeper):
    r = requests.put(
        f"{safekeeper.http}/v1/failpoints", params={"name": "nope", "active": "true"}, timeout=5
    )
    assert r.status_code == 400
    assert "wal-write-enospc" in r.text


@pytest.mark.promise(6)
def test_failed_fsync_aborts_and_nothing_undurable_is_claimed(safekeeper_factory, tmp_path):
    sk = safekeeper_factory().start()
    ack_log = tmp_path / "acks"
    wp = spawn_proposer(sk, ack_log, "--total", "10G", "--rate", "8M")
    wait_until(lambda: max_acked(ack_log) > 0, "a first acknowledgement")
    failpoint(sk, "wal-fsync-error", True)
    # The next fsync fails: the process aborts instead of retrying.
    assert sk.proc.wait(timeout=20) == -6  # SIGABRT
    assert "fsync failed" in sk.log()
    wp.kill()
    wp.wait()
    acked = max_acked(ack_log)
    sk.start()
    t = requests.get(f"{sk.http}/v1/timelines", timeout=5).json()[0]
    # Everything acknowledged before the failure is there after the restart.
    assert lsn_int(t["flush_lsn"]) >= acked, (t, acked)


@pytest.mark.promise(7)
def test_disk_full_fails_appends_keeps_serving_and_resumes(safekeeper_factory, tmp_path):
    sk = safekeeper_factory().start()
    ack_log = tmp_path / "acks"
    wp = spawn_proposer(sk, ack_log, "--total", "24M", "--rate", "6M")
    wait_until(lambda: max_acked(ack_log) > 0, "a first acknowledgement")
    failpoint(sk, "wal-write-enospc", True)
    wait_until(lambda: "no space left on device" in sk.log(), "an append failing with ENOSPC")
    # Appends fail, the daemon stays up and answers.
    assert sk.proc.poll() is None
    stalled = max_acked(ack_log)
    assert requests.get(f"{sk.http}/v1/status", timeout=5).ok
    t = requests.get(f"{sk.http}/v1/timelines", timeout=5).json()[0]
    assert lsn_int(t["flush_lsn"]) >= stalled
    # ... and serves committed WAL to a real reader while the disk is full.
    recv = tmp_path / "recv"
    recv.mkdir()
    out = receivewal(sk, recv, "--endpos", before(t["commit_lsn"]))
    assert out.returncode == 0, out.stderr
    received = sum(p.stat().st_size for p in recv.iterdir())
    assert received > 0, list(recv.iterdir())
    # Space returns: the proposer's reconnects succeed and it finishes.
    failpoint(sk, "wal-write-enospc", False)
    out, err = wp.communicate(timeout=120)
    assert wp.returncode == 0, err
    assert "no space left on device" in err, "the proposer must have seen the error"
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["commit_lsn"] == stats["end_lsn"]
    t = requests.get(f"{sk.http}/v1/timelines", timeout=5).json()[0]
    assert t["flush_lsn"] == stats["end_lsn"]
    assert max_acked(ack_log) <= lsn_int(t["flush_lsn"])


@pytest.mark.promise(7)
def test_real_full_filesystem_fails_appends_and_recovers_when_space_returns(
    safekeeper_factory, tmp_path
):
    """A real 6 MiB tmpfs fills up under 1 MiB WAL segments; growing it lets ingestion finish."""
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(small)], capture_output=True
    )
    if mounted.returncode != 0:
        # CI runs as root and can mount: there a failed mount fails the test.
        missing(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        sk = safekeeper_factory()
        sk.datadir = small / "data"
        sk.start()
        ack_log = tmp_path / "acks"
        wp = spawn_proposer(
            sk, ack_log, "--wal-seg-size", "1048576", "--total", "12M", "--rate", "4M"
        )
        wait_until(
            lambda: "no space left on device" in sk.log() or wp.poll() is not None,
            "the filesystem to fill up",
        )
        assert wp.poll() is None, wp.stderr.read()
        assert sk.proc.poll() is None
        assert requests.get(f"{sk.http}/v1/status", timeout=5).ok
        stalled = max_acked(ack_log)
        subprocess.run(["mount", "-o", "remount,size=64m", str(small)], check=True)
        out, err = wp.communicate(timeout=120)
        assert wp.returncode == 0, err
        stats = json.loads(out.strip().splitlines()[-1])
        t = requests.get(f"{sk.http}/v1/timelines", timeout=5).json()[0]
        assert t["flush_lsn"] == stats["end_lsn"]
        assert stalled <= lsn_int(t["flush_lsn"])
        sk.stop()
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)
