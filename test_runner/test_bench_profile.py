"""The flamegraph workflow of wal-bench, as its README documents it.

`--profile-time N` must reach Criterion for every bench of the crate: a helper binary benched
with libtest's harness refuses the option ("Unrecognized option: 'profile-time'") and fails the
whole `cargo bench` run. The README's exact command runs here, and the SVG it names must be a
flamegraph of the bench's own code.
"""

import json
import re
import shlex
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from fixtures.daemon import BENCH_BUILD, RELEASE_DIR, REPO, cargo_release

TARGET = RELEASE_DIR.parent


def readme_profile_block() -> tuple[list[str], Path]:
    """The command of wal-bench/README.md's "## Profile" block and the SVG its comment names."""
    text = (REPO / "wal-bench" / "README.md").read_text()
    section = text.split("\n## Profile\n", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    command = next(line for line in block.splitlines() if line.startswith("cargo bench"))
    svg = re.search(r"^# -> (\S+)$", block, re.M).group(1)
    return shlex.split(command), REPO / svg


def run_bench(argv: list[str]) -> str:
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1800)
    log = out.stdout + out.stderr
    assert out.returncode == 0, f"{shlex.join(argv)} failed:\n{log[-4000:]}"
    assert "Unrecognized option" not in log, log[-4000:]
    return log


def assert_flamegraph(svg: Path, since: float, frame: str) -> None:
    assert svg.exists(), f"no flamegraph at {svg}"
    assert svg.stat().st_mtime >= since, f"{svg} was not rewritten by this run"
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg"), root.tag
    titles = [t.text or "" for t in root.iter() if t.tag.endswith("title")]
    # Frames name the functions with their module paths (full debug info in the bench profile).
    assert any(frame in t for t in titles), f"no frame of {frame} among {len(titles)} frames"


def test_the_readme_flamegraph_command_writes_the_svg_it_names():
    argv, svg = readme_profile_block()
    assert "--profile-time" in argv, argv
    started = time.time() - 1
    log = run_bench(argv)
    assert "Profiling for" in log, log[-4000:]
    assert_flamegraph(svg, started, "safekeeper::")


def test_profile_time_without_naming_the_bench():
    """`cargo bench -p wal-bench -- <filter> --profile-time N` goes to every bench binary of the
    crate (the helper binaries too, unless they are kept out of `cargo bench`)."""
    started = time.time() - 1
    log = run_bench(
        ["cargo", "bench", "-p", "wal-bench", "--", "process_msg/fsync=false/commit=false/size=8$"]
        + ["--profile-time", "1"]
    )
    assert "Profiling for" in log, log[-4000:]
    svg = TARGET / "criterion/process_msg/fsync=false_commit=false/size=8/profile/flamegraph.svg"
    assert_flamegraph(svg, started, "process_msg")


@pytest.fixture(scope="module")
def commit_tail() -> Path:
    """wal-bench's commit-tail and the echo peer it starts, built in release."""
    # The session's build made them (this is a no-op then), with wal-bench's package set.
    cargo_release(*BENCH_BUILD, "--bin", "commit-tail", "--bin", "echo-peer")
    return RELEASE_DIR / "commit-tail"


def test_the_independent_commit_client_commits_real_wal(commit_tail, safekeeper):
    """wal-bench's commit-tail (the bench report's independent protocol-v3 client and tail
    rows): its commits are real, decodable WAL in the daemon's timeline, and its summary is
    ordered."""
    samples, warm_up = 300, 20
    out = subprocess.run(
        [str(commit_tail), "commit"]
        + ["--safekeeper", f"127.0.0.1:{safekeeper.pg_port}"]
        + ["--samples", str(samples), "--warm-up", str(warm_up)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["name"] == "commit/safekeepers=1" and s["n"] == samples, s
    assert 0 < s["p50_us"] <= s["p90_us"] <= s["p99_us"] <= s["p999_us"] <= s["max_us"], s
    assert safekeeper.stop() == 0
    (tl_dir,) = [d for d in (safekeeper.datadir / ("7a" * 16)).iterdir() if d.is_dir()]
    v = subprocess.run(
        [str(RELEASE_DIR / "wal-verify"), str(tl_dir)], capture_output=True, text=True, timeout=120
    )
    assert v.returncode == 0, v.stderr
    verified = json.loads(v.stdout)
    # Every commit is one record; the last one's commit is only known to the client.
    assert verified["records"] >= samples + warm_up - 1, verified


def test_disk_and_echo_baselines_run(commit_tail, tmp_path):
    """The physical limits the tail rows divide by: raw pwrite + fdatasync (one file and two at
    once) and the echo round trip, summarised the same way."""
    for args in (
        ["disk", "--dir", str(tmp_path)],
        ["disk", "--dir", str(tmp_path), "--files", "2"],
        ["echo"],
    ):
        out = subprocess.run(
            [str(commit_tail), *args, "--samples", "200", "--warm-up", "10"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        s = json.loads(out.stdout)
        assert s["n"] == 200 and 0 < s["p50_us"] <= s["p99_us"] <= s["max_us"], s
