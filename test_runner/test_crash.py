"""Crash safety with real processes: a synthetic proposer streams into three safekeepers while
safekeepers (and sometimes the proposer) are killed with SIGKILL and restarted. Every
acknowledgement (quorum commit) the proposers made is logged; at the end nothing acknowledged
is lost and nothing unexpected appears (Jepsen's lost/unexpected counts).

Promise checked: an acknowledged byte is never lost or changed; nothing is invented. The
proposers' `--ack-log` is a content ledger (a SHA-256 per acknowledged range), compared with the
bytes on every safekeeper at the end.
Knobs: CRASH_CYCLES (default 25), CRASH_SEED (default: random, printed)."""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import time

import pytest

from fixtures.daemon import RELEASE_DIR, lsn_int, read_wal, timeline_dir, walproposer
from fixtures.ledger import acked, check_ledger, ledger
from fixtures.tools import require_pg_tool

START = "0/1000000"


def spawn_proposer(sks, ack_log) -> subprocess.Popen:
    return subprocess.Popen(
        [
            str(RELEASE_DIR / "walproposer"),
            "--safekeepers",
            ",".join(f"127.0.0.1:{sk.pg_port}" for sk in sks),
            "--total",
            "100G",
            "--rate",
            "8M",
            "--record-size",
            "300",
            "--ack-log",
            str(ack_log),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "RUST_LOG": "warn"},
    )


@pytest.mark.promise(2, 3)
def test_kill9_loop_loses_nothing_acknowledged(safekeeper_factory, tmp_path):
    cycles = int(os.environ.get("CRASH_CYCLES", "25"))
    seed = int(os.environ.get("CRASH_SEED", random.randrange(1 << 32)))
    print(f"CRASH_SEED={seed} CRASH_CYCLES={cycles}")
    rng = random.Random(seed)
    sks = [safekeeper_factory(node_id=i + 1).start() for i in range(3)]
    ack_log = tmp_path / "acks"
    proposer = spawn_proposer(sks, ack_log)
    proposer_kills = sk_kills = 0
    try:
        for _ in range(cycles):
            time.sleep(rng.uniform(0.2, 0.7))
            if rng.random() < 0.2:
                proposer.send_signal(signal.SIGKILL)
                proposer.wait()
                proposer_kills += 1
                proposer = spawn_proposer(sks, ack_log)
            else:
                victim = rng.choice(sks)
                victim.kill()
                sk_kills += 1
                time.sleep(rng.uniform(0.05, 0.5))
                victim.start()
        time.sleep(1.0)
    finally:
        proposer.send_signal(signal.SIGKILL)
        proposer.wait()
    max_acked = acked(ack_log)
    assert max_acked > lsn_int(START), "nothing was ever acknowledged"

    # A new proposer commits the end of WAL on a quorum and brings everyone up to date.
    synced = lsn_int(walproposer(sks, "--sync")["lsn"])
    walproposer(sks, "--total", "1M")  # streams past the sync point, so all catch up
    lost = max(0, max_acked - synced)
    # The content ledger: every acknowledged range's bytes, on every safekeeper, are the bytes
    # the proposer that acknowledged them sent (LSNs alone would miss a changed byte).
    lines = ledger(ack_log)
    digests = set()
    for sk in sks:
        wal = read_wal(sk, lsn_int(START), max_acked)
        ranges, ledger_bytes = check_ledger(lines, wal, lsn_int(START))
        digests.add(hashlib.sha256(wal).hexdigest())
    assert ranges > 0 and ledger_bytes > 0, "the ack log carries no digests"

    # Nothing unexpected: the WAL up to the sync point decodes in real pg_waldump, every record
    # one of the proposers' logical messages.
    dump = tmp_path / "dump"
    dump.mkdir()
    for p in timeline_dir(sks[0]).iterdir():
        if re.fullmatch(r"[0-9A-F]{24}(\.partial)?", p.name):
            shutil.copy(p, dump / p.name.removesuffix(".partial"))
    end = f"{synced >> 32:X}/{synced & 0xFFFFFFFF:X}"
    out = subprocess.run(
        [require_pg_tool("pg_waldump"), "--stats=record", "-p", str(dump), "-s", START, "-e", end],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    total = re.search(r"^Total\s+(\d+)", out.stdout, re.M)
    messages = re.search(r"^LogicalMessage/MESSAGE\s+(\d+)", out.stdout, re.M)
    assert total and messages, out.stdout
    unexpected = int(total.group(1)) - int(messages.group(1))
    print(
        f"cycles={cycles} safekeeper_kills={sk_kills} proposer_kills={proposer_kills} "
        f"acknowledged_bytes={max_acked - lsn_int(START)} records={messages.group(1)} "
        f"lost={lost} unexpected={unexpected} replicas_agree={len(digests) == 1} "
        f"ledger_ranges={ranges} ledger_bytes={ledger_bytes}"
    )
    assert lost == 0
    assert unexpected == 0
    assert len(digests) == 1, "safekeepers disagree on acknowledged WAL"


def test_content_ledger_catches_a_changed_byte_that_lsns_miss():
    """The ledger check itself: the same LSNs with one byte changed fail (an LSN-only check
    passes them). No daemon needed."""
    start = lsn_int(START)
    wal = bytes(range(256)) * 64
    lines = [(start, None)]
    for end in (start + 1000, start + 5000, start + len(wal)):
        lines.append((end, hashlib.sha256(wal[lines[-1][0] - start : end - start]).hexdigest()))
    assert check_ledger(lines, wal, start) == (3, len(wal))
    changed = bytearray(wal)
    changed[4321] ^= 1
    with pytest.raises(AssertionError, match="differs from what was sent"):
        check_ledger(lines, bytes(changed), start)
