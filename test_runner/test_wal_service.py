"""The WAL service with real PostgreSQL 15 clients: WAL pushed by our walproposer is served to
real `pg_receivewal`, whose segments must equal the safekeeper's byte for byte and decode with
real `pg_waldump`."""

from __future__ import annotations

import os
import re
import shutil
import signal
import struct
import subprocess
import time

import pytest
import requests

from fixtures.daemon import (
    RELEASE_DIR,
    TENANT,
    TIMELINE,
    fmt_lsn,
    lsn_int,
    metric,
    read_wal,
    timeline_dir,
    wait_until,
    walproposer,
)
from fixtures.pgwire import connect, query, read_message
from fixtures.tools import before, receivewal, require, require_pg_tool, tmpfs

SEG = 16 << 20


def waldump_count(directory, start: str, end: str) -> int:
    """Records pg_waldump decodes in [start, end); fails on any decoding error."""
    exe = require_pg_tool("pg_waldump")
    out = subprocess.run(
        [exe, "--stats", "-p", str(directory), "-s", start, "-e", end],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "error" not in out.stderr.lower(), out.stderr
    m = re.search(r"^LogicalMessage\s+(\d+)", out.stdout, re.M)
    assert m, out.stdout
    return int(m.group(1))


def test_pg_receivewal_with_slot_gets_byte_identical_segments(safekeeper, tmp_path):
    stats = walproposer([safekeeper], "--total", "40M", "--record-size", "1000")
    start, end = stats["start_lsn"], stats["commit_lsn"]
    assert stats["end_lsn"] == end
    recv = tmp_path / "recv"
    recv.mkdir()
    out = receivewal(safekeeper, recv, "--slot", "s1", "--endpos", before(end))
    assert out.returncode == 0, out.stderr
    assert f"starting log streaming at {start}" in out.stderr

    # Completed segments equal the safekeeper's; the partial one up to the end position.
    full = sorted(p for p in recv.iterdir() if not p.name.endswith(".partial"))
    assert len(full) >= 2, list(recv.iterdir())
    for seg in full:
        assert seg.read_bytes() == (timeline_dir(safekeeper) / seg.name).read_bytes(), seg.name
    partial = next(recv.glob("*.partial"))
    seg_start = lsn_int(end) - lsn_int(end) % SEG
    got = partial.read_bytes()[: lsn_int(end) - seg_start]
    assert got == read_wal(safekeeper, seg_start, lsn_int(end))

    # Real pg_waldump decodes every record the proposer generated.
    dump = tmp_path / "dump"
    dump.mkdir()
    for p in recv.iterdir():
        shutil.copy(p, dump / p.name.removesuffix(".partial"))
    assert waldump_count(dump, start, end) == stats["records"]


def test_pg_receivewal_without_slot_starts_at_the_current_segment(safekeeper, tmp_path):
    stats = walproposer([safekeeper], "--total", "20M")
    end = stats["commit_lsn"]
    recv = tmp_path / "recv"
    recv.mkdir()
    out = receivewal(safekeeper, recv, "--endpos", before(end))
    assert out.returncode == 0, out.stderr
    seg_start = lsn_int(end) - lsn_int(end) % SEG
    assert f"starting log streaming at 0/{seg_start:X}" in out.stderr
    (partial,) = recv.glob("*.partial")
    assert partial.read_bytes()[: lsn_int(end) - seg_start] == read_wal(
        safekeeper, seg_start, lsn_int(end)
    )


@pytest.mark.promise(3)
def test_reader_asking_for_wal_ahead_of_commit_gets_postgres_error(safekeeper, tmp_path):
    walproposer([safekeeper], "--total", "1M")
    exe = require("pg_receivewal", "postgresql-client-15")
    # A directory holding a far-ahead segment makes pg_receivewal resume there.
    recv = tmp_path / "recv"
    recv.mkdir()
    (recv / "000000010000000000000009.partial").write_bytes(b"\0" * SEG)
    out = subprocess.run(
        [exe, "-D", str(recv), "-h", "127.0.0.1", "-p", str(safekeeper.pg_port)]
        + ["-U", "postgres", "--no-loop"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "is ahead of the WAL flush position of this server" in out.stderr, out.stderr


def test_timeline_status_and_metrics_after_ingest(safekeeper):
    stats = walproposer([safekeeper], "--total", "8M")
    tls = requests.get(f"{safekeeper.http}/v1/timelines", timeout=5).json()
    assert len(tls) == 1
    assert tls[0]["flush_lsn"] == stats["end_lsn"]
    assert tls[0]["commit_lsn"] == stats["commit_lsn"]
    assert tls[0]["term"] == 1
    text = requests.get(f"{safekeeper.http}/metrics", timeout=5).text
    written = re.search(r"^safekeeper_wal_written_bytes_total (\d+)", text, re.M)
    assert written and int(written.group(1)) >= 8 << 20
    flushes = re.search(r"^safekeeper_wal_flushes_total (\d+)", text, re.M)
    assert flushes and int(flushes.group(1)) > 0
    assert re.search(r'^safekeeper_flush_lsn\{tenant_id="[0-9a-f]+",timeline_id', text, re.M)
    appends = re.search(
        r'^safekeeper_proposer_acceptor_messages_total\{kind="append",outcome="ok"\} (\d+)',
        text,
        re.M,
    )
    assert appends and int(appends.group(1)) > 0, text


def tl_status(sk) -> dict:
    r = requests.get(f"{sk.http}/v1/tenant/{TENANT}/timeline/{TIMELINE}", timeout=10)
    r.raise_for_status()
    return r.json()


def flush_ahead_of_commit(safekeeper_factory) -> tuple:
    """Three safekeepers and a paced walproposer; once WAL is committed, two of them are
    frozen (SIGSTOP), so the proposer's commit stops while the third goes on flushing what it
    is sent; then the proposer and the frozen two are killed. Returns (the third, its
    commit_lsn, its flush_lsn), flush at least 1 MiB past commit, neither moving any more."""
    sks = [safekeeper_factory(i).start() for i in (1, 2, 3)]
    wp = subprocess.Popen(
        [str(RELEASE_DIR / "walproposer"), "--safekeepers"]
        + [",".join(f"127.0.0.1:{sk.pg_port}" for sk in sks)]
        + ["--total", "64M", "--rate", "8M", "--record-size", "1000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "RUST_LOG": "warn"},
    )
    try:
        third = sks[2]

        def positions() -> tuple[int, int]:
            st = tl_status(third)
            return lsn_int(st["commit_lsn"]), lsn_int(st["flush_lsn"])

        def committed() -> bool:
            try:
                return positions()[0] > 0x1000000 + (1 << 20)
            except requests.HTTPError:
                return False  # the proposer has not created the timeline there yet

        wait_until(committed, "1 MiB committed on the third safekeeper")
        for sk in sks[:2]:
            sk.proc.send_signal(signal.SIGSTOP)
        wait_until(
            lambda: positions()[1] > positions()[0] + (2 << 20),
            "the third safekeeper's flush_lsn 2 MiB ahead of its commit_lsn",
        )
        assert wp.poll() is None, "the walproposer ended"
    finally:
        wp.kill()
        wp.wait()
    for sk in sks[:2]:
        sk.kill()
    # The last messages the proposer sent are processed: the positions stand still.
    prev = [positions()]

    def still() -> bool:
        now = positions()
        same = now == prev[0]
        prev[0] = now
        return same

    wait_until(still, "the third safekeeper's positions to stand still", interval=0.3)
    commit, flush = prev[0]
    assert flush > commit + (1 << 20), (fmt_lsn(commit), fmt_lsn(flush))
    return third, commit, flush


def stream_until_idle(port: int, start: int, commit: int) -> tuple[bytes, int, set[int]]:
    """A raw replication stream from `start`: reads XLogData until it has `commit`, then asks
    for a reply (a status update with the reply flag) and reads on until a keepalive answers
    after it. The walsender sends every WAL byte it has before it looks at the client again
    (its loop sends the next chunk as long as one is due), so anything it would serve past
    `commit` arrives before that keepalive. Returns the bytes received, where they end, and
    every wal_end the server reported (XLogData and keepalives)."""
    s = connect(port)
    assert not isinstance(s, dict), s
    try:
        tag, body = query(s, f"START_REPLICATION PHYSICAL {fmt_lsn(start)}")
        assert tag == b"W", body
        data = bytearray()
        pos = start
        ends: set[int] = set()
        asked = False
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, f"stream stuck at {fmt_lsn(pos)}"
            tag, body = read_message(s)
            assert tag == b"d", (tag, body[:200])
            if body[:1] == b"w":
                wal_start, wal_end = struct.unpack("!QQ", body[1:17])
                assert wal_start == pos, (fmt_lsn(wal_start), fmt_lsn(pos))
                ends.add(wal_end)
                data += body[25:]
                pos += len(body) - 25
            elif body[:1] == b"k":
                ends.add(struct.unpack("!Q", body[1:9])[0])
                if asked:
                    return bytes(data), pos, ends
            if pos >= commit and not asked:
                update = b"r" + struct.pack("!QQQqB", pos, pos, 0, 0, 1)
                s.sendall(b"d" + struct.pack("!I", 4 + len(update)) + update)
                asked = True
    finally:
        s.close()


@pytest.mark.promise(3)
def test_plain_readers_get_committed_wal_only_while_flush_is_ahead_of_commit(
    safekeeper_factory, tmp_path
):
    """A safekeeper whose flush_lsn is past its commit_lsn (the proposer lost its quorum and
    died): the WAL past commit is on its disk, and neither a real pg_receivewal nor a raw
    replication client is sent a byte of it (`send_wal.rs`'s `end_of`: a plain reader's end is
    commit_lsn). Served up to flush_lsn, a standby would apply WAL a later election may
    truncate."""
    sk, commit, flush = flush_ahead_of_commit(safekeeper_factory)
    start = lsn_int(tl_status(sk)["timeline_start_lsn"])
    on_disk = read_wal(sk, start, flush)
    # The WAL past commit exists on the node's disk (generated records, not zeros).
    assert on_disk[commit - start :].strip(b"\0"), "no WAL past commit on disk"

    # A real pg_receivewal from the timeline's start, asked to stop at the flush LSN: it gets
    # everything up to commit (identical to the disk), and never reaches the flush LSN.
    exe = require("pg_receivewal", "postgresql-client-15")
    recv = tmp_path / "recv"
    recv.mkdir()
    rw = subprocess.Popen(
        [exe, "-D", str(recv), "-h", "127.0.0.1", "-p", str(sk.pg_port), "-U", "postgres"]
        + ["--no-loop", "--no-password", "--slot", "s1", "--endpos", before(fmt_lsn(flush))]
        + ["--status-interval", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    seg_start = commit - commit % SEG
    per = 2**32 // SEG
    partial = recv / f"{1:08X}{seg_start // SEG // per:08X}{seg_start // SEG % per:08X}.partial"

    def received_to_commit() -> bool:
        # Exit 0: it reached its --endpos, the flush LSN: it was served past commit.
        assert rw.poll() is None, (
            f"pg_receivewal ended (exit {rw.returncode}; 0: at its --endpos, the flush LSN) "
            f"instead of waiting at commit {fmt_lsn(commit)}: "
            f"{rw.stderr.read().decode(errors='replace')}"
        )
        if not partial.exists():
            return False
        with open(partial, "rb") as f:
            got = f.read(commit - seg_start)
        return got == on_disk[seg_start - start : commit - start]

    try:
        wait_until(received_to_commit, "pg_receivewal to receive the WAL up to commit_lsn")
        # The deterministic check: a raw stream gets exactly [start, commit) and the server
        # reports commit as its end (XLogData and keepalives alike).
        data, end, ends = stream_until_idle(sk.pg_port, start, commit)
        assert end == commit, f"served up to {fmt_lsn(end)}, commit_lsn {fmt_lsn(commit)}"
        assert data == on_disk[: commit - start]
        assert ends == {commit}, sorted(map(fmt_lsn, ends))
        # pg_receivewal, streaming all along, got nothing past commit either.
        assert rw.poll() is None, "pg_receivewal reached the flush LSN (its --endpos)"
    finally:
        rw.terminate()
        rw.wait(timeout=30)
    with open(partial, "rb") as f:
        past = f.read()[commit - seg_start :]
    assert not past.strip(b"\0"), "pg_receivewal received WAL past commit_lsn"
    later = [p.name for p in recv.iterdir() if p.name[:24] > partial.name[:24]]
    assert not later, later
    # The node's positions did not move meanwhile.
    st = tl_status(sk)
    assert (lsn_int(st["commit_lsn"]), lsn_int(st["flush_lsn"])) == (commit, flush)


@pytest.mark.promise(2)
def test_segments_from_the_node_pool_serve_real_readers(safekeeper_factory, tmp_path):
    """The node's pool of zero-filled segments (`--prepared-segments`): filled while the node
    is quiet, a timeline's new segments come from it, real pg_receivewal gets byte-identical
    segments and real pg_waldump decodes them; the pool refills once the node is quiet again,
    and a restart keeps its whole segments and drops a half-written one.

    The data directory is a real 256 MiB tmpfs: the pool writes nothing that would take its
    file system past 90 %, so on the host's disk the test would pass or fail with how full that
    disk is (a CI machine at 90 % once left the pool unrefilled)."""
    with tmpfs(tmp_path / "sk1", "256m"):
        pool_serves_readers(safekeeper_factory, tmp_path)


def pool_serves_readers(safekeeper_factory, tmp_path):
    sk = safekeeper_factory(extra_args=["--prepared-segments", "2"]).start()
    pool = sk.datadir / "segment_pool"

    def ready() -> float:
        return metric(sk, r"safekeeper_prepared_segments ")

    wait_until(lambda: ready() == 2, "the pool filled")
    assert sorted(p.stat().st_size for p in pool.iterdir()) == [SEG, SEG]
    stats = walproposer([sk], "--total", "20M", "--record-size", "1000")
    start, end = stats["start_lsn"], stats["commit_lsn"]
    assert metric(sk, r"safekeeper_prepared_segments_used_total") == 2
    # Both of the timeline's segments came from the pool: allocated throughout.
    segs = sorted(timeline_dir(sk).glob("0000*"))
    assert len(segs) == 2, segs
    for s in segs:
        assert s.stat().st_blocks * 512 >= SEG, s
    wait_until(lambda: ready() == 2, "the pool refilled once the node was quiet")

    recv = tmp_path / "recv"
    recv.mkdir()
    out = receivewal(sk, recv, "--slot", "s1", "--endpos", before(end))
    assert out.returncode == 0, out.stderr
    (full,) = (p for p in recv.iterdir() if not p.name.endswith(".partial"))
    assert full.read_bytes() == (timeline_dir(sk) / full.name).read_bytes()
    dump = tmp_path / "dump"
    dump.mkdir()
    for p in recv.iterdir():
        shutil.copy(p, dump / p.name.removesuffix(".partial"))
    assert waldump_count(dump, start, end) == stats["records"]

    # A restart keeps the whole segments; a half-written one and a short one go.
    assert sk.stop() == 0
    (pool / "prepared.tmp").write_bytes(b"\0" * 4096)
    (pool / "prepared-99").write_bytes(b"\0" * 4096)
    sk.start()
    assert ready() == 2
    assert all(p.stat().st_size == SEG for p in pool.iterdir())
    assert not (pool / "prepared.tmp").exists() and not (pool / "prepared-99").exists()
    assert sk.stop() == 0
