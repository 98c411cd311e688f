"""Many timelines on one safekeeper under a default `ulimit -n` of 1024 (issue 17): every
timeline with WAL used to keep its `.partial` segment open, so about a thousand of them ran the
daemon out of descriptors. Now an LRU (`--max-open-segment-files`) closes idle timelines'
segments; its default is derived from the limit (512, or less under a small one: the last
test). MANY_TIMELINES (default 2,000; 10,000 by hand) sizes the first.

Printed for the record: start-up time with N timelines, RSS per idle timeline, the most
descriptors seen."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import threading
import time

import pytest
import requests

from fixtures.daemon import RELEASE_DIR, TENANT, lsn_int

NOFILE = 1024


def _default_ulimit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class FdWatch:
    """The most descriptors `pid` held while the block ran (sampled every 20 ms)."""

    def __init__(self, pid: int):
        self.pid, self.most, self._stop = pid, 0, threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.most = max(self.most, _fds(self.pid))
            except FileNotFoundError:
                return
            time.sleep(0.02)

    def __enter__(self) -> FdWatch:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _drive(sk, n: int, timeout: float) -> dict:
    """One commit of 8 KiB on each of `n` timelines (created on first use), 32 at a time."""
    out = subprocess.run(
        [str(RELEASE_DIR / "many-timelines"), "--safekeeper", f"127.0.0.1:{sk.pg_port}"]
        + ["--timelines", str(n), "--wal-seg-size", str(1 << 20), "--tenant-id", TENANT],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "RUST_LOG": "error"},
    )
    assert out.returncode == 0, f"{out.stderr[-3000:]}\n--- safekeeper log:\n{sk.log()[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_many_timelines_with_wal_fit_a_default_open_files_limit(safekeeper_factory):
    n = int(os.environ.get("MANY_TIMELINES", "2000"))
    cap = NOFILE // 2
    # Besides segment files: ~30 of the daemon's own (listeners, epoll, log, lock file, ...),
    # the driver's 32 connections at a time, 3 descriptors each (the socket, the epoll and
    # eventfd of the connection's own runtime), two generations of them overlapping as they
    # are replaced, and short-lived reads and creations.
    margin = 64 + 3 * 2 * 32
    # --no-sync: what is measured here is descriptors, start-up and memory, not the disk (the
    # LRU's fsync before close is the unit test's); it keeps the test short.
    sk = safekeeper_factory(
        extra_args=["--no-sync", "--max-connections", "128"], preexec_fn=_default_ulimit
    )
    sk.start()
    idle_rss = sk.rss_bytes()
    with FdWatch(sk.proc.pid) as watch:
        created = _drive(sk, n, timeout=120)
    assert watch.most <= cap + margin, (watch.most, cap)
    assert f"max_open_segment_files={cap}" in sk.log()
    assert sk.stop() == 0

    t = time.monotonic()
    sk.start(timeout=60)
    startup = time.monotonic() - t
    t = time.monotonic()
    timelines = requests.get(f"{sk.http}/v1/timelines", timeout=60).json()
    status_seconds = time.monotonic() - t
    assert len(timelines) == n
    assert all(lsn_int(tl["flush_lsn"]) > 1 << 20 for tl in timelines)
    # The cheap list: the same ids, nothing else.
    t = time.monotonic()
    r = requests.get(f"{sk.http}/v1/tenant/timeline", timeout=60)
    list_seconds = time.monotonic() - t
    r.raise_for_status()
    ids = r.json()
    assert all(set(x) == {"tenant_id", "timeline_id"} for x in ids), ids[:3]
    assert sorted((x["tenant_id"], x["timeline_id"]) for x in ids) == sorted(
        (tl["tenant_id"], tl["timeline_id"]) for tl in timelines
    )
    loaded_rss = sk.rss_bytes()
    # Served: every timeline takes a new proposer and one more commit after the restart (its
    # segment is opened again), still under the cap.
    with FdWatch(sk.proc.pid) as watch:
        again = _drive(sk, n, timeout=120)
    assert watch.most <= cap + margin, (watch.most, cap)
    metrics = requests.get(f"{sk.http}/metrics", timeout=10).text
    open_files = next(
        float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("safekeeper_open_segment_files ")
    )
    assert 0 < open_files <= cap
    print(
        f"\n{n} timelines: populated in {created['populate_seconds']:.1f} s, restart (until "
        f"the HTTP API answers) {startup:.2f} s, served again in "
        f"{again['populate_seconds']:.1f} s; "
        f"RSS idle {idle_rss / 2**20:.1f} MiB, with {n} idle timelines "
        f"{loaded_rss / 2**20:.1f} MiB = {(loaded_rss - idle_rss) / n / 1024:.1f} KiB per "
        f"timeline; most descriptors {watch.most} (cap {cap}, ulimit -n {NOFILE}); "
        f"GET /v1/timelines {status_seconds * 1000:.0f} ms, GET /v1/tenant/timeline "
        f"{list_seconds * 1000:.0f} ms ({len(r.content)} bytes)"
    )


# safekeeper/src/daemon.rs `default_max_open_segment_files`: the constant, or what the open
# files limit leaves after the proposer connections and a reserve, if lower (but at least a
# quarter of the limit).
DEFAULT_MAX_OPEN_SEGMENT_FILES = 512
FDS_RESERVED = 64
FDS_PER_CONNECTION = 3
DEFAULT_MAX_CONNECTIONS = 256


def derived_open_files_cap(soft: int, max_connections: int) -> int:
    budget = max(soft - FDS_RESERVED - FDS_PER_CONNECTION * max_connections, 0, soft // 4)
    return max(min(DEFAULT_MAX_OPEN_SEGMENT_FILES, budget), 1)


def _metric(sk, name: str) -> float:
    text = requests.get(f"{sk.http}/metrics", timeout=10).text
    return next(float(x.split()[1]) for x in text.splitlines() if x.startswith(f"{name} "))


@pytest.mark.parametrize(
    "nofile,max_connections",
    # The reserve branch: 600 - 64 - 3 * 128 = 152 (more than 600 / 4).
    # The quarter branch: 400 - 64 - 3 * 256 is negative, so 400 / 4 = 100 (the default
    # --max-connections).
    [(600, 128), (400, None)],
)
def test_open_files_default_is_derived_from_the_ulimit(safekeeper_factory, nofile, max_connections):
    """Without --max-open-segment-files the cap comes from `ulimit -n` (the daemon raises its
    soft limit to the hard one first, so both are set here). Every other run has a limit large
    enough for the 512 constant; under these the derived value is smaller, the daemon reports
    it, and its LRU holds exactly that many files once more timelines than that have WAL."""
    connections = DEFAULT_MAX_CONNECTIONS if max_connections is None else max_connections
    cap = derived_open_files_cap(nofile, connections)
    assert cap < DEFAULT_MAX_OPEN_SEGMENT_FILES
    extra = ["--no-sync"]
    if max_connections is not None:
        extra += ["--max-connections", str(max_connections)]

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    sk = safekeeper_factory(extra_args=extra, preexec_fn=limit)
    sk.start()
    assert f"max_open_segment_files={cap} " in sk.log(), sk.log()[-2000:]
    _drive(sk, cap + 40, timeout=120)
    # Every timeline keeps its segment open until the LRU closes it for another one: with more
    # timelines than the cap, exactly the cap stays open (and some were closed for it).
    assert _metric(sk, "safekeeper_open_segment_files") == cap
    assert _metric(sk, "safekeeper_segment_file_evictions_total") >= 40
