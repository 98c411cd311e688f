//! The WAL service over loopback TCP: a proposer speaking protocol v3 pushes pipelined appends
//! of generated WAL into a real daemon (real files, real fsync), and everything acknowledged is
//! on disk, byte for byte, and survives a restart.

mod common;

use common::*;
use pg_wal::generator::WalGenerator;
use pq_proto::PqError;
use pq_proto::client::{ClientConfig, ClientConn};
use sk_core::protocol::AcceptorProposerMessage;
use sk_core::types::{Lsn, Term};

const START: Lsn = Lsn(SEG_SIZE); // 0/1000000: the start of segment 1

fn generate(bytes: usize, msg_len: usize) -> Vec<u8> {
    let mut g = WalGenerator::new(SYSID, SEG_SIZE, START).unwrap();
    let mut out = Vec::new();
    let msg = vec![0x5a; msg_len];
    g.fill(&mut out, bytes, &msg);
    out
}

/// Splits WAL into append-sized pieces at uneven offsets (records span appends).
fn pieces(wal: &[u8]) -> Vec<(Lsn, &[u8])> {
    let sizes = [1024usize, 777, 1, 8192, 2000, 513];
    let mut out = Vec::new();
    let (mut off, mut i) = (0usize, 0usize);
    while off < wal.len() {
        // Mostly small appends, and now and then one of the protocol's maximum size.
        let size = if i % 50 == 49 {
            131_072
        } else {
            sizes[i % sizes.len()]
        };
        let n = size.min(wal.len() - off);
        out.push((Lsn(START.0 + off as u64), &wal[off..off + n]));
        off += n;
        i += 1;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_appends_are_acked_monotonically_and_stored_byte_exact() {
    let dir = tempfile::tempdir().unwrap();
    let d = TestDaemon::start(dir.path()).await;
    let (mut p, _) = Client::elect(&d, START).await;
    assert_eq!(p.term, Term(1));

    let wal = generate(8 << 20, 200);
    let end = Lsn(START.0 + wal.len() as u64);
    let appends = pieces(&wal);
    let n = appends.len();
    assert!(n > 1000, "only {n} appends");
    // Send everything without waiting (the proposer's pipelining), reading acks concurrently.
    let msgs: Vec<_> = appends
        .iter()
        .map(|(lsn, data)| p.append(*lsn, data, Lsn::INVALID))
        .collect();
    let mut writer = p.writer;
    let send = tokio::spawn(async move {
        for m in &msgs {
            writer.queue(m).unwrap();
            if writer.buffered() > 512 * 1024 {
                writer.flush().await.unwrap();
            }
        }
        writer.flush().await.unwrap();
        writer
    });
    let mut acks = Vec::new();
    loop {
        match p.reader.recv().await.unwrap() {
            AcceptorProposerMessage::AppendResponse(r) => {
                assert_eq!(r.term, Term(1));
                acks.push(r.flush_lsn);
                if r.flush_lsn >= end {
                    break;
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    let mut writer = send.await.unwrap();
    assert!(
        acks.windows(2).all(|w| w[0] <= w[1]),
        "acks went backwards: {acks:?}"
    );
    assert_eq!(*acks.last().unwrap(), end);
    assert!(
        acks.len() < n,
        "{} acks for {n} appends: flushes were not batched",
        acks.len()
    );

    // Tell the safekeeper everything is committed (a single-node quorum).
    writer
        .send(&append_msg(Term(1), end, &[], end))
        .await
        .unwrap();
    writer.finish().await.unwrap();
    drop(writer);
    // Drain until the server closes the stream.
    while p.reader.recv().await.is_ok() {}

    // The segment holds exactly the bytes sent.
    let tl_dir = dir
        .path()
        .join(ttid().tenant_id.to_string())
        .join(ttid().timeline_id.to_string());
    let seg = std::fs::read(tl_dir.join("000000010000000000000001.partial")).unwrap();
    assert_eq!(seg.len() as u64, SEG_SIZE);
    assert!(
        seg[..wal.len()] == wal[..],
        "segment differs from the WAL sent"
    );
    assert!(seg[wal.len()..].iter().all(|&b| b == 0));

    let status = d.timeline_status().await;
    assert_eq!(status["flush_lsn"], end.to_string());
    assert_eq!(status["commit_lsn"], end.to_string());
    assert_eq!(status["term"], 1);
    d.stop().await.unwrap();

    // Restart: state and WAL are recovered from disk.
    let d = TestDaemon::start(dir.path()).await;
    let status = d.get_json("/v1/timelines").await;
    assert_eq!(status[0]["flush_lsn"], end.to_string());
    assert_eq!(status[0]["commit_lsn"], end.to_string());
    let mut p = Client::connect(&d).await;
    assert_eq!(p.term, Term(1));
    let v = p.vote(Term(2)).await;
    assert!(v.vote_given);
    assert_eq!(v.flush_lsn, end);
    assert_eq!(v.term_history.0.len(), 1);
    assert_eq!(v.term_history.0[0].lsn, START);
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn append_with_gap_ends_only_that_connection() {
    let dir = tempfile::tempdir().unwrap();
    let d = TestDaemon::start(dir.path()).await;
    let (mut p, _) = Client::elect(&d, START).await;
    assert_eq!(p.term, Term(1));
    let wal = generate(64 << 10, 100);
    p.writer
        .send(&p.append(Lsn(START.0 + 8192), &wal[8192..16384], Lsn::INVALID))
        .await
        .unwrap();
    match p.reader.recv().await {
        Err(walproposer::conn::ConnError::Pq(e)) => match *e {
            PqError::Server(e) => assert!(
                e.message.contains("gap") || e.message.contains("rejected"),
                "{e:?}"
            ),
            other => panic!("expected a server error for a gap, got {other:?}"),
        },
        other => panic!("expected an error for a gap, got {other:?}"),
    }
    // The daemon still serves: a new connection elects and appends correctly.
    let (mut p, start) = Client::elect(&d, START).await;
    assert_eq!((p.term, start), (Term(2), START));
    p.writer
        .send(&p.append(START, &wal, Lsn::INVALID))
        .await
        .unwrap();
    match p.reader.recv().await.unwrap() {
        AcceptorProposerMessage::AppendResponse(r) => {
            assert_eq!(r.flush_lsn, Lsn(START.0 + wal.len() as u64))
        }
        other => panic!("unexpected {other:?}"),
    }
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_copy_data_gets_a_protocol_error() {
    let dir = tempfile::tempdir().unwrap();
    let d = TestDaemon::start(dir.path()).await;
    let cfg = client_config(&d);
    let conn = ClientConn::connect(&cfg).await.unwrap();
    let (mut r, mut w) = conn
        .start_copy_both("START_WAL_PUSH (proto_version '3')")
        .await
        .unwrap();
    w.send_copy_data(b"\xffnot a message").await.unwrap();
    match r.read().await {
        Err(PqError::Server(e)) => {
            assert_eq!(e.code, "08P01");
            assert!(
                e.message.contains("first message must be a greeting")
                    || e.message.contains("invalid proposer message"),
                "{e:?}"
            );
        }
        other => panic!("expected a protocol error, got {other:?}"),
    }
    // Unknown commands get an error naming them, and the connection stays usable.
    let mut c = ClientConn::connect(&cfg).await.unwrap();
    match c.simple_query("DROP TABLE x").await {
        Err(PqError::Server(e)) => assert!(e.message.contains("DROP"), "{e:?}"),
        other => panic!("expected an error, got {other:?}"),
    }
    let rows = c.simple_query("TIMELINE_STATUS").await.unwrap();
    assert!(rows.is_empty(), "no timeline exists yet: {rows:?}");
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_reader_gets_keepalives_and_prompt_replies() {
    use pq_proto::BackendMessage;
    use pq_proto::client::CopyEvent;
    use pq_proto::replication::{ReplicationMessage, StandbyMessage};
    use std::time::Duration;

    let dir = tempfile::tempdir().unwrap();
    let d = TestDaemon::start(dir.path()).await;
    let (mut p, _) = Client::elect(&d, START).await;
    assert_eq!(p.term, Term(1));
    let wal = generate(200 << 10, 300);
    let end = Lsn(START.0 + wal.len() as u64);
    let half = wal.len() / 2;
    p.writer
        .queue(&p.append(START, &wal[..half], Lsn::INVALID))
        .unwrap();
    p.writer
        .send(&p.append(Lsn(START.0 + half as u64), &wal[half..], Lsn::INVALID))
        .await
        .unwrap();
    p.wait_flushed(end).await;
    // Commit it, so readers may see it.
    p.writer
        .send(&append_msg(Term(1), end, &[], end))
        .await
        .unwrap();

    let cfg = client_config(&d);
    let conn = ClientConn::connect(&cfg).await.unwrap();
    let (mut r, mut w) = conn
        .start_copy_both(&format!("START_REPLICATION PHYSICAL {START} TIMELINE 1"))
        .await
        .unwrap();
    let mut got = Vec::new();
    while (got.len() as u64) < end.0 - START.0 {
        let CopyEvent::Data(d) = r.read().await.unwrap() else {
            panic!("stream ended")
        };
        match ReplicationMessage::decode(d).unwrap() {
            ReplicationMessage::XLogData {
                wal_start, data, ..
            } => {
                assert_eq!(wal_start.0, START.0 + got.len() as u64);
                assert!(data.len() <= 128 * 1024);
                got.extend_from_slice(&data);
            }
            ReplicationMessage::Keepalive { .. } => {}
        }
    }
    assert!(got == wal, "streamed WAL differs from what was pushed");

    // Idle: keepalives that ask for a reply keep coming (one a second; waited for with a
    // generous deadline, not timed).
    let mut keepalives = 0;
    tokio::time::timeout(Duration::from_secs(30), async {
        while keepalives < 2 {
            let CopyEvent::Data(d) = r.read().await.unwrap() else {
                panic!("stream ended")
            };
            if let ReplicationMessage::Keepalive {
                wal_end,
                reply_requested,
                ..
            } = ReplicationMessage::decode(d).unwrap()
            {
                assert_eq!(wal_end, end);
                assert!(reply_requested, "a periodic keepalive asks for a reply");
                keepalives += 1;
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{keepalives} keepalives in 30 s on an idle stream"));

    // A status update that asks for a reply is answered: a keepalive that does not ask for one
    // (the periodic ones all do, so it can only be the answer).
    w.write_standby_message(&StandbyMessage::StatusUpdate {
        write: end,
        flush: end,
        apply: end,
        send_time: 0,
        reply_requested: true,
    });
    w.flush().await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let CopyEvent::Data(d) = r.read().await.unwrap() else {
                panic!("stream ended")
            };
            if let ReplicationMessage::Keepalive {
                wal_end,
                reply_requested: false,
                ..
            } = ReplicationMessage::decode(d).unwrap()
            {
                assert_eq!(wal_end, end);
                break;
            }
        }
    })
    .await
    .expect("no reply to a status update that asked for one within 30 s");

    // CopyDone ends streaming and the connection returns to query mode.
    w.send_copy_done().await.unwrap();
    while let CopyEvent::Data(_) = r.read().await.unwrap() {}
    loop {
        if let BackendMessage::ReadyForQuery(_) = r.read_message().await.unwrap() {
            break;
        }
    }
    let mut conn = r.unsplit(w);
    let rows = conn.simple_query("IDENTIFY_SYSTEM").await.unwrap();
    assert_eq!(rows[0][0].as_deref(), Some(SYSID.to_string().as_str()));
    assert_eq!(rows[0][2].as_deref(), Some(end.to_string().as_str()));
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_startup_packets_are_refused_and_the_daemon_keeps_serving() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let d = TestDaemon::start(dir.path()).await;
    let cases: [&[u8]; 4] = [
        b"\x00\x00\x00\x08\x00\x02\x00\x00",  // protocol 2.0
        b"\x7f\xff\xff\xff\x00\x03\x00\x00",  // absurd length
        b"\x00\x00\x00\x02",                  // length below the minimum
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", // not PostgreSQL at all
    ];
    for bytes in cases {
        let mut s = tokio::net::TcpStream::connect(d.pg).await.unwrap();
        s.write_all(bytes).await.unwrap();
        let mut reply = Vec::new();
        // The server answers (an ErrorResponse) or not, and closes the connection either way.
        tokio::time::timeout(std::time::Duration::from_secs(5), s.read_to_end(&mut reply))
            .await
            .expect("the server must close a malformed connection")
            .ok();
        if let Some(&tag) = reply.first() {
            assert_eq!(tag, b'E', "unexpected reply {reply:?}");
        }
    }
    // Honest clients keep working.
    let (p, _) = Client::elect(&d, START).await;
    assert_eq!(p.term, Term(1));
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_token_file_requires_the_shared_secret() {
    use safekeeper::config::Conf;
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").unwrap();
    let mut conf = Conf::for_tests(dir.path().join("data"));
    conf.pg_auth_token_file = Some(token);
    let listeners = safekeeper::daemon::bind(&conf).await.unwrap();
    let port = listeners.pg_addr().port();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(safekeeper::daemon::run(conf, listeners, async move {
        let _ = rx.await;
    }));
    let mut cfg = ClientConfig::new("127.0.0.1", port, "test");
    // Without a password the server asks for one.
    match ClientConn::connect(&cfg).await {
        Err(PqError::UnsupportedAuth(m)) => assert!(m.contains("asks for a password"), "{m}"),
        Err(e) => panic!("expected a password request, got {e:?}"),
        Ok(_) => panic!("connected without the secret"),
    }
    cfg.password = Some("wrong".into());
    match ClientConn::connect(&cfg).await {
        Err(PqError::Rejected(e)) | Err(PqError::Server(e)) => assert_eq!(e.code, "28P01", "{e:?}"),
        Err(e) => panic!("expected an authentication error, got {e:?}"),
        Ok(_) => panic!("connected with a wrong secret"),
    }
    cfg.password = Some("s3cret".into());
    let mut c = ClientConn::connect(&cfg).await.unwrap();
    assert!(c.simple_query("TIMELINE_STATUS").await.unwrap().is_empty());
    tx.send(()).unwrap();
    task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_or_unreadable_token_file_refuses_to_start_naming_it() {
    use safekeeper::config::Conf;
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    for contents in [None, Some(""), Some("\n")] {
        if let Some(c) = contents {
            std::fs::write(&token, c).unwrap();
        }
        let mut conf = Conf::for_tests(dir.path().join("data"));
        conf.pg_auth_token_file = Some(token.clone());
        let listeners = safekeeper::daemon::bind(&conf).await.unwrap();
        let err = safekeeper::daemon::run(conf, listeners, std::future::pending())
            .await
            .expect_err("a daemon with an empty or missing token file must not start");
        let err = format!("{err:#}");
        assert!(err.contains("--pg-auth-token-file"), "{err}");
        assert!(err.contains(&*token.to_string_lossy()), "{err}");
    }
}
