"""Injected storage faults (failpoints of the `testing` build): a failed fsync aborts the
process and nothing undurable is claimed after restart; a full disk fails appends while the
daemon keeps serving, and ingestion resumes when space returns; `--max-disk-usage-ratio` on a
real small tmpfs. Promises 6 and 7 of docs/durability.md. "Nothing acknowledged is lost" is
checked by content: the walproposer's `--ack-log` carries a SHA-256 per acknowledged range,
compared with the safekeeper's segment files and with what a real reader received."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import requests

from fixtures.daemon import RELEASE_DIR, fmt_lsn, lsn_int, max_acked, wait_until
from fixtures.ledger import (
    digest_ranges,
    ledger,
    segment_name,
    verify,
    verify_received,
    verify_safekeeper,
)
from fixtures.tools import before, receivewal, tmpfs

START = lsn_int("0/1000000")
SEG = 1 << 20


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


def timeline_lsn(sk, field: str) -> int:
    """`field` of the node's (only) timeline, 0 before the proposer created it."""
    tls = requests.get(f"{sk.http}/v1/timelines", timeout=5).json()
    return lsn_int(tls[0][field]) if tls else 0


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
    # WAL acknowledged before the failure (the first line, the start LSN, acknowledges none).
    wait_until(lambda: max_acked(ack_log) > START + SEG, "a first MiB acknowledged")
    failpoint(sk, "wal-fsync-error", True)
    # The next fsync fails: the process aborts instead of retrying.
    assert sk.proc.wait(timeout=20) == -6  # SIGABRT
    assert "fsync failed" in sk.log()
    wp.kill()
    wp.wait()
    acked = max_acked(ack_log)
    sk.start()
    t = requests.get(f"{sk.http}/v1/timelines", timeout=5).json()[0]
    # Everything acknowledged before the failure is there after the restart, byte for byte.
    assert lsn_int(t["flush_lsn"]) >= acked, (t, acked)
    ranges, checked = verify_safekeeper(ack_log, sk)
    assert ranges > 0 and checked == acked - START, (ranges, checked, fmt_lsn(acked))


@pytest.mark.promise(7)
def test_disk_full_fails_appends_keeps_serving_and_resumes(safekeeper_factory, tmp_path):
    sk = safekeeper_factory().start()
    ack_log = tmp_path / "acks"
    wp = spawn_proposer(sk, ack_log, "--total", "24M", "--rate", "6M")
    # Some WAL committed, and learnt by the safekeeper, before the disk fills.
    wait_until(lambda: timeline_lsn(sk, "commit_lsn") > START + SEG, "a first MiB committed")
    failpoint(sk, "wal-write-enospc", True)
    wait_until(lambda: "no space left on device" in sk.log(), "an append failing with ENOSPC")
    # Appends fail, the daemon stays up and answers.
    assert sk.proc.poll() is None
    stalled = max_acked(ack_log)
    assert requests.get(f"{sk.http}/v1/status", timeout=5).ok
    t = requests.get(f"{sk.http}/v1/timelines", timeout=5).json()[0]
    assert lsn_int(t["flush_lsn"]) >= stalled
    # What was acknowledged before the disk filled is on it, unchanged.
    ranges, _ = verify_safekeeper(ack_log, sk, hi=stalled)
    assert ranges > 0
    # ... and serves committed WAL to a real reader while the disk is full: the bytes the
    # proposer sent, up to the commit LSN asked for.
    recv = tmp_path / "recv"
    recv.mkdir()
    out = receivewal(sk, recv, "--endpos", before(t["commit_lsn"]))
    assert out.returncode == 0, out.stderr
    ranges, received = verify_received(ack_log, recv, lsn_int(t["commit_lsn"]))
    assert ranges > 0 and received > SEG // 2, (ranges, received, t)
    # Space returns: the proposer's reconnects succeed and it finishes.
    failpoint(sk, "wal-write-enospc", False)
    out, err = wp.communicate(timeout=120)
    assert wp.returncode == 0, err
    assert "no space left on device" in err, "the proposer must have seen the error"
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["commit_lsn"] == stats["end_lsn"]
    t = requests.get(f"{sk.http}/v1/timelines", timeout=5).json()[0]
    assert t["flush_lsn"] == stats["end_lsn"]
    # Every byte acknowledged, before, during and after the full disk, is the one sent.
    assert max_acked(ack_log) == lsn_int(stats["end_lsn"]) > stalled
    ranges, checked = verify_safekeeper(ack_log, sk)
    assert checked == lsn_int(stats["end_lsn"]) - START, (ranges, checked)


def used_ratio(path: Path) -> float:
    """The used fraction of the file system holding `path`, as the daemon (and `df`) count it."""
    st = os.statvfs(path)
    used = st.f_blocks - st.f_bfree
    return used / (used + st.f_bavail)


@pytest.mark.promise(7)
def test_real_full_filesystem_fails_appends_and_recovers_when_space_returns(
    safekeeper_factory, tmp_path
):
    """A real 6 MiB tmpfs fills up under 1 MiB WAL segments; growing it lets ingestion finish."""
    with tmpfs(tmp_path / "small", "6m") as small:
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
        # On the full file system, what was acknowledged is there unchanged.
        ranges, _ = verify_safekeeper(ack_log, sk, SEG, hi=stalled)
        assert ranges > 0
        subprocess.run(["mount", "-o", "remount,size=64m", str(small)], check=True)
        out, err = wp.communicate(timeout=120)
        assert wp.returncode == 0, err
        stats = json.loads(out.strip().splitlines()[-1])
        t = requests.get(f"{sk.http}/v1/timelines", timeout=5).json()[0]
        assert t["flush_lsn"] == stats["end_lsn"]
        assert stalled < lsn_int(t["flush_lsn"]) == max_acked(ack_log)
        ranges, checked = verify_safekeeper(ack_log, sk, SEG)
        assert checked == lsn_int(stats["end_lsn"]) - START, (ranges, checked)
        sk.stop()


def test_disk_usage_ratio_refuses_appends_naming_it_loses_nothing_and_resumes(
    safekeeper_factory, tmp_path
):
    """`--max-disk-usage-ratio` end to end, on a real 16 MiB tmpfs holding the data directory:
    once half of it is used, appends are refused with the limit's documented error (and the
    file system stays near half used); everything acknowledged is there unchanged; when the
    tmpfs grows (space returns) the node logs that appends resume and the push finishes."""
    with tmpfs(tmp_path / "small", "16m") as small:
        sk = safekeeper_factory(extra_args=["--max-disk-usage-ratio", "0.5"])
        sk.datadir = small / "data"
        sk.start()
        size = os.statvfs(small).f_blocks * os.statvfs(small).f_frsize
        ack_log = tmp_path / "acks"
        wp_log = tmp_path / "walproposer.log"
        with open(wp_log, "wb") as err:
            wp = subprocess.Popen(
                [str(RELEASE_DIR / "walproposer"), "--safekeepers", f"127.0.0.1:{sk.pg_port}"]
                + ["--ack-log", str(ack_log), "--wal-seg-size", str(SEG)]
                + ["--total", "24M", "--rate", "4M"],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env={**os.environ, "RUST_LOG": "warn"},
            )
        # The documented error (safekeeper/src/disk_usage.rs).
        limit = "at the limit --max-disk-usage-ratio 0.5 (appends resume once space is freed)"
        documented = re.compile(
            r"the data directory's file system is \d+\.\d% used, " + re.escape(limit)
        )
        try:
            wait_until(
                lambda: limit in sk.log() or wp.poll() is not None,
                "appends refused naming --max-disk-usage-ratio",
            )
            assert wp.poll() is None, wp_log.read_text()
            assert documented.search(sk.log()), sk.log()[-2000:]

            def within_limit() -> int:
                """The WAL held stays at the ratio: at most a prepared segment and an append
                past it (the daemon counts bytes appended since its last measurement)."""
                ratio = used_ratio(small)
                assert ratio < 0.5 + 2 * SEG / size, f"{ratio:.3f} used, the limit is 0.5"
                flush = timeline_lsn(sk, "flush_lsn")
                assert flush - START <= size // 2 + 2 * SEG, fmt_lsn(flush)
                return flush

            flush = within_limit()
            print(f"refused at {used_ratio(small):.3f} used, {(flush - START) >> 10} KiB of WAL")
            # Not refused early: most of the allowed half holds WAL.
            assert flush - START >= 4 * SEG, fmt_lsn(flush)
            # The node serves while it refuses appends, and what it acknowledged is intact.
            assert requests.get(f"{sk.http}/v1/status", timeout=5).ok
            stalled = max_acked(ack_log)
            ranges, checked = verify_safekeeper(ack_log, sk, SEG, hi=stalled)
            assert ranges > 0 and checked == stalled - START, (ranges, checked)
            within_limit()
            # Space returns: the next measurement finds the file system under the ratio.
            subprocess.run(["mount", "-o", "remount,size=64m", str(small)], check=True)
            out, _ = wp.communicate(timeout=120)
            assert wp.returncode == 0, wp_log.read_text()[-2000:]
        finally:
            if wp.poll() is None:
                wp.kill()
                wp.wait()
        assert documented.search(wp_log.read_text()), "the proposer must have been told the limit"
        assert "disk usage back under the limits: appends resume" in sk.log()
        stats = json.loads(out.strip().splitlines()[-1])
        end = lsn_int(stats["end_lsn"])
        assert stats["commit_lsn"] == stats["end_lsn"]
        # Appends resumed: acknowledged past the refusal, every byte as sent.
        assert max_acked(ack_log) == end > stalled
        ranges, checked = verify_safekeeper(ack_log, sk, SEG)
        assert checked == end - START, (ranges, checked)
        sk.stop()


def test_ledger_check_of_segment_files_catches_zeroed_bytes_and_missing_segments(tmp_path):
    """The segment-file checks of fixtures/ledger.py themselves (no daemon): WAL laid out as a
    safekeeper and pg_receivewal write it passes; a zeroed range (what an LSN or size check
    cannot see) and a missing segment fail; a reader's zero padding past its end is not
    compared."""
    wal = os.urandom(3 * SEG + 5000)
    d = tmp_path / "tl"
    d.mkdir()
    for i in range(4):
        name = segment_name(START // SEG + i, SEG) + (".partial" if i == 3 else "")
        piece = wal[i * SEG : (i + 1) * SEG]
        (d / name).write_bytes(piece + bytes(SEG - len(piece)))  # full-size, zero-padded
    lines = [(START, None)]
    for end in (START + 4000, START + SEG + 17, START + 2 * SEG, START + len(wal)):
        digest = hashlib.sha256(wal[lines[-1][0] - START : end - START]).hexdigest()
        lines.append((end, digest))
    ack_log = tmp_path / "acks"
    ack_log.write_text("".join(f"{fmt_lsn(e)} {h or ''}\n" for e, h in lines))
    assert ledger(ack_log) == lines and len(digest_ranges(lines)) == 4
    assert verify(lines, d, SEG) == (4, len(wal))
    # pg_receivewal's output up to 2 segments in: the ranges below, none past.
    assert verify_received(ack_log, d, START + 2 * SEG, SEG) == (3, 2 * SEG)
    # Zeroed bytes inside the last (partial) segment: same sizes, same LSNs, caught.
    partial = d / (segment_name(START // SEG + 3, SEG) + ".partial")
    data = bytearray(partial.read_bytes())
    data[100:200] = bytes(100)
    partial.write_bytes(bytes(data))
    with pytest.raises(AssertionError, match="differs from what was sent"):
        verify(lines, d, SEG)
    assert verify(lines, d, SEG, hi=START + 2 * SEG) == (3, 2 * SEG)
    # A segment gone: named.
    (d / segment_name(START // SEG + 1, SEG)).unlink()
    with pytest.raises(AssertionError, match=segment_name(START // SEG + 1, SEG)):
        verify(lines, d, SEG)
