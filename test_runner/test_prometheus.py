"""A real Prometheus (Debian's `prometheus`) scraping a 3-node local cluster while two
walproposers push WAL to two timelines: the operator's queries of README.md ("Operating it")
and the recording rules of docs/prometheus/ answer through Prometheus's HTTP API, every alert
rule loads and evaluates, and `promtool` finds nothing to lint in `/metrics` or the rules."""

from __future__ import annotations

import os
import subprocess
import time

import requests

from fixtures.daemon import RELEASE_DIR, REPO, TENANT, free_port, wait_until
from fixtures.tools import require

RULES = REPO / "docs" / "prometheus" / "safekeeper.rules.yml"
TIMELINES = ["9e4c8f36bca74c2bc9b7b0f1bd0c6f0b", "0a1b2c3d4e5f60718293a4b5c6d7e8f9"]


def test_promtool_checks_the_rules():
    promtool = require("promtool", "prometheus")
    out = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 12 rules found" in out.stdout, out.stdout


def test_promtool_checks_metrics_clean(safekeeper):
    promtool = require("promtool", "prometheus")
    # Every family present: a profile request, and a timeline with WAL.
    requests.get(f"{safekeeper.http}/profile/cpu?seconds=1", timeout=30).raise_for_status()
    text = requests.get(f"{safekeeper.http}/metrics", timeout=10).text
    assert "profile_requests_total" in text
    out = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), (
        out.stdout + out.stderr
    )


class Prometheus:
    def __init__(self, url: str):
        self.url = url

    def query(self, expr: str) -> list[dict]:
        r = requests.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert r.ok and body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def values(self, expr: str) -> list[tuple[dict, float]]:
        return [(s["metric"], float(s["value"][1])) for s in self.query(expr)]


def test_prometheus_scrapes_a_cluster_under_load(safekeeper_factory, tmp_path):
    prometheus = require("prometheus", "prometheus")
    sks = [safekeeper_factory(node_id=i).start() for i in (1, 2, 3)]
    targets = ", ".join(f"'127.0.0.1:{sk.http_port}'" for sk in sks)
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: ['{RULES}']
scrape_configs:
  - job_name: safekeeper
    static_configs:
      - targets: [{targets}]
"""
    )
    prom_log = open(tmp_path / "prometheus.log", "wb")
    prom = subprocess.Popen(
        [
            prometheus,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=prom_log,
        stderr=subprocess.STDOUT,
    )
    proposers = []
    try:
        p = Prometheus(f"http://127.0.0.1:{port}")
        wait_until(lambda: _ready(p.url), "prometheus ready", timeout=60)
        addrs = ",".join(f"127.0.0.1:{sk.pg_port}" for sk in sks)
        for timeline in TIMELINES:
            proposers.append(
                subprocess.Popen(
                    [str(RELEASE_DIR / "walproposer"), "--safekeepers", addrs]
                    + ["--timeline-id", timeline, "--total", "64M", "--rate", "3M"],
                    stdout=subprocess.DEVNULL,
                    stderr=open(tmp_path / f"walproposer-{timeline}.log", "wb"),
                    env={**os.environ, "RUST_LOG": "warn"},
                )
            )

        def all_up():
            up = p.values('up{job="safekeeper"}')
            return len(up) == 3 and all(v == 1 for _, v in up)

        wait_until(all_up, "3 targets up", timeout=30, interval=0.5)
        # Profiles served: the counter must be seen rising (a series' first value is no rate).
        requests.get(f"{sks[0].http}/debug/pprof/heap", timeout=30).raise_for_status()
        wait_until(
            lambda: p.values('profile_requests_total{profile="heap",outcome="ok"} == 1'),
            "the first profile request scraped",
        )
        requests.get(f"{sks[0].http}/profile/cpu?seconds=1", timeout=30).raise_for_status()
        requests.get(f"{sks[0].http}/debug/pprof/heap", timeout=30).raise_for_status()

        # Commit lag per timeline and node (recording rule): 3 nodes x 2 timelines.
        def lag_series():
            s = p.values("safekeeper:timeline_commit_lag_bytes")
            return s if len(s) == 6 else None

        lag = wait_until(lag_series, "commit lag of 2 timelines on 3 nodes", timeout=60)
        assert {m["timeline_id"] for m, _ in lag} == set(TIMELINES)
        assert {m["tenant_id"] for m, _ in lag} == {TENANT}
        assert all(0 <= v < 64 << 20 for _, v in lag), lag
        behind = p.values("safekeeper:timeline_behind_peers_bytes")
        assert len(behind) == 6 and all(v >= 0 for _, v in behind), behind

        # WAL write rate: every node is writing both streams (2 x 3 MiB/s offered).
        def writing():
            s = p.values("safekeeper:wal_write_bytes:rate1m")
            return s if len(s) == 3 and all(v > 1 << 20 for _, v in s) else None

        rates = wait_until(writing, "WAL write rate above 1 MiB/s on 3 nodes", timeout=60)
        assert all(v < 64 << 20 for _, v in rates), rates

        # Flush latency p99 through histogram_quantile.
        def p99():
            s = p.values("safekeeper:flush_wal_seconds:p99_1m")
            return s if len(s) == 3 and all(0 < v < 5 for _, v in s) else None

        wait_until(p99, "flush p99 on 3 nodes", timeout=60)
        raw = p.values(
            "histogram_quantile(0.99, sum by (instance, le) "
            "(rate(safekeeper_flush_wal_seconds_bucket[30s])))"
        )
        assert len(raw) == 3, raw

        # jemalloc resident memory of each node.
        resident = p.values("jemalloc_resident_bytes")
        assert len(resident) == 3 and all(1 << 20 < v < 8 << 30 for _, v in resident), resident

        # Profiles served.
        wait_until(
            lambda: {
                (m["profile"], v)
                for m, v in p.values('sum by (profile) (profile_requests_total{outcome="ok"})')
            }
            >= {("cpu", 1.0), ("heap", 2.0)},
            "profiles served",
        )
        wait_until(
            lambda: p.values("safekeeper:profile_requests:rate5m > 0"), "profile request rate"
        )

        # Every rule group evaluates without errors; the alerts are loaded (none firing).
        rules = requests.get(f"{p.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        loaded = [r for g in rules for r in g["rules"]]
        assert len(loaded) == 12, loaded
        assert all(r["health"] == "ok" for r in loaded), [
            (r["name"], r.get("lastError")) for r in loaded if r["health"] != "ok"
        ]
        firing = requests.get(f"{p.url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
        assert not [a for a in firing if a["state"] == "firing"], firing

        # Scrape durations, as Prometheus measured them.
        scrape = p.values('scrape_duration_seconds{job="safekeeper"}')
        assert len(scrape) == 3 and all(v < 1 for _, v in scrape), scrape
    finally:
        for proc in proposers:
            proc.kill()
            proc.wait()
        prom.terminate()
        try:
            prom.wait(timeout=10)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()


def _ready(url: str) -> bool:
    try:
        return requests.get(f"{url}/-/ready", timeout=1).ok
    except requests.RequestException:
        return False
    finally:
        time.sleep(0.1)


def test_scrape_duration_with_many_timelines(safekeeper_factory, tmp_path):
    """Prometheus's own `scrape_duration_seconds` of one safekeeper holding many timelines
    (SCRAPE_TIMELINES, default 100 in CI; the README's figure is for 1,000), printed for the
    record and bounded well below the 1 s scrape interval."""
    prometheus = require("prometheus", "prometheus")
    n = int(os.environ.get("SCRAPE_TIMELINES", "100"))
    sk = safekeeper_factory(extra_args=["--no-sync"]).start()
    addr = f"127.0.0.1:{sk.pg_port}"
    pending = [f"{i:032x}" for i in range(1, n + 1)]
    running: list[subprocess.Popen] = []
    env = {**os.environ, "RUST_LOG": "error"}
    while pending or running:
        while pending and len(running) < 4:
            tl = pending.pop()
            running.append(
                subprocess.Popen(
                    [str(RELEASE_DIR / "walproposer"), "--safekeepers", addr]
                    + ["--timeline-id", tl, "--total", "8K", "--wal-seg-size", str(1 << 20)],
                    stdout=subprocess.DEVNULL,
                    env=env,
                )
            )
        for proc in list(running):
            if proc.poll() is not None:
                assert proc.returncode == 0
                running.remove(proc)
        time.sleep(0.01)
    timelines = requests.get(f"{sk.http}/v1/timelines", timeout=30).json()
    assert len(timelines) == n

    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        f"""global:
  scrape_interval: 1s
scrape_configs:
  - job_name: safekeeper
    static_configs:
      - targets: ['127.0.0.1:{sk.http_port}']
"""
    )
    prom = subprocess.Popen(
        [
            prometheus,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=open(tmp_path / "prometheus.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        p = Prometheus(f"http://127.0.0.1:{port}")
        wait_until(lambda: _ready(p.url), "prometheus ready", timeout=60)

        def scraped_ten_times():
            c = p.values('count_over_time(scrape_duration_seconds{job="safekeeper"}[1m])')
            return c and c[0][1] >= 10

        wait_until(scraped_ten_times, "10 scrapes", timeout=60, interval=0.5)
        q = 'quantile_over_time({q}, scrape_duration_seconds{{job="safekeeper"}}[1m])'
        median = p.values(q.format(q=0.5))[0][1]
        worst = p.values(q.format(q=1.0))[0][1]
        samples = p.values('scrape_samples_scraped{job="safekeeper"}')[0][1]
        size = len(requests.get(f"{sk.http}/metrics", timeout=10).content)
        print(
            f"\nscrape of {n} timelines: median {median * 1e3:.2f} ms, max {worst * 1e3:.2f} ms, "
            f"{samples:.0f} samples, {size} bytes"
        )
        assert worst < 0.5, (median, worst)
    finally:
        prom.terminate()
        prom.wait(timeout=10)
