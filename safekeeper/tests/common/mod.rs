//! Shared helpers of the loopback integration tests: an in-process daemon on ephemeral ports,
//! and a raw protocol-v3 client whose elections are run by the real proposer core.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use safekeeper::config::Conf;
use safekeeper::daemon;
use sk_core::protocol::{
    AcceptorProposerMessage, AppendRequest, AppendRequestHeader, ProposerAcceptorMessage,
    ProposerGreeting, VoteRequest, VoteResponse,
};
use sk_core::state::Configuration;
use sk_core::types::{Generation, Lsn, TenantId, TenantTimelineId, Term, TimelineId};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use walproposer::conn::{PushReader, PushWriter, SafekeeperAddr, connect_push};
use walproposer::consensus::{Action, CoreConfig, Event, Phase, ProposerCore};

pub const SEG_SIZE: u64 = 16 << 20;
pub const SYSID: u64 = 7_400_000_000_000_000_001;

/// A daemon running inside the test process.
pub struct TestDaemon {
    pub datadir: PathBuf,
    pub pg: SocketAddr,
    pub http: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

impl TestDaemon {
    pub async fn start(datadir: &Path) -> TestDaemon {
        TestDaemon::start_as(datadir, 1).await
    }

    /// A daemon with node id `id` (a safekeeper set needs distinct ones).
    pub async fn start_as(datadir: &Path, id: u64) -> TestDaemon {
        TestDaemon::start_with(datadir, id, |_| {}).await
    }

    /// A daemon with node id `id` and the configuration changes of `f`.
    pub async fn start_with(datadir: &Path, id: u64, f: impl FnOnce(&mut Conf)) -> TestDaemon {
        let mut conf = Conf::for_tests(datadir.to_path_buf());
        conf.id = Some(id);
        f(&mut conf);
        let listeners = daemon::bind(&conf).await.expect("bind");
        let (pg, http) = (listeners.pg_addr(), listeners.http_addr());
        let (tx, rx) = oneshot::channel();
        let task = tokio::spawn(daemon::run(conf, listeners, async move {
            let _ = rx.await;
        }));
        TestDaemon {
            datadir: datadir.to_path_buf(),
            pg,
            http,
            stop: Some(tx),
            task: Some(task),
        }
    }

    /// Graceful stop (like SIGTERM); returns the daemon's result.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        let _ = self.stop.take().expect("running").send(());
        self.task
            .take()
            .expect("running")
            .await
            .expect("daemon task")
    }

    pub fn addr(&self) -> SafekeeperAddr {
        SafekeeperAddr {
            host: "127.0.0.1".into(),
            port: self.pg.port(),
            password: None,
            tls: None,
        }
    }

    pub async fn get_json(&self, path: &str) -> serde_json::Value {
        http_get_json(self.http, path).await
    }

    /// The status of the test timeline (`ttid()`).
    pub async fn timeline_status(&self) -> serde_json::Value {
        self.try_timeline_status()
            .await
            .unwrap_or_else(|| panic!("timeline {} not found on {}", ttid(), self.http))
    }

    /// The status of the test timeline, or `None` while this node does not have it (404): a
    /// proposer elected by a quorum greets the remaining member a moment later.
    pub async fn try_timeline_status(&self) -> Option<serde_json::Value> {
        let path = format!(
            "/v1/tenant/{}/timeline/{}",
            ttid().tenant_id,
            ttid().timeline_id
        );
        let (status, body) = http_get(self.http, &path).await;
        match status {
            404 => None,
            200 => {
                Some(serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {path}: {body}")))
            }
            _ => panic!("GET {path}: HTTP {status}: {body}"),
        }
    }

    /// How many timelines `/v1/timelines` lists.
    pub async fn timeline_count(&self) -> usize {
        self.get_json("/v1/timelines")
            .await
            .as_array()
            .expect("/v1/timelines is a list")
            .len()
    }
}

/// Waits (every 20 ms) until `done`; fails naming `what` after `secs` seconds.
pub async fn poll(what: &str, secs: u64, mut done: impl AsyncFnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while !done().await {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// A proposer of the test timeline over `safekeepers`, WAL from `start` if they are empty.
pub fn proposer_config(
    safekeepers: Vec<SafekeeperAddr>,
    start: Lsn,
) -> walproposer::ProposerConfig {
    walproposer::ProposerConfig {
        safekeepers,
        ttid: ttid(),
        system_id: SYSID,
        pg_version: 150018,
        wal_seg_size: SEG_SIZE as u32,
        start_lsn: start,
        allow_timeline_creation: true,
        max_replication_flush_lag: 0,
        max_replication_apply_lag: 0,
    }
}

/// The WAL bytes `[from, to)` of the test timeline under `datadir`, read from its segment files.
pub fn wal_bytes(datadir: &Path, from: Lsn, to: Lsn) -> Vec<u8> {
    let dir = datadir
        .join(ttid().tenant_id.to_string())
        .join(ttid().timeline_id.to_string());
    let mut out = Vec::new();
    let mut pos = from;
    while pos < to {
        let segno = pos.segment_number(SEG_SIZE);
        let name = pg_wal::format::xlog_file_name(1, segno, SEG_SIZE);
        let file = [dir.join(&name), dir.join(format!("{name}.partial"))]
            .into_iter()
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("segment {name} missing"));
        let data = std::fs::read(file).unwrap();
        let off = pos.segment_offset(SEG_SIZE) as usize;
        let n = ((SEG_SIZE as usize) - off).min((to.0 - pos.0) as usize);
        out.extend_from_slice(&data[off..off + n]);
        pos = Lsn(pos.0 + n as u64);
    }
    out
}

/// A replication client configuration for the test timeline on `d`.
pub fn client_config(d: &TestDaemon) -> pq_proto::client::ClientConfig {
    let mut cfg = pq_proto::client::ClientConfig::new("127.0.0.1", d.pg.port(), "test");
    cfg.options = Some(format!(
        "-c tenant_id={} timeline_id={}",
        ttid().tenant_id,
        ttid().timeline_id
    ));
    cfg
}

/// A tiny HTTP/1.0 GET (enough for our JSON API): the status code and the body.
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect http");
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .expect("write");
    let mut resp = Vec::new();
    s.read_to_end(&mut resp).await.expect("read");
    let text = String::from_utf8(resp).expect("utf8");
    let (head, body) = text.split_once("\r\n\r\n").expect("a body");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {head}"));
    (status, body.to_string())
}

/// A GET that must answer 200 with JSON.
pub async fn http_get_json(addr: SocketAddr, path: &str) -> serde_json::Value {
    let (status, body) = http_get(addr, path).await;
    assert_eq!(status, 200, "GET {path}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {path}: {body}"))
}

pub fn ttid() -> TenantTimelineId {
    TenantTimelineId {
        tenant_id: "de200bd42b49cc1814412c7e592dd6e9"
            .parse::<TenantId>()
            .unwrap(),
        timeline_id: "9e4c8f36bca74c2bc9b7b0f1bd0c6f0b"
            .parse::<TimelineId>()
            .unwrap(),
    }
}

pub fn greeting() -> ProposerAcceptorMessage {
    let t = ttid();
    ProposerAcceptorMessage::Greeting(ProposerGreeting {
        tenant_id: t.tenant_id,
        timeline_id: t.timeline_id,
        mconf: Configuration::default(),
        pg_version: 150018,
        system_id: SYSID,
        wal_seg_size: SEG_SIZE as u32,
    })
}

/// A raw protocol-v3 connection to one safekeeper, for tests that send hand-made messages
/// (gaps, pipelined appends, votes). Elections are run by the real proposer core
/// ([`Client::elect`]): there is one proposer in the codebase.
pub struct Client {
    pub reader: PushReader,
    pub writer: PushWriter,
    /// The safekeeper's term from its greeting, or ours once elected.
    pub term: Term,
}

impl Client {
    /// Connects and greets.
    pub async fn connect(d: &TestDaemon) -> Client {
        let (mut reader, mut writer) = connect_push(&d.addr(), ttid(), true, "test")
            .await
            .expect("connect");
        writer.send(&greeting()).await.expect("send greeting");
        let AcceptorProposerMessage::Greeting(g) = reader.recv().await.expect("greeting reply")
        else {
            panic!("expected a greeting reply");
        };
        Client {
            reader,
            writer,
            term: g.term,
        }
    }

    /// Asks for a vote in `term` (no election follows).
    pub async fn vote(&mut self, term: Term) -> VoteResponse {
        self.writer
            .send(&ProposerAcceptorMessage::VoteRequest(VoteRequest {
                generation: Generation(0),
                term,
            }))
            .await
            .expect("send vote");
        match self.reader.recv().await.expect("vote reply") {
            AcceptorProposerMessage::VoteResponse(v) => v,
            other => panic!("expected a vote response, got {other:?}"),
        }
    }

    /// Runs the real proposer core over a new connection to `d` (a one-safekeeper set, WAL
    /// starting at `start` if empty) until it is elected and the safekeeper acknowledged its
    /// start point; returns the connection, quiet, for hand-made appends, and the start point.
    pub async fn elect(d: &TestDaemon, start: Lsn) -> (Client, Lsn) {
        let (mut reader, mut writer) = connect_push(&d.addr(), ttid(), true, "test")
            .await
            .expect("connect");
        let mut cfg = CoreConfig::new(1, ttid(), SYSID, 150018, SEG_SIZE as u32, start);
        cfg.max_in_flight = u64::MAX;
        let mut core = ProposerCore::new(cfg);
        core.step(Event::Connected { sk: 0, conn: 1 });
        loop {
            for action in core.take_actions() {
                match action {
                    Action::Send { msg, .. } => writer.queue(&msg).expect("encode"),
                    Action::Elected { .. } | Action::Commit(_) => {}
                    other => panic!("election over one safekeeper failed: {other:?}"),
                }
            }
            writer.flush().await.expect("send");
            let msg = reader.recv().await.expect("reply during the election");
            core.step(Event::Received {
                sk: 0,
                conn: 1,
                msg,
            });
            if core.phase() == Phase::Elected && core.counted_flush(0) >= core.term_start() {
                // Quiet from here: what the core would send next (the commit LSN) is not sent.
                let (term, start) = (core.term(), core.term_start());
                return (
                    Client {
                        reader,
                        writer,
                        term,
                    },
                    start,
                );
            }
        }
    }

    /// Reads replies until one says the WAL is flushed up to `lsn` (another message fails).
    pub async fn wait_flushed(&mut self, lsn: Lsn) {
        loop {
            match self.reader.recv().await.unwrap() {
                AcceptorProposerMessage::AppendResponse(r) if r.flush_lsn >= lsn => return,
                AcceptorProposerMessage::AppendResponse(_) => {}
                other => panic!("waiting for a flush to {lsn}, got {other:?}"),
            }
        }
    }

    /// An append of `data` at `begin` in our term.
    pub fn append(&self, begin: Lsn, data: &[u8], commit: Lsn) -> ProposerAcceptorMessage {
        append_msg(self.term, begin, data, commit)
    }
}

/// An append of `data` at `begin` in `term`.
pub fn append_msg(term: Term, begin: Lsn, data: &[u8], commit: Lsn) -> ProposerAcceptorMessage {
    {
        ProposerAcceptorMessage::AppendRequest(AppendRequest {
            h: AppendRequestHeader {
                generation: Generation(0),
                term,
                begin_lsn: begin,
                end_lsn: Lsn(begin.0 + data.len() as u64),
                commit_lsn: commit,
                truncate_lsn: Lsn::INVALID,
            },
            wal_data: Bytes::copy_from_slice(data),
        })
    }
}

/// A tiny HTTP/1.0 request with an optional JSON body: the status code and the body text.
pub async fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect http");
    let body = body.unwrap_or("");
    s.write_all(
        format!(
            "{method} {path} HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .expect("write");
    let mut resp = Vec::new();
    s.read_to_end(&mut resp).await.expect("read");
    let text = String::from_utf8(resp).expect("utf8");
    let code = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {text}"));
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (code, body)
}
