"""JWT authentication on both ports, with Ed25519 keys and tokens made in the test (the
`cryptography` and `PyJWT` packages): none, expired, wrong signature, wrong tenant and scope are
refused with a clear error (HTTP 401/403, SQLSTATE 28000), the right tokens work (for real
`psql`, `pg_receivewal` and the walproposer too), keys rotate on SIGHUP, and a daemon without
keys serves loopback only."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import jwt
import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fixtures.daemon import RELEASE_DIR, TENANT, TIMELINE, lsn_int, wait_until, walproposer_refused
from fixtures.ledger import verify_received
from fixtures.pgwire import OPTIONS, connect, query
from fixtures.tools import before, require

OTHER_TENANT = "0123456789abcdef0123456789abcdef"
TIMELINE_ROUTE = f"/v1/tenant/{TENANT}/timeline/{TIMELINE}"


class Issuer:
    """An Ed25519 key pair that signs tokens; `public_pem` goes to --auth-public-key-path."""

    def __init__(self):
        self.key = Ed25519PrivateKey.generate()
        self.public_pem = self.key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def token(self, scope: str = "safekeeperdata", tenant: str | None = None, **claims) -> str:
        body = {"scope": scope, **claims}
        if tenant:
            body["tenant_id"] = tenant
        return jwt.encode(body, self.key, algorithm="EdDSA")


@pytest.fixture
def issuer() -> Issuer:
    return Issuer()


@pytest.fixture
def authed(safekeeper_factory, issuer, tmp_path):
    """A safekeeper requiring tokens, with WAL on the test timeline (pushed with a data token;
    its content ledger in `tmp_path / "acks"`)."""
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "issuer.pem").write_bytes(issuer.public_pem)
    sk = safekeeper_factory(extra_args=["--auth-public-key-path", str(keys)]).start()
    out = run_walproposer(sk, issuer.token(), "--total", "1M", "--ack-log", str(tmp_path / "acks"))
    assert out.returncode == 0, out.stderr
    return sk


def run_walproposer(sk, token: str | None, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RUST_LOG": "warn"}
    env.pop("WALPROPOSER_AUTH_TOKEN", None)
    if token is not None:
        env["WALPROPOSER_AUTH_TOKEN"] = token
    return subprocess.run(
        [str(RELEASE_DIR / "walproposer"), "--safekeepers", f"127.0.0.1:{sk.pg_port}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def get(sk, route: str, token: str | None = None) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.get(f"{sk.http}{route}", headers=headers, timeout=5)


def test_http_data_routes_need_a_token_whose_scope_covers_them(authed, issuer):
    sk = authed
    expired = issuer.token(exp=int(time.time()) - 60)
    forged = Issuer().token()
    for token, why in [(None, "missing"), (expired, "expired"), (forged, "none of our keys")]:
        for route in ["/v1/timelines", "/v1/tenant/timeline", TIMELINE_ROUTE]:
            r = get(sk, route, token)
            assert r.status_code == 401, (route, why, r.text)
            assert why in r.text, r.text
            assert r.headers["WWW-Authenticate"] == "Bearer"
    mine = issuer.token("tenant", TENANT)
    theirs = issuer.token("tenant", OTHER_TENANT)
    pageserver = issuer.token("pageserverapi")
    assert get(sk, TIMELINE_ROUTE, mine).status_code == 200
    r = get(sk, TIMELINE_ROUTE, theirs)
    assert r.status_code == 403 and OTHER_TENANT in r.text, r.text
    # A tenant token does not list every tenant's timelines (nor their ids).
    for route in ["/v1/timelines", "/v1/tenant/timeline"]:
        r = get(sk, route, mine)
        assert r.status_code == 403 and "safekeeperdata" in r.text, (route, r.text)
    r = get(sk, "/v1/timelines", pageserver)
    assert r.status_code == 403 and "scope" in r.text, r.text
    data = issuer.token()
    assert get(sk, "/v1/timelines", data).json()[0]["tenant_id"] == TENANT
    assert get(sk, "/v1/tenant/timeline", data).json() == [
        {"tenant_id": TENANT, "timeline_id": TIMELINE}
    ]
    assert get(sk, TIMELINE_ROUTE, data).status_code == 200
    # Observability routes stay open by default (neon's choice).
    assert get(sk, "/v1/status").status_code == 200
    assert get(sk, "/metrics").status_code == 200
    assert "JWT authentication on both ports" in sk.log()


def test_operator_routes_need_the_safekeeperdata_scope(authed, issuer):
    """Membership, create, delete, snapshot and pull change which nodes serve a timeline: a
    tenant token, even of this tenant, is refused (403); a safekeeperdata token is let through."""
    sk = authed
    mine = issuer.token("tenant", TENANT)
    data = issuer.token()
    body = {"generation": 1, "members": [{"id": 1, "host": "127.0.0.1", "pg_port": sk.pg_port}]}
    calls = [
        ("PUT", f"{TIMELINE_ROUTE}/membership", body),
        ("GET", f"{TIMELINE_ROUTE}/snapshot", None),
        ("POST", f"/v1/tenant/{TENANT}/timeline", {"timeline_id": "x"}),
        ("DELETE", f"/v1/tenant/{OTHER_TENANT}", None),
    ]
    for method, route, payload in calls:
        for token in (None, mine):
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            r = requests.request(
                method, f"{sk.http}{route}", json=payload, headers=headers, timeout=5
            )
            assert r.status_code == (403 if token else 401), (method, route, r.text)
    headers = {"Authorization": f"Bearer {data}"}
    r = requests.put(f"{sk.http}{TIMELINE_ROUTE}/membership", json=body, headers=headers, timeout=5)
    assert r.status_code == 200 and r.json()["generation"] == 1, r.text
    r = requests.post(
        f"{sk.http}/v1/tenant/{TENANT}/timeline", json={"timeline_id": "x"}, headers=headers
    )
    assert r.status_code == 400, r.text


def test_auth_ops_routes_flag_closes_status_metrics_and_profiles(
    safekeeper_factory, issuer, tmp_path
):
    key = tmp_path / "key.pem"
    key.write_bytes(issuer.public_pem)
    sk = safekeeper_factory(
        extra_args=["--auth-public-key-path", str(key), "--auth-ops-routes"]
    ).start()
    for route in ["/v1/status", "/metrics", "/profile/heap"]:
        assert get(sk, route).status_code == 401, route
        assert get(sk, route, issuer.token("tenant", TENANT)).status_code == 403, route
    assert get(sk, "/v1/status", issuer.token()).status_code == 200
    assert get(sk, "/metrics", issuer.token()).status_code == 200


def test_pg_port_takes_the_token_as_password_and_refuses_others_with_28000(authed, issuer):
    sk = authed
    expired = issuer.token(exp=int(time.time()) - 60)
    forged = Issuer().token()
    for password, why in [
        ("", "invalid token"),
        ("not-a-jwt", "invalid token"),
        (expired, "expired"),
        (forged, "none of our keys"),
        (issuer.token("tenant", OTHER_TENANT), OTHER_TENANT),
        (issuer.token("pageserverapi"), "scope"),
    ]:
        err = connect(sk.pg_port, password)
        assert isinstance(err, dict), f"{why}: connected"
        assert err["C"] == "28000", err
        assert err["S"] == "FATAL", err
        assert why in err["M"], err
    # The right tenant, and the data scope, connect and read.
    for token in [issuer.token("tenant", TENANT), issuer.token()]:
        s = connect(sk.pg_port, token)
        assert not isinstance(s, dict), s
        tag, body = query(s, "IDENTIFY_SYSTEM")
        assert tag != b"E", body
        s.close()
    # A tenant token on a connection naming no timeline reaches only its tenant's.
    s = connect(sk.pg_port, issuer.token("tenant", OTHER_TENANT), options=None)
    assert not isinstance(s, dict), s
    tag, body = query(s, "IDENTIFY_SYSTEM")
    assert tag == b"E" and b"28000" in body, body
    s.close()


def test_real_clients_and_the_walproposer_authenticate_with_tokens(authed, issuer, tmp_path):
    sk = authed
    mine, theirs = issuer.token("tenant", TENANT), issuer.token("tenant", OTHER_TENANT)
    psql = require("psql", "postgresql-client-15")
    conninfo = (
        f"host=127.0.0.1 port={sk.pg_port} user=postgres replication=true options='{OPTIONS}'"
    )

    def run_psql(token: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [psql, "-X", "-w", "-At", "-c", "IDENTIFY_SYSTEM", conninfo],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "PGPASSWORD": token},
        )

    out = run_psql(mine)
    assert out.returncode == 0, out.stderr
    out = run_psql(theirs)
    assert out.returncode != 0 and OTHER_TENANT in out.stderr, out.stderr

    # pg_receivewal with the tenant token: the committed WAL, as the proposer pushed it.
    receivewal = require("pg_receivewal", "postgresql-client-15")
    dest = tmp_path / "wal"
    dest.mkdir()
    commit = get(sk, TIMELINE_ROUTE, mine).json()["commit_lsn"]
    out = subprocess.run(
        [receivewal, "-D", str(dest), "-d", conninfo, "--no-loop", "-w"]
        + ["--endpos", before(commit)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PGPASSWORD": mine},
    )
    assert out.returncode == 0, out.stderr
    ranges, received = verify_received(tmp_path / "acks", dest, lsn_int(commit))
    assert ranges > 0 and received > 512 << 10, (ranges, received, commit)

    # The walproposer: a token from the environment, or from a file.
    out = run_walproposer(sk, mine, "--total", "1M")
    assert out.returncode == 0, out.stderr
    token_file = tmp_path / "token"
    token_file.write_text(issuer.token() + "\n")
    out = run_walproposer(sk, None, "--auth-token-file", str(token_file), "--total", "1M")
    assert out.returncode == 0, out.stderr
    # A token for another tenant is refused, and the walproposer says why.
    walproposer_refused(
        ["--safekeepers", f"127.0.0.1:{sk.pg_port}", "--total", "1M"],
        "the token is for tenant",
        tmp_path / "refused.log",
        env={"WALPROPOSER_AUTH_TOKEN": theirs},
    )
    token_file.write_text("")
    out = run_walproposer(sk, None, "--auth-token-file", str(token_file), "--total", "1M")
    assert out.returncode != 0 and str(token_file) in out.stderr and "empty" in out.stderr


def test_keys_rotate_on_sighup(safekeeper_factory, tmp_path):
    old, new = Issuer(), Issuer()
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "current.pem").write_bytes(old.public_pem)
    sk = safekeeper_factory(extra_args=["--auth-public-key-path", str(keys)]).start()
    assert get(sk, "/v1/timelines", old.token()).status_code == 200
    assert get(sk, "/v1/timelines", new.token()).status_code == 401
    (keys / "current.pem").write_bytes(new.public_pem)
    # Nothing changes until SIGHUP.
    assert get(sk, "/v1/timelines", old.token()).status_code == 200
    sk.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: get(sk, "/v1/timelines", new.token()).status_code == 200, "the new key")
    assert get(sk, "/v1/timelines", old.token()).status_code == 401
    assert not isinstance(connect(sk.pg_port, new.token()), dict)
    # A broken key file on reload keeps the keys in force, and says why.
    (keys / "current.pem").write_text("")
    sk.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "old ones stay in force" in sk.log(), "the reload error")
    assert get(sk, "/v1/timelines", new.token()).status_code == 200
    assert sk.proc.poll() is None


def test_key_files_and_open_binds_are_checked_at_start(safekeeper_factory, tmp_path):
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    for path, why in [(empty, "empty"), (tmp_path / "missing.pem", "cannot read")]:
        sk = safekeeper_factory(extra_args=["--auth-public-key-path", str(path)])
        assert sk.spawn().wait(timeout=20) == 1
        assert str(path) in sk.log() and why in sk.log(), sk.log()
    # Without keys: loopback only, unless --allow-no-auth.
    sk = safekeeper_factory(node_id=2, pg_listen_host="0.0.0.0")
    assert sk.spawn().wait(timeout=20) == 1
    assert "--allow-no-auth" in sk.log() and "not a loopback address" in sk.log(), sk.log()
    sk = safekeeper_factory(node_id=3, pg_listen_host="0.0.0.0", extra_args=["--allow-no-auth"])
    sk.start()
    assert "authentication is OFF" in sk.log()
    sk = safekeeper_factory(node_id=4).start()
    assert "authentication is off: serving loopback only" in sk.log()
