"""Logs a machine can read: `--log-format json` writes one JSON object per line, every line
about a timeline carries its tenant and timeline ids as fields, and text logs have no ANSI
colour codes unless stderr is a terminal."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import time

from fixtures.daemon import TENANT, TIMELINE, walproposer

# Modules whose every log line is about one timeline.
TIMELINE_TARGETS = (
    "safekeeper::receive_wal",
    "safekeeper::send_wal",
    "safekeeper::wal_store",
    "safekeeper::timeline",
    "safekeeper::registry",
    "safekeeper::control_file",
)


def test_json_log_lines_carry_the_timeline_ids(safekeeper_factory):
    sk = safekeeper_factory(extra_args=["--log-format", "json"]).start()
    walproposer([sk], "--total", "2M")
    assert sk.stop() == 0
    sk.start()  # loads the timeline: recovery and WAL store lines
    walproposer([sk], "--total", "1M")
    assert sk.stop() == 0

    lines = [json.loads(line) for line in sk.log().splitlines() if line.strip()]
    assert all({"timestamp", "level", "target", "message"} <= line.keys() for line in lines)
    about_timeline = [line for line in lines if line["target"].startswith(TIMELINE_TARGETS)]
    messages = {line["message"] for line in about_timeline}
    expected = {
        "timeline created",
        "proposer connected",
        "proposer disconnected",
        "timeline loaded",
        "WAL store opened",
    }
    assert expected <= messages, messages
    for line in about_timeline:
        span = line.get("span", {})
        assert span.get("tenant_id") == TENANT and span.get("timeline_id") == TIMELINE, line


def test_text_logs_have_no_colour_codes_when_not_a_terminal(safekeeper_factory):
    sk = safekeeper_factory().start()
    walproposer([sk], "--total", "1M")
    assert sk.stop() == 0
    log = sk.log()
    assert "\x1b[" not in log, repr(log[:500])
    # The timeline's ids are fields of the lines about it in text form too.
    assert re.search(
        rf"timeline\{{tenant_id={TENANT} timeline_id={TIMELINE}\}}.*proposer connected", log
    ), log


def test_text_logs_are_coloured_on_a_terminal(safekeeper_factory):
    sk = safekeeper_factory()
    sk.datadir.mkdir(parents=True)
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        sk.args(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=secondary,
        env={**os.environ, "RUST_LOG": "info"},
    )
    os.close(secondary)
    out = b""
    try:
        deadline = time.monotonic() + 20
        while b"safekeeper started" not in out and time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 0.5)
            if ready:
                out += os.read(primary, 65536)
    finally:
        proc.kill()
        proc.wait()
        os.close(primary)
    assert b"safekeeper started" in out, out
    assert b"\x1b[" in out, out
