"""A nemesis run of real daemons (issue 26, Jepsen-style): three safekeepers backing up to a
real S3 server (moto), a walproposer pushing with its `--ack-log` content ledger, a
pg_receivewal reader from the timeline's start (served from the store once removed), and a
seeded schedule of faults in between:

- kill -9 of a safekeeper at a random moment, or right after it removed a segment;
- store outages (the S3 server frozen);
- a full disk on one node: each node's data directory is a real tmpfs of its own (mounting
  needs root: CI runs as root, elsewhere the test skips), filled up with a file until writes
  that need new space fail with ENOSPC (new segments, control-file saves, segment preparation;
  removal may free some meanwhile) for a while, then the file is removed and space returns;
- another timeline deleted on every node and created again with the same ids (refused while
  its remote objects are being deleted; its objects are gone before it exists again);
- one replacement of a node by pull_timeline and a membership switch (`local-cluster
  replace`), onto a node that starts from the backed-up point;
- status requests in a tight loop on every node all along (each daemon's RSS sampled after
  each), and a pg_receivewal reader from the timeline's start (restarted on a live member when
  its node dies).

At the end: a second pg_receivewal from the timeline's start, after its WAL was removed
locally, is served from the store (the node's remote read counter covers all it asked for);
every acknowledged byte identical (by the ledger's SHA-256) on every member, local or in the
store, and in what the readers received; every complete segment below the commit is in the
store, whole, identical to the members' WAL, and the ledger's digests hold on the store's bytes
alone; every node restarts; the replacement completed; no status request waited more than 10 s
(a timed-out one counts as its whole timeout; a connection error from a node that was up
throughout fails the run); RSS bounded all along, read while the daemons ran (before the final
restarts). The seed is printed (and named on failure).

Knobs: NEMESIS_SEEDS (comma-separated, default "1,2"), NEMESIS_STEPS (default 8; the long mode is
e.g. NEMESIS_STEPS=200 NEMESIS_SEEDS=1,2,3)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import signal
import subprocess
import threading
import time

import pytest
import requests

from fixtures.daemon import RELEASE_DIR, TENANT, TIMELINE, fmt_lsn, lsn_int, wait_until
from fixtures.ledger import check_ledger, ledger, verify, verify_received
from fixtures.tools import fill, require, tmpfs
from test_node_replacement import TL_PATH, Cluster
from test_wal_lifecycle import BUCKET, S3Store

SEG = 1 << 20
SEEDS = [int(s) for s in os.environ.get("NEMESIS_SEEDS", "1,2").split(",")]
STEPS = int(os.environ.get("NEMESIS_STEPS", "8"))
TIMELINE2 = "0f" * 16


def seg_name(segno: int) -> str:
    per = 2**32 // SEG
    return f"{1:08X}{segno // per:08X}{segno % per:08X}"


class Reader(threading.Thread):
    """Real pg_receivewal from the timeline's start (a slot), on a current member, started
    again whenever its node dies: what it receives below the local WAL comes from the store."""

    def __init__(self, cluster: Cluster, members: list[int], dest):
        super().__init__(daemon=True)
        self.cluster, self.members, self.dest = cluster, members, dest
        self.stop_flag = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.runs = 0

    def run(self):
        exe = require("pg_receivewal", "postgresql-client-15")
        while not self.stop_flag.is_set():
            node = self.members[-1]
            self.proc = subprocess.Popen(
                [
                    exe,
                    "-D",
                    str(self.dest),
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(self.cluster.sk(node).pg_port),
                ]
                + ["-U", "postgres", "--slot", "s1", "--no-loop", "--no-password"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self.runs += 1
            while self.proc.poll() is None and not self.stop_flag.is_set():
                time.sleep(0.1)
            time.sleep(0.3)

    def stop(self):
        self.stop_flag.set()
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()
        self.join(timeout=30)


# A status request that takes longer than this is given up and counted as a wait of its full
# duration (more than the 10 s promised).
STATUS_TIMEOUT = 15
# RSS bounds of every daemon, sampled all along the run: any sample, and the samples of a
# process past its first WARM_UP seconds. Start-up no longer peaks (profiling::warm_up used to
# symbolize one backtrace through the binary's full debug info: ~316 MiB for ~0.1 s); symbols
# now come from an on-disk index read with pread. The steady state is ~40-70 MiB.
RSS_BOUND = 192 << 20
RSS_STEADY_BOUND = 192 << 20
WARM_UP = 2.0


def rss_of(pid: int) -> int | None:
    """VmRSS of `pid` in bytes, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Hammer(threading.Thread):
    """Status requests in a tight loop on every node, and each daemon's RSS sampled after each
    of its requests (the largest kept per node, while it ran: a restart does not hide it; and
    the largest past each process's start-up).

    Every request's duration counts, answered or not: one that timed out waited
    STATUS_TIMEOUT. A connection error is expected from a node the schedule has down (killed,
    not yet restarted, or not started yet: `down()`/`up()` around it); from a node that was up
    for the whole request it is a failure, as is any timeout."""

    def __init__(self, cluster: Cluster, nodes: list[int], up: list[int]):
        super().__init__(daemon=True)
        self.cluster, self.nodes = cluster, nodes
        self.stop_flag = threading.Event()
        self.lock = threading.Lock()
        # Node -> incremented by every down() and up(): a request on a node whose epoch did
        # not change and that was up meanwhile saw a live node.
        self.epoch = {i: 0 for i in nodes}
        self.live = set(up)
        self.longest = (0.0, None, None)  # (seconds, node, outcome)
        self.served = 0
        self.outcomes: dict[str, int] = {}
        self.failures: list[str] = []
        # Node -> (largest RSS, what the schedule was doing then): of any sample, and of the
        # samples of a process seen for WARM_UP seconds already.
        self.phase = "start"
        self.rss_max: dict[int, tuple[int, str]] = {}
        self.rss_steady: dict[int, tuple[int, str]] = {}
        self.first_seen: dict[int, float] = {}  # pid -> when

    def down(self, i: int) -> None:
        with self.lock:
            self.live.discard(i)
            self.epoch[i] += 1

    def up(self, i: int) -> None:
        with self.lock:
            self.live.add(i)
            self.epoch[i] += 1

    def sample_rss(self, i: int) -> None:
        try:
            pid = self.cluster.pid(i)
        except (OSError, ValueError):
            return  # not started yet
        rss = rss_of(pid)
        if rss is None:
            return
        seen = self.first_seen.setdefault(pid, time.monotonic())
        if rss > self.rss_max.get(i, (0, ""))[0]:
            self.rss_max[i] = (rss, self.phase)
        if time.monotonic() - seen >= WARM_UP and rss > self.rss_steady.get(i, (0, ""))[0]:
            self.rss_steady[i] = (rss, self.phase)

    def run(self):
        while not self.stop_flag.is_set():
            for i in list(self.nodes):
                with self.lock:
                    was = (i in self.live, self.epoch[i])
                started = time.monotonic()
                try:
                    r = requests.get(self.cluster.sk(i).http + TL_PATH, timeout=STATUS_TIMEOUT)
                    outcome = str(r.status_code)
                except requests.Timeout as e:
                    outcome, error = "timeout", e
                except requests.RequestException as e:
                    outcome, error = "connection error", e
                took = time.monotonic() - started
                if outcome == "timeout":
                    took = max(took, STATUS_TIMEOUT)
                with self.lock:
                    live = was == (True, self.epoch[i]) and i in self.live
                self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
                if outcome == "200":
                    self.served += 1
                elif outcome == "timeout" or (outcome == "connection error" and live):
                    self.failures.append(f"node {i}: {outcome} after {took:.1f} s: {error}")
                if took > self.longest[0]:
                    self.longest = (took, i, outcome)
                self.sample_rss(i)


def wal_of(cluster: Cluster, i: int, store: S3Store, start: int, end: int) -> bytes:
    """The bytes [start, end) of node i's timeline: its local segments, else the store's."""
    d = cluster.sk(i).datadir / TENANT / TIMELINE
    out = bytearray()
    pos = start
    while pos < end:
        name = seg_name(pos // SEG)
        n = min(end - pos, SEG - pos % SEG)
        for p in (d / name, d / f"{name}.partial"):
            if p.exists():
                data = p.read_bytes()
                break
        else:
            data = store.s3.get_object(Bucket=BUCKET, Key=f"sk/{TENANT}/{TIMELINE}/{name}")[
                "Body"
            ].read()
        out += data[pos % SEG : pos % SEG + n]
        pos += n
    return bytes(out)


def status(cluster: Cluster, i: int, path: str = TL_PATH) -> dict:
    r = requests.get(cluster.sk(i).http + path, timeout=10)
    r.raise_for_status()
    return r.json()


def objects(store: S3Store, timeline: str) -> list[str]:
    pages = store.s3.get_paginator("list_objects_v2").paginate(
        Bucket=BUCKET, Prefix=f"sk/{TENANT}/{timeline}/"
    )
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


@pytest.fixture
def node_disks(tmp_path):
    """Each node's data directory (nodes 1 to 4 of the cluster in `tmp_path`) on a real tmpfs
    of its own, so a full disk is one node's alone. 256 MiB each (in RAM, and a full-disk fault
    fills one): the local WAL stays a few segments (`--wal-keep-size 0`, backed up as it
    goes)."""
    with contextlib.ExitStack() as stack:
        for i in range(1, 5):
            node = tmp_path / "cluster" / f"sk{i}"
            node.mkdir(parents=True)
            stack.enter_context(tmpfs(node / "data", "256m"))
        yield


@pytest.mark.promise(14)
@pytest.mark.parametrize("seed", SEEDS)
def test_nemesis(tmp_path, seed, node_disks):
    print(f"NEMESIS_SEEDS={seed} NEMESIS_STEPS={STEPS}")
    rng = random.Random(seed)
    store = S3Store(tmp_path)
    cluster = Cluster(tmp_path, 4)
    cluster.env.update(store.env)
    # No segment pool: on a 256 MiB disk it would hold a quarter of it, and give it back when a
    # disk-full fault fills the rest (undoing the fault).
    cluster.env["LOCAL_CLUSTER_SK_ARGS"] = (
        f"--remote-storage {store.url} --wal-keep-size 0 --prepared-segments 0"
    )
    # The real daemon (every fault here is real: no failpoint).
    cluster.env["LOCAL_CLUSTER_SK_BIN"] = str(RELEASE_DIR / "safekeeper")
    out = cluster.run("start", "3")
    assert out.returncode == 0, out.stderr
    members = [1, 2, 3]
    hammer = Hammer(cluster, [1, 2, 3, 4], up=members)
    hammer.start()
    recv = tmp_path / "recv"
    recv.mkdir()
    reader = Reader(cluster, members, recv)
    ack_log = tmp_path / "acks"
    wp_log = open(tmp_path / "walproposer.log", "wb")
    wp = subprocess.Popen(
        [str(RELEASE_DIR / "walproposer"), "--safekeepers"]
        + [",".join(f"127.0.0.1:{cluster.pg_base + i}" for i in members)]
        + ["--wal-seg-size", str(SEG), "--total", "10G", "--rate", "2M"]
        + ["--record-size", "4000", "--ack-log", str(ack_log)],
        stdout=subprocess.DEVNULL,
        stderr=wp_log,
        env={**os.environ, "RUST_LOG": "info"},
    )
    reader.start()
    faults: list[str] = []
    replaced = False
    try:
        wait_until(lambda: max(e for e, _ in ledger(ack_log) or [(0, None)]) > 4 * SEG, "commits")
        # One replacement per run, at a seeded step; the other faults at random.
        replace_at = rng.randrange(STEPS)
        # And one full disk at another seeded step (more may come at random).
        full_at = (replace_at + 1 + rng.randrange(STEPS - 1)) % STEPS
        for step in range(STEPS):
            live = [i for i in members]
            fault = rng.choice(["kill", "kill-after-removal", "outage", "recreate", "disk-full"])
            if step == replace_at:
                fault = "replace"
            elif step == full_at:
                fault = "disk-full"
            faults.append(fault)
            print(f"step {step}: {fault}")
            hammer.phase = f"step {step} ({fault})"
            if fault in ("kill", "kill-after-removal"):
                victim = rng.choice(live)
                if fault == "kill-after-removal":
                    was = lsn_int(status(cluster, victim)["removal_horizon_lsn"])
                    wait_until(
                        lambda v=victim, w=was: lsn_int(status(cluster, v)["removal_horizon_lsn"])
                        > w,
                        f"a removal on {victim}",
                        timeout=60,
                        interval=0.005,
                    )
                else:
                    time.sleep(rng.uniform(0.05, 1.5))
                hammer.down(victim)
                hammer.phase = f"step {step} ({fault} of {victim})"
                os.kill(cluster.pid(victim), signal.SIGKILL)
                time.sleep(rng.uniform(0.1, 1.0))
                r = cluster.run("restart", str(victim))
                assert r.returncode == 0, f"seed {seed}: node {victim} does not restart\n{r.stderr}"
                hammer.up(victim)
                hammer.phase = f"step {step} ({victim} restarted)"
            elif fault == "outage":
                store.proc.send_signal(signal.SIGSTOP)
                time.sleep(rng.uniform(0.5, 3))
                store.proc.send_signal(signal.SIGCONT)
            elif fault == "disk-full":
                victim = rng.choice(live)
                log = cluster.dir / f"sk{victim}" / "safekeeper.log"
                before = enospc_lines(log)
                filler = fill(cluster.sk(victim).datadir)
                hammer.phase = f"step {step} (disk of {victim} full)"
                try:
                    time.sleep(rng.uniform(0.5, 3))
                    # The fault took: the node's writes failed for want of space.
                    wait_until(
                        lambda log=log, before=before: enospc_lines(log) > before,
                        f"node {victim} failing writes with ENOSPC",
                        timeout=30,
                    )
                    # The node kept serving while its writes failed.
                    st = status(cluster, victim)
                    assert st["flush_lsn"], f"seed {seed}: node {victim} status"
                finally:
                    filler.unlink()
            elif fault == "recreate":
                recreate_other_timeline(cluster, store, members, seed)
            elif fault == "replace":
                old = rng.choice(members)
                new = 4
                hammer.down(old)
                os.kill(cluster.pid(old), signal.SIGKILL)
                r = cluster.run("replace", str(old), str(new), timeout=300)
                assert (
                    r.returncode == 0
                ), f"seed {seed}: replace {old} by {new}\n{r.stdout}{r.stderr}"
                hammer.up(new)
                members[:] = [i for i in members if i != old] + [new]
                replaced = True
            wait_until(lambda: wp.poll() is None, "the proposer running")
            time.sleep(rng.uniform(0.2, 1.0))
    except BaseException:
        # Nothing of a failed run may outlive it: its daemons spun on a data directory that the
        # tmpfs teardown had removed (a failed run once left three at 45 % of a core each).
        hammer.stop_flag.set()
        reader.stop()
        cluster.run("stop")
        store.close()
        raise
    finally:
        wp.send_signal(signal.SIGKILL)
        wp.wait()
        wp_log.close()
    reader.stop()
    try:
        max_acked = max(e for e, _ in ledger(ack_log))
        # Everyone up to date.
        for i in members:
            wait_until(
                lambda i=i: lsn_int(status(cluster, i)["flush_lsn"]) >= max_acked
                or lsn_int(status(cluster, i)["commit_lsn"]) >= max_acked,
                f"node {i} to hold the acknowledged WAL",
                timeout=120,
            )
        start = lsn_int(status(cluster, members[0])["timeline_start_lsn"])
        # A second reader, from the timeline's start once it was removed locally: served from
        # the store (the node's remote read counter says so).
        recv2 = tmp_path / "recv2"
        recv2.mkdir()
        hammer.phase = "reader 2"
        end2, from_store = reader_from_the_store(cluster, members[0], start, recv2, seed)
        hammer.stop_flag.set()
        hammer.join(timeout=2 * STATUS_TIMEOUT)
        assert not hammer.is_alive(), f"seed {seed}: a status request never returned"
        # RSS bounded: the largest sampled while each daemon ran, before they are restarted.
        for i in members:
            hammer.sample_rss(i)
        assert set(members) <= set(hammer.rss_steady), (members, hammer.rss_steady)
        for bound, seen in ((RSS_BOUND, hammer.rss_max), (RSS_STEADY_BOUND, hammer.rss_steady)):
            for i, (rss, phase) in sorted(seen.items()):
                assert rss < bound, f"seed {seed}: node {i}: RSS {rss >> 20} MiB at {phase}"
        # Every node restarts.
        for i in members:
            os.kill(cluster.pid(i), signal.SIGKILL)
            r = cluster.run("restart", str(i))
            assert r.returncode == 0, f"seed {seed}: node {i} does not restart\n{r.stderr}"
        lines = ledger(ack_log)
        for i in members:
            wal = wal_of(cluster, i, store, start, max_acked)
            ranges, checked = check_ledger(lines, wal, start)
            assert ranges > 0, "the ack log carries no digests"
        reference = wal_of(cluster, members[0], store, start, max_acked)
        # Every complete segment in the store: identical to the ledger and the members' WAL.
        stored, stored_checked = check_store(
            cluster, store, members, lines, reference, start, max_acked, seed
        )
        # The readers got the WAL from the timeline's start, identical to the members'
        # (complete segments; committed WAL only, compared up to what the ledger acknowledged).
        compared = compare_received(recv, reference, start, max_acked, f"seed {seed}: reader 1")
        assert compared > 0
        received = sorted(p.name for p in recv.iterdir() if len(p.name) == 24)
        assert received and received[0] == seg_name(start // SEG), (received[:3], reader.runs)
        compared2 = compare_received(recv2, reference, start, end2, f"seed {seed}: reader 2")
        assert compared2 >= end2 - start - SEG, (compared2, end2 - start)
        # And by the ledger's digests: reader 1 up to its last complete segment, reader 2 up to
        # where it was asked to stop.
        complete1 = max(int(n[8:16], 16) * (2**32 // SEG) + int(n[16:], 16) for n in received) + 1
        assert verify_received(ack_log, recv, min(complete1 * SEG, max_acked), SEG).ranges > 0
        assert verify_received(ack_log, recv2, end2, SEG).ranges > 0
        digest = {
            hashlib.sha256(wal_of(cluster, i, store, start, max_acked)).hexdigest() for i in members
        }
        assert len(digest) == 1, f"seed {seed}: the members' WAL differs"
        assert replaced, "the schedule replaced no node"
        assert "disk-full" in faults, "the schedule filled no disk"
        if replaced:
            st = status(cluster, members[0])
            assert sorted(m["id"] for m in st["mconf"]["members"]) == sorted(members), st
        longest, longest_node, longest_outcome = hammer.longest
        print(
            f"seed {seed}: faults {faults}; {max_acked - start} bytes acknowledged, checked on "
            f"{len(members)} members, {stored} segments in the store ({stored_checked} bytes "
            f"by the ledger), {compared} bytes by reader 1 ({reader.runs} runs), "
            f"{compared2} by reader 2 ({from_store} bytes read from the store); "
            f"status requests {hammer.outcomes}, longest {longest:.2f} s (node "
            f"{longest_node}, {longest_outcome}); RSS max "
            + ", ".join(
                f"node {i} {rss >> 20} MiB ({phase}), {hammer.rss_steady[i][0] >> 20} MiB "
                f"past start-up ({hammer.rss_steady[i][1]})"
                for i, (rss, phase) in sorted(hammer.rss_max.items())
                if i in hammer.rss_steady
            )
        )
        assert hammer.served > 0
        assert not hammer.failures, f"seed {seed}: status requests failed: {hammer.failures[:5]}"
        assert longest < 10, f"seed {seed}: a status request waited {longest:.1f} s"
    finally:
        hammer.stop_flag.set()
        cluster.run("stop")
        store.close()


def enospc_lines(log) -> int:
    """How often the node's log says a write found no space (the WAL store's own error, or the
    OS error's text from other writers)."""
    return log.read_text(errors="replace").lower().count("no space left on device")


def metric(cluster: Cluster, i: int, name: str) -> float:
    text = requests.get(cluster.sk(i).http + "/metrics", timeout=10).text
    return next(float(x.split()[-1]) for x in text.splitlines() if x.startswith(f"{name} "))


def reader_from_the_store(cluster: Cluster, node: int, start: int, dest, seed: int):
    """A real pg_receivewal from the timeline's start on `node`, once the node has removed
    that WAL locally, up to at most 16 segments (below the removal horizon). Returns where it
    was asked to stop and how many bytes the node read from the store meanwhile (at least all
    of it: nothing was local)."""
    horizon = wait_until(
        lambda: (h := lsn_int(status(cluster, node)["removal_horizon_lsn"])) > start + 2 * SEG
        and h,
        f"node {node} to remove its first segments",
        timeout=60,
    )
    end = min(horizon, start + 16 * SEG)
    was = metric(cluster, node, "safekeeper_remote_read_bytes_total")
    exe = require("pg_receivewal", "postgresql-client-15")
    out = subprocess.run(
        [exe, "-D", str(dest), "-h", "127.0.0.1", "-p", str(cluster.sk(node).pg_port)]
        + ["-U", "postgres", "--slot", "s2", "--no-loop", "--no-password", "-v"]
        + ["--endpos", fmt_lsn(end - 1)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"seed {seed}: reader 2 on node {node}: {out.stderr[-2000:]}"
    assert f"starting log streaming at {fmt_lsn(start)}" in out.stderr, out.stderr
    read = metric(cluster, node, "safekeeper_remote_read_bytes_total") - was
    assert read >= end - start, f"seed {seed}: {read} of {end - start} bytes read from the store"
    return end, int(read)


def compare_received(recv, reference: bytes, start: int, upto: int, what: str) -> int:
    """Compares the complete segments pg_receivewal wrote to `recv` with `reference` (the WAL
    from `start`) below `upto`; returns the bytes compared."""
    compared = 0
    for p in sorted(recv.iterdir()):
        if len(p.name) != 24:
            continue  # .partial
        segno = int(p.name[8:16], 16) * (2**32 // SEG) + int(p.name[16:24], 16)
        lo, hi = max(segno * SEG, start), min((segno + 1) * SEG, upto)
        if hi > lo:
            got = p.read_bytes()[lo - segno * SEG : hi - segno * SEG]
            assert got == reference[lo - start : hi - start], f"{what}: {p.name}"
            compared += hi - lo
    return compared


def check_store(cluster, store, members, lines, reference, start, max_acked, seed):
    """Once the backup reached the segment of the members' commit: every complete segment
    below it is in the store, every stored segment is whole and identical to the members' WAL
    (the ledger-checked `reference` below `max_acked`, and each member's local copy where it
    still has the complete segment below its commit), and the ledger's digests hold on the
    store's own bytes. Returns (segments, bytes checked by the ledger)."""
    commits = {i: lsn_int(status(cluster, i)["commit_lsn"]) for i in members}
    target = min(commits.values()) // SEG * SEG
    wait_until(
        lambda: max(lsn_int(status(cluster, i)["backup_lsn"]) for i in members) >= target,
        f"the backup to reach {fmt_lsn(target)}",
        timeout=120,
    )
    stored = {}
    for key in objects(store, TIMELINE):
        name = key.rsplit("/", 1)[1]
        if len(name) == 24 and all(c in "0123456789ABCDEF" for c in name):
            stored[int(name[8:16], 16) * (2**32 // SEG) + int(name[16:24], 16)] = key
    missing = [seg_name(n) for n in range(start // SEG, target // SEG) if n not in stored]
    assert not missing, f"seed {seed}: complete segments not in the store: {missing[:5]}"
    prefix: dict[str, bytes] = {}  # the stored segments from the first one on, without a gap
    for segno in sorted(stored):
        data = store.s3.get_object(Bucket=BUCKET, Key=stored[segno])["Body"].read()
        name = seg_name(segno)
        assert len(data) == SEG, f"seed {seed}: stored {name} has {len(data)} bytes"
        lo, hi = max(segno * SEG, start), min((segno + 1) * SEG, max_acked)
        if hi > lo:
            assert (
                data[lo - segno * SEG : hi - segno * SEG] == reference[lo - start : hi - start]
            ), f"seed {seed}: stored {name} differs from the acknowledged WAL"
        for i in members:
            local = cluster.sk(i).datadir / TENANT / TIMELINE / name
            if (segno + 1) * SEG <= commits[i] and local.exists():
                assert local.read_bytes() == data, f"seed {seed}: stored {name} != node {i}'s"
        if segno == start // SEG + len(prefix):
            prefix[name] = data
    # The ledger against the store alone: every acknowledged range within the stored prefix.
    stored_end = (start // SEG + len(prefix)) * SEG
    ranges, checked = verify(lines, prefix, SEG, lo=start, hi=stored_end)
    assert ranges > 0, f"seed {seed}: no acknowledged range checked in the store"
    return len(stored), checked


def create_everywhere(cluster: Cluster, members: list[int], create: dict, seed: int) -> None:
    """Creates timeline 2 on every member, retrying while a deletion of it is still deleting
    its remote objects (409 "being deleted")."""
    for i in members:
        url = f"{cluster.sk(i).http}/v1/tenant/{TENANT}/timeline"
        deadline = time.monotonic() + 60
        r = requests.post(url, json=create, timeout=30)
        while r.status_code == 409 and "being deleted" in r.text:
            assert time.monotonic() < deadline, f"seed {seed}: node {i} never finished the deletion"
            time.sleep(0.2)
            r = requests.post(url, json=create, timeout=30)
        assert r.status_code in (200, 201), f"seed {seed}: create on {i}: {r.status_code} {r.text}"


def recreate_other_timeline(cluster: Cluster, store: S3Store, members: list[int], seed: int):
    """Timeline 2 is created, gets WAL (backed up), is deleted on every member, and is created
    again with the same ids: refused while its remote objects are being deleted, and the store
    holds none of the old one's objects when it exists again. It is left deleted (a timeline
    without a proposer would hold up a membership switch)."""
    path2 = f"/v1/tenant/{TENANT}/timeline/{TIMELINE2}"
    create = {"timeline_id": TIMELINE2, "pg_version": 150000, "system_id": 7}
    create["wal_seg_size"] = SEG
    create_everywhere(cluster, members, create, seed)
    subprocess.run(
        [str(RELEASE_DIR / "walproposer"), "--safekeepers"]
        + [",".join(f"127.0.0.1:{cluster.pg_base + i}" for i in members)]
        + ["--timeline-id", TIMELINE2, "--system-id", "7", "--wal-seg-size", str(SEG)]
        + ["--total", "3M"],
        check=True,
        capture_output=True,
        timeout=120,
        env={**os.environ, "RUST_LOG": "warn"},
    )
    wait_until(lambda: objects(store, TIMELINE2), "timeline 2 backed up", timeout=60)

    def delete_everywhere():
        for i in members:
            r = requests.delete(cluster.sk(i).http + path2, timeout=30)
            assert r.status_code == 200, r.text

    delete_everywhere()
    wait_until(lambda: not objects(store, TIMELINE2), "timeline 2's objects deleted", timeout=60)
    create_everywhere(cluster, members, create, seed)
    assert not objects(store, TIMELINE2), "the recreated timeline sees the old one's objects"
    delete_everywhere()
