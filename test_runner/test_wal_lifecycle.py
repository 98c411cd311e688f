"""WAL lifecycle (issue 19): backup of complete segments to remote storage, removal below the
horizon, readers served from the backup. Every test runs on `file://` and on a real S3 server
(moto's server mode, started here).

WAL_LIFECYCLE_PUSH sizes the main push (default 64M; the issue's figure is 256M)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from fixtures.daemon import (
    TENANT,
    TIMELINE,
    fmt_lsn,
    free_port,
    lsn_int,
    timeline_dir,
    wait_until,
    walproposer,
)
from fixtures.ledger import acked, ledger, verify
from fixtures.pg import WalProposerRelay
from fixtures.tools import before, receivewal, require_pg_tool

SEG = 1 << 20
PUSH = os.environ.get("WAL_LIFECYCLE_PUSH", "64M")
KEEP = 4 * SEG
BUCKET = "walbackup"


def seg_name(segno: int) -> str:
    per = 2**32 // SEG
    return f"{1:08X}{segno // per:08X}{segno % per:08X}"


class FileStore:
    """A `file://` store in a directory."""

    def __init__(self, root: Path):
        self.root = root
        self.url = f"file://{root}"
        self.env: dict[str, str] = {}

    def objects(self) -> dict[str, bytes]:
        d = self.root / TENANT / TIMELINE
        if not d.exists():
            return {}
        # `name#N`: object_store's staging file of an upload a kill -9 cut short (never under
        # an object's name).
        return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file() and "#" not in p.name}

    def outage(self):
        """Makes the store unwritable (its root moved aside, a plain file in its place) until
        the returned function is called."""
        aside = self.root.with_name(self.root.name + ".aside")
        self.root.rename(aside)
        self.root.write_bytes(b"unreachable")

        def restore():
            self.root.unlink()
            aside.rename(self.root)

        return restore


class S3Store:
    """A bucket on a real S3 server (moto_server) started for the test."""

    def __init__(self, tmp: Path):
        import boto3

        exe = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
        self.port = free_port()
        self.log = open(tmp / "moto.log", "wb")
        self.proc = subprocess.Popen(
            [exe, "-p", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT
        )
        endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
        }
        self.url = f"s3://{BUCKET}/sk"
        self.s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

        def up():
            try:
                self.s3.create_bucket(Bucket=BUCKET)
                return True
            except Exception:
                return False

        wait_until(up, "moto_server to answer", timeout=30, interval=0.2)

    def objects(self) -> dict[str, bytes]:
        out = {}
        prefix = f"sk/{TENANT}/{TIMELINE}/"
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        for page in pages:
            for o in page.get("Contents", []):
                try:
                    body = self.s3.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()
                except self.s3.exceptions.NoSuchKey:
                    continue  # removed since the listing (a superseded partial segment)
                out[o["Key"].removeprefix(prefix)] = body
        return out

    def outage(self):
        """Freezes the server (SIGSTOP): requests hang, then fail, until it resumes."""
        self.proc.send_signal(signal.SIGSTOP)
        return lambda: self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait()
        self.log.close()


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        yield FileStore(tmp_path / "remote")
        return
    s = S3Store(tmp_path)
    try:
        yield s
    finally:
        s.close()


def status(sk) -> dict:
    r = requests.get(f"{sk.http}/v1/tenant/{TENANT}/timeline/{TIMELINE}", timeout=5)
    r.raise_for_status()
    return r.json()


def start_sks(factory, store, keep: list[int], extra: tuple[str, ...] = ()) -> list:
    sks = []
    for i, k in enumerate(keep, start=1):
        sk = factory(
            i,
            extra_args=["--remote-storage", store.url, "--wal-keep-size", str(k), *extra],
            env=store.env,
        )
        sks.append(sk.start())
    return sks


def push(sks, total: str = PUSH, ack_log: Path | None = None) -> dict:
    """A synthetic push of `total` bytes in 1 MiB segments; with `ack_log`, its content ledger
    (appended to, so several pushes share one)."""
    ledger_args = ["--ack-log", str(ack_log)] if ack_log else []
    return walproposer(
        sks, "--wal-seg-size", str(SEG), "--total", total, "--record-size", "4000", *ledger_args
    )


def push_in_background(
    sks, total: str, stderr, rate: str | None = None, ack_log: Path | None = None
) -> subprocess.Popen:
    """The push of `push()`, running while the test goes on (its stats on stdout), at `rate`
    bytes per second if given (else as fast as the quorum commits)."""
    return subprocess.Popen(
        [str(sks[0].binary.with_name("walproposer")), "--safekeepers"]
        + [",".join(f"127.0.0.1:{sk.pg_port}" for sk in sks)]
        + ["--wal-seg-size", str(SEG), "--total", total, "--record-size", "4000"]
        + (["--rate", rate] if rate else [])
        + (["--ack-log", str(ack_log)] if ack_log else []),
        stdout=subprocess.PIPE,
        stderr=stderr,
        env={**os.environ, "RUST_LOG": "warn"},
    )


def backed_up_to(sks, lsn: int, timeout: float = 120) -> int:
    """Waits until every node backed up every complete segment below `lsn` that it knows to be
    committed (a node may learn the last commit LSN late: the proposer may exit first); returns
    the end of the segments every node backed up."""

    def done():
        ends = []
        for sk in sks:
            st = status(sk)
            commit = min(lsn, lsn_int(st["commit_lsn"]))
            if lsn_int(st["backup_lsn"]) < commit - commit % SEG:
                return None
            ends.append(commit - commit % SEG)
        return min(ends) or None

    return wait_until(
        done, f"every safekeeper to back up to {lsn:#x}", timeout=timeout, interval=0.2
    )


def local_segments(sk) -> list[str]:
    return sorted(p.name for p in timeline_dir(sk).iterdir() if p.name[:8] == "00000001")


def check_store(store, reference, first: int, end_lsn: int) -> None:
    """Every complete segment from `first` below `end_lsn` is stored exactly once, full-size,
    byte-identical to the reference node's local copy; nothing else is stored."""
    objs = store.objects()
    want = [seg_name(n) for n in range(first, end_lsn // SEG)]
    below = [n for n in sorted(objs) if n < seg_name(end_lsn // SEG)]
    assert below == want, sorted(objs)
    assert all(len(b) == SEG for b in objs.values()), "a torn object"

    for name in want:
        assert objs[name] == (timeline_dir(reference) / name).read_bytes(), name


@pytest.mark.promise(12)
def test_backup_removal_and_readers_from_the_backup(safekeeper_factory, store, tmp_path):
    # sk3 keeps everything locally: the reference the backup and the readers are checked on.
    sks = start_sks(safekeeper_factory, store, [KEEP, KEEP, 1 << 40])
    stats = push(sks)
    start, end = lsn_int(stats["start_lsn"]), lsn_int(stats["commit_lsn"])
    backed = backed_up_to(sks, end)
    assert end - backed < 4 * SEG, (hex(end), hex(backed))
    first = start // SEG
    check_store(store, sks[2], first, backed)
    # Local disk on the removing nodes stays near --wal-keep-size.
    for sk in sks[:2]:
        wait_until(
            lambda sk=sk: len(local_segments(sk)) <= KEEP // SEG + 2,
            "removal down to --wal-keep-size",
        )
        st = status(sk)
        assert lsn_int(st["removal_horizon_lsn"]) > start, st
        assert st["remote_location"].endswith(f"{TENANT}/{TIMELINE}"), st
    assert len(local_segments(sks[2])) >= (end - start) // SEG
    # pg_receivewal from the start of WAL, off a node that removed it: byte-identical.
    recv = tmp_path / "recv"
    recv.mkdir()
    out = receivewal(sks[0], recv, "--slot", "s1", "--endpos", before(stats["commit_lsn"]))
    assert out.returncode == 0, out.stderr
    full = sorted(p.name for p in recv.iterdir() if not p.name.endswith(".partial"))
    assert full[: backed // SEG - first] == [seg_name(n) for n in range(first, backed // SEG)], full
    for name in full:
        assert (recv / name).read_bytes() == (timeline_dir(sks[2]) / name).read_bytes(), name
    metrics = requests.get(f"{sks[0].http}/metrics", timeout=5).text
    assert "safekeeper_wal_removed_segments_total" in metrics

    def gauge(name: str) -> int:
        line = next(x for x in metrics.splitlines() if x.startswith(name + "{"))
        return int(float(line.split()[-1]))

    assert gauge("safekeeper_backup_lsn") == lsn_int(status(sks[0])["backup_lsn"])
    assert gauge("safekeeper_backup_lag_bytes") < 4 * SEG
    assert 0 < gauge("safekeeper_timeline_local_wal_bytes") <= KEEP + 3 * SEG


@pytest.mark.promise(14)
def test_pull_after_removal_starts_at_the_backed_up_point_and_serves_the_rest_from_the_store(
    safekeeper_factory, store, tmp_path
):
    """Issue 26, defect 3: with --remote-storage, removal is the normal state; a dead node must
    still be replaceable. The snapshot starts at the backed-up point, and the new node serves
    the WAL below it from the store, byte-identical (sk3 keeps everything: the reference)."""
    sks = start_sks(safekeeper_factory, store, [0, 0, 1 << 40])
    stats = push(sks, "24M")
    start, end = lsn_int(stats["start_lsn"]), lsn_int(stats["commit_lsn"])
    backed = backed_up_to(sks, end)
    for sk in sks[:2]:
        wait_until(
            lambda sk=sk: lsn_int(status(sk)["removal_horizon_lsn"]) > start + 8 * SEG,
            "removal on the donors",
        )
    sk4 = safekeeper_factory(
        4, extra_args=["--remote-storage", store.url, "--wal-keep-size", "0"], env=store.env
    ).start()
    body = {"tenant_id": TENANT, "timeline_id": TIMELINE}
    body["http_hosts"] = [f"127.0.0.1:{sk.http_port}" for sk in sks[:2]]
    r = requests.post(f"{sk4.http}/v1/pull_timeline", json=body, timeout=120)
    assert r.status_code == 200, r.text
    pulled = r.json()
    assert lsn_int(pulled["start_lsn"]) > start + 8 * SEG, pulled
    assert lsn_int(pulled["flush_lsn"]) >= end, pulled
    assert pulled["wal_bytes"] < (end - start) // 2, "only the WAL above the backed-up point"
    st = status(sk4)
    assert st["node_id"] == 4 and lsn_int(st["local_start_lsn"]) == lsn_int(pulled["start_lsn"])
    # The new node serves the timeline from its start: the early WAL from the store.
    recv = tmp_path / "recv"
    recv.mkdir()
    out = receivewal(sk4, recv, "--slot", "s1", "--endpos", before(stats["commit_lsn"]))
    assert out.returncode == 0, out.stderr
    full = sorted(p.name for p in recv.iterdir() if not p.name.endswith(".partial"))
    first = start // SEG
    assert full[: backed // SEG - first] == [seg_name(n) for n in range(first, backed // SEG)]
    for name in full:
        assert (recv / name).read_bytes() == (timeline_dir(sks[2]) / name).read_bytes(), name


READERS = int(os.environ.get("WAL_LIFECYCLE_READERS", "200"))


@pytest.mark.promise(14)
def test_readers_below_the_local_wal_share_a_bounded_read_budget(safekeeper_factory, store):
    """Issue 26, defect 6: a reader below the local WAL once downloaded its whole segment
    before it was counted (40 readers took the daemon from 107 to 716 MiB). Now each reads
    ranges of at most 1 MiB against --remote-read-budget: 200 readers from the timeline start
    that never read their sockets stay within that budget plus their small buffers. Readers
    hold nothing: removal goes on under them."""
    from fixtures.pgwire import connect, query

    sk = safekeeper_factory(
        1,
        extra_args=["--remote-storage", store.url, "--wal-keep-size", "0"]
        + ["--remote-read-budget", "16MB", "--max-connections", str(READERS + 20)],
        env=store.env,
    ).start()
    stats = push([sk], "24M")
    start, end = lsn_int(stats["start_lsn"]), lsn_int(stats["commit_lsn"])
    backed_up_to([sk], end)
    wait_until(lambda: lsn_int(status(sk)["removal_horizon_lsn"]) > start + 16 * SEG, "removal")
    rss_before = sk.rss_bytes()
    readers = []
    for _ in range(READERS):
        s = connect(sk.pg_port)
        assert not isinstance(s, dict), s
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        tag, body = query(s, f"START_REPLICATION {start >> 32:X}/{start & 0xFFFFFFFF:X}")
        assert tag == b"W", body
        readers.append(s)

    def buffered() -> int:
        metrics = requests.get(f"{sk.http}/metrics", timeout=5).text
        return next(
            int(float(x.split()[-1]))
            for x in metrics.splitlines()
            if x.startswith("safekeeper_remote_read_buffered_bytes ")
        )

    # Every reader is streaming (its socket full) or waiting for the budget, which is spent.
    wait_until(lambda: status(sk)["readers"] == READERS, "every reader counted")
    wait_until(lambda: buffered() >= 15 << 20, "the read budget spent by the readers")
    rss = sk.rss_bytes()
    buffered = buffered()
    print(
        f"{READERS} readers below the local WAL: RSS {rss_before >> 20} -> {rss >> 20} MiB, "
        f"{buffered >> 20} MiB buffered from the store"
    )
    assert 0 < buffered <= 16 << 20, buffered
    assert rss - rss_before < (16 << 20) + READERS * (512 << 10), (rss_before, rss)
    for s in readers:
        s.close()


@pytest.mark.promise(12)
def test_standby_built_after_removal_catches_up_from_the_backup(
    safekeeper_factory, store, pg_factory, tmp_path
):
    """A real PG15 standby whose base backup's WAL the safekeepers removed locally: it streams
    from a safekeeper, which serves the removed segments from the backup."""
    primary = pg_factory("primary").init("--wal-segsize=1").start()
    primary.psql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    sks = start_sks(safekeeper_factory, store, [KEEP, KEEP, KEEP])
    relay = WalProposerRelay(sks, primary, "wp", tmp_path)

    def commit_lsn(sk) -> int:
        try:
            return lsn_int(status(sk)["commit_lsn"])
        except requests.HTTPError:
            return 0  # the relay has not created the timeline yet

    def committed(lsn: int) -> None:
        for sk in sks:
            wait_until(
                lambda sk=sk: commit_lsn(sk) >= lsn,
                f"{lsn:#x} committed",
                timeout=60,
            )
            assert relay.proc.poll() is None, relay.log()

    try:
        committed(primary.current_lsn())
        standby = pg_factory("standby").basebackup_from(primary, sks[0].pg_port)
        first = standby.backup_start_lsn() // SEG
        # ~26 MiB of WAL: the base backup's segment falls far below --wal-keep-size.
        for i in range(12):
            primary.psql(
                f"INSERT INTO t SELECT g, repeat('x', 1000) "
                f"FROM generate_series({i * 2000 + 1}, {(i + 1) * 2000}) g"
            )
        end = primary.current_lsn()
        committed(end)
        for sk in sks:
            wait_until(
                lambda sk=sk: seg_name(first) not in local_segments(sk),
                "the base backup's segment removed locally",
                timeout=120,
            )
        assert seg_name(first) in store.objects()
        standby.start()
        standby.wait_replayed(end, timeout=120)
        q = "SELECT count(*), sum(id), md5(string_agg(id || ':' || v, ',' ORDER BY id)) FROM t"
        assert standby.psql(q) == primary.psql(q)
        assert standby.psql("SELECT count(*) FROM t") == "24000"
    finally:
        relay.stop()


@pytest.mark.promise(12)
def test_outage_removes_nothing_unbacked_and_the_backlog_uploads_on_return(
    safekeeper_factory, store, tmp_path
):
    sks = start_sks(safekeeper_factory, store, [KEEP, KEEP, KEEP])
    ack_log = tmp_path / "acks"
    stats = push(sks, "8M", ack_log)
    start = lsn_int(stats["start_lsn"])
    backed_up_to(sks, lsn_int(stats["commit_lsn"]))
    restore = store.outage()
    try:
        stats = push(sks, "16M", ack_log)
        end = lsn_int(stats["commit_lsn"])
        time.sleep(3)  # several lifecycle ticks while the store is down
        for sk in sks:
            st = status(sk)
            backup = lsn_int(st["backup_lsn"])
            assert backup < end - end % SEG, st
            # Every segment from the backed-up point on is still local.
            names = set(local_segments(sk))
            for n in range(backup // SEG, end // SEG):
                assert seg_name(n) in names, (seg_name(n), sorted(names))
    finally:
        restore()
    backed = backed_up_to(sks, end, timeout=180)
    objs = store.objects()
    for n in range(start // SEG, end // SEG):
        assert len(objs.get(seg_name(n), b"")) == SEG, seg_name(n)
    # The backlog's objects hold the bytes the proposers sent (their ack log's SHA-256 per
    # acknowledged range), before and during the outage: a full-size object of the wrong or
    # zeroed bytes fails here.
    ranges, checked = verify(ledger(ack_log), objs, SEG, lo=start, hi=backed)
    assert ranges > 0 and checked > backed - start - SEG, (ranges, checked, backed - start)
    for sk in sks:
        wait_until(lambda sk=sk: len(local_segments(sk)) <= KEEP // SEG + 2, "removal")


@pytest.mark.promise(12)
def test_kill9_during_uploads_leaves_no_torn_lost_or_doubled_object(safekeeper_factory, store):
    sks = start_sks(safekeeper_factory, store, [1 << 40, 1 << 40, 1 << 40])
    # 48 MiB in ~12 s: the kills below land while WAL streams and segments upload (a kill and
    # restart takes seconds on a loaded machine; 4 s of push once ended before the second).
    proposer = push_in_background(sks, "48M", stderr=subprocess.DEVNULL, rate="4M")
    # Kill nodes while they upload, restart them: each kill after uploads made progress.
    for victim in (sks[0], sks[1]):
        seen = len(store.objects())
        wait_until(lambda seen=seen: len(store.objects()) >= seen + 2, "uploads", timeout=60)
        assert proposer.poll() is None, "the push ended before the kill"
        victim.kill()
        victim.start()
    assert proposer.wait(timeout=300) == 0
    stats = json.loads(proposer.stdout.read().decode().strip().splitlines()[-1])
    backed = backed_up_to(sks, lsn_int(stats["commit_lsn"]))
    check_store(store, sks[2], lsn_int(stats["start_lsn"]) // SEG, backed)


@pytest.mark.promise(12)
def test_disk_limit_refuses_appends_naming_it_serves_and_resumes(
    safekeeper_factory, store, tmp_path
):
    # 12 MiB per timeline: the push below needs more, so appends stop until backup and
    # removal (keeping 2 MiB) bring the directory back under the limit, then resume.
    sks = start_sks(
        safekeeper_factory, store, [2 * SEG] * 3, extra=("--max-timeline-disk-usage", str(12 * SEG))
    )
    restore = store.outage()  # no backup yet: nothing can be removed, the limit is reached
    # 32 MiB in ~8 s: every node measures its usage (each second) past the limit before the
    # push could complete on two of them, and learns commit LSNs from the appends before.
    ack_log = tmp_path / "acks"
    proposer = push_in_background(sks, "32M", stderr=subprocess.PIPE, rate="4M", ack_log=ack_log)
    try:
        wait_until(
            lambda: all("--max-timeline-disk-usage" in sk.log() for sk in sks),
            "appends refused naming the limit",
            timeout=90,
        )
        # Every node refuses: what is acknowledged fits in the limit (plus one append).
        refused_at = acked(ack_log)
        assert refused_at <= lsn_int("0/1000000") + 13 * SEG, fmt_lsn(refused_at)
        # The daemon still serves: status, and WAL to a reader.
        wait_until(
            lambda: lsn_int(status(sks[0])["commit_lsn"]) >= 0x1100000,
            "a committed first segment",
        )
        recv = tmp_path / "recv"
        recv.mkdir()
        out = receivewal(sks[0], recv, "--slot", "s1", "--endpos", before("0/1100000"))
        assert out.returncode == 0, out.stderr
    finally:
        restore()
    # Backup and removal free space: the push completes by itself.
    assert proposer.wait(timeout=240) == 0, proposer.stderr.read().decode()[-2000:]
    stats = json.loads(proposer.stdout.read().decode().strip().splitlines()[-1])
    end = lsn_int(stats["commit_lsn"])
    # Appends resumed (the limit's own message says "appends resume once ...": the check is of
    # what happened, not of that text). WAL was acknowledged past the refusal, to the end ...
    assert refused_at < acked(ack_log) == end, (fmt_lsn(refused_at), stats)
    # ... each node said its usage came back under the limit ...
    for sk in sks:
        wait_until(
            lambda sk=sk: "disk usage back under the limits: appends resume" in sk.log(),
            f"node {sk.node_id} to take appends again",
            timeout=60,
        )
    # ... and every acknowledged byte, before and after the refusal, is the one sent: on a
    # quorum to the end, on every node up to its own flush LSN, in its local segments or
    # (removed locally) in the store. (The proposer finishes once a quorum has everything: a
    # node still refusing then, or reconnecting, may stay behind, as it would in production
    # until the next proposer or peer recovery.)
    backed_up_to(sks, end)
    wait_until(
        lambda: sum(lsn_int(status(sk)["flush_lsn"]) >= end for sk in sks) >= 2,
        "a quorum at the end",
    )
    objs = store.objects()
    lines = ledger(ack_log)
    at_end = 0
    for sk in sks:
        flush = min(lsn_int(status(sk)["flush_lsn"]), end)
        ranges, checked = verify(lines, [timeline_dir(sk), objs], SEG, hi=flush)
        if flush < end:
            assert checked > 0, (sk.node_id, fmt_lsn(flush))
            continue
        at_end += 1
        assert checked == end - lsn_int(stats["start_lsn"]), (sk.node_id, ranges, checked)
        after, _ = verify(lines, [timeline_dir(sk), objs], SEG, lo=refused_at)
        assert after > 0, "nothing acknowledged after the refusal was checked"
    assert at_end >= 2


def allocated(d: Path) -> int:
    """Bytes allocated to the files of directory `d`, as the daemon measures a timeline."""
    return sum(p.stat().st_blocks * 512 for p in d.iterdir() if p.is_file())


def test_disk_limit_holds_against_an_unpaced_push(safekeeper_factory, tmp_path):
    """Issue 26, item 9: the limit holds at any ingest rate, not only at the 4 MB/s the test
    above paces its push at. An unpaced 64 MiB push (no `--rate`: as fast as the node takes it)
    into a timeline limited to 8 MiB, with nothing to free space (no remote storage): appends
    are refused with the limit's documented error once the timeline holds 8 MiB; its WAL stays
    within one append of the limit (the daemon's status and metrics, and the directory, with
    the next segment prepared in the background); the push never completes; everything
    acknowledged is on disk as sent."""
    limit = 8 * SEG
    sk = safekeeper_factory(1, extra_args=["--max-timeline-disk-usage", str(limit)]).start()
    ack_log = tmp_path / "acks"
    # A first, small push that completes: WAL acknowledged for certain (the unpaced push may
    # see none acknowledged before it is refused).
    first = push([sk], "1M", ack_log)
    assert acked(ack_log) == lsn_int(first["commit_lsn"]) > lsn_int(first["start_lsn"]), first
    with open(tmp_path / "walproposer.log", "wb") as err:
        proposer = push_in_background([sk], "64M", stderr=err, ack_log=ack_log)
    # The documented error (safekeeper/src/disk_usage.rs), naming the usage it counted.
    refusal = re.compile(
        r"the timeline uses (\d+) bytes, at its limit --max-timeline-disk-usage "
        + f"{limit} "
        + re.escape("(appends resume once backup and removal free space)")
    )
    # One append of the proposer: a 128 KiB chunk and the record that crosses its end.
    append = (128 << 10) + 8192
    try:

        def refused_at_the_limit():
            assert proposer.poll() is None, "the whole unpaced push went in"
            # The usage counted: the last measurement (segments preallocated whole included)
            # and the bytes appended since. (A new timeline's first refusals name its start
            # LSN as usage: a daemon bug, not this refusal.)
            used = [int(n) for n in refusal.findall(sk.log())]
            return [n for n in used if limit <= n <= limit + append + 2 * SEG]

        wait_until(refused_at_the_limit, "appends refused at the limit", timeout=120)
        st = status(sk)
        start, flush = lsn_int(st["local_start_lsn"]), lsn_int(st["flush_lsn"])
        on_disk = allocated(timeline_dir(sk))
        metrics = requests.get(f"{sk.http}/metrics", timeout=5).text
        local_wal = next(
            int(float(x.split()[-1]))
            for x in metrics.splitlines()
            if x.startswith("safekeeper_timeline_local_wal_bytes{")
        )
        print(
            f"refused with {(flush - start) >> 10} KiB of WAL, {on_disk >> 10} KiB allocated, "
            f"local WAL {local_wal >> 10} KiB (limit {limit >> 10} KiB); usage named in the "
            f"refusals: {sorted(set(int(n) for n in refusal.findall(sk.log())))}"
        )
        assert flush - start <= limit + append, st
        assert local_wal <= limit + append, local_wal
        # The directory: the WAL, the control file, and segments preallocated whole (the one
        # being written and the next, prepared in the background) that the next measurement
        # counts.
        assert on_disk <= limit + append + 2 * SEG, on_disk
        # Refused at the limit, not well before it.
        assert flush - start >= limit - 3 * SEG, st
        # Nothing acknowledged beyond what the node holds, and all of it as sent.
        max_acked = acked(ack_log)
        ranges, checked = verify(ledger(ack_log), timeline_dir(sk), SEG)
        assert ranges > 0 and max_acked <= flush, (ranges, fmt_lsn(max_acked), st)
        assert checked == max_acked - start, (checked, fmt_lsn(max_acked), st)
        assert max_acked >= lsn_int(first["commit_lsn"])
        assert proposer.poll() is None, "the push completed past the limit"
    finally:
        proposer.kill()
        proposer.wait()


PARTIAL_RE = re.compile(r"^([0-9A-F]{24})_([0-9A-F]{16})_([0-9A-F]{16})\.partial$")


def partials(store) -> dict[int, tuple[str, bytes]]:
    """The store's partial segments by end LSN: (object name, bytes)."""
    out = {}
    for name, body in store.objects().items():
        m = PARTIAL_RE.match(name)
        if m:
            out[int(m.group(3), 16)] = (name, body)
    return out


@pytest.mark.promise(12)
def test_a_quiet_timeline_has_its_committed_wal_mid_segment_in_the_store(
    safekeeper_factory, store, tmp_path
):
    """Partial-segment backup (issue 30): a timeline whose commits stop mid-segment has the
    committed part of that segment stored within --partial-backup-timeout, as one object named by
    term and end LSN that real pg_waldump reads to its end; a later commit supersedes it and the
    older object is removed."""
    # --wal-keep-size as its default (128 MiB): nothing is removed here.
    sks = start_sks(
        safekeeper_factory, store, [128 << 20] * 3, extra=("--partial-backup-timeout", "1s")
    )
    # Two complete segments and a third one started (the proposer starts at a segment start).
    stats = push(sks, total=str(2 * SEG + 300_000))
    start, end = lsn_int(stats["start_lsn"]), lsn_int(stats["commit_lsn"])
    assert end % SEG != 0, stats
    t0 = time.monotonic()
    first = wait_until(
        lambda: partials(store).get(end), f"a partial segment ending at {end:#x}", timeout=60
    )
    waited = time.monotonic() - t0
    name, body = first
    segno = end // SEG
    assert name.startswith(seg_name(segno)), name
    assert len(body) == end % SEG, (name, len(body))
    local = (timeline_dir(sks[0]) / (seg_name(segno) + ".partial")).read_bytes()
    assert body == local[: end % SEG], "the partial object differs from the committed WAL"
    # The complete segments are stored as before, and no partial object is taken for one.
    backed_up_to(sks, end)
    assert seg_name(segno) not in store.objects()
    # pg_waldump reads the stored WAL (the partial object, completed with zeros as a segment
    # file) up to its end.
    wal = tmp_path / "from-store"
    wal.mkdir()
    (wal / seg_name(segno)).write_bytes(body + bytes(SEG - len(body)))
    waldump = require_pg_tool("pg_waldump")
    seg_start = fmt_lsn(segno * SEG)
    out = subprocess.run(
        [waldump, "-p", str(wal), "-s", seg_start, "-e", fmt_lsn(end), seg_name(segno)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("rmgr:") > 10, out.stdout[-2000:]

    # More WAL in the same segment: a new partial object, and the old one goes.
    stats = push(sks, total="100000")
    end2 = lsn_int(stats["commit_lsn"])
    assert end2 // SEG == segno and end2 > end, (hex(end), hex(end2))
    wait_until(
        lambda: set(partials(store)) == {end2},
        f"only the partial segment ending at {end2:#x} left",
        timeout=60,
    )
    total = 0
    for sk in sks:
        m = re.search(
            r'^safekeeper_partial_backups_total\{outcome="uploaded"\} (\d+)',
            requests.get(f"{sk.http}/metrics", timeout=5).text,
            re.M,
        )
        total += int(m.group(1)) if m else 0
    assert total >= 2, total
    print(f"partial segment stored {waited:.1f} s after the last commit (timeout 1 s)")
    assert start < end
