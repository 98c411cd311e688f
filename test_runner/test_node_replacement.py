"""Operating a safekeeper set with real daemons: a dead safekeeper replaced by a new one with
`scripts/local-cluster replace` (pull_timeline, joint configuration, switch condition, new
configuration) while a walproposer streams; a puller killed with -9 mid-transfer; a deleted
timeline that a late proposer cannot recreate."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from fixtures.daemon import (
    RELEASE_DIR,
    REPO,
    TENANT,
    TIMELINE,
    fmt_lsn,
    free_base,
    lsn_int,
    max_acked,
    read_wal,
    wait_until,
    walproposer,
    walproposer_refused,
)
from fixtures.ledger import verify_safekeeper
from fixtures.tools import before, receivewal

SCRIPT = REPO / "scripts" / "local-cluster"
TL_PATH = f"/v1/tenant/{TENANT}/timeline/{TIMELINE}"


class Cluster:
    """`scripts/local-cluster` in a directory of the test, on free ports."""

    def __init__(self, tmp: Path, n: int):
        self.dir = tmp / "cluster"
        self.pg_base, self.http_base = free_base(n + 1), free_base(n + 1)
        self.env = {
            **os.environ,
            "LOCAL_CLUSTER_DIR": str(self.dir),
            "LOCAL_CLUSTER_PG_BASE": str(self.pg_base),
            "LOCAL_CLUSTER_HTTP_BASE": str(self.http_base),
            "LOCAL_CLUSTER_NO_BUILD": "1",
            "CARGO_TARGET_DIR": str(RELEASE_DIR.parent),
        }

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(SCRIPT), *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def sk(self, i: int) -> SimpleNamespace:
        return SimpleNamespace(
            pg_port=self.pg_base + i,
            datadir=self.dir / f"sk{i}" / "data",
            http=f"http://127.0.0.1:{self.http_base + i}",
        )

    def status(self, i: int) -> dict:
        return requests.get(self.sk(i).http + TL_PATH, timeout=5).json()

    def pid(self, i: int) -> int:
        return int((self.dir / f"sk{i}" / "pid").read_text())


@pytest.mark.promise(10)
def test_dead_safekeeper_replaced_while_streaming(tmp_path):
    cluster = Cluster(tmp_path, 4)
    out = cluster.run("start", "3")
    assert out.returncode == 0, out.stderr
    ack_log = tmp_path / "acks"
    wp_log = open(tmp_path / "walproposer.log", "wb")
    wp = subprocess.Popen(
        [
            str(RELEASE_DIR / "walproposer"),
            "--safekeepers",
            ",".join(f"127.0.0.1:{cluster.pg_base + i}" for i in (1, 2, 3)),
            *("--total", "40M", "--rate", "3M", "--ack-log", str(ack_log)),
        ],
        stdout=subprocess.PIPE,
        stderr=wp_log,
        env={**os.environ, "RUST_LOG": "info"},
    )
    try:
        wait_until(lambda: max_acked(ack_log) > (16 << 20) + (4 << 20), "4 MiB committed")
        # Safekeeper 2's machine dies with its disk.
        os.kill(cluster.pid(2), signal.SIGKILL)
        subprocess.run(["rm", "-rf", str(cluster.sk(2).datadir)], check=True)
        before_switch = max_acked(ack_log)

        out = cluster.run("replace", "2", "4")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "generation 3: members 1 3 4" in out.stdout, out.stdout
        # Streaming continues through the switch and to the end.
        wp.communicate(timeout=120)
        assert wp.returncode == 0, (tmp_path / "walproposer.log").read_text()
        commit = max_acked(ack_log)
        assert commit > before_switch

        # The three members agree: the configuration, and the WAL byte for byte.
        for i in (1, 3, 4):
            s = cluster.status(i)
            assert s["generation"] == 3, (i, s)
            assert [m["id"] for m in s["mconf"]["members"]] == [1, 3, 4], s
            assert lsn_int(s["flush_lsn"]) >= commit, (i, s)
        start = 16 << 20
        wal = {i: read_wal(cluster.sk(i), start, commit) for i in (1, 3, 4)}
        assert wal[1] == wal[3] == wal[4]
        # ... and it is the WAL the proposer sent, before and after the switch: every
        # acknowledged range's SHA-256 (the ack log's content ledger) on every member.
        for i in (1, 3, 4):
            ranges, checked = verify_safekeeper(ack_log, cluster.sk(i), hi=commit)
            assert ranges > 0 and checked == commit - start, (i, ranges, checked)
        # A reader on the new safekeeper gets the same WAL.
        recv = tmp_path / "recv"
        recv.mkdir()
        out = receivewal(cluster.sk(4), recv, "--slot", "s1", "--endpos", before(fmt_lsn(commit)))
        assert out.returncode == 0, out.stderr
        seg = 16 << 20
        compared = 0
        for f in sorted(recv.iterdir()):
            segno = int(f.name[8:16], 16) * ((1 << 32) // seg) + int(f.name[16:24], 16)
            lo = segno * seg
            lo_c, hi_c = max(lo, start), min(lo + seg, commit)
            if hi_c > lo_c:
                got = f.read_bytes()
                assert got[lo_c - lo : hi_c - lo] == wal[4][lo_c - start : hi_c - start], f.name
                compared += hi_c - lo_c
        assert compared == commit - start
    finally:
        if wp.poll() is None:
            wp.kill()
            wp.wait()
        wp_log.close()
        cluster.run("stop")


@pytest.mark.promise(11)
def test_puller_killed_mid_transfer_leaves_nothing_then_pulls_whole(safekeeper_factory, tmp_path):
    src = safekeeper_factory(1).start()
    ack_log = tmp_path / "acks"
    stats = walproposer([src], "--total", "40M", "--ack-log", str(ack_log))
    end = lsn_int(stats["commit_lsn"])
    assert max_acked(ack_log) == end
    puller = safekeeper_factory(2).start()
    r = requests.put(f"{puller.http}/v1/failpoints?name=pull-slow&active=true", timeout=5)
    assert r.ok, r.text
    body = {"tenant_id": TENANT, "timeline_id": TIMELINE, "http_hosts": [src.http]}

    def pull():
        try:
            requests.post(f"{puller.http}/v1/pull_timeline", json=body, timeout=60)
        except requests.RequestException:
            pass

    t = threading.Thread(target=pull)
    t.start()
    tmp = puller.datadir / "tmp"
    wait_until(
        lambda: tmp.exists()
        and any(p.name.startswith("pull_") for p in tmp.iterdir())
        and sum(f.stat().st_size for d in tmp.iterdir() for f in d.iterdir()) > 0,
        "the pull to write its first segment",
    )
    time.sleep(0.3)
    puller.kill()
    t.join()
    # Nothing installed: no timeline directory, and the temp dir is gone after a restart.
    assert not (puller.datadir / TENANT / TIMELINE).exists()
    puller.start()
    assert not (puller.datadir / "tmp").exists() or not any((puller.datadir / "tmp").iterdir())
    assert requests.get(puller.http + TL_PATH, timeout=5).status_code == 404
    # A pull that completes installs a valid timeline, byte-identical to the source.
    r = requests.post(f"{puller.http}/v1/pull_timeline", json=body, timeout=60)
    assert r.ok, r.text
    assert lsn_int(r.json()["flush_lsn"]) == end
    start = lsn_int(stats["start_lsn"])
    assert read_wal(puller, start, end) == read_wal(src, start, end)
    # It survives a restart (start-up verifies the control file and the committed WAL), with
    # every acknowledged byte as the proposer sent it.
    puller.stop()
    puller.start()
    assert lsn_int(requests.get(puller.http + TL_PATH, timeout=5).json()["flush_lsn"]) == end
    ranges, checked = verify_safekeeper(ack_log, puller)
    assert ranges > 0 and checked == end - start, (ranges, checked)


@pytest.mark.promise(11)
def test_deleted_timeline_is_not_recreated_by_a_late_proposer(safekeeper, tmp_path):
    walproposer([safekeeper], "--total", "1M")
    r = requests.delete(safekeeper.http + TL_PATH, timeout=5)
    assert r.ok and r.json()["existed"], r.text
    assert not (safekeeper.datadir / TENANT / TIMELINE).exists()
    args = ["--safekeepers", f"127.0.0.1:{safekeeper.pg_port}", "--total", "1M"]
    walproposer_refused(args, "was deleted on this safekeeper", tmp_path / "late.log")
    assert not (safekeeper.datadir / TENANT / TIMELINE).exists()
    # HTTP errors are 4xx with the reason: the deleted timeline is not found.
    r = requests.put(safekeeper.http + TL_PATH + "/membership", json={"generation": 1}, timeout=5)
    assert r.status_code == 404 and "not found" in r.text, r.text
