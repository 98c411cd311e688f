"""TLS on both ports, with a CA and a server certificate made in the test by the `openssl` CLI:
real `psql` and `pg_receivewal` with sslmode=verify-full, sslmode=disable refused, HTTPS, the
walproposer over TLS to 3 safekeepers and from a real PostgreSQL primary, and the certificate
replaced without a restart (SIGHUP)."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
from pathlib import Path

import pytest
import requests

from fixtures.daemon import RELEASE_DIR, fmt_lsn, lsn_int, wait_until, walproposer_refused
from fixtures.ledger import verify_received, verify_safekeeper
from fixtures.pgwire import OPTIONS
from fixtures.tools import require


class Pki:
    """A CA and server certificates it signed (for localhost and 127.0.0.1), as PEM files."""

    def __init__(self, d: Path, name: str = "ca"):
        self.dir = d
        self.openssl = require("openssl", "openssl")
        self.ca_key, self.ca = d / f"{name}.key", d / f"{name}.crt"
        self._run(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", str(self.ca_key), "-out", str(self.ca), "-days", "2",
            "-subj", f"/CN=test {name}",
        )  # fmt: skip

    def _run(self, *args: str) -> None:
        out = subprocess.run([self.openssl, *args], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr

    def server_cert(self, name: str) -> tuple[Path, Path]:
        """A certificate for localhost / 127.0.0.1 signed by this CA: (cert, key)."""
        key, csr, crt = (self.dir / f"{name}.{e}" for e in ("key", "csr", "crt"))
        ext = self.dir / f"{name}.ext"
        ext.write_text(
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
            "basicConstraints=CA:FALSE\n"
        )
        self._run(
            "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}",
        )  # fmt: skip
        self._run(
            "x509", "-req", "-in", str(csr), "-CA", str(self.ca), "-CAkey", str(self.ca_key),
            "-CAcreateserial", "-out", str(crt), "-days", "2", "-extfile", str(ext),
        )  # fmt: skip
        return crt, key


@pytest.fixture
def pki(tmp_path) -> Pki:
    d = tmp_path / "pki"
    d.mkdir()
    return Pki(d)


def tls_safekeeper(factory, pki: Pki, node_id: int = 1):
    cert, key = pki.server_cert(f"sk{node_id}")
    return factory(
        node_id=node_id, tls_ca=pki.ca, extra_args=["--tls-cert", str(cert), "--tls-key", str(key)]
    ).start()


def walproposer_tls(sks, ca: Path, *args: str, mode: str = "verify-full"):
    return subprocess.run(
        [str(RELEASE_DIR / "walproposer"), "--safekeepers"]
        + [",".join(f"localhost:{sk.pg_port}" for sk in sks)]
        + ["--sslmode", mode, "--sslrootcert", str(ca), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RUST_LOG": "warn"},
    )


def conninfo(sk, ca: Path, mode: str = "verify-full") -> str:
    return (
        f"host=localhost port={sk.pg_port} user=postgres replication=true "
        f"sslmode={mode} sslrootcert={ca} options='{OPTIONS}'"
    )


def psql(conn: str, q: str = "IDENTIFY_SYSTEM") -> subprocess.CompletedProcess:
    exe = require("psql", "postgresql-client-15")
    return subprocess.run(
        [exe, "-X", "-w", "-At", "-c", q, conn], capture_output=True, text=True, timeout=30
    )


def test_real_clients_with_verify_full_and_plaintext_refused(safekeeper_factory, pki, tmp_path):
    sk = tls_safekeeper(safekeeper_factory, pki)
    ack_log = tmp_path / "acks"
    out = walproposer_tls([sk], pki.ca, "--total", "2M", "--ack-log", str(ack_log))
    assert out.returncode == 0, out.stderr
    end = json.loads(out.stdout.strip().splitlines()[-1])["commit_lsn"]

    out = psql(conninfo(sk, pki.ca))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("|")[2] == end, out.stdout
    # Not encrypted: refused, saying why.
    out = psql(conninfo(sk, pki.ca, "disable"))
    assert out.returncode != 0 and "requires TLS" in out.stderr, out.stderr
    # A certificate from another CA does not verify.
    other = Pki(tmp_path, "other-ca")
    out = psql(conninfo(sk, other.ca))
    assert out.returncode != 0 and "certificate verify failed" in out.stderr, out.stderr

    exe = require("pg_receivewal", "postgresql-client-15")
    dest = tmp_path / "wal"
    dest.mkdir()
    out = subprocess.run(
        [exe, "-D", str(dest), "-d", conninfo(sk, pki.ca), "--no-loop", "-w"]
        + ["--endpos", fmt_lsn(lsn_int(end) - 1)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    # What arrived over TLS is what the proposer pushed: every acknowledged range's SHA-256.
    ranges, received = verify_received(ack_log, dest, lsn_int(end))
    assert ranges > 0 and received == lsn_int(end) - lsn_int("0/1000000"), (ranges, received)

    # HTTPS on the HTTP port, verified against the same CA; plain HTTP gets nothing.
    r = requests.get(f"https://localhost:{sk.http_port}/v1/timelines", verify=str(pki.ca))
    assert r.json()[0]["commit_lsn"] == end
    with pytest.raises(requests.RequestException):
        requests.get(f"http://127.0.0.1:{sk.http_port}/v1/status", timeout=5)


def test_walproposer_over_tls_to_three_safekeepers(safekeeper_factory, pki, tmp_path):
    sks = [tls_safekeeper(safekeeper_factory, pki, i) for i in (1, 2, 3)]
    ack_log = tmp_path / "acks"
    out = walproposer_tls(sks, pki.ca, "--total", "16M", "--ack-log", str(ack_log))
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert stats["commit_lsn"] == stats["end_lsn"], stats
    commit = lsn_int(stats["commit_lsn"])
    for sk in sks:
        tl = requests.get(f"{sk.http}/v1/timelines", verify=str(pki.ca), timeout=5).json()[0]
        assert lsn_int(tl["flush_lsn"]) >= commit, tl
        # ... byte for byte as sent over TLS.
        ranges, checked = verify_safekeeper(ack_log, sk, hi=commit)
        assert ranges > 0 and checked == commit - lsn_int(stats["start_lsn"]), (ranges, checked)
    # sslmode=require (no verification) works too; plain TCP does not.
    out = walproposer_tls(sks, pki.ca, "--total", "1M", mode="require")
    assert out.returncode == 0, out.stderr
    walproposer_refused(
        ["--safekeepers", ",".join(f"127.0.0.1:{sk.pg_port}" for sk in sks), "--sync"],
        "requires TLS",
        tmp_path / "plain.log",
    )


def peer_cert(port: int, ca: Path) -> bytes:
    ctx = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection(("127.0.0.1", port)) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as s:
            return s.getpeercert(binary_form=True)


def test_certificate_is_replaced_on_sighup_without_a_restart(safekeeper_factory, pki, tmp_path):
    sk = tls_safekeeper(safekeeper_factory, pki)
    cert = sk.extra_args[sk.extra_args.index("--tls-cert") + 1]
    key = sk.extra_args[sk.extra_args.index("--tls-key") + 1]
    # A new CA and certificate, written over the old files.
    new = Pki(tmp_path, "new-ca")
    new_cert, new_key = new.server_cert("rotated")
    before = peer_cert(sk.http_port, pki.ca)
    Path(cert).write_bytes(new_cert.read_bytes())
    Path(key).write_bytes(new_key.read_bytes())
    assert psql(conninfo(sk, pki.ca), "TIMELINE_STATUS").returncode == 0  # the old one until SIGHUP
    sk.proc.send_signal(signal.SIGHUP)
    wait_until(
        lambda: psql(conninfo(sk, new.ca), "TIMELINE_STATUS").returncode == 0, "the new certificate"
    )
    after = peer_cert(sk.http_port, new.ca)
    assert after != before
    assert psql(conninfo(sk, pki.ca), "TIMELINE_STATUS").returncode != 0
    # A broken file on reload keeps the certificate in force.
    Path(cert).write_text("")
    sk.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "old one stays in force" in sk.log(), "the reload error")
    assert psql(conninfo(sk, new.ca), "TIMELINE_STATUS").returncode == 0
    assert sk.proc.poll() is None


def test_tls_files_are_checked_at_start(safekeeper_factory, pki, tmp_path):
    cert, key = pki.server_cert("sk")
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    for args, named in [
        (["--tls-cert", str(empty), "--tls-key", str(key)], empty),
        (["--tls-cert", str(cert), "--tls-key", str(tmp_path / "missing.key")], "missing.key"),
    ]:
        sk = safekeeper_factory(extra_args=args)
        assert sk.spawn().wait(timeout=20) == 1
        assert str(named) in sk.log(), sk.log()


def test_real_postgres_relayed_over_tls(safekeeper_factory, pki, tmp_path):
    from fixtures.pg import PgCluster, WalProposerRelay

    primary = PgCluster("primary")
    relay = None
    try:
        primary.init().start()
        sks = [tls_safekeeper(safekeeper_factory, pki, i) for i in (1, 2, 3)]
        relay = WalProposerRelay(
            sks, primary, "wp", tmp_path, "--sslmode", "verify-full", "--sslrootcert", str(pki.ca)
        )
        primary.psql("CREATE TABLE t AS SELECT g FROM generate_series(1, 10000) g")
        target = primary.current_lsn()

        def committed():
            assert relay.proc.poll() is None, relay.log()
            tl = requests.get(f"{sks[2].http}/v1/timelines", verify=str(pki.ca), timeout=5)
            tls = tl.json()
            return tls and lsn_int(tls[0]["commit_lsn"]) >= target

        wait_until(committed, "the primary's WAL committed over TLS", timeout=60)
        relay.stop()
    finally:
        if relay:
            relay.kill()
        primary.cleanup()
