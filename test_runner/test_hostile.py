"""Hostile and broken input against a running daemon, and start-up refusals on corrupt data.

Promises checked: hostile input is contained (no crash, bounded memory, honest clients keep
working); corruption before the end of WAL stops start-up with a clear error; a graceful stop
during ingestion keeps everything acknowledged."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import struct
import subprocess
import time

import pytest
import requests

from fixtures.daemon import RELEASE_DIR, lsn_int, timeline_dir, walproposer


@pytest.mark.promise(8)
def test_many_concurrent_cpu_profiles_get_one_200_and_409s(safekeeper):
    def get(_):
        return requests.get(f"{safekeeper.http}/profile/cpu?seconds=2", timeout=60).status_code

    with concurrent.futures.ThreadPoolExecutor(max_workers=100) as pool:
        codes = list(pool.map(get, range(100)))
    assert codes.count(200) >= 1
    assert codes.count(200) + codes.count(409) == 100, codes
    # Only requests that did not overlap a running profile could succeed: with all 100 sent at
    # once, nearly all conflict.
    assert codes.count(409) >= 90, codes
    assert requests.get(f"{safekeeper.http}/v1/status", timeout=5).ok


@pytest.mark.promise(8)
def test_hostile_pg_clients_are_contained(safekeeper):
    walproposer([safekeeper], "--total", "2M")
    rss_before = safekeeper.rss_bytes()
    socks = []
    # Many idle connections, some that announce a huge message and stall, some garbage.
    for i in range(300):
        s = socket.create_connection(("127.0.0.1", safekeeper.pg_port))
        if i % 3 == 1:
            s.sendall(struct.pack("!I", 0x7FFFFFF0))  # a startup packet "of 2 GiB"
        elif i % 3 == 2:
            s.sendall(os.urandom(64))
        socks.append(s)
    time.sleep(1)
    rss_during = safekeeper.rss_bytes()
    # Honest clients keep working meanwhile.
    stats = walproposer([safekeeper], "--total", "4M")
    assert stats["commit_lsn"] == stats["end_lsn"]
    assert requests.get(f"{safekeeper.http}/v1/status", timeout=5).ok
    for s in socks:
        s.close()
    growth = rss_during - rss_before
    print(f"RSS before {rss_before >> 20} MiB, with 300 hostile connections {rss_during >> 20} MiB")
    assert growth < 64 << 20, f"hostile connections grew RSS by {growth >> 20} MiB"
    assert safekeeper.proc.poll() is None


@pytest.mark.promise(1, 9)
def test_sigterm_during_ingestion_exits_promptly_keeping_acknowledged_wal(
    safekeeper_factory, tmp_path
):
    sk = safekeeper_factory().start()
    ack_log = tmp_path / "acks"
    wp = subprocess.Popen(
        [str(RELEASE_DIR / "walproposer"), "--safekeepers", f"127.0.0.1:{sk.pg_port}"]
        + ["--total", "10G", "--rate", "16M", "--ack-log", str(ack_log)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(2)
    started = time.monotonic()
    assert sk.stop(timeout=5) == 0
    assert time.monotonic() - started < 5
    wp.send_signal(signal.SIGKILL)
    wp.wait()
    acked = max(lsn_int(x) for x in ack_log.read_text().split())
    sk.start()
    t = requests.get(f"{sk.http}/v1/timelines", timeout=5).json()[0]
    assert lsn_int(t["flush_lsn"]) >= acked, (t, acked)
    # The safekeeper may not have learnt the last commit LSN before it stopped (the proposer
    # acknowledges on the flush reply, then tells the safekeeper with its next append), but the
    # acknowledged WAL is there to be committed: a new proposer commits all of it.
    assert lsn_int(t["commit_lsn"]) <= lsn_int(t["flush_lsn"]), t
    synced = walproposer([sk], "--sync")
    assert lsn_int(synced["lsn"]) >= acked, (synced, acked)


def _stopped_with_wal(factory):
    sk = factory().start()
    walproposer([sk], "--total", "3M")
    assert sk.stop() == 0
    return sk


@pytest.mark.promise(5)
def test_bit_flip_in_control_file_refuses_start_naming_the_file(safekeeper_factory):
    sk = _stopped_with_wal(safekeeper_factory)
    control = timeline_dir(sk) / "safekeeper.control"
    data = bytearray(control.read_bytes())
    data[len(data) // 2] ^= 0x10
    control.write_bytes(bytes(data))
    proc = sk.spawn()
    assert proc.wait(timeout=30) == 1
    assert str(control) in sk.log()
    assert "checksum" in sk.log().lower() or "corrupt" in sk.log().lower()


@pytest.mark.promise(5)
def test_flipped_byte_below_commit_refuses_start(safekeeper_factory):
    sk = _stopped_with_wal(safekeeper_factory)
    seg = timeline_dir(sk) / "000000010000000000000001.partial"
    data = bytearray(seg.read_bytes())
    data[1 << 20] ^= 0xFF  # 1 MiB into the WAL, far below the commit LSN (3 MiB)
    seg.write_bytes(bytes(data))
    proc = sk.spawn()
    assert proc.wait(timeout=30) == 1
    log = sk.log()
    assert "below the commit LSN" in log, log[-2000:]
    assert "refusing to start" in log
