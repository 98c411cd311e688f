"""PostgreSQL 14 to 18 with real servers of each version (issue 28).

For every major version: a real primary of that version is relayed by `walproposer --source
postgres` to three safekeepers under a write load; a standby of the same version, made with the
low-level backup API and a file copy (no WAL copied), streams from the safekeepers and returns the
primary's count/sum/md5; one safekeeper is killed with SIGKILL mid-load and restarted; a segment
switch (`pg_switch_wal()`) is relayed; the safekeepers' segments decode record by record with our
decoder (`wal-verify`: the version's page magic and every record's CRC-32C) and equal the
primary's bytes where the primary still has them. Readers are told the timeline's version.

PostgreSQL 15 comes from Debian; the other versions from `scripts/install-postgres` (CI installs
them; a test never downloads). PG15 keeps its fuller suite in test_postgres_e2e.py
(pg_receivewal, pg_waldump, pg_basebackup)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time

import pytest

from fixtures.daemon import RELEASE_DIR, fmt_lsn, lsn_int
from fixtures.pg import PgCluster, WalProposerRelay
from fixtures.pgwire import read_message, startup_packet
from fixtures.tools import PG_MAJORS
from test_postgres_e2e import SEG, segment_name, timeline, wait_committed

CHECKS = [
    "SELECT count(*), sum(id), md5(string_agg(id || ':' || v, ',' ORDER BY id)) FROM known",
    "SELECT count(*), sum(bal), md5(string_agg(id || ':' || bal, ',' ORDER BY id)) FROM acct",
]
# Commits timed for the figures (each waits for the quorum through synchronous replication).
COMMITS = 200


def reported_server_version(port: int) -> str:
    """The `server_version` a replication client is told at startup."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(10)
    try:
        s.sendall(startup_packet("user", "postgres", "replication", "true"))
        while True:
            tag, body = read_message(s)
            assert tag != b"E", body
            if tag == b"S":
                name, value = body.rstrip(b"\0").split(b"\0")
                if name == b"server_version":
                    return value.decode()
            assert tag != b"Z", "no server_version before ReadyForQuery"
    finally:
        s.close()


def wal_verify(tl_dir, start: int, end: int) -> dict:
    out = subprocess.run(
        [str(RELEASE_DIR / "wal-verify"), str(tl_dir), "--from", fmt_lsn(start)]
        + ["--to", fmt_lsn(end)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def same_results(primary: PgCluster, standby: PgCluster) -> None:
    for q in CHECKS:
        assert standby.psql(q) == primary.psql(q), q


@pytest.mark.parametrize("major", PG_MAJORS)
def test_primary_of_each_major_version_relayed_to_a_standby_of_that_version(
    major, safekeeper_factory, pg_factory, tmp_path
):
    # wal_keep_size: the primary keeps its segments, to compare the safekeepers' with.
    primary = (
        pg_factory("primary", major).init(wal_sender_timeout="'3s'", wal_keep_size="'1GB'").start()
    )
    version_num = int(primary.psql("SHOW server_version_num"))
    assert version_num // 10000 == major
    primary.psql("CREATE TABLE known (id int PRIMARY KEY, v text)")
    primary.psql("CREATE TABLE acct (id int PRIMARY KEY, bal bigint)")
    primary.psql("INSERT INTO acct SELECT g, 0 FROM generate_series(1, 1000) g")
    primary.psql("INSERT INTO known SELECT g, 'row ' || g FROM generate_series(1, 1000) g")

    sks = [safekeeper_factory(i).start() for i in (1, 2, 3)]
    relay = WalProposerRelay(sks, primary, "wp_slot", tmp_path)
    figures: dict = {"major": major, "server_version_num": version_num}
    try:
        tl = wait_committed(sks[0], primary.current_lsn(), relay)
        start = lsn_int(tl["local_start_lsn"])
        assert start % SEG == 0, tl
        assert tl["pg_version"] == version_num, tl
        assert (
            primary.psql(
                "SELECT slot_type, active FROM pg_replication_slots WHERE slot_name = 'wp_slot'"
            )
            == "physical|t"
        )
        # A reader is told the timeline's version, as the primary would tell it.
        v = reported_server_version(sks[0].pg_port)
        assert v.split(" ")[0] == f"{major}.{version_num % 10000}", v

        standby = pg_factory("standby", major).lowlevel_backup_from(primary, sks[0].pg_port)
        assert standby.backup_start_lsn() >= start
        standby.start()

        # A write load; one safekeeper dies with SIGKILL in the middle of it and comes back.
        stop = threading.Event()
        batches: list[int] = []
        failures: list[BaseException] = []

        def load() -> None:
            i = 0
            try:
                while not stop.is_set():
                    i += 1
                    lo = 1000 + i * 100
                    primary.psql(
                        f"INSERT INTO known SELECT g, 'load {i} ' || g "
                        f"FROM generate_series({lo + 1}, {lo + 100}) g; "
                        f"UPDATE acct SET bal = bal + {i} WHERE id % 7 = {i % 7}"
                    )
                    batches.append(i)
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                failures.append(e)

        writer = threading.Thread(target=load, daemon=True)
        writer.start()
        deadline = time.monotonic() + 30
        while len(batches) < 20 and time.monotonic() < deadline and not failures:
            time.sleep(0.05)
        sks[2].kill()
        killed_at = len(batches)
        while len(batches) < killed_at + 20 and time.monotonic() < deadline and not failures:
            time.sleep(0.05)
        sks[2].start()
        time.sleep(1)
        stop.set()
        writer.join(timeout=60)
        assert not failures, failures
        assert len(batches) >= killed_at + 20, f"the load stalled after the kill: {batches[-1:]}"

        # A segment switch, then a row in the next segment.
        switched = lsn_int(primary.psql("SELECT pg_switch_wal()"))
        primary.psql("INSERT INTO known VALUES (0, 'after the switch')")
        target = primary.current_lsn()
        assert target // SEG > switched // SEG
        for sk in sks:
            wait_committed(sk, target, relay)
        standby.wait_replayed(target)
        same_results(primary, standby)
        assert standby.psql("SELECT v FROM known WHERE id = 0") == "after the switch"

        # Figures: a bulk load relayed (MB/s until the quorum committed it), then commits that
        # each wait for the quorum (synchronous replication to the relay).
        lsn0, t0 = primary.current_lsn(), time.monotonic()
        primary.psql(
            "INSERT INTO known SELECT g, repeat('x', 200) FROM generate_series(-200000, -1) g"
        )
        lsn1 = primary.current_lsn()
        wait_committed(sks[0], lsn1, relay)
        figures["relay_mb_s"] = round((lsn1 - lsn0) / 1e6 / (time.monotonic() - t0), 2)
        primary.psql("ALTER SYSTEM SET synchronous_standby_names = 'walproposer'")
        primary.psql("SELECT pg_reload_conf()")
        time.sleep(0.5)
        script = "".join(f"INSERT INTO acct VALUES ({2000 + i}, {i});\n" for i in range(COMMITS))
        t0 = time.monotonic()
        out = subprocess.run(
            [primary.psql_exe, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1"]
            + ["-p", str(primary.port), "-U", "postgres", "-d", "postgres"],
            input=script,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        figures["sync_commit_mean_us"] = round((time.monotonic() - t0) / COMMITS * 1e6)
        sync = primary.psql(
            "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'walproposer'"
        )
        assert sync == "sync", sync
        primary.psql("ALTER SYSTEM RESET synchronous_standby_names")
        primary.psql("SELECT pg_reload_conf()")
        target = primary.current_lsn()
        standby.wait_replayed(target)
        same_results(primary, standby)
        end = lsn_int(timeline(sks[0])["commit_lsn"])

        final = json.loads(relay.stop().splitlines()[-1])
        assert lsn_int(final["commit_lsn"]) >= target
    finally:
        relay.kill()

    # Every safekeeper's WAL decodes record by record with the version's magic and CRCs, and
    # the segments the primary still has are byte-identical to its own.
    for sk in sks:
        assert sk.stop() == 0
    primary.stop()
    records = set()
    for sk in sks:
        tl_dir = next(sk.datadir.glob("*/*/safekeeper.control")).parent
        got = wal_verify(tl_dir, start, end)
        assert got["major"] == major and got["pg_version"] == version_num, got
        assert got["records"] > 1000, got
        records.add(got["records"])
        compared = 0
        for seg in sorted(tl_dir.glob("0000000100000000000000??")):
            theirs = primary.datadir / "pg_wal" / seg.name
            if theirs.exists():
                assert seg.read_bytes() == theirs.read_bytes(), (sk.node_id, seg.name)
                compared += 1
        # At least every segment up to the switched one is complete on the safekeepers.
        assert compared >= switched // SEG - start // SEG + 1, (sk.node_id, compared)
        figures[f"sk{sk.node_id}_segments_equal_to_primary"] = compared
    assert len(records) == 1, records
    figures["records_decoded"] = records.pop()
    figures["switched_segment"] = segment_name(switched)
    print("\nFIGURES " + json.dumps(figures))
    # scripts/bench-report collects them from one run of every version.
    if os.environ.get("PG_VERSIONS_FIGURES"):
        with open(os.environ["PG_VERSIONS_FIGURES"], "a") as f:
            f.write(json.dumps(figures) + "\n")


def test_an_unsupported_or_mixed_version_is_refused(safekeeper):
    """The walproposer refuses to run as PostgreSQL 13 naming the supported range (the
    safekeeper's own refusal of such a greeting is tested in sk_core and the registry); a
    timeline of 17 refuses a proposer of 16 at every greeting, and keeps its version."""
    wp = RELEASE_DIR / "walproposer"

    def push(pg_version: int, timeout: float = 60) -> tuple[int | None, str]:
        args = [str(wp), "--safekeepers", f"127.0.0.1:{safekeeper.pg_port}", "--total", "64K"]
        try:
            out = subprocess.run(
                [*args, "--pg-version", str(pg_version)],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            return out.returncode, out.stderr
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr
            return None, err or ""

    code, err = push(130020)
    assert code == 1, err
    assert "PostgreSQL version 130020 is not supported" in err and "14 to 18" in err, err
    assert not list(safekeeper.datadir.glob("*/*/safekeeper.control"))

    code, err = push(170010)
    assert code == 0, err
    assert timeline(safekeeper)["pg_version"] == 170010
    assert reported_server_version(safekeeper.pg_port).startswith("17.10 ")
    # Refused at each attempt, so the proposer retries until it is stopped.
    code, err = push(160014, timeout=6)
    assert code is None, err
    assert "mixed major versions within a timeline are refused" in err, err
    assert timeline(safekeeper)["pg_version"] == 170010


# Fills the current segment until less than two pages are left (PostgreSQL's own
# 026_overwrite_contrecord test does the same), so the next large record crosses into the next.
FILL_SEGMENT = """DO $$
DECLARE
    seg int := setting::int FROM pg_settings WHERE name = 'wal_segment_size';
BEGIN
    LOOP
        INSERT INTO filler SELECT g, 'filler' FROM generate_series(1, 10) g;
        EXIT WHEN seg - (pg_current_wal_insert_lsn() - '0/0') % seg < 2 * 8192;
    END LOOP;
END
$$"""


@pytest.mark.parametrize("major", PG_MAJORS)
def test_a_record_abandoned_by_a_crashed_primary_is_relayed_and_overwritten(
    major, safekeeper_factory, pg_factory, tmp_path
):
    """A primary crashes with a large record half on disk: its first part in one segment, the
    segment holding the rest lost. Restarted, the primary abandons the record and writes the
    page where it would have continued with XLP_FIRST_IS_OVERWRITE_CONTRECORD. The relay, which
    had not seen the record, streams both: the safekeepers accept the WAL, commit what follows,
    and hold exactly the primary's segments, which decode record by record."""
    primary = pg_factory("primary", major).init(wal_keep_size="'1GB'").start()
    primary.psql("CREATE TABLE filler (a int, b text)")
    sks = [safekeeper_factory(i).start() for i in (1, 2, 3)]
    relay = WalProposerRelay(sks, primary, "wp_slot", tmp_path)
    try:
        start = lsn_int(wait_committed(sks[0], primary.current_lsn(), relay)["local_start_lsn"])
        relay.stop()

        primary.psql(FILL_SEGMENT)
        first = primary.psql("SELECT pg_walfile_name(pg_current_wal_insert_lsn())")
        primary.psql("SELECT pg_logical_emit_message(true, 'abandoned', repeat('xyzxz', 123456))")
        lost = primary.psql("SELECT pg_walfile_name(pg_current_wal_insert_lsn())")
        assert first != lost
        primary.stop("immediate")
        (primary.datadir / "pg_wal" / lost).unlink()
        primary.start()
        primary.psql("CREATE TABLE after_crash AS SELECT 'hello' AS v")
        head = (primary.datadir / "pg_wal" / lost).read_bytes()[:4]
        assert int.from_bytes(head[2:4], "little") & 0x0008, "XLP_FIRST_IS_OVERWRITE_CONTRECORD"

        relay = WalProposerRelay(sks, primary, "wp_slot", tmp_path)
        target = primary.current_lsn()
        for sk in sks:
            wait_committed(sk, target, relay)
        end = lsn_int(timeline(sks[0])["commit_lsn"])
        relay.stop()
    finally:
        relay.kill()
    for sk in sks:
        assert sk.stop() == 0
    primary.stop()
    for sk in sks:
        tl_dir = next(sk.datadir.glob("*/*/safekeeper.control")).parent
        assert wal_verify(tl_dir, start, end)["records"] > 0
        for name in (first, lost):
            ours = tl_dir / name
            # A segment still being written ends with the committed WAL: compare up to there.
            upto = SEG
            if not ours.exists():
                ours, upto = tl_dir / f"{name}.partial", (end % SEG) or SEG
            theirs = (primary.datadir / "pg_wal" / name).read_bytes()
            assert ours.read_bytes()[:upto] == theirs[:upto], (sk.node_id, name)
