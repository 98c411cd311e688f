"""The walproposer over three real safekeepers: quorum commit survives a safekeeper killed
with SIGKILL mid-stream, competing proposers never rewrite committed WAL, and sync mode."""

from __future__ import annotations

import hashlib
import os
import subprocess

import pytest
import requests

from fixtures.daemon import RELEASE_DIR, lsn_int, read_wal, wait_until, walproposer


def start_cluster(factory, n=3):
    return [factory(node_id=i + 1).start() for i in range(n)]


def spawn_proposer(sks, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            str(RELEASE_DIR / "walproposer"),
            "--safekeepers",
            ",".join(f"127.0.0.1:{sk.pg_port}" for sk in sks),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RUST_LOG": "info"},
    )


def timeline(sk) -> dict:
    tls = requests.get(f"{sk.http}/v1/timelines", timeout=5).json()
    assert len(tls) == 1, tls
    return tls[0]


def committed_everywhere(sks) -> int:
    """The lowest commit LSN the safekeepers `sks` know (0 before they have a timeline)."""
    lsns = []
    for sk in sks:
        tls = requests.get(f"{sk.http}/v1/timelines", timeout=5).json()
        lsns.append(lsn_int(tls[0]["commit_lsn"]) if tls else 0)
    return min(lsns)


def digest(sk, start: int, end: int) -> str:
    return hashlib.sha256(read_wal(sk, start, end)).hexdigest()


@pytest.mark.promise(2)
def test_kill9_of_one_safekeeper_mid_stream_loses_nothing(safekeeper_factory):
    sks = start_cluster(safekeeper_factory)
    wp = spawn_proposer(sks, "--total", "160M", "--rate", "32M", "--record-size", "512")
    start = lsn_int("0/1000000")
    wait_until(lambda: committed_everywhere(sks) > start + (8 << 20), "8 MiB committed")
    victim = sks[1]
    victim.kill()
    # Writing continues on the remaining quorum.
    rest = [sks[0], sks[2]]
    at_kill = committed_everywhere(rest)
    wait_until(
        lambda: wp.poll() is not None or committed_everywhere(rest) > at_kill + (16 << 20),
        "16 MiB more committed on the remaining quorum",
    )
    assert wp.poll() is None, wp.stderr.read() if wp.stderr else ""
    victim.start()
    out, err = wp.communicate(timeout=120)
    assert wp.returncode == 0, err
    import json

    stats = json.loads(out.strip().splitlines()[-1])
    start, commit = lsn_int(stats["start_lsn"]), lsn_int(stats["commit_lsn"])
    assert stats["commit_lsn"] == stats["end_lsn"]
    assert "streaming failed" in err, "the proposer should have seen the safekeeper die"

    # The restarted safekeeper caught up: all three hold identical WAL up to the commit LSN.
    for sk in sks:
        t = timeline(sk)
        assert lsn_int(t["flush_lsn"]) >= commit, (sk.node_id, t)
    digests = {digest(sk, start, commit) for sk in sks}
    assert len(digests) == 1, "safekeepers disagree on committed WAL"


@pytest.mark.promise(2)
def test_competing_proposers_never_rewrite_committed_wal(safekeeper_factory):
    sks = start_cluster(safekeeper_factory)
    first = spawn_proposer(sks, "--total", "400M", "--rate", "40M")
    # Wait until some WAL is committed everywhere, and remember its digest.
    start = lsn_int("0/1000000")
    committed = wait_until(
        lambda: (c := committed_everywhere(sks)) > start + (4 << 20) and c, "4 MiB committed"
    )
    before = digest(sks[0], start, committed)

    # A second proposer elects itself with a higher term; the first steps down.
    second = walproposer(sks, "--total", "16M")
    _, err = first.communicate(timeout=60)
    assert first.returncode != 0
    assert "stepped down" in err, err
    assert lsn_int(second["start_lsn"]) >= committed

    # Committed WAL was never rewritten, on any safekeeper; all agree on the new term's WAL.
    for sk in sks:
        assert digest(sk, start, committed) == before, sk.node_id
    end = lsn_int(second["commit_lsn"])
    assert len({digest(sk, start, end) for sk in sks}) == 1
    terms = {timeline(sk)["term"] for sk in sks}
    assert terms == {2}, terms


def test_sync_mode_commits_the_end_of_wal(safekeeper_factory):
    sks = start_cluster(safekeeper_factory)
    stats = walproposer(sks, "--total", "4M")
    synced = walproposer(sks, "--sync")
    assert synced["lsn"] == stats["end_lsn"]
    # A quorum persisted a commit LSN at the end of WAL (sync waits for that).
    persisted = sorted(lsn_int(timeline(sk)["persisted_commit_lsn"]) for sk in sks)
    assert persisted[1] >= lsn_int(synced["lsn"]), persisted
