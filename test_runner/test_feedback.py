"""Readers that talk back (issue 31), with real PostgreSQL 15 and real `pg_receivewal`:

- a real hot standby (`hot_standby_feedback=on`) streaming from one of three safekeepers
  holds a repeatable-read snapshot: its xmin reaches the primary through that safekeeper's
  AppendResponse and the relay's standby feedback (the slot's xmin), though the other two
  report no reader; the primary's VACUUM keeps the rows the snapshot sees, and once the query
  ends the xmin moves on and VACUUM removes them;
- per-reader positions and lags appear in the timeline's status within one status interval;
- a paused `pg_receivewal` (SIGSTOP) stops the writer at `--max-replication-flush-lag` and not
  before, and the writer resumes by itself when the reader does, with every acknowledged byte
  intact (the `--ack-log` ledger); with three safekeepers the paused reader is on the third
  while a live one reads from the first, and the writer still waits for the slowest.

`FEEDBACK_HOLD_SECONDS` makes the standby's query longer (for the note's xmin figures)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest
import requests

from fixtures.daemon import RELEASE_DIR, fmt_lsn, lsn_int, wait_until
from fixtures.ledger import ledger, verify_safekeeper
from fixtures.pg import PgCluster, WalProposerRelay
from fixtures.tools import require

HOLD_SECONDS = float(os.environ.get("FEEDBACK_HOLD_SECONDS", "3"))


def timeline(sk) -> dict:
    tls = requests.get(f"{sk.http}/v1/timelines", timeout=5).json()
    assert len(tls) == 1, tls
    return tls[0]


def slot_xmin(primary: PgCluster, slot: str) -> int | None:
    v = primary.psql(f"SELECT xmin FROM pg_replication_slots WHERE slot_name = '{slot}'")
    return int(v) if v else None


def vacuum(primary: PgCluster, table: str) -> tuple[int, int]:
    """VACUUM VERBOSE `table` on the primary: (tuples removed, dead but not yet removable)."""
    out = subprocess.run(
        [primary.psql_exe, "-X", "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres"]
        + ["-c", f"VACUUM (VERBOSE) {table}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    m = re.search(
        r"tuples: (\d+) removed, \d+ remain, (\d+) are dead but not yet removable", out.stderr
    )
    assert m, out.stderr
    return int(m.group(1)), int(m.group(2))


class Session:
    """A psql session kept open on `pg` (statements sent one by one, answers read back)."""

    def __init__(self, pg: PgCluster):
        self.proc = subprocess.Popen(
            [pg.psql_exe, "-X", "-A", "-t", "-q", "-h", "127.0.0.1", "-p", str(pg.port)]
            + ["-U", "postgres", "-v", "ON_ERROR_STOP=1"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def query(self, sql: str) -> str:
        """Runs `sql` (one row, one column) and returns its answer."""
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(f"{sql};\n\\echo __done\n")
        self.proc.stdin.flush()
        lines = []
        while (line := self.proc.stdout.readline()) != "__done\n":
            assert line, f"the session ended: {''.join(lines)}"
            lines.append(line)
        return "".join(lines).strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)


def test_standby_snapshot_holds_the_primarys_vacuum_through_the_safekeeper(
    safekeeper_factory, pg_factory, tmp_path
):
    primary = pg_factory("primary").init().start()
    primary.psql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    primary.psql("INSERT INTO t SELECT g, 'row ' || g FROM generate_series(1, 500) g")
    sks = [safekeeper_factory(i).start() for i in (1, 2, 3)]
    # The standby reads from the third: the relay hears its xmin from that one alone.
    sk = sks[2]
    relay = WalProposerRelay(sks, primary, "wp", tmp_path)
    session = None
    try:
        wait_until(
            lambda: requests.get(f"{sk.http}/v1/timelines", timeout=5).json()
            and lsn_int(timeline(sk)["commit_lsn"]) >= primary.current_lsn(),
            "the primary's WAL committed",
            timeout=60,
        )
        standby = pg_factory("standby").basebackup_from(
            primary, sk.pg_port, hot_standby_feedback="on"
        )
        standby.start()
        standby.wait_replayed(primary.current_lsn())

        # The standby reports back within a status interval (1 s): positions and its xmin.
        def standby_reader() -> dict | None:
            readers = timeline(sk)["reader_feedback"]
            mine = [r for r in readers if r["application_name"] == "standby"]
            return mine[0] if mine and mine[0]["reply_time"] is not None else None

        r = wait_until(standby_reader, "the standby's status update in the timeline", timeout=5)
        assert lsn_int(r["replay_lsn"]) > 0 and r["client_addr"].startswith("127.0.0.1:"), r

        session = Session(standby)
        session.query("BEGIN ISOLATION LEVEL REPEATABLE READ")
        assert session.query("SELECT count(*) FROM t") == "500"
        held = wait_until(lambda: timeline(sk)["hs_feedback"]["xmin"], "hs_feedback at the sk")
        assert [timeline(other)["hs_feedback"]["xmin"] for other in sks[:2]] == [0, 0]
        # (A new cluster is in epoch 0: 32-bit and full xids compare alike.)
        deleted = int(primary.psql("WITH d AS (DELETE FROM t RETURNING 1) SELECT txid_current()"))
        assert held <= deleted, (held, deleted)  # the DELETE is invisible to the snapshot
        deleted_at = primary.current_lsn()
        # The standby's xmin is at the primary: its slot's xmin is the one the sk aggregated.
        wait_until(
            lambda: slot_xmin(primary, "wp") == timeline(sk)["hs_feedback"]["xmin"],
            "the slot's xmin to be the standby's",
            timeout=10,
        )
        xmin = slot_xmin(primary, "wp")
        assert xmin <= held, (xmin, held)
        samples = [(0.0, xmin)]

        removed, dead = vacuum(primary, "t")
        assert (removed, dead) == (0, 500), "VACUUM must keep the rows the standby's snapshot sees"
        standby.wait_replayed(primary.current_lsn())
        t0 = time.monotonic()
        while time.monotonic() - t0 < HOLD_SECONDS:
            samples.append((round(time.monotonic() - t0, 1), slot_xmin(primary, "wp")))
            time.sleep(0.5)
        # No conflict cancelled the query: the snapshot still sees every row.
        assert session.query("SELECT count(*) FROM t") == "500"
        session.query("COMMIT")
        t_end = time.monotonic()

        # Released: the standby's next feedback moves its xmin past the DELETE.
        wait_until(
            lambda: (slot_xmin(primary, "wp") or 0) > deleted,
            "the slot's xmin moves past the DELETE",
            timeout=10,
        )
        released_s = time.monotonic() - t_end
        removed, dead = vacuum(primary, "t")
        assert (removed, dead) == (500, 0)
        print(
            f"backend_xmin over the standby's query: {samples}; released {released_s:.2f} s after"
            f" it ended (deleted at {fmt_lsn(deleted_at)})"
        )
    finally:
        if session:
            session.close()
        relay.stop()
    out = relay.out_path.read_text()
    assert '"hs_feedback_sent"' in out, out


def receivewal(sk, dest, name: str) -> subprocess.Popen:
    """`pg_receivewal` from `sk` into `dest`, reporting its flush position every second."""
    dest.mkdir()
    # --synchronous: its flush position follows what it wrote (else only whole segments).
    return subprocess.Popen(
        [require("pg_receivewal", "postgresql-client-15"), "-D", str(dest), "--no-loop"]
        + ["--synchronous", "--status-interval", "1", "-d"]
        + [f"host=127.0.0.1 port={sk.pg_port} user=postgres application_name={name}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.mark.parametrize("n", [1, 3])
def test_paused_reader_stops_the_writer_at_the_limit_and_resumes(safekeeper_factory, tmp_path, n):
    limit = 4 << 20
    sks = [safekeeper_factory(i).start() for i in range(1, n + 1)]
    # The paused reader reads from the last safekeeper; with three, a live one from the first.
    sk = sks[-1]
    ack_log = tmp_path / "ack.log"
    wp_log = tmp_path / "wp.log"
    wp = subprocess.Popen(
        [str(RELEASE_DIR / "walproposer"), "--safekeepers"]
        + [",".join(f"127.0.0.1:{s.pg_port}" for s in sks)]
        + ["--total", "48M", "--rate", "8M", "--ack-log", str(ack_log)]
        + ["--max-replication-flush-lag", str(limit)],
        stdout=subprocess.PIPE,
        stderr=open(wp_log, "wb"),
        env={**os.environ, "RUST_LOG": "info"},
    )
    recv = live = None
    try:
        for s in sks:
            wait_until(lambda s=s: requests.get(f"{s.http}/v1/timelines", timeout=5).json(), "tl")
        recv = receivewal(sk, tmp_path / "recv", "receiver")
        if n > 1:
            live = receivewal(sks[0], tmp_path / "live", "live")

        def reader() -> dict | None:
            rs = [r for r in timeline(sk)["reader_feedback"] if r["application_name"] == "receiver"]
            return rs[0] if rs and rs[0]["reply_time"] is not None else None

        r = wait_until(reader, "pg_receivewal's status update", timeout=5)
        assert r["required"] is True
        # Paused: it reports nothing more, its connection stays.
        recv.send_signal(signal.SIGSTOP)
        stopped_flush = lsn_int(wait_until(reader, "reader")["flush_lsn"])
        t_stop = time.monotonic()

        def writer_end() -> int:
            return lsn_int(timeline(sk)["flush_lsn"])

        # The writer pauses: its end stops moving, at the limit past the reader's last report.
        def settled():
            a = writer_end()
            time.sleep(1.5)
            return a if writer_end() == a and a - stopped_flush >= limit // 2 else None

        end = wait_until(settled, "the writer pauses", timeout=30)
        engaged_s = time.monotonic() - t_stop
        last_flush = lsn_int(reader()["flush_lsn"])
        assert end - last_flush >= limit, "paused before the limit"
        assert end - last_flush <= limit + (1 << 20), "went on past the limit"
        assert "backpressure: pausing appends" in wp_log.read_text()
        if live:
            # The live reader on the first safekeeper kept up: only the paused one holds back.
            ahead = [
                r for r in timeline(sks[0])["reader_feedback"] if r["application_name"] == "live"
            ]
            assert ahead and end - lsn_int(ahead[0]["flush_lsn"]) < limit // 2, ahead

        recv.send_signal(signal.SIGCONT)
        t_cont = time.monotonic()
        wait_until(lambda: writer_end() > end + (1 << 20), "the writer resumes", timeout=20)
        released_s = time.monotonic() - t_cont
        out, _ = wp.communicate(timeout=120)
        assert wp.returncode == 0, wp_log.read_text()
        assert "backpressure: released" in wp_log.read_text()
        print(
            f"backpressure engaged {engaged_s:.2f} s after the reader stopped, released "
            f"{released_s:.2f} s after it resumed; writer stopped {end - last_flush} bytes "
            f"ahead of the reader (limit {limit})"
        )
    finally:
        if recv and recv.poll() is None:
            recv.send_signal(signal.SIGCONT)
            recv.kill()
        if live and live.poll() is None:
            live.kill()
        if wp.poll() is None:
            wp.kill()
    # Every acknowledged byte is on the paused reader's safekeeper up to its flush LSN, and on a
    # quorum to the end.
    end = ledger(ack_log)[-1][0]
    at_end = 0
    for s in sks:
        flush = lsn_int(timeline(s)["flush_lsn"])
        verified = verify_safekeeper(ack_log, s, hi=min(flush, end))
        assert verified.ranges > 0, ("nothing verified", s.node_id)
        at_end += flush >= end
    assert at_end > n // 2, (at_end, n)
