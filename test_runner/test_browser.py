"""Profiles as people look at them, in a real browser (Debian's headless `chromium`): the CPU
and heap flamegraphs straight from the server, the SVG of an idle profile, and the web UI of
`go tool pprof -http` fetching our profile by URL. Each page must render (a screenshot that is
not blank) and its scripts must run without errors (the flamegraph's own search and zoom are
called; the console and uncaught exceptions are collected over the DevTools protocol)."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from contextlib import contextmanager

import requests

from fixtures.browser import Chromium, assert_not_blank
from fixtures.daemon import free_port
from fixtures.tools import require


@contextmanager
def load(server, threads: int = 2):
    """Bounded HTTP load (metrics scrapes) while the block runs, so CPU profiles have samples."""
    stop = threading.Event()

    def loop():
        with requests.Session() as s:
            while not stop.is_set():
                s.get(f"{server.http}/metrics", timeout=5)

    workers = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    try:
        yield
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=10)


def check_flamegraph(browser: Chromium, url: str, shot, term: str) -> None:
    browser.open(url)
    browser.settle()
    # init() ran on load (it sets `details`), and the flamegraph has frames.
    assert browser.eval("typeof details === 'object' && details !== null"), browser.errors
    frames = browser.eval("document.getElementById('frames').children.length")
    assert frames and frames > 3, frames
    browser.eval(f"search({json.dumps(term)})")
    matched = browser.eval("document.getElementById('matched').textContent")
    assert matched and matched.startswith("Matched: "), matched
    assert float(matched.removeprefix("Matched: ").rstrip("%")) > 0, matched
    browser.eval("zoom(document.getElementById('frames').children[1])")
    assert not browser.eval("document.getElementById('unzoom').classList.contains('hide')")
    browser.eval("unzoom(); reset_search()")
    browser.settle(0.2)
    assert_not_blank(browser.screenshot(shot))
    assert not browser.errors, browser.errors


def test_cpu_and_heap_flamegraphs_render_and_their_scripts_run(safekeeper, tmp_path):
    with Chromium(tmp_path) as browser:
        with load(safekeeper):
            check_flamegraph(
                browser,
                f"{safekeeper.http}/profile/cpu?seconds=3&format=svg",
                tmp_path / "cpu.png",
                "tokio",
            )
        # The idle heap is the runtime's (the symbolizer's cache from start-up is freed).
        check_flamegraph(
            browser, f"{safekeeper.http}/profile/heap?format=svg", tmp_path / "heap.png", "tokio"
        )


def test_idle_profile_svg_renders_its_message(safekeeper, tmp_path):
    with Chromium(tmp_path) as browser:
        browser.open(f"{safekeeper.http}/profile/cpu?seconds=1&frequency=1&format=svg")
        text = browser.eval("document.documentElement.textContent")
        assert "no samples in 1." in text and "at 1 Hz" in text, text
        assert_not_blank(browser.screenshot(tmp_path / "idle.png"), min_colors=3)
        assert not browser.errors, browser.errors


def test_the_checker_sees_script_errors(tmp_path):
    """The check above has teeth: an SVG whose script fails is reported."""
    bad = tmp_path / "bad.svg"
    bad.write_text(
        '<svg xmlns="http://www.w3.org/2000/svg" onload="init(evt)" width="100" height="100">'
        '<script type="text/ecmascript"><![CDATA[function init(evt) { no_such_function(); }]]>'
        '</script><rect width="100" height="100" fill="red"/></svg>'
    )
    with Chromium(tmp_path) as browser:
        browser.open(bad.as_uri())
        browser.settle()
        assert any("no_such_function" in e for e in browser.errors), browser.errors


def test_go_pprof_web_ui_shows_our_profile(safekeeper, tmp_path):
    """`go tool pprof -http` fetches the CPU profile by URL (Go's default path) and serves its
    web UI; its graph (drawn by graphviz), flame graph and top views render in Chromium."""
    go = require("go", "golang-go")
    require("dot", "graphviz")
    port = free_port()
    log = open(tmp_path / "pprof-http.log", "wb")
    with load(safekeeper):
        proc = subprocess.Popen(
            [go, "tool", "pprof", "-no_browser", f"-http=127.0.0.1:{port}", "-seconds", "3"]
            + [safekeeper.http],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 90
            while True:
                assert proc.poll() is None, (tmp_path / "pprof-http.log").read_text()
                try:
                    if requests.get(f"http://127.0.0.1:{port}/ui/top", timeout=2).ok:
                        break
                except requests.RequestException:
                    pass
                assert time.monotonic() < deadline, "go tool pprof -http did not serve"
                time.sleep(0.2)
        except BaseException:
            proc.kill()
            raise
    try:
        with Chromium(tmp_path) as browser:
            for view in ["/ui/", "/ui/flamegraph", "/ui/top"]:
                browser.open(f"http://127.0.0.1:{port}{view}")
                browser.settle(1.0)
                text = browser.eval("document.documentElement.textContent")
                assert "tokio" in text, f"{view}: {text[:2000]}"
                assert "Could not execute dot" not in text, text[:2000]
                name = view.strip("/").replace("/", "-") or "ui"
                assert_not_blank(browser.screenshot(tmp_path / f"{name}.png"))
            assert not browser.errors, browser.errors
    finally:
        proc.kill()
        proc.wait()
