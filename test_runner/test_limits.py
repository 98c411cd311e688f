"""Limits against real sockets: a connection flood over --max-connections, slow-loris clients
before authentication, stalled streaming connections, and the HTTP per-class request limit.
Each is cut at its limit while an honest walproposer keeps committing, and memory stays
bounded."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests

from fixtures.daemon import RELEASE_DIR, TENANT, TIMELINE, lsn_int, max_acked, wait_until
from fixtures.pgwire import (
    OPTIONS,
    assert_closed_by_peer,
    error_code,
    query_message,
    read_message,
    startup_packet,
)
from fixtures.tools import require


class Proposer:
    """An honest walproposer streaming at a steady rate in the background, with an ack log."""

    def __init__(self, sk, tmp_path, rate: str = "4M"):
        self.ack_log = tmp_path / "acks"
        self.log_path = tmp_path / "walproposer.log"
        self.proc = subprocess.Popen(
            [str(RELEASE_DIR / "walproposer"), "--safekeepers", f"127.0.0.1:{sk.pg_port}"]
            + ["--total", "10G", "--rate", rate, "--ack-log", str(self.ack_log)],
            stdout=subprocess.DEVNULL,
            stderr=open(self.log_path, "wb"),
            env={**os.environ, "RUST_LOG": "info"},
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
    """50 connections each send one byte of their startup packet every 0.25 s: never idle, never
    done. Every one is cut while it is still sending, and the daemon says it was the handshake
    timeout (its configured 2 s) that cut it."""
    sk = safekeeper_factory(extra_args=["--handshake-timeout", "2s"]).start()
    wp = Proposer(sk, tmp_path)
    # A long (but legal: under the 8 KiB cap) packet: ~500 bytes last over 2 min at this pace,
    # far longer than the handshake timeout even on a loaded machine. Its last byte is never sent.
    packet = startup_packet(
        "user", "postgres", "replication", "true", "options", OPTIONS, "application_name", "l" * 400
    )
    lorises = [socket.create_connection(("127.0.0.1", sk.pg_port)) for _ in range(50)]
    cut_while_sending: set[int] = set()
    for i in range(len(packet) - 1):
        for n, s in enumerate(lorises):
            if n in cut_while_sending:
                continue
            try:
                s.sendall(packet[i : i + 1])
            except (BrokenPipeError, ConnectionResetError):
                cut_while_sending.add(n)
        if len(cut_while_sending) == len(lorises):
            break
        time.sleep(0.25)
    for s in lorises:
        s.close()
    assert len(cut_while_sending) == len(
        lorises
    ), f"only {len(cut_while_sending)} of {len(lorises)} were cut before their packet ran out"
    # The cut is the handshake timeout, at its configured value.
    cuts = sk.log().count("the startup handshake took longer than 2s (--handshake-timeout)")
    assert cuts >= len(lorises), sk.log()[-3000:]
    wp.assert_commits("after the slow-loris clients")
    wp.stop()


def tcp_connections(pid: int, port: int) -> set[int]:
    """The local ports of the established TCP connections of process `pid` to `port` on
    loopback (from /proc: the process's socket inodes matched in /proc/net/tcp)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        local, remote, state, inode = f[1], f[2], f[3], f[9]
        if state == "01" and int(remote.split(":")[1], 16) == port and inode in inodes:
            ports.add(int(local.split(":")[1], 16))
    return ports


def test_stalled_streaming_connections_are_cut_at_the_idle_timeout(safekeeper_factory, tmp_path):
    idle_timeout = 2
    sk = safekeeper_factory(extra_args=["--pg-idle-timeout", f"{idle_timeout}s"]).start()
    # A slow honest proposer: its 1 s heartbeats and appends keep its stream alive.
    wp = Proposer(sk, tmp_path, rate="256K")
    honest = tcp_connections(wp.proc.pid, sk.pg_port)
    assert len(honest) == 1, honest
    honest_since = time.monotonic()
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
    # The daemon logs each cut (a reader that reads nothing would take long to drain what was
    # sent before the cut through its tiny window, so the log is the witness).
    wait_until(
        lambda: sk.log().count("(--pg-idle-timeout)") >= len(stalled),
        "every stalled connection to be cut",
    )
    for s in stalled[::3] + stalled[2::3]:  # the WAL pushes and the idle ones: closed
        assert_closed_by_peer(s)
    # The honest stream outlives several idle timeouts: let three pass since it connected, then
    # it is still the same connection (same local port, still established; the proposer never
    # logged a reconnect), it kept committing, and the daemon cut nothing but the stalled ones.
    wait_until(
        lambda: time.monotonic() >= honest_since + 3 * idle_timeout,
        "three idle timeouts to pass over the honest stream",
    )
    wp.assert_commits("after the stalled connections were cut")
    assert tcp_connections(wp.proc.pid, sk.pg_port) == honest
    assert "reconnecting" not in wp.log_path.read_text(), wp.log_path.read_text()[-3000:]
    assert sk.log().count("(--pg-idle-timeout)") == len(stalled), sk.log()[-3000:]
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


def test_http_data_requests_over_their_limit_get_503_and_status_is_unaffected(
    safekeeper_factory,
):
    """The data class has its own limit: a pull_timeline waiting on a peer that never answers
    holds its only slot, so a timeline listing is shed with 503 while status still answers; once
    the peer hangs up the pull fails (502) and the slot is free again."""
    sk = safekeeper_factory(extra_args=["--http-max-concurrent-requests", "1"]).start()
    # A "peer" that accepts the pull's status request and never answers it.
    silent = socket.create_server(("127.0.0.1", 0))
    accepted_conns: list[socket.socket] = []
    acceptor = threading.Thread(
        target=lambda: accepted_conns.append(silent.accept()[0]), daemon=True
    )
    acceptor.start()
    pulled: list[requests.Response] = []
    body = {
        "tenant_id": TENANT,
        "timeline_id": TIMELINE,
        "http_hosts": [f"127.0.0.1:{silent.getsockname()[1]}"],
    }
    puller = threading.Thread(
        target=lambda: pulled.append(
            requests.post(f"{sk.http}/v1/pull_timeline", data=json.dumps(body), timeout=120)
        )
    )
    puller.start()
    try:
        wait_until(lambda: accepted_conns, "the pull to reach the silent peer")

        def shed() -> str | None:
            # The pull must still hold the slot: one that ended would make this wait forever.
            assert not pulled, (pulled[0].status_code, pulled[0].text[:500])
            r = requests.get(f"{sk.http}/v1/timelines", timeout=5)
            return r.text if r.status_code == 503 else None

        text = wait_until(shed, "the timeline listing to be shed")
        assert "too many data requests" in text and "--http-max-concurrent-requests" in text
        # ...while the status class has its own slot.
        assert requests.get(f"{sk.http}/v1/status", timeout=5).status_code == 200
        assert not pulled, "the pull ended while the peer was silent"
    finally:
        for c in accepted_conns:
            c.close()
        silent.close()
        puller.join(timeout=120)
    assert pulled and pulled[0].status_code == 502, pulled and pulled[0].text
    assert requests.get(f"{sk.http}/v1/timelines", timeout=5).status_code == 200
