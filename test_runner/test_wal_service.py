"""The WAL service with real PostgreSQL 15 clients: WAL pushed by our walproposer is served to
real `pg_receivewal`, whose segments must equal the safekeeper's byte for byte and decode with
real `pg_waldump`."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import requests

from fixtures.daemon import lsn_int, read_wal, timeline_dir, walproposer
from fixtures.tools import before, receivewal, require, require_pg_tool

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
