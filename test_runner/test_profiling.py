"""The profiling routes of a running release daemon and of the profiling crate's example
service (`profiled` runs each test against both), checked by the real consumers of their
output: `go tool pprof` (from files and by URL, on Go's `/debug/pprof/` paths), `jeprof` and an
XML parser."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
import xml.etree.ElementTree as ET
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from fixtures.daemon import RELEASE_DIR, ExampleService
from fixtures.tools import require


def cheap_path(server) -> str:
    return "/" if isinstance(server, ExampleService) else "/v1/status"


def retain(server, mib: int) -> None:
    """Makes the server allocate and keep `mib` MiB (a known allocation site: `retain_memory`)."""
    path = "/retain" if isinstance(server, ExampleService) else "/v1/debug/retain_memory"
    requests.put(f"{server.http}{path}?mib={mib}", timeout=30).raise_for_status()


def release(server) -> None:
    path = "/retain" if isinstance(server, ExampleService) else "/v1/debug/retain_memory"
    requests.delete(f"{server.http}{path}", timeout=30).raise_for_status()


@contextmanager
def http_load(sk, threads: int = 2):
    """Keeps the server busy with a stream of HTTP requests (metrics scrapes render jemalloc and
    process stats; the other path is cheap) until the block ends. Bounded by its duration."""
    stop = threading.Event()
    count = [0]
    # The example's own routes are trivial: make it burn a little CPU per request.
    cheap = "/work?ms=2" if isinstance(sk, ExampleService) else cheap_path(sk)

    def loop():
        with requests.Session() as s:
            while not stop.is_set():
                s.get(f"{sk.http}/metrics", timeout=5)
                s.get(f"{sk.http}{cheap}", timeout=5)
                count[0] += 2

    workers = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    try:
        yield count
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=10)


def go_pprof(*args: str) -> str:
    go = require("go", "golang-go")
    out = subprocess.run([go, "tool", "pprof", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"go tool pprof {args} failed:\n{out.stderr}"
    return out.stdout


def fetch(sk, path: str, dest: Path, timeout: float = 90) -> requests.Response:
    r = requests.get(f"{sk.http}{path}", timeout=timeout)
    assert r.status_code == 200, f"{path}: {r.status_code} {r.text}"
    dest.write_bytes(r.content)
    return r


def test_cpu_pprof_is_symbolized_with_deep_stacks(profiled, tmp_path):
    with http_load(profiled) as served:
        r = fetch(profiled, "/profile/cpu?seconds=3", tmp_path / "cpu.pb.gz")
    assert served[0] > 0
    assert r.headers["content-type"] == "application/octet-stream"
    assert 'filename="profile.pb.gz"' in r.headers["content-disposition"]
    assert r.content[:2] == b"\x1f\x8b"

    top = go_pprof("-top", "-nodecount=200", str(tmp_path / "cpu.pb.gz"))
    assert "Type: cpu" in top
    # Symbolized: names from our own crates and from tokio appear.
    assert re.search(r"safekeeper::|profiling::|profiled_service::", top), top
    assert "tokio::" in top, top

    # Deep stacks: frames from our crates sit under tokio's runtime frames, not 1-2 frame stacks.
    traces = go_pprof("-traces", str(tmp_path / "cpu.pb.gz"))
    stacks = [
        s
        for s in traces.split("-----------+-------------------------------------------------------")
        if s.strip()
    ]
    ours = [
        s
        for s in stacks
        if re.search(
            r"safekeeper::http::|profiling::metrics|safekeeper::daemon|profiled_service::", s
        )
        and "tokio::runtime" in s
    ]
    assert ours, f"no stack shows our handlers under tokio's runtime:\n{traces[:4000]}"
    depth = max(
        len([ln for ln in s.splitlines() if ln.strip() and "bytes:" not in ln]) for s in ours
    )
    assert depth >= 10, f"deepest stack through our code has only {depth} frames"


def test_cpu_svg_is_well_formed_and_names_functions(profiled, tmp_path):
    with http_load(profiled):
        r = fetch(profiled, "/profile/cpu?seconds=2&format=svg", tmp_path / "cpu.svg")
    assert r.headers["content-type"] == "image/svg+xml"
    assert 'filename="profile.svg"' in r.headers["content-disposition"]
    root = ET.fromstring(r.content)
    assert root.tag.endswith("svg")
    titles = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}title"))
    assert "tokio::" in titles
    assert re.search(r"safekeeper|profiling|profiled_service", titles), titles[:2000]
    xmllint = require("xmllint", "libxml2-utils")
    subprocess.run([xmllint, "--noout", str(tmp_path / "cpu.svg")], check=True)


def test_heap_pprof_names_our_functions(profiled, tmp_path):
    r = fetch(profiled, "/profile/heap", tmp_path / "heap.pb.gz")
    assert r.headers["content-type"] == "application/octet-stream"
    assert 'filename="heap.pb.gz"' in r.headers["content-disposition"]
    assert r.content[:2] == b"\x1f\x8b"
    top = go_pprof("-top", "-cum", "-nodecount=300", str(tmp_path / "heap.pb.gz"))
    assert "inuse_space" in top
    # Live memory allocated at start-up by our code (the runtime, the profiler warm-up).
    assert re.search(r"safekeeper::main|profiled_service::main|profiling::cpu::warm_up", top), top


def test_a_daemon_started_by_a_relative_path_names_its_functions(safekeeper_factory, tmp_path):
    """`target/release/safekeeper` run from the repository, as the README does: the main
    executable's mapping then has a relative path, and its frames were left as bare addresses
    (only libc was symbolized)."""
    sk = safekeeper_factory(binary_name="safekeeper")
    sk.cwd = RELEASE_DIR.parent
    assert "/" in sk.args()[0] and not sk.args()[0].startswith("/"), sk.args()[0]
    sk.start()
    fetch(sk, "/profile/heap", tmp_path / "heap.pb.gz")
    top = go_pprof("-top", "-cum", "-nodecount=300", str(tmp_path / "heap.pb.gz"))
    assert re.search(r"safekeeper::|profiling::", top), top[:3000]
    fetch(sk, "/profile/cpu?seconds=1", tmp_path / "cpu.pb.gz")
    assert "no symbols" not in sk.log(), sk.log()[-2000:]


def test_heap_jemalloc_dump_is_read_by_jeprof(profiled, tmp_path):
    jeprof = require("jeprof", "libjemalloc-dev")
    r = fetch(profiled, "/profile/heap?format=jemalloc", tmp_path / "heap.dump")
    assert 'filename="heap.dump"' in r.headers["content-disposition"]
    assert r.content.startswith(b"heap_v2/")
    out = subprocess.run(
        [jeprof, "--text", str(profiled.binary), str(tmp_path / "heap.dump")],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    assert "Total:" in out.stdout
    assert re.search(r"safekeeper::|profiling::|profiled_service::", out.stdout), out.stdout[:3000]


def test_heap_svg_is_well_formed(profiled, tmp_path):
    r = fetch(profiled, "/profile/heap?format=svg", tmp_path / "heap.svg")
    assert r.headers["content-type"] == "image/svg+xml"
    root = ET.fromstring(r.content)
    assert root.tag.endswith("svg")


def pprof_bytes(value: str, unit: str) -> float:
    """A size as `go tool pprof` prints it (`63.72` `MB`), in bytes."""
    return float(value) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]


def mb_total(top: str) -> float:
    """The total of a `go tool pprof -top` listing, in bytes."""
    total = re.search(r"of ([\d.]+)([kMG]?B) total", top)
    assert total, top
    return pprof_bytes(total.group(1), total.group(2))


def cum_bytes(top: str, function: str) -> float:
    """The cumulative bytes of `function`'s line in a `go tool pprof -top -cum` listing (0 when
    it has none)."""
    for ln in top.splitlines():
        m = re.match(r"\s*\S+\s+\S+%\s+\S+%\s+([\d.]+)([kMG]?B)\s+\S+%\s+(.*)$", ln)
        if m and m.group(3).startswith(function):
            return pprof_bytes(m.group(1), m.group(2))
    return 0.0


def test_heap_delta_profile_shows_growth(profiled, tmp_path):
    """While a 3 s delta profile runs, the test makes the daemon allocate and keep 64 MiB through
    a testing hook; the delta names that allocation site with most of those bytes, and a plain
    profile taken alongside is not reduced to the growth: it has the 64 MiB and what was live
    before the delta began."""
    # The first profile of a binary builds its symbol index (in a child process, ~10 s): do it
    # before the delta's window opens.
    requests.get(f"{profiled.http}/profile/heap", timeout=60).raise_for_status()
    result: dict[str, requests.Response] = {}

    def take():
        result["r"] = requests.get(f"{profiled.http}/profile/heap?seconds=3", timeout=60)

    t = threading.Thread(target=take)
    t.start()
    time.sleep(1.0)
    retain(profiled, 64)
    # The plain profile, taken while the delta is still running.
    fetch(profiled, "/profile/heap", tmp_path / "plain.pb.gz")
    t.join(timeout=60)
    assert not t.is_alive(), "the delta profile was never answered"
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.headers["x-profile-delta-seconds"] == "3"
    (tmp_path / "delta.pb.gz").write_bytes(r.content)
    top = go_pprof("-top", "-cum", "-nodecount=300", str(tmp_path / "delta.pb.gz"))
    line = next((ln for ln in top.splitlines() if "retain_memory" in ln), None)
    assert line, top
    value = mb_total(top)
    # Sampling every 2 MiB estimates 64 MiB within tens of percent.
    assert 32e6 < value < 160e6, top
    # Start-up's allocations (the profiler's warm-up) are live but did not grow: not in the delta.
    assert "profiling::cpu::warm_up" not in top, top

    # The plain profile has the retained memory and what was live before: the warm-up's
    # allocations at start-up (a few MiB since the symbol cache left the heap), which the delta
    # does not have; so it exceeds the growth by at least most of them.
    plain = go_pprof("-top", "-cum", "-nodecount=300", str(tmp_path / "plain.pb.gz"))
    assert "retain_memory" in plain, plain
    warm_up = cum_bytes(plain, "profiling::cpu::warm_up")
    assert warm_up > 0, plain
    assert mb_total(plain) - value > 0.5 * warm_up, (mb_total(plain), value, warm_up, plain[:3000])

    # A second delta over an idle interval does not show the retained memory again.
    r = requests.get(f"{profiled.http}/profile/heap?seconds=1", timeout=60)
    (tmp_path / "idle.pb.gz").write_bytes(r.content)
    idle = go_pprof("-top", "-cum", "-nodecount=300", str(tmp_path / "idle.pb.gz"))
    assert "retain_memory" not in idle, idle


def test_second_cpu_profile_conflicts_and_force_takes_over(profiled, tmp_path):
    """A second profile gets 409; one with force=true takes over, and the pre-empted request
    (a continuous profiler's, say) is still answered 200 with its shortened profile and headers
    saying it was cut short and how long it really ran (neon's semantics)."""
    first: dict[str, requests.Response] = {}
    # The first profile of a binary builds its symbol index: not inside the timed window.
    requests.get(f"{profiled.http}/profile/heap", timeout=60).raise_for_status()

    def run_first():
        first["r"] = requests.get(f"{profiled.http}/profile/cpu?seconds=20", timeout=60)

    with http_load(profiled, threads=1):
        # The probe must arrive while the first profile holds the profiler; on a loaded machine
        # the first may not have started yet, so the scenario is retried (the probe never takes
        # the profiler away from a running profile: that is what is checked).
        for _ in range(5):
            t = threading.Thread(target=run_first)
            t.start()
            time.sleep(1.0)
            r = requests.get(f"{profiled.http}/profile/cpu?seconds=1", timeout=30)
            if r.status_code == 409:
                break
            t.join(timeout=60)
        assert r.status_code == 409, r.text
        assert "force=true" in r.text
        assert t.is_alive(), "the first profile must still be running"

        time.sleep(1.0)
        forced = requests.get(f"{profiled.http}/profile/cpu?seconds=1&force=true", timeout=30)
        assert forced.status_code == 200, forced.text
        assert "x-profile-cut-short" not in forced.headers
        # The forced profile ran its whole second (its own report says so).
        assert float(forced.headers["x-profile-duration-seconds"]) >= 1.0, forced.headers
        t.join(timeout=60)
    assert not t.is_alive(), "the pre-empted request was never answered"
    cut = first["r"]
    assert cut.status_code == 200, cut.text
    assert cut.headers["x-profile-cut-short"].startswith("true"), cut.headers
    # What the cut profile reports: it ran at least the second the test waited between its 409
    # (it held the profiler) and the forced request, and less than the 20 s it asked for.
    ran = float(cut.headers["x-profile-duration-seconds"])
    assert 1.0 <= ran < 20, ran
    assert "of the 20 s requested" in cut.headers["x-profile-cut-short"], cut.headers
    assert cut.content[:2] == b"\x1f\x8b"
    (tmp_path / "cut.pb.gz").write_bytes(cut.content)
    raw = go_pprof("-raw", str(tmp_path / "cut.pb.gz"))
    # The profile itself records its real duration, and it kept what it sampled.
    duration = re.search(r"^Duration: ([\d.]+)", raw, re.M)
    assert duration and abs(float(duration.group(1)) - ran) < 0.5, raw[:1000]
    assert re.search(r"^\s+\d+\s+\d+: ", raw, re.M), f"no samples kept:\n{raw[:2000]}"
    metrics = requests.get(f"{profiled.http}/metrics", timeout=10).text
    assert re.search(r'profile_requests_total\{outcome="cut_short",profile="cpu"\} 1', metrics)


def test_client_disconnect_stops_cpu_profile(profiled):
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.get(f"{profiled.http}/profile/cpu?seconds=30", timeout=1)
    # The abandoned profile stopped with its client: a new one (without force) runs at once.
    deadline = time.monotonic() + 5
    while True:
        r = requests.get(f"{profiled.http}/profile/cpu?seconds=1", timeout=30)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "path, valid",
    [
        ("/profile/cpu?format=xml", "pprof, svg"),
        ("/profile/cpu?seconds=0", "1 to 60"),
        ("/profile/cpu?seconds=61", "1 to 60"),
        ("/profile/cpu?seconds=abc", "1 to 60"),
        ("/profile/cpu?frequency=0", "1 to 1000"),
        ("/profile/cpu?frequency=1001", "1 to 1000"),
        ("/profile/cpu?force=maybe", "true or false"),
        ("/profile/cpu?secs=5", "valid parameters are"),
        ("/profile/heap?format=xml", "pprof, jemalloc, svg"),
        ("/profile/heap?seconds=0", "1 to 300"),
        ("/profile/heap?format=jemalloc&seconds=5", "format=pprof or format=svg"),
    ],
)
@pytest.mark.promise(8)
def test_bad_profile_parameters_get_400_with_reason(profiled, path, valid):
    r = requests.get(f"{profiled.http}{path}", timeout=10)
    assert r.status_code == 400, r.text
    assert valid in r.text


def test_frequency_above_kernel_tick_is_clamped_and_said(profiled):
    r = requests.get(f"{profiled.http}/profile/cpu?seconds=1&frequency=1000", timeout=30)
    assert r.status_code == 200
    header = r.headers["x-profile-frequency"]
    used = int(header.split(";")[0])
    assert 1 <= used <= 1000
    if used < 1000:
        assert "requested=1000" in header and "clamped" in header


def rss_growth(server, baseline: int, limit: int, timeout: float = 30) -> int:
    """RSS above `baseline` once it is below `limit`, or after `timeout` s: what it then is."""
    deadline = time.monotonic() + timeout
    while True:
        growth = server.rss_bytes() - baseline
        if growth < limit or time.monotonic() > deadline:
            return growth
        time.sleep(0.5)


def test_repeated_cpu_profiles_do_not_ratchet_memory(profiled):
    """Each CPU profile re-allocates pprof-rs's sample table; jemalloc's background thread must
    hand the freed pages back (after its decay time), so RSS after ten profiles comes back to
    within 64 MiB of its level after the first."""

    def profile_ok():
        r = requests.get(f"{profiled.http}/profile/cpu?seconds=1", timeout=30)
        return r.status_code == 200

    with http_load(profiled, threads=1):
        assert profile_ok()
        time.sleep(1)
        after_first = profiled.rss_bytes()
        for _ in range(9):
            assert profile_ok()
    # Freed memory is returned gradually (jemalloc's dirty/muzzy decay, 10 s by default).
    growth = rss_growth(profiled, after_first, 64 * 2**20)
    assert growth < 64 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB over 9 more profiles"


# A scraper's rounds (a CPU profile of 1 s and a heap profile each) and the pause between them.
# CI runs a few short rounds; `PROFILE_SCRAPE_ROUNDS=30 PROFILE_SCRAPE_INTERVAL=10` is the
# Parca / Grafana Alloy shape, by hand.
SCRAPE_ROUNDS = int(os.environ.get("PROFILE_SCRAPE_ROUNDS", "4"))
SCRAPE_INTERVAL = float(os.environ.get("PROFILE_SCRAPE_INTERVAL", "0.5"))
MIB = 2**20


def proc_status(server, field: str) -> int:
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{server.proc.pid}/status")


@pytest.mark.parametrize("kind", ["safekeeper", "example"])
def test_profiles_keep_rss_within_20_mib_of_idle(
    safekeeper_factory, example_factory, kind, tmp_path
):
    """Symbolizing used to parse the binary's debug info onto the heap (~280 MiB for the
    safekeeper, at every start-up and kept while profiles were taken). Now it reads an
    on-disk index built by a child process: the start-up peak (VmHWM), RSS while a
    scraper takes CPU and heap profiles, and RSS after them all stay within 20 MiB of idle;
    and the profiles still name functions by their full paths, with inlined frames and
    file:line, as `go tool pprof` reads them."""
    factory = safekeeper_factory if kind == "safekeeper" else example_factory
    server = factory().start()
    time.sleep(1)
    idle = server.rss_bytes()
    hwm = proc_status(server, "VmHWM")
    assert idle < 40 * MIB, f"idle RSS {idle / MIB:.1f} MiB"
    assert (
        hwm - idle < 20 * MIB
    ), f"start-up peak {hwm / MIB:.1f} MiB against {idle / MIB:.1f} MiB idle"

    peak = [idle]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], server.rss_bytes())
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with http_load(server, threads=1):  # CPU samples to name
            for i in range(SCRAPE_ROUNDS):
                fetch(server, "/profile/cpu?seconds=1", tmp_path / f"cpu{i}.pb.gz")
                fetch(server, "/debug/pprof/heap", tmp_path / f"heap{i}.pb.gz")
                if i == 0:
                    for path in ["/profile/cpu?seconds=1&format=svg", "/profile/heap?format=svg"]:
                        r = requests.get(f"{server.http}{path}", timeout=120)
                        assert r.status_code == 200, (path, r.text)
                        assert b"tokio::runtime::" in r.content, path
                time.sleep(SCRAPE_INTERVAL)
    finally:
        stop.set()
        sampler.join(timeout=5)
    after = server.rss_bytes()
    assert (
        peak[0] - idle < 20 * MIB
    ), f"RSS peaked {(peak[0] - idle) / MIB:.1f} MiB above idle while profiling"
    assert after - idle < 20 * MIB, f"RSS {(after - idle) / MIB:.1f} MiB above idle after"

    last = str(tmp_path / f"cpu{SCRAPE_ROUNDS - 1}.pb.gz")
    for profile in [last, str(tmp_path / f"heap{SCRAPE_ROUNDS - 1}.pb.gz")]:
        lines = go_pprof("-lines", "-top", "-nodecount=400", profile)
        # Full paths and file:line. (The heap profile is sampled, every 512 KiB on average: the
        # live memory it catches may be start-up allocations only, so any module path will do.)
        assert re.search(r"\w+::\w+::\S+ \S+\.rs:\d+", lines), lines[:3000]
        traces = go_pprof("-traces", profile)
        # Inlined frames: go tool pprof marks them.
        assert "(inline)" in traces, traces[:3000]


@pytest.mark.parametrize("kind", ["safekeeper", "example"])
def test_heap_route_explains_when_profiling_is_off(safekeeper_factory, example_factory, kind):
    env = {"MALLOC_CONF": "prof:false"}
    sk = (safekeeper_factory if kind == "safekeeper" else example_factory)(env=env).start()
    for path in ["/profile/heap", "/debug/pprof/heap", "/debug/pprof/allocs"]:
        r = requests.get(f"{sk.http}{path}", timeout=10)
        assert r.status_code == 503, (path, r.text)
        assert "heap profiling is not active" in r.text
    # The server is still healthy.
    assert requests.get(f"{sk.http}{cheap_path(sk)}", timeout=5).ok


@pytest.mark.parametrize("kind", ["safekeeper", "example"])
def test_allocs_refuses_without_cumulative_counts(safekeeper_factory, example_factory, kind):
    """Without prof_accum jemalloc does not count freed allocations: /debug/pprof/allocs says so
    instead of serving zeros, and the heap profile carries only the inuse_ types."""
    env = {"MALLOC_CONF": "prof_accum:false"}
    sk = (safekeeper_factory if kind == "safekeeper" else example_factory)(env=env).start()
    r = requests.get(f"{sk.http}/debug/pprof/allocs", timeout=10)
    assert r.status_code == 503, r.text
    assert "prof_accum" in r.text
    # go tool pprof shows the reason, not just the status.
    go = require("go", "golang-go")
    out = subprocess.run(
        [go, "tool", "pprof", "-top", f"{sk.http}/debug/pprof/allocs"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "prof_accum" in out.stderr, out.stderr
    raw = go_pprof("-raw", f"{sk.http}/debug/pprof/heap")
    assert "inuse_objects/count inuse_space/bytes" in raw, raw[:2000]
    assert "alloc_space" not in raw, raw[:2000]


def test_idle_cpu_profile_is_a_valid_empty_profile(profiled, tmp_path):
    """At 1 Hz a sample needs a whole second of CPU, which an idle server does not spend in one
    second: no samples. The SVG still renders and says so; the pprof is valid with zero samples
    (Go's CPU sample types, period and duration)."""
    r = fetch(profiled, "/profile/cpu?seconds=1&frequency=1&format=svg", tmp_path / "idle.svg")
    assert r.headers["content-type"] == "image/svg+xml"
    root = ET.fromstring(r.content)
    assert root.tag.endswith("svg")
    text = " ".join("".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text"))
    assert re.search(r"no samples in 1\.\d s at 1 Hz \(the process was idle\)", text), text

    r = fetch(profiled, "/profile/cpu?seconds=1&frequency=1", tmp_path / "idle.pb.gz")
    assert len(r.content) > 20 and r.content[:2] == b"\x1f\x8b"
    raw = go_pprof("-raw", str(tmp_path / "idle.pb.gz"))
    assert "PeriodType: cpu nanoseconds" in raw, raw
    assert "Period: 1000000000" in raw, raw
    assert re.search(r"^samples/count cpu/nanoseconds", raw, re.M), raw
    assert re.search(r"^Duration: 1(\.\d+)?s?$", raw, re.M), raw
    assert not re.search(r"^\s+\d+\s+\d+: ", raw, re.M), raw
    top = go_pprof("-top", str(tmp_path / "idle.pb.gz"))
    assert "Type: cpu" in top


def test_go_tool_pprof_fetches_by_url_with_its_defaults(profiled):
    """`go tool pprof http://host:port` (no path) fetches Go's /debug/pprof/profile; heap and
    allocs on Go's paths carry Go's sample types and units."""
    with http_load(profiled):
        top = go_pprof("-seconds", "2", "-top", profiled.http)
    assert "Type: cpu" in top, top
    assert "tokio::" in top, top
    with http_load(profiled):
        raw = go_pprof("-seconds", "2", "-raw", profiled.http)
    assert "PeriodType: cpu nanoseconds" in raw
    assert re.search(r"^samples/count cpu/nanoseconds", raw, re.M), raw[:2000]
    assert re.search(r"^\s+\d+\s+\d+: ", raw, re.M), raw[:2000]

    heap_raw = go_pprof("-raw", f"{profiled.http}/debug/pprof/heap")
    assert "PeriodType: space bytes" in heap_raw
    assert "Period: 2097152" in heap_raw
    assert re.search(
        r"^alloc_objects/count alloc_space/bytes inuse_objects/count inuse_space/bytes\[dflt\]",
        heap_raw,
        re.M,
    ), heap_raw[:2000]
    heap_top = go_pprof("-top", f"{profiled.http}/debug/pprof/heap")
    assert "Type: inuse_space" in heap_top, heap_top
    allocs_top = go_pprof("-top", f"{profiled.http}/debug/pprof/allocs")
    assert "Type: alloc_space" in allocs_top, allocs_top


def test_allocs_counts_freed_memory_and_heap_does_not(profiled, tmp_path):
    """64 MiB allocated and freed again: /debug/pprof/allocs (cumulative) still charges it to
    `retain_memory`, /debug/pprof/heap (live) no longer does."""
    retain(profiled, 64)
    release(profiled)

    def mb_at(url: str, sample_index: str) -> float:
        top = go_pprof(f"-sample_index={sample_index}", "-top", "-cum", "-nodecount=300", url)
        line = next((ln for ln in top.splitlines() if "retain_memory" in ln), None)
        if line is None:
            return 0.0
        # -top -cum columns: flat flat% sum% cum cum%; the cumulative value is the 4th.
        value = line.split()[3]
        number = float(re.match(r"[\d.]+", value).group(0))
        return number * {"kB": 1e-3, "MB": 1, "GB": 1e3}.get(value.lstrip("0123456789."), 1e-6)

    allocated = mb_at(f"{profiled.http}/debug/pprof/allocs", "alloc_space")
    live = mb_at(f"{profiled.http}/debug/pprof/heap", "inuse_space")
    assert 32 < allocated < 160, allocated
    assert live < 8, live


def test_profile_sizes_and_times_under_load(safekeeper_factory, tmp_path):
    """Size and time of each profile kind while a walproposer streams WAL to the safekeeper,
    printed for the record (PROFILE_SECONDS, default 3; the README's figures are for 30 at
    99 Hz). Each answer must be a non-empty, readable profile."""
    seconds = int(os.environ.get("PROFILE_SECONDS", "3"))
    sk = safekeeper_factory().start()
    proposer = subprocess.Popen(
        [str(RELEASE_DIR / "walproposer"), "--safekeepers", f"127.0.0.1:{sk.pg_port}"]
        + ["--total", "100G", "--rate", "16M"],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "walproposer.log", "wb"),
        env={**os.environ, "RUST_LOG": "warn"},
    )
    rows = []
    try:
        time.sleep(1.0)
        kinds = [
            ("cpu pprof", f"/debug/pprof/profile?seconds={seconds}", seconds),
            ("cpu svg", f"/profile/cpu?seconds={seconds}&format=svg", seconds),
            ("heap pprof", "/debug/pprof/heap", 0),
            ("allocs pprof", "/debug/pprof/allocs", 0),
            ("heap svg", "/profile/heap?format=svg", 0),
            ("heap jemalloc", "/profile/heap?format=jemalloc", 0),
            ("heap delta pprof", f"/debug/pprof/heap?seconds={seconds}", seconds),
        ]
        for name, path, sampling in kinds:
            assert proposer.poll() is None, (tmp_path / "walproposer.log").read_text()
            started = time.monotonic()
            r = requests.get(f"{sk.http}{path}", timeout=seconds + 120)
            elapsed = time.monotonic() - started
            assert r.status_code == 200, (path, r.text)
            assert len(r.content) > 100, (path, r.content)
            rows.append((name, len(r.content), elapsed - sampling))
    finally:
        proposer.kill()
        proposer.wait()
    print(f"\nprofiles at 99 Hz, {seconds} s, under WAL load:")
    for name, size, extra in rows:
        print(f"  {name:18} {size / 1024:8.1f} KiB  {extra * 1e3:8.0f} ms beyond the sampling time")
