"""Real PostgreSQL end to end: a real PG15 primary relayed by `walproposer --source postgres` into
three safekeepers; a real PG15 hot standby (base backup taken with `-X none`, so every WAL byte it
replays came from a safekeeper) streams from one safekeeper, then from another after the first
stops; real `pg_receivewal` from a safekeeper gets segments byte-identical to the primary's.
WAL whose last record is a `pg_switch_wal()` survives safekeeper restarts (issue 13)."""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import threading
import time

import pytest
import requests

from fixtures.daemon import fmt_lsn, lsn_int, read_wal, wait_until
from fixtures.pg import PgCluster, WalProposerRelay
from fixtures.tools import require, require_pg_tool
from test_node_replacement import Cluster

SEG = 16 << 20
# Bigger values for the note's measurements; the defaults keep the test short.
SCALE = os.environ.get("E2E_PGBENCH_SCALE", "1")
SECONDS = os.environ.get("E2E_PGBENCH_SECONDS", "3")

# What the standby must return exactly as the primary does.
CHECKS = [
    "SELECT count(*), sum(id), md5(string_agg(id || ':' || v, ',' ORDER BY id)) FROM known",
    "SELECT count(*), sum(abalance), md5(string_agg(aid || ':' || abalance, ',' ORDER BY aid))"
    " FROM pgbench_accounts",
    "SELECT count(*), sum(bbalance) FROM pgbench_branches",
    "SELECT count(*), sum(tbalance) FROM pgbench_tellers",
    "SELECT count(*), sum(delta) FROM pgbench_history",
]


def timeline(sk) -> dict:
    tls = requests.get(f"{sk.http}/v1/timelines", timeout=5).json()
    assert len(tls) == 1, tls
    return tls[0]


def wait_committed(sk, lsn: int, relay: WalProposerRelay, timeout: float = 60) -> dict:
    """Waits until safekeeper `sk` knows `lsn` is committed."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            tl = timeline(sk)
            if lsn_int(tl["commit_lsn"]) >= lsn:
                return tl
        except (requests.RequestException, AssertionError):
            pass
        assert relay.proc.poll() is None, f"walproposer exited:\n{relay.log()}"
        assert time.monotonic() < deadline, f"{fmt_lsn(lsn)} not committed:\n{relay.log()}"
        time.sleep(0.05)


def segment_name(lsn: int, seg: int = SEG) -> str:
    segno, per_id = lsn // seg, (1 << 32) // seg
    return f"00000001{segno // per_id:08X}{segno % per_id:08X}"


def receive_and_compare(primary: PgCluster, sk, end: int, dest, seg: int = SEG) -> list[str]:
    """pg_receivewal from `sk` up to `end`; completed segments must equal the primary's.
    Returns the names compared (segments the primary still has)."""
    dest.mkdir()
    exe = require("pg_receivewal", "postgresql-client-15")
    out = subprocess.run(
        [exe, "-D", str(dest), "-h", "127.0.0.1", "-p", str(sk.pg_port), "-U", "postgres"]
        + ["--no-loop", "-v", "--slot", "recv", "--endpos", fmt_lsn(end - 1)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    compared = []
    for got in sorted(p for p in dest.iterdir() if not p.name.endswith(".partial")):
        theirs = primary.datadir / "pg_wal" / got.name
        if theirs.exists():
            assert got.read_bytes() == theirs.read_bytes(), got.name
            compared.append(got.name)
    return compared


def pgbench(primary: PgCluster, *args: str) -> None:
    exe = require("pgbench", "postgresql-contrib-15")
    out = subprocess.run(
        [exe, "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres", *args, "postgres"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr


def same_results(primary: PgCluster, standby: PgCluster) -> None:
    for q in CHECKS:
        assert standby.psql(q) == primary.psql(q), q


def follow_from(
    primary: PgCluster, standby: PgCluster, port: int, tag: str, lo: int, hi: int, txs: int
) -> None:
    """Points the standby at the safekeeper on `port`; rows `lo..=hi` of `known` and `txs`
    pgbench transactions later, it must return the primary's results, with `known` ending at
    `hi`, and stream from that port."""
    standby.psql(f"ALTER SYSTEM SET primary_conninfo = {standby.conninfo_setting(port)}")
    standby.psql("SELECT pg_reload_conf()")
    primary.psql(f"INSERT INTO known SELECT g, '{tag} ' || g FROM generate_series({lo}, {hi}) g")
    pgbench(primary, "-c", "1", "-t", str(txs), "-n")
    standby.wait_replayed(primary.current_lsn())
    same_results(primary, standby)
    assert standby.psql("SELECT count(*), max(id) FROM known") == f"{hi}|{hi}"
    assert f"port={port}" in standby.psql("SHOW primary_conninfo")


def test_primary_relayed_through_safekeepers_to_standby_and_pg_receivewal(
    safekeeper_factory, pg_factory, tmp_path
):
    # A short wal_sender_timeout: the relay's status updates must keep its stream alive.
    primary = pg_factory("primary").init(wal_sender_timeout="'3s'").start()
    system_id = primary.psql("SELECT system_identifier FROM pg_control_system()")
    primary.psql("CREATE TABLE known (id int PRIMARY KEY, v text)")
    primary.psql("INSERT INTO known SELECT g, 'row ' || g FROM generate_series(1, 1000) g")

    sks = [safekeeper_factory(i).start() for i in (1, 2, 3)]
    relay = WalProposerRelay(sks, primary, "wp_slot", tmp_path)
    try:
        # The safekeepers hold the primary's WAL from a segment start, with its identity.
        tl = wait_committed(sks[0], primary.current_lsn(), relay)
        start = lsn_int(tl["local_start_lsn"])
        assert start % SEG == 0, tl
        assert str(tl["system_id"]) == system_id
        assert tl["wal_seg_size"] == SEG
        assert tl["pg_version"] // 10000 == 15
        slot = primary.psql(
            "SELECT slot_type, active FROM pg_replication_slots WHERE slot_name = 'wp_slot'"
        )
        assert slot == "physical|t"

        # Only now the base backup: its redo point lies in WAL the safekeepers have.
        standby = pg_factory("standby").basebackup_from(primary, sks[0].pg_port)
        assert standby.backup_start_lsn() >= start
        standby.start()

        # Writes on the primary: a known table and pgbench, sampled for the note's figures.
        primary.psql("INSERT INTO known SELECT g, 'more ' || g FROM generate_series(1001, 2000) g")
        figures = {}
        samples: list[tuple[float, int, int]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                try:
                    # Standby first: primary minus standby is then an upper bound of the lag.
                    s = standby.replay_lsn()
                    p = primary.current_lsn()
                    samples.append((time.monotonic(), p, s))
                except AssertionError:
                    pass
                time.sleep(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for phase, args in (
            ("pgbench_init", ("-i", "-s", SCALE, "-q")),
            ("pgbench_run", ("-c", "2", "-j", "2", "-T", SECONDS, "-n")),
        ):
            lsn0, t0 = primary.current_lsn(), time.monotonic()
            pgbench(primary, *args)
            lsn1, t1 = primary.current_lsn(), time.monotonic()
            wait_committed(sks[0], lsn1, relay)
            t2 = time.monotonic()
            standby.wait_replayed(lsn1)
            t3 = time.monotonic()
            mb = (lsn1 - lsn0) / 1e6
            figures[phase] = {
                "wal_mb": round(mb, 2),
                "primary_mb_s": round(mb / (t1 - t0), 2),
                "relay_committed_mb_s": round(mb / (t2 - t0), 2),
                "commit_after_end_s": round(t2 - t1, 3),
                "standby_replayed_after_end_s": round(t3 - t1, 3),
            }
        stop.set()
        sampler.join()
        lags = [p - s for _, p, s in samples]
        figures["standby_lag_bytes_upper_bound"] = {
            "samples": len(lags),
            "median": int(statistics.median(lags)) if lags else None,
            "max": max(lags) if lags else None,
        }
        same_results(primary, standby)
        assert standby.psql("SELECT count(*) FROM known") == "2000"
        assert standby.psql("SELECT count(*) FROM pgbench_history") != "0"

        # The standby's safekeeper stops; point the standby at another one.
        sks[0].stop()
        follow_from(primary, standby, sks[1].pg_port, "after", 2001, 2500, 200)

        # The primary restarts: the relay reconnects and resumes where the proposer's WAL ends.
        primary.restart()
        primary.psql("INSERT INTO known VALUES (2502, 'after the primary restarted')")
        standby.wait_replayed(primary.current_lsn())
        same_results(primary, standby)
        assert "replication from the primary stopped" in relay.log()

        # Complete a segment, then read everything from a safekeeper with pg_receivewal.
        switched = lsn_int(primary.psql("SELECT pg_switch_wal()"))
        primary.psql("INSERT INTO known VALUES (2501, 'next segment')")
        end = lsn_int(wait_committed(sks[1], primary.current_lsn(), relay)["commit_lsn"])
        assert end // SEG > switched // SEG
        compared = receive_and_compare(primary, sks[1], end, tmp_path / "recv")
        assert segment_name(switched) in compared, compared

        assert "replication timeout" not in primary.log()
        final = json.loads(relay.stop().splitlines()[-1])
        assert lsn_int(final["commit_lsn"]) >= end
        figures["relay_total"] = final
        print("\nFIGURES " + json.dumps(figures))
        (tmp_path / "figures.json").write_text(json.dumps(figures, indent=1))
        # The slot followed the quorum-committed LSN: the primary may recycle WAL below it.
        restart = primary.psql(
            "SELECT restart_lsn FROM pg_replication_slots WHERE slot_name = 'wp_slot'"
        )
        assert lsn_int(restart) >= end, restart
    finally:
        relay.kill()


@pytest.mark.promise(10)
def test_primary_relayed_through_a_node_replacement_keeps_the_standby_consistent(
    pg_factory, tmp_path
):
    """A real primary relayed to safekeepers 1, 2, 3 of `scripts/local-cluster`; while pgbench
    runs, safekeeper 2 dies with its disk and `local-cluster replace 2 4` pulls the timeline to
    a new safekeeper 4 and switches the membership to {1, 3, 4}. The relay streams on; a standby
    fed by the safekeepers (from 1, then from the new 4) ends with the primary's count/sum/md5,
    and the members hold the same WAL."""
    cluster = Cluster(tmp_path, 4)
    out = cluster.run("start", "3")
    assert out.returncode == 0, out.stderr
    primary = pg_factory("primary").init(wal_sender_timeout="'3s'").start()
    primary.psql("CREATE TABLE known (id int PRIMARY KEY, v text)")
    primary.psql("INSERT INTO known SELECT g, 'row ' || g FROM generate_series(1, 1000) g")
    relay = WalProposerRelay([cluster.sk(i) for i in (1, 2, 3)], primary, "wp_slot", tmp_path)
    try:
        start = lsn_int(
            wait_committed(cluster.sk(1), primary.current_lsn(), relay)["local_start_lsn"]
        )
        standby = pg_factory("standby").basebackup_from(primary, cluster.sk(1).pg_port)
        standby.start()
        pgbench(primary, "-i", "-s", SCALE, "-q")

        load = threading.Thread(
            target=pgbench, args=(primary, "-c", "2", "-j", "2", "-T", "6", "-n")
        )
        load.start()
        wait_until(
            lambda: primary.psql("SELECT count(*) FROM pgbench_history") != "0", "pgbench to run"
        )
        os.kill(cluster.pid(2), 9)
        shutil.rmtree(cluster.sk(2).datadir)
        t0 = time.monotonic()
        out = cluster.run("replace", "2", "4")
        replace_s = time.monotonic() - t0
        assert out.returncode == 0, out.stdout + out.stderr
        assert "generation 3: members 1 3 4" in out.stdout, out.stdout
        load.join()
        primary.psql("INSERT INTO known SELECT g, 'after ' || g FROM generate_series(1001, 1500) g")
        target = primary.current_lsn()
        commit = lsn_int(wait_committed(cluster.sk(4), target, relay)["commit_lsn"])
        standby.wait_replayed(target)
        same_results(primary, standby)

        # The standby moves to the new safekeeper and follows new writes from there.
        follow_from(primary, standby, cluster.sk(4).pg_port, "on 4", 1501, 1700, 100)

        for i in (1, 3, 4):
            s = cluster.status(i)
            assert s["generation"] == 3 and lsn_int(s["flush_lsn"]) >= commit, (i, s)
        wal = {i: read_wal(cluster.sk(i), start, commit) for i in (1, 3, 4)}
        assert wal[1] == wal[3] == wal[4]
        print(f"\nFIGURES replace_seconds={replace_s:.2f} wal_mb={(commit - start) / 1e6:.1f}")
    finally:
        relay.kill()
        cluster.run("stop")


def test_relay_from_inside_a_record_and_after_a_restart(safekeeper_factory, pg_factory, tmp_path):
    """1 MiB segments and a slot whose segment begins inside a 3 MB record: the safekeepers'
    WAL starts with that record's tail. A restarted relay continues at the term start (mid
    segment). pg_receivewal gets every completed segment byte-identical to the primary's."""
    seg = 1 << 20
    primary = pg_factory("primary").init("--wal-segsize=1").start()
    before_msg = primary.current_lsn()
    primary.psql("SELECT pg_logical_emit_message(false, 'big', repeat('x', 3000000))")
    # A new physical slot reserves WAL from the last checkpoint's redo point: move it past.
    primary.psql("CHECKPOINT")
    primary.psql("SELECT pg_create_physical_replication_slot('wp', true)")
    restart = lsn_int(
        primary.psql("SELECT restart_lsn FROM pg_replication_slots WHERE slot_name = 'wp'")
    )
    first_seg = restart - restart % seg
    assert first_seg > before_msg, "the slot's segment must begin inside the message"
    page = (primary.datadir / "pg_wal" / segment_name(first_seg, seg)).read_bytes()[:4]
    assert int.from_bytes(page[2:4], "little") & 0x0001, "XLP_FIRST_IS_CONTRECORD"

    sks = [safekeeper_factory(i).start() for i in (1, 2, 3)]
    relay = WalProposerRelay(sks, primary, "wp", tmp_path)
    try:
        tl = wait_committed(sks[0], primary.current_lsn(), relay)
        assert lsn_int(tl["local_start_lsn"]) == first_seg
        assert tl["wal_seg_size"] == seg
        first = json.loads(relay.stop().splitlines()[-1])
        assert first["start_lsn"] == fmt_lsn(first_seg)

        # WAL written while no relay runs; a new relay (a new term) continues where the
        # safekeepers' WAL ends, which is not a segment start.
        primary.psql("CREATE TABLE t AS SELECT g FROM generate_series(1, 20000) g")
        relay = WalProposerRelay(sks, primary, "wp", tmp_path)
        wait_committed(sks[0], primary.current_lsn(), relay)
        primary.psql("SELECT pg_switch_wal()")
        primary.psql("INSERT INTO t VALUES (0)")
        end = lsn_int(wait_committed(sks[2], primary.current_lsn(), relay)["commit_lsn"])
        second = json.loads(relay.stop().splitlines()[-1])
        assert second["start_lsn"] == first["commit_lsn"]
        assert lsn_int(second["start_lsn"]) % seg != 0
        assert (
            json.loads(requests.get(f"{sks[2].http}/v1/timelines", timeout=5).text)[0]["term"] == 2
        )

        compared = receive_and_compare(primary, sks[2], end, tmp_path / "recv", seg)
        assert segment_name(first_seg, seg) in compared, compared
        assert len(compared) >= 3, compared
    finally:
        relay.kill()


def pg_waldump_all(segment_dir, dest, start: int, end: int) -> str:
    """Real pg_waldump over the segments in `segment_dir` (`.partial` ones renamed, as
    pg_waldump wants plain names) from `start` to `end`; returns its output."""
    dest.mkdir()
    for p in segment_dir.iterdir():
        if re.fullmatch(r"[0-9A-F]{24}(\.partial)?", p.name):
            shutil.copy(p, dest / p.name.removesuffix(".partial"))
    out = subprocess.run(
        [require_pg_tool("pg_waldump"), "-p", str(dest), "-s", fmt_lsn(start), "-e", fmt_lsn(end)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.promise(2)
@pytest.mark.parametrize("seg_mb", [1, 16])
def test_wal_ending_with_a_switch_survives_sigterm_and_sigkill(
    safekeeper_factory, pg_factory, tmp_path, seg_mb
):
    """Issue 13, item 1: a real primary's WAL whose last record is `pg_switch_wal()`'s
    XLOG_SWITCH ends at a segment boundary, and the safekeepers acknowledge that boundary. Each
    safekeeper restarts after SIGTERM (commit LSN persisted at the boundary: recovery starts
    there) and then after SIGKILL; all must start. A new term continues into the next segment;
    real pg_receivewal gets segments byte-identical to the primary's and real pg_waldump reads
    all of it, the switch included."""
    seg = seg_mb << 20
    # No autovacuum: nothing but the test writes WAL, so the WAL can end with the switch.
    primary = pg_factory("primary").init(f"--wal-segsize={seg_mb}", autovacuum="off").start()
    primary.psql("SELECT pg_create_physical_replication_slot('wp', true)")
    primary.psql("CREATE TABLE t AS SELECT g FROM generate_series(1, 5000) g")
    sks = [safekeeper_factory(i).start() for i in (1, 2, 3)]

    def new_relay(name: str) -> WalProposerRelay:
        (tmp_path / name).mkdir()
        return WalProposerRelay(sks, primary, "wp", tmp_path / name)

    relay = new_relay("relay1")
    try:
        # The safekeepers' WAL must end exactly at the boundary: retry if the primary wrote a
        # record after the switch (a background standby snapshot) before the relay stopped.
        for attempt in range(5):
            switch_end = lsn_int(primary.psql("SELECT pg_switch_wal()"))
            boundary = (switch_end + seg - 1) // seg * seg
            for sk in sks:
                wait_committed(sk, boundary, relay)
            relay.kill()
            flushed = {lsn_int(timeline(sk)["flush_lsn"]) for sk in sks}
            if flushed == {boundary}:
                break
            relay = new_relay(f"relay-retry{attempt}")
            primary.psql("INSERT INTO t VALUES (-1)")
        else:
            pytest.fail(f"WAL never ended at the switch: {flushed}")
        term = timeline(sks[0])["term"]

        for sk in sks:
            assert sk.stop() == 0, sk.log()
            sk.start()  # recovery starts at the boundary: the persisted commit LSN
            assert lsn_int(timeline(sk)["flush_lsn"]) == boundary, sk.log()
            assert lsn_int(timeline(sk)["persisted_commit_lsn"]) == boundary
            sk.kill()
            sk.start()
            assert lsn_int(timeline(sk)["flush_lsn"]) == boundary, sk.log()

        # A new term streams on into the next segment.
        relay = new_relay("relay2")
        primary.psql("INSERT INTO t SELECT g FROM generate_series(1, 1000) g")
        target = primary.current_lsn()
        assert target > boundary + 40
        end = min(lsn_int(wait_committed(sk, target, relay)["commit_lsn"]) for sk in sks)
        assert timeline(sks[2])["term"] > term
        relay.stop()

        switched = boundary - seg
        compared = receive_and_compare(primary, sks[1], end, tmp_path / "recv", seg)
        assert segment_name(switched, seg) in compared, compared
        tl = timeline(sks[2])
        tl_dir = sks[2].datadir / tl["tenant_id"] / tl["timeline_id"]
        dump = pg_waldump_all(tl_dir, tmp_path / "dump", switched, end)
        assert "desc: SWITCH" in dump, dump[-2000:]
        # The dump goes on past the switch: the new term's records in the next segment.
        lsns = [lsn_int(m) for m in re.findall(r"lsn: ([0-9A-F]+/[0-9A-F]+),", dump)]
        assert max(lsns) > boundary, dump[-2000:]
    finally:
        relay.kill()
