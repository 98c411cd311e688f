"""A nemesis run of real daemons (issue 26, Jepsen-style): three safekeepers backing up to a
real S3 server (moto), a walproposer pushing with its `--ack-log` content ledger, a
pg_receivewal reader from the timeline's start (served from the store once removed), and a
seeded schedule of faults in between:

- kill -9 of a safekeeper at a random moment, or right after it removed a segment;
- store outages (the S3 server frozen);
- a full disk on one node (every WAL write fails with ENOSPC for a while: failpoint
  `wal-write-enospc` of the `safekeeper-testing` build the cluster runs), then space returns;
- another timeline deleted on every node and created again with the same ids (refused while
  its remote objects are being deleted; its objects are gone before it exists again);
- one replacement of a node by pull_timeline and a membership switch (`local-cluster
  replace`), onto a node that starts from the backed-up point;
- status requests in a tight loop on every node all along, and a pg_receivewal reader from the
  timeline's start (restarted on a live member when its node dies).

At the end: every acknowledged byte identical (by the ledger's SHA-256) on every member, local
or in the store, and in what the reader received; every node restarts; the replacement
completed; no status request waited more than 10 s; RSS bounded. The seed is printed (and
named on failure).

Knobs: NEMESIS_SEEDS (comma-separated, default "1,2"), NEMESIS_STEPS (default 8; the long mode is
e.g. NEMESIS_STEPS=200 NEMESIS_SEEDS=1,2,3)."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import threading
import time

import pytest
import requests

from fixtures.daemon import RELEASE_DIR, TENANT, TIMELINE, lsn_int, wait_until
from fixtures.tools import require
from test_crash import check_ledger, ledger
from test_faults import failpoint
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


class Hammer(threading.Thread):
    """Status requests in a tight loop on every node; the longest successful one is kept."""

    def __init__(self, cluster: Cluster, nodes: list[int]):
        super().__init__(daemon=True)
        self.cluster, self.nodes = cluster, nodes
        self.stop_flag = threading.Event()
        self.longest = 0.0
        self.served = 0

    def run(self):
        while not self.stop_flag.is_set():
            for i in list(self.nodes):
                started = time.monotonic()
                try:
                    r = requests.get(self.cluster.sk(i).http + TL_PATH, timeout=30)
                except requests.RequestException:
                    continue  # the node is down
                took = time.monotonic() - started
                if r.status_code == 200:
                    self.served += 1
                    self.longest = max(self.longest, took)


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


@pytest.mark.promise(14)
@pytest.mark.parametrize("seed", SEEDS)
def test_nemesis(tmp_path, seed):
    print(f"NEMESIS_SEEDS={seed} NEMESIS_STEPS={STEPS}")
    rng = random.Random(seed)
    store = S3Store(tmp_path)
    cluster = Cluster(tmp_path, 4)
    cluster.env.update(store.env)
    cluster.env["LOCAL_CLUSTER_SK_ARGS"] = f"--remote-storage {store.url} --wal-keep-size 0"
    # The testing build: the same daemon plus failpoints (the full-disk fault).
    cluster.env["LOCAL_CLUSTER_SK_BIN"] = str(RELEASE_DIR / "safekeeper-testing")
    out = cluster.run("start", "3")
    assert out.returncode == 0, out.stderr
    members = [1, 2, 3]
    hammer = Hammer(cluster, [1, 2, 3, 4])
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
                os.kill(cluster.pid(victim), signal.SIGKILL)
                time.sleep(rng.uniform(0.1, 1.0))
                r = cluster.run("restart", str(victim))
                assert r.returncode == 0, f"seed {seed}: node {victim} does not restart\n{r.stderr}"
            elif fault == "outage":
                store.proc.send_signal(signal.SIGSTOP)
                time.sleep(rng.uniform(0.5, 3))
                store.proc.send_signal(signal.SIGCONT)
            elif fault == "disk-full":
                victim = rng.choice(live)
                log = cluster.dir / f"sk{victim}" / "safekeeper.log"
                before = log.read_text(errors="replace").count("no space left on device")
                failpoint(cluster.sk(victim), "wal-write-enospc", True)
                time.sleep(rng.uniform(0.5, 3))
                # The fault took: the node refused appends for want of space.
                wait_until(
                    lambda log=log, before=before: log.read_text(errors="replace").count(
                        "no space left on device"
                    )
                    > before,
                    f"node {victim} refusing appends with ENOSPC",
                    timeout=30,
                )
                # The node kept serving while its writes failed.
                assert status(cluster, victim)["flush_lsn"], f"seed {seed}: node {victim} status"
                failpoint(cluster.sk(victim), "wal-write-enospc", False)
            elif fault == "recreate":
                recreate_other_timeline(cluster, store, members, seed)
            elif fault == "replace":
                old = rng.choice(members)
                new = 4
                os.kill(cluster.pid(old), signal.SIGKILL)
                r = cluster.run("replace", str(old), str(new), timeout=300)
                assert (
                    r.returncode == 0
                ), f"seed {seed}: replace {old} by {new}\n{r.stdout}{r.stderr}"
                members[:] = [i for i in members if i != old] + [new]
                replaced = True
            wait_until(lambda: wp.poll() is None, "the proposer running")
            time.sleep(rng.uniform(0.2, 1.0))
    finally:
        wp.send_signal(signal.SIGKILL)
        wp.wait()
        wp_log.close()
    hammer.stop_flag.set()
    hammer.join(timeout=60)
    reader.stop()
    try:
        max_acked = max(e for e, _ in ledger(ack_log))
        # Everyone up to date and every node restarts.
        for i in members:
            wait_until(
                lambda i=i: lsn_int(status(cluster, i)["flush_lsn"]) >= max_acked
                or lsn_int(status(cluster, i)["commit_lsn"]) >= max_acked,
                f"node {i} to hold the acknowledged WAL",
                timeout=120,
            )
        for i in members:
            os.kill(cluster.pid(i), signal.SIGKILL)
            r = cluster.run("restart", str(i))
            assert r.returncode == 0, f"seed {seed}: node {i} does not restart\n{r.stderr}"
        start = lsn_int(status(cluster, members[0])["timeline_start_lsn"])
        lines = ledger(ack_log)
        for i in members:
            wal = wal_of(cluster, i, store, start, max_acked)
            ranges, checked = check_ledger(lines, wal, start)
            assert ranges > 0, "the ack log carries no digests"
        # The reader got the WAL from the timeline's start, identical to the members' (complete
        # segments; committed WAL only, compared up to what the ledger acknowledged).
        received = sorted(p.name for p in recv.iterdir() if len(p.name) == 24)
        assert received and received[0] == seg_name(start // SEG), (received[:3], reader.runs)
        reference = wal_of(cluster, members[0], store, start, max_acked)
        compared = 0
        for name in received:
            segno = int(name[8:16], 16) * (2**32 // SEG) + int(name[16:24], 16)
            lo, hi = max(segno * SEG, start), min((segno + 1) * SEG, max_acked)
            if hi > lo:
                got = (recv / name).read_bytes()[lo - segno * SEG : hi - segno * SEG]
                assert got == reference[lo - start : hi - start], f"seed {seed}: reader's {name}"
                compared += hi - lo
        assert compared > 0
        digest = {
            hashlib.sha256(wal_of(cluster, i, store, start, max_acked)).hexdigest() for i in members
        }
        assert len(digest) == 1, f"seed {seed}: the members' WAL differs"
        assert replaced, "the schedule replaced no node"
        assert "disk-full" in faults, "the schedule filled no disk"
        if replaced:
            st = status(cluster, members[0])
            assert sorted(m["id"] for m in st["mconf"]["members"]) == sorted(members), st
        for i in members:
            rss = int(open(f"/proc/{cluster.pid(i)}/status").read().split("VmRSS:")[1].split()[0])
            assert rss < 400 << 10, f"node {i}: RSS {rss >> 10} MiB"
        print(
            f"seed {seed}: faults {faults}; {max_acked - start} bytes acknowledged, checked on "
            f"{len(members)} members and {compared} by a reader ({reader.runs} runs); "
            f"{hammer.served} status requests, longest "
            f"{hammer.longest:.2f} s"
        )
        assert hammer.served > 0
        assert hammer.longest < 10, f"a status request waited {hammer.longest:.1f} s"
    finally:
        cluster.run("stop")
        store.close()


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
