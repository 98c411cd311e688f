"""Limits against real sockets: a connection flood over --max-connections, slow-loris clients
before authentication, stalled streaming connections, and the HTTP per-class request limit.
Each is cut at its limit while an honest walproposer keeps committing, and memory stays
bounded."""

from __future__ import annotations

import socket
import struct
import subprocess
import threading
import time

import pytest
import requests

from fixtures.daemon import RELEASE_DIR, lsn_int, max_acked, wait_until
from fixtures.pgwire import (
    OPTIONS,
    error_code,
    query_message,
    read_message,
    startup_packet,
    wait_closed,
)
from fixtures.tools import require


class Proposer:
    """An honest walproposer streaming at a steady rate in the background, with an ack log."""

    def __init__(self, sk, tmp_path, rate: str = "4M"):
        self.ack_log = tmp_path / "acks"
        self.proc = subprocess.Popen(
            [str(RELEASE_DIR / "walproposer"), "--safekeepers", f"127.0.0.1:{sk.pg_port}"]
            + ["--total", "10G", "--rate", rate, "--ack-log", str(self.ack_log)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(lambda: max_acked(self.ack_log) > lsn_int("0/1000000"), "first commit")

    def acked(self) -> int:
        return max_acked(self.ack_log)

    def assert_commits(self, what: str) -> None:
        before = self.acked()
        wait_until(lambda: self.acked() > before + (1 << 20), f"commits to advance {what}")
        assert self.proc.poll() is None, "the honest proposer exited"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_connection_flood_over_the_limit_gets_53300_while_a_proposer_commits(
    safekeeper_factory, tmp_path
):
    sk = safekeeper_factory(extra_args=["--max-connections", "20"]).start()
    wp = Proposer(sk, tmp_path)
    rss_before = sk.rss_bytes()
    held, refused = [], 0
    for _ in range(400):
        s = socket.create_connection(("127.0.0.1", sk.pg_port))
        s.settimeout(10)
        s.sendall(startup_packet("user", "postgres", "replication", "true", "options", OPTIONS))
        tag, body = read_message(s)
        if tag == b"E":
            assert error_code(body) == "53300", body
            assert b"too many clients" in body, body
            refused += 1
            s.close()
        else:
            held.append(s)  # accepted: keep it open, holding a slot
    # The proposer holds a slot; the flood takes the others and every later one is refused.
    assert 15 <= len(held) <= 19, len(held)
    assert refused == 400 - len(held)
    wp.assert_commits("during the flood")
    # A real client over the limit gets PostgreSQL's message.
    exe = require("pg_receivewal", "postgresql-client-15")
    out = subprocess.run(
        [exe, "-D", str(tmp_path), "-h", "127.0.0.1", "-p", str(sk.pg_port), "-U", "postgres"]
        + ["--no-loop", "--no-password"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode != 0
    assert "sorry, too many clients already" in out.stderr, out.stderr
    rss_during = sk.rss_bytes()
    for s in held:
        s.close()
    # Slots come back when connections close.
    wait_until(lambda: accepted(sk), "a slot to free up")
    wp.assert_commits("after the flood")
    wp.stop()
    growth = rss_during - rss_before
    print(
        f"RSS before {rss_before >> 20} MiB, during a 400-connection flood {rss_during >> 20} MiB"
    )
    assert growth < 32 << 20, f"the flood grew RSS by {growth >> 20} MiB"


def accepted(sk) -> bool:
    with socket.create_connection(("127.0.0.1", sk.pg_port)) as s:
        s.settimeout(10)
        s.sendall(startup_packet("user", "postgres", "replication", "true"))
        return read_message(s)[0] != b"E"


@pytest.mark.promise(14)
def test_idle_sockets_that_never_authenticate_do_not_keep_clients_out(safekeeper_factory, tmp_path):
    """Issue 26, defect 8: 600 TCP connections that never send a startup packet (far more than
    --max-connections and the handshake pool) used to hold every slot for the whole handshake
    timeout. They only push each other out of their own pool: an authenticated client gets in
    at once, and the proposer goes on committing."""
    sk = safekeeper_factory(
        extra_args=["--max-connections", "20", "--max-handshaking-connections", "16"]
    ).start()
    wp = Proposer(sk, tmp_path)
    idle = [socket.create_connection(("127.0.0.1", sk.pg_port)) for _ in range(600)]

    # Every one was accepted (the daemon accepts at once); all but the newest 16 were closed.
    def closed(s) -> bool:
        s.setblocking(False)
        try:
            return s.recv(1) == b""
        except BlockingIOError:
            return False
        except ConnectionResetError:
            return True

    wait_until(lambda: sum(closed(s) for s in idle) >= 600 - 16, "the oldest idle sockets closed")
    assert accepted(sk), "an authenticated client is served while idle sockets keep arriving"
    wp.assert_commits("with 600 idle sockets opened")
    for s in idle:
        s.close()
    wp.stop()
    assert "handshake pool" in sk.log()


def test_slow_loris_before_auth_is_cut_at_the_handshake_timeout(safekeeper_factory, tmp_path):
    sk = safekeeper_factory(extra_args=["--handshake-timeout", "2s"]).start()
    wp = Proposer(sk, tmp_path)
    packet = startup_packet("user", "postgres", "replication", "true", "options", OPTIONS)
    lorises = [socket.create_connection(("127.0.0.1", sk.pg_port)) for _ in range(50)]
    started = time.monotonic()
    closed_at: dict[int, float] = {}
    # One byte of the startup packet per connection every 0.25 s: never idle, never done.
    for i in range(len(packet)):
        for n, s in enumerate(lorises):
            if n in closed_at:
                continue
            try:
                s.sendall(packet[i : i + 1])
            except (BrokenPipeError, ConnectionResetError):
                closed_at[n] = time.monotonic() - started
        if len(closed_at) == len(lorises) or time.monotonic() - started > 15:
            break
        time.sleep(0.25)
    for n, s in enumerate(lorises):
        if n not in closed_at:
            wait_closed(s, 10)
            closed_at[n] = time.monotonic() - started
        s.close()
    latest = max(closed_at.values())
    print(f"50 slow-loris connections cut after {min(closed_at.values()):.1f}-{latest:.1f} s")
    assert latest < 6, closed_at
    wp.assert_commits("after the slow-loris clients")
    assert "--handshake-timeout" in sk.log()
    wp.stop()


def test_stalled_streaming_connections_are_cut_at_the_idle_timeout(safekeeper_factory, tmp_path):
    sk = safekeeper_factory(extra_args=["--pg-idle-timeout", "2s"]).start()
    # A slow honest proposer: its 1 s heartbeats and appends keep its stream alive.
    wp = Proposer(sk, tmp_path, rate="256K")
    rss_before = sk.rss_bytes()

    def connect():
        s = socket.create_connection(("127.0.0.1", sk.pg_port))
        s.settimeout(10)
        s.sendall(startup_packet("user", "postgres", "replication", "true", "options", OPTIONS))
        while read_message(s)[0] != b"Z":
            pass
        return s

    def query(s, q: str, until: bytes):
        s.sendall(query_message(q))
        while read_message(s)[0] != until:
            pass

    stalled = []
    for _ in range(10):
        # A proposer that opens WAL push, sends part of a frame, then nothing.
        s = connect()
        query(s, "START_WAL_PUSH (proto_version '3')", b"W")
        s.sendall(b"d" + struct.pack("!I", 4 + 4096) + b"g" + bytes(7))
        stalled.append(s)
        # A reader that starts streaming, never sends feedback and never reads.
        s = socket.create_connection(("127.0.0.1", sk.pg_port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(10)
        s.sendall(startup_packet("user", "postgres", "replication", "true", "options", OPTIONS))
        while read_message(s)[0] != b"Z":
            pass
        query(s, "START_REPLICATION 0/1000000", b"W")
        stalled.append(s)
        # A client idle in query mode.
        stalled.append(connect())
    started = time.monotonic()
    # The daemon logs each cut (a reader that reads nothing would take long to drain what was
    # sent before the cut through its tiny window, so the log is the witness).
    wait_until(
        lambda: sk.log().count("(--pg-idle-timeout)") >= len(stalled),
        "every stalled connection to be cut",
        timeout=8,
    )
    elapsed = time.monotonic() - started
    print(f"{len(stalled)} stalled connections cut within {elapsed:.1f} s (idle timeout 2 s)")
    for s in stalled[::3] + stalled[2::3]:  # the WAL pushes and the idle ones: closed
        assert wait_closed(s, 5) < 5
    # The honest stream outlived several idle timeouts.
    wp.assert_commits("after the stalled connections were cut")
    assert time.monotonic() - started > 2
    assert sk.rss_bytes() - rss_before < 32 << 20
    for s in stalled:
        s.close()
    wp.stop()


def test_http_requests_over_a_class_limit_get_503_and_other_classes_are_unaffected(
    safekeeper_factory,
):
    sk = safekeeper_factory(extra_args=["--http-max-concurrent-requests", "1"]).start()
    held: list[requests.Response] = []
    slow = threading.Thread(
        target=lambda: held.append(requests.get(f"{sk.http}/profile/cpu?seconds=12", timeout=60))
    )
    slow.start()
    try:
        # The profile holds the only slot of its class: status is shed with 503...
        def shed() -> str | None:
            # The slot's holder must still hold it: a profile that ended (or failed) early
            # would make this wait for a 503 that cannot come.
            assert not held, (held[0].status_code, held[0].text[:500])
            r = requests.get(f"{sk.http}/v1/status", timeout=5)
            return r.text if r.status_code == 503 else None

        # (Up to 10 s: on a loaded machine the profile may take a while to take its slot.)
        text = wait_until(shed, "the status route to be shed", timeout=10)
        assert "--http-max-concurrent-requests" in text
        # ...while the data class has its own slot.
        assert requests.get(f"{sk.http}/v1/timelines", timeout=5).status_code == 200
    finally:
        slow.join()
    assert requests.get(f"{sk.http}/v1/status", timeout=5).status_code == 200
