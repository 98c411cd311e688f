"""Eviction of idle timelines (issue 30): a timeline idle for --eviction-min-idle whose WAL is
wholly in remote storage keeps only its control file locally, and is restored on demand by a
proposer, a reader from its start, or a pull. Every test runs on `file://` and on a real S3
server (moto)."""

from __future__ import annotations

import time

import pytest
import requests

import test_wal_lifecycle
from fixtures.daemon import TENANT, TIMELINE, lsn_int, metric, timeline_dir, wait_until
from fixtures.ledger import ledger, verify
from fixtures.tools import before, receivewal
from test_wal_lifecycle import SEG, partials, push, seg_name, start_sks, status

# The `file://` and S3 (moto) store of the lifecycle tests: every test here runs on both.
store = test_wal_lifecycle.store

EVICT = ("--partial-backup-timeout", "1s", "--eviction-min-idle", "2s")


def evicted(sk) -> bool:
    return bool(status(sk).get("evicted"))


def local_files(sk) -> list[str]:
    return sorted(p.name for p in timeline_dir(sk).iterdir())


def wait_evicted(sks, timeout: float = 60) -> None:
    for sk in sks:
        wait_until(lambda sk=sk: evicted(sk), f"sk{sk.node_id} to evict the timeline", timeout)
        assert local_files(sk) == ["safekeeper.control"], local_files(sk)


@pytest.mark.promise(15)
def test_an_evicted_timeline_serves_a_reader_a_proposer_and_a_pull(
    safekeeper_factory, store, tmp_path
):
    """An idle timeline whose WAL is stored (complete segments and a partial one) is evicted on
    every node: only its control file stays. A pg_receivewal from its start, a new proposer and
    a pull each bring it back, and nothing acknowledged is lost."""
    sks = start_sks(safekeeper_factory, store, [0] * 3, extra=EVICT)
    ack_log = tmp_path / "acks"
    stats = push(sks, total=str(2 * SEG + 300_000), ack_log=ack_log)
    start, end = lsn_int(stats["start_lsn"]), lsn_int(stats["commit_lsn"])
    assert end % SEG != 0, stats
    wait_evicted(sks)
    for sk in sks:
        st = status(sk)
        assert lsn_int(st["flush_lsn"]) == end and lsn_int(st["commit_lsn"]) == end, st
        assert metric(sk, r'safekeeper_timelines\{state="evicted"\}') == 1
        assert metric(sk, r'safekeeper_evictions_total\{outcome="done"\}') >= 1
        assert metric(sk, r'safekeeper_wal_bytes\{location="local"\}') == 0
        assert metric(sk, r'safekeeper_wal_bytes\{location="remote"\}') == end - start
    ids = requests.get(f"{sks[0].http}/v1/tenant/timeline", timeout=5).json()
    assert ids == [{"tenant_id": TENANT, "timeline_id": TIMELINE}], ids
    # What was acknowledged is in the store: complete segments, and the last one partially.
    objs = store.objects()
    tail = partials(store)[end][1]
    objs[seg_name(end // SEG)] = tail
    ranges, checked = verify(ledger(ack_log), objs, SEG, lo=start, hi=end)
    assert ranges > 0 and checked > 0

    # A reader from the timeline's start restores it (sk1), byte-identical to the store.
    recv = tmp_path / "recv"
    recv.mkdir()
    t0 = time.monotonic()
    out = receivewal(sks[0], recv, "--slot", "s1", "--endpos", before(stats["commit_lsn"]))
    assert out.returncode == 0, out.stderr
    print(f"pg_receivewal of the evicted timeline: {time.monotonic() - t0:.2f} s")
    assert not evicted(sks[0])
    for n in range(start // SEG, end // SEG):
        assert (recv / seg_name(n)).read_bytes() == objs[seg_name(n)], seg_name(n)
    got = (recv / (seg_name(end // SEG) + ".partial")).read_bytes()
    assert got[: len(tail)] == tail

    # A new proposer (its greeting) restores the others and goes on from the end.
    stats2 = push(sks, total="200000", ack_log=ack_log)
    end2 = lsn_int(stats2["commit_lsn"])
    assert lsn_int(stats2["start_lsn"]) >= end and end2 > end, stats2
    for sk in sks:
        assert metric(sk, r'safekeeper_restores_total\{outcome="ok"\}') >= 1
        assert not evicted(sk) or lsn_int(status(sk)["flush_lsn"]) == end2

    # Evicted again; a pull onto a new node restores a donor for its snapshot.
    wait_evicted(sks[1:])
    sk4 = safekeeper_factory(
        4, extra_args=["--remote-storage", store.url, "--wal-keep-size", "0"], env=store.env
    ).start()
    body = {
        "tenant_id": TENANT,
        "timeline_id": TIMELINE,
        "http_hosts": [f"127.0.0.1:{sk.http_port}" for sk in sks[1:]],
    }
    r = requests.post(f"{sk4.http}/v1/pull_timeline", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert lsn_int(r.json()["flush_lsn"]) == end2, r.json()
    assert lsn_int(status(sk4)["flush_lsn"]) == end2
    # The pulled copy serves the whole timeline (the early WAL from the store).
    recv4 = tmp_path / "recv4"
    recv4.mkdir()
    out = receivewal(sk4, recv4, "--slot", "s4", "--endpos", before(stats2["commit_lsn"]))
    assert out.returncode == 0, out.stderr
    lines = ledger(ack_log)
    ranges, checked = verify(lines, [recv4], SEG, lo=start, hi=end2)
    assert ranges > 1 and checked > 2 * SEG, (ranges, checked)
    restore_ms = [
        1000
        * metric(sk, r"safekeeper_eviction_seconds_sum\{op=\"restore\"\}")
        / max(1, metric(sk, r"safekeeper_eviction_seconds_count\{op=\"restore\"\}"))
        for sk in sks
    ]
    print(f"mean restore per node, ms: {[round(x, 1) for x in restore_ms]}")


@pytest.mark.promise(15)
def test_a_restore_during_a_store_outage_fails_clearly_and_is_retried(
    safekeeper_factory, store, tmp_path
):
    """A reader of an evicted timeline during a store outage gets an error that says the
    restore failed and the timeline stays evicted; the status still answers; once the store is
    back the next reader is served. A kill -9 while evicted loses nothing: the node starts with
    the timeline evicted, without opening its WAL."""
    sks = start_sks(safekeeper_factory, store, [0], extra=EVICT)
    ack_log = tmp_path / "acks"
    stats = push(sks, total=str(SEG + 500_000), ack_log=ack_log)
    end = lsn_int(stats["commit_lsn"])
    wait_evicted(sks)
    sk = sks[0]
    sk.kill()
    sk.start()
    assert evicted(sk) and local_files(sk) == ["safekeeper.control"]
    back = store.outage()
    try:
        recv = tmp_path / "recv"
        recv.mkdir()
        out = receivewal(sk, recv, "--slot", "s1", "--endpos", before(stats["commit_lsn"]))
        assert out.returncode != 0
        assert "restoring evicted timeline" in out.stderr, out.stderr
        assert evicted(sk)
        assert lsn_int(status(sk)["flush_lsn"]) == end
        assert metric(sk, r'safekeeper_restores_total\{outcome="error"\}') >= 1
    finally:
        back()
    recv = tmp_path / "recv2"
    recv.mkdir()
    out = receivewal(sk, recv, "--slot", "s2", "--endpos", before(stats["commit_lsn"]))
    assert out.returncode == 0, out.stderr
    assert not evicted(sk)
    objs = store.objects()
    ranges, _ = verify(ledger(ack_log), [recv, objs], SEG, hi=end)
    assert ranges > 0
