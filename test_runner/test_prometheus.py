"""A real Prometheus (Debian's `prometheus`) scraping a 3-node local cluster while two
walproposers push WAL to two timelines: the operator's queries of README.md ("Operating it")
and the recording rules of docs/prometheus/ answer through Prometheus's HTTP API, every alert
rule loads and evaluates, and `promtool` finds nothing to lint in `/metrics` or the rules. The
alerts fire: every one under `promtool test rules` over synthetic series (the rule file as
shipped, its `for:` included), and SafekeeperDown in a real Prometheus when a node is killed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import requests

from fixtures.daemon import (
    RELEASE_DIR,
    REPO,
    TENANT,
    TIMELINE,
    free_port,
    wait_until,
    walproposer,
)
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
    walproposer([safekeeper], "--total", "2M")
    text = requests.get(f"{safekeeper.http}/metrics", timeout=10).text
    assert "profile_requests_total" in text
    # The per-timeline gauges (there are none without a timeline) and the WAL path's families.
    labels = f'{{tenant_id="{TENANT}",timeline_id="{TIMELINE}"}}'
    per_timeline = set(re.findall(rf"^(\w+){re.escape(labels)} ", text, re.M))
    assert {"safekeeper_flush_lsn", "safekeeper_commit_lsn", "safekeeper_acceptor_term"} <= (
        per_timeline
    ), text
    assert len(per_timeline) >= 8, per_timeline
    flushed = re.search(rf"^safekeeper_flush_lsn{re.escape(labels)} (\d+)$", text, re.M)
    assert flushed and int(flushed.group(1)) > 2 << 20, text
    assert re.search(r"^safekeeper_flush_wal_seconds_count [1-9]", text, re.M), text
    out = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), (
        out.stdout + out.stderr
    )


class Prometheus:
    def __init__(self, url: str):
        self.url = url

    def alerts(self, name: str, state: str = "firing") -> list[dict]:
        """The alerts named `name` in `state`, from the HTTP API."""
        r = requests.get(f"{self.url}/api/v1/alerts", timeout=10)
        assert r.ok, r.text
        return [
            a
            for a in r.json()["data"]["alerts"]
            if a["labels"]["alertname"] == name and a["state"] == state
        ]

    def query(self, expr: str) -> list[dict]:
        r = requests.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert r.ok and body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def values(self, expr: str) -> list[tuple[dict, float]]:
        return [(s["metric"], float(s["value"][1])) for s in self.query(expr)]


def scrape_config(sks, rules: Path) -> str:
    """A prometheus.yml scraping `sks` every second as job "safekeeper", with `rules`."""
    targets = ", ".join(f"'127.0.0.1:{sk.http_port}'" for sk in sks)
    return f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: ['{rules}']
scrape_configs:
  - job_name: safekeeper
    static_configs:
      - targets: [{targets}]
"""


def test_prometheus_scrapes_a_cluster_under_load(safekeeper_factory, tmp_path):
    sks = [safekeeper_factory(node_id=i).start() for i in (1, 2, 3)]
    proposers = []
    with running_prometheus(tmp_path, scrape_config(sks, RULES)) as p:
        try:
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

            # The scrapes under load succeed (a scrape past its 1 s timeout is up == 0).
            scraped = p.values('up{job="safekeeper"} == 1 and scrape_samples_scraped > 0')
            assert len(scraped) == 3, p.values('up{job="safekeeper"}')
        finally:
            for proc in proposers:
                proc.kill()
                proc.wait()


@contextmanager
def running_prometheus(tmp_path: Path, config: str):
    """A real Prometheus with `config` (its prometheus.yml) on a free port until the block ends;
    yields it once it is ready."""
    prometheus = require("prometheus", "prometheus")
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(config)
    prom = subprocess.Popen(
        [
            prometheus,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=open(tmp_path / "prometheus.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        p = Prometheus(f"http://127.0.0.1:{port}")
        wait_until(lambda: _ready(p.url), "prometheus ready", timeout=60)
        yield p
    finally:
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
    record. What is checked is that the scrapes work: every one in the window succeeded (within
    Prometheus's timeout, the 1 s interval) and stored every timeline's series."""
    require("prometheus", "prometheus")
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

    config = f"""global:
  scrape_interval: 1s
scrape_configs:
  - job_name: safekeeper
    static_configs:
      - targets: ['127.0.0.1:{sk.http_port}']
"""
    with running_prometheus(tmp_path, config) as p:
        # Ten successful scrapes (a scrape past its 1 s timeout, or a failed one, is up == 0).
        def scraped_ten_times():
            c = p.values('sum_over_time(up{job="safekeeper"}[1m])')
            return c and c[0][1] >= 10

        wait_until(scraped_ten_times, "10 successful scrapes", timeout=60, interval=0.5)
        every = p.values('min_over_time(up{job="safekeeper"}[1m])')
        assert every and every[0][1] == 1, ("a scrape failed", every)
        # What Prometheus stored from them: every timeline's series.
        stored = p.values('count(safekeeper_flush_lsn{job="safekeeper"})')
        assert stored and stored[0][1] == n, stored
        q = 'quantile_over_time({q}, scrape_duration_seconds{{job="safekeeper"}}[1m])'
        median = p.values(q.format(q=0.5))[0][1]
        worst = p.values(q.format(q=1.0))[0][1]
        samples = p.values('scrape_samples_scraped{job="safekeeper"}')[0][1]
        size = len(requests.get(f"{sk.http}/metrics", timeout=10).content)
        print(
            f"\nscrape of {n} timelines: median {median * 1e3:.2f} ms, max {worst * 1e3:.2f} ms, "
            f"{samples:.0f} samples, {size} bytes"
        )
        # At least the 8 per-timeline gauges of each timeline were scraped.
        assert samples >= 8 * n, samples


def rule_descriptions(text: str) -> dict[str, str]:
    """Each alert's `description` annotation in a rule file, as YAML reads it (a folded `>-`
    block joined with spaces, or a quoted string): the fixed text, without templates."""
    out: dict[str, str] = {}
    lines = text.splitlines()
    alert = None
    for i, line in enumerate(lines):
        if m := re.match(r"\s*- alert: (\w+)$", line):
            alert = m.group(1)
        m = re.match(r"(\s*)description: (.*)$", line)
        if not (m and alert):
            continue
        indent, value = len(m.group(1)), m.group(2)
        if value == ">-":
            block = []
            for follow in lines[i + 1 :]:
                if len(follow) - len(follow.lstrip()) <= indent:
                    break
                block.append(follow.strip())
            value = " ".join(block)
        else:
            value = value.strip('"')
        out[alert] = value
    return out


def test_every_alert_fires_under_promtool_test_rules(tmp_path):
    """`promtool test rules` evaluates the rule file as shipped (its `for:` durations included)
    over synthetic series: each alert stays quiet before its `for:` has passed and for healthy
    series, then fires with its labels and its annotations rendered."""
    promtool = require("promtool", "prometheus")
    desc = rule_descriptions(RULES.read_text())
    assert len(desc) == 7 and not any("{{" in d for d in desc.values()), desc
    tl = {"tenant_id": TENANT, "timeline_id": TIMELINE}
    job = 'job="safekeeper"'
    ttl = f'tenant_id="{TENANT}",timeline_id="{TIMELINE}"'
    mib = 1 << 20
    bucket = "safekeeper_flush_wal_seconds_bucket"
    backup_lag = "safekeeper_backup_lag_bytes"

    def alert(name: str, labels: dict, summary: str) -> dict:
        return {
            "exp_labels": labels,
            "exp_annotations": {"summary": summary, "description": desc[name]},
        }

    def case(name: str, series: list[tuple[str, str]], quiet: str, firing: str, alerts: list):
        return {
            "interval": "15s",
            "input_series": [{"series": s, "values": v} for s, v in series],
            "alert_rule_test": [
                {"eval_time": quiet, "alertname": name, "exp_alerts": []},
                {"eval_time": firing, "alertname": name, "exp_alerts": alerts},
            ],
        }

    sk1 = {"job": "safekeeper", "instance": "sk1:7676"}
    sk2 = {"job": "safekeeper", "instance": "sk2:7676"}
    tests = [
        # Down for 2 min: pending until its 1 min has passed, then firing; the node that
        # answers and a target of another job do not fire.
        case(
            "SafekeeperDown",
            [
                (f'up{{{job},instance="sk1:7676"}}', "1x3 0x20"),
                (f'up{{{job},instance="sk2:7676"}}', "1x23"),
                ('up{job="other",instance="x:1"}', "0x23"),
            ],
            "1m15s",
            "2m",
            [
                alert(
                    "SafekeeperDown",
                    {**sk1, "severity": "critical"},
                    "safekeeper sk1:7676 is not answering scrapes",
                )
            ],
        ),
        # 300 MiB flushed but not committed on sk1 for 10 min; sk2 has committed everything.
        case(
            "SafekeeperCommitLagHigh",
            [
                (f'safekeeper_flush_lsn{{{job},instance="sk1:7676",{ttl}}}', f"{400 * mib}x40"),
                (f'safekeeper_commit_lsn{{{job},instance="sk1:7676",{ttl}}}', f"{100 * mib}x40"),
                (f'safekeeper_flush_lsn{{{job},instance="sk2:7676",{ttl}}}', f"{400 * mib}x40"),
                (f'safekeeper_commit_lsn{{{job},instance="sk2:7676",{ttl}}}', f"{400 * mib}x40"),
            ],
            "4m",
            "10m",
            [
                alert(
                    "SafekeeperCommitLagHigh",
                    {**sk1, **tl, "severity": "warning"},
                    f"timeline {TENANT}/{TIMELINE} on sk1:7676: 300MiB flushed but not known "
                    "committed",
                )
            ],
        ),
        # sk2 has flushed 300 MiB less than sk1 of the same timeline.
        case(
            "SafekeeperBehindPeers",
            [
                (f'safekeeper_flush_lsn{{{job},instance="sk1:7676",{ttl}}}', f"{400 * mib}x40"),
                (f'safekeeper_flush_lsn{{{job},instance="sk2:7676",{ttl}}}', f"{100 * mib}x40"),
            ],
            "4m",
            "10m",
            [
                alert(
                    "SafekeeperBehindPeers",
                    {**sk2, **tl, "severity": "warning"},
                    f"sk2:7676 is 300MiB behind its peers on timeline {TENANT}/{TIMELINE}",
                )
            ],
        ),
        # Every flush on sk1 takes 50-250 ms (p99 248 ms); sk2's all take under 50 ms.
        case(
            "SafekeeperFlushSlow",
            [
                (f'{bucket}{{{job},instance="sk{n}:7676",le="{le}"}}', values)
                for n, le, values in [
                    (1, "0.05", "0x40"),
                    (1, "0.25", "0+10x40"),
                    (1, "+Inf", "0+10x40"),
                    (2, "0.05", "0+10x40"),
                    (2, "0.25", "0+10x40"),
                    (2, "+Inf", "0+10x40"),
                ]
            ],
            "4m",
            "10m",
            [
                alert(
                    "SafekeeperFlushSlow",
                    {**sk1, "severity": "warning"},
                    "sk1:7676: WAL fsync p99 is 248ms",
                )
            ],
        ),
        # 5 GiB resident for 15 min (its `for:` is 10 min); sk2 holds 1 GiB.
        case(
            "SafekeeperMemoryHigh",
            [
                (f'jemalloc_resident_bytes{{{job},instance="sk1:7676"}}', f"{5 << 30}x60"),
                (f'jemalloc_resident_bytes{{{job},instance="sk2:7676"}}', f"{1 << 30}x60"),
            ],
            "9m",
            "15m",
            [
                alert(
                    "SafekeeperMemoryHigh",
                    {**sk1, "severity": "warning"},
                    "sk1:7676: 5GiB resident in jemalloc",
                )
            ],
        ),
        # A failed CPU profile at 2 min (no `for:`: it fires at once); successes do not.
        case(
            "SafekeeperProfileErrors",
            [
                (
                    f'profile_requests_total{{{job},instance="sk1:7676",outcome="error",profile="cpu"}}',
                    "0x8 1x20",
                ),
                (
                    f'profile_requests_total{{{job},instance="sk1:7676",outcome="ok",profile="cpu"}}',
                    "0+1x28",
                ),
            ],
            "1m45s",
            "3m",
            [
                alert(
                    "SafekeeperProfileErrors",
                    {**sk1, "outcome": "error", "profile": "cpu", "severity": "info"},
                    "sk1:7676: cpu profiles are failing",
                )
            ],
        ),
        # 2 GiB of committed WAL not backed up for 20 min (its `for:` is 15 min).
        case(
            "SafekeeperBackupLagging",
            [
                (
                    f'safekeeper_backup_lag_bytes{{{job},instance="sk1:7676",{ttl}}}',
                    f"{2 << 30}x80",
                ),
                (f'{backup_lag}{{{job},instance="sk2:7676",{ttl}}}', "0x80"),
            ],
            "14m",
            "20m",
            [
                alert(
                    "SafekeeperBackupLagging",
                    {**sk1, **tl, "severity": "warning"},
                    f"sk1:7676: 2GiB of committed WAL of timeline {TENANT}/{TIMELINE} not backed "
                    "up",
                )
            ],
        ),
    ]
    assert {t["alert_rule_test"][0]["alertname"] for t in tests} == set(desc)
    # JSON is YAML: promtool reads it as its test file.
    spec = tmp_path / "alerts.test.yml"
    spec.write_text(json.dumps({"rule_files": [str(RULES)], "tests": tests}, indent=1))
    out = subprocess.run(
        [promtool, "test", "rules", str(spec)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout, out.stdout


def test_safekeeper_down_fires_in_a_real_prometheus(safekeeper_factory, tmp_path):
    """A real Prometheus scraping two nodes with the shipped rules, SafekeeperDown's `for:`
    shortened from 1m to 2s in a copy (the only change): nothing fires while both answer; kill
    one and the alert fires for that instance only, seen through /api/v1/alerts with its
    annotations rendered; start it again and the alert resolves."""
    text = RULES.read_text()
    shortened, n = re.subn(
        r"(- alert: SafekeeperDown\n\s+expr: [^\n]+\n\s+)for: 1m\n", r"\1for: 2s\n", text
    )
    assert n == 1, "SafekeeperDown's `for: 1m` not found in the rule file"
    rules = tmp_path / "safekeeper.rules.yml"
    rules.write_text(shortened)
    sks = [safekeeper_factory(node_id=i).start() for i in (1, 2)]
    with running_prometheus(tmp_path, scrape_config(sks, rules)) as p:

        def all_up():
            up = p.values('up{job="safekeeper"}')
            return len(up) == 2 and all(v == 1 for _, v in up)

        wait_until(all_up, "2 targets up", timeout=60, interval=0.5)
        assert not p.alerts("SafekeeperDown", "firing") + p.alerts("SafekeeperDown", "pending")

        down = sks[1]
        down.kill()
        instance = f"127.0.0.1:{down.http_port}"
        firing = wait_until(
            lambda: p.alerts("SafekeeperDown"), "SafekeeperDown to fire", timeout=60, interval=0.5
        )
        assert [a["labels"]["instance"] for a in firing] == [instance], firing
        assert firing[0]["labels"]["severity"] == "critical", firing
        assert firing[0]["annotations"]["summary"] == (
            f"safekeeper {instance} is not answering scrapes"
        ), firing
        # The node that answers stays quiet.
        assert all(
            a["labels"]["instance"] == instance for a in p.alerts("SafekeeperDown", "pending")
        )

        down.start()
        wait_until(
            lambda: not p.alerts("SafekeeperDown"),
            "SafekeeperDown to resolve once the node answers again",
            timeout=60,
            interval=0.5,
        )
        assert p.values(f'up{{job="safekeeper",instance="{instance}"}}') == [
            ({"__name__": "up", "job": "safekeeper", "instance": instance}, 1.0)
        ]
