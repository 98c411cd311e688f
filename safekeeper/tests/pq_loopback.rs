//! `pq_proto::client` against `pq_proto::server` on loopback (127.0.0.1:0) and in-memory pipes: startup,
//! authentication, result sets, errors, the duplex CopyBoth phase, limits and cancellation.

mod pq_common;

use bytes::{BufMut, Bytes, BytesMut};
use pq_common::*;
use pq_proto::PqError;
use pq_proto::backend::decode_backend;
use pq_proto::client::{ClientConfig, ClientConn, CopyEvent};
use pq_proto::framing::DEFAULT_MAX_MESSAGE_SIZE;
use pq_proto::frontend::{StartupPacket, StartupParams};
use pq_proto::replication::{ReplicationMessage, StandbyMessage};
use pq_proto::server::{ServerConfig, ServerConn};
use pq_proto::{BackendMessage, ErrorFields, FrontendMessage, ProtocolError, sqlstate};
use sk_core::types::Lsn;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn client_config(srv: &TestServer) -> ClientConfig {
    ClientConfig::new("127.0.0.1", srv.addr.port(), "postgres")
}

#[tokio::test]
async fn client_runs_identify_system_show_and_timeline_status() {
    let srv = start_server(ServerConfig::default(), StartMode::Refuse).await;
    let mut cfg = client_config(&srv);
    cfg.application_name = Some("wal_proposer".into());
    cfg.options = Some("-c tenant_id=de200bd42b49cc1814412c7e592dd6e9 timeline_id=0102030405060708090a0b0c0d0e0f10".into());
    let mut c = ClientConn::connect(&cfg).await.expect("connect");
    assert_eq!(
        c.parameter("server_version"),
        Some("15.18 (mini-safekeeper)")
    );
    assert_eq!(c.parameter("integer_datetimes"), Some("on"));
    assert!(c.backend_key().is_some());

    let rows = c.simple_query("IDENTIFY_SYSTEM").await.expect("identify");
    assert_eq!(
        rows,
        vec![vec![
            Some(SYSTEM_ID.to_string()),
            Some("1".to_string()),
            Some(XLOGPOS.to_string()),
            None
        ]]
    );
    let full = c
        .simple_query_full("show WAL_SEGMENT_SIZE;")
        .await
        .expect("show");
    assert_eq!(full.rows, vec![vec![Some("16MB".to_string())]]);
    assert_eq!(full.columns[0].name, "wal_segment_size");
    assert_eq!(full.tag.as_deref(), Some("SHOW"));
    let rows = c.simple_query("TIMELINE_STATUS").await.expect("status");
    assert_eq!(rows[0].len(), 2);
    c.close().await.expect("close");

    // The server saw the startup parameters as sent.
    srv.log.wait_for("X").await;
    let log = srv.log.entries();
    assert!(log.contains(&"startup:application_name=wal_proposer".to_string()));
    assert!(
        log.iter()
            .any(|e| e.starts_with("startup:options=-c tenant_id="))
    );
    assert!(log.contains(&"X".to_string()), "{log:?}");
}

#[tokio::test]
async fn server_errors_carry_sqlstate_and_leave_the_connection_usable() {
    let srv = start_server(ServerConfig::default(), StartMode::Refuse).await;
    let mut c = ClientConn::connect(&client_config(&srv))
        .await
        .expect("connect");
    let err = c.simple_query("DROP TABLE x").await.unwrap_err();
    let PqError::Server(e) = &err else {
        panic!("expected a server error, got {err:?}")
    };
    assert_eq!(e.code, sqlstate::SYNTAX_ERROR);
    assert_eq!(e.severity, "ERROR");
    assert_eq!(e.message, "unsupported command DROP");
    assert_eq!(err.sqlstate(), Some("42601"));
    let err = c.simple_query("SHOW nope").await.unwrap_err();
    assert_eq!(err.sqlstate(), Some(sqlstate::UNDEFINED_OBJECT));
    // Still usable.
    assert_eq!(
        c.simple_query("IDENTIFY_SYSTEM").await.expect("ok").len(),
        1
    );
    // START_REPLICATION refused: the error comes back from start_copy_both.
    let Err(err) = c
        .start_copy_both("START_REPLICATION 0/1000000 TIMELINE 1")
        .await
    else {
        panic!("expected a refusal");
    };
    assert!(
        err.to_string().contains("ahead of the WAL flush position"),
        "{err}"
    );
}

#[tokio::test]
async fn password_auth_accepts_the_secret_and_rejects_others() {
    let config = ServerConfig {
        password: Some(b"token".to_vec()),
        ..ServerConfig::default()
    };
    let srv = start_server(config, StartMode::Refuse).await;
    let mut cfg = client_config(&srv);
    cfg.password = Some("token".into());
    let mut c = ClientConn::connect(&cfg).await.expect("right password");
    assert_eq!(
        c.simple_query("IDENTIFY_SYSTEM").await.expect("ok").len(),
        1
    );

    cfg.password = Some("tokem".into());
    let err = ClientConn::connect(&cfg)
        .await
        .err()
        .expect("wrong password");
    assert_eq!(err.sqlstate(), Some(sqlstate::INVALID_PASSWORD), "{err}");

    cfg.password = None;
    let err = ClientConn::connect(&cfg).await.err().expect("no password");
    assert!(matches!(err, PqError::UnsupportedAuth(_)), "{err}");
}

#[tokio::test]
async fn non_replication_and_logical_connections_are_refused() {
    let srv = start_server(ServerConfig::default(), StartMode::Refuse).await;
    let mut cfg = client_config(&srv);
    cfg.replication = false;
    let err = ClientConn::connect(&cfg).await.err().expect("refused");
    assert_eq!(
        err.sqlstate(),
        Some(sqlstate::INVALID_AUTHORIZATION_SPECIFICATION)
    );

    // replication=database, by hand.
    for (value, code) in [
        ("database", sqlstate::FEATURE_NOT_SUPPORTED),
        ("maybe", sqlstate::PROTOCOL_VIOLATION),
    ] {
        let e = raw_startup(&srv, vec![("user", "postgres"), ("replication", value)]).await;
        assert_eq!(e.code, code, "{value}: {e:?}");
        assert_eq!(e.severity, "FATAL");
    }
    let e = raw_startup(&srv, vec![("replication", "true")]).await;
    assert_eq!(e.code, sqlstate::INVALID_AUTHORIZATION_SPECIFICATION);
    assert!(e.message.contains("no PostgreSQL user name"));
}

/// Sends a StartupMessage with `params` and returns the ErrorResponse the server answers.
async fn raw_startup(srv: &TestServer, params: Vec<(&str, &str)>) -> ErrorFields {
    let mut s = TcpStream::connect(srv.addr).await.expect("connect");
    let mut b = BytesMut::new();
    StartupPacket::Startup {
        minor_version: 0,
        params: StartupParams(
            params
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        ),
    }
    .encode(&mut b);
    s.write_all(&b).await.expect("write");
    read_error(&mut s).await
}

/// Reads backend messages until an ErrorResponse, then expects EOF.
async fn read_error(s: &mut TcpStream) -> ErrorFields {
    let mut buf = BytesMut::new();
    loop {
        if let Some(m) = decode_backend(&mut buf, 1 << 20).expect("valid reply") {
            if let BackendMessage::ErrorResponse(e) = m {
                let mut rest = Vec::new();
                s.read_to_end(&mut rest).await.expect("read to EOF");
                assert!(rest.is_empty(), "nothing after a FATAL error");
                return e;
            }
            continue;
        }
        assert!(
            s.read_buf(&mut buf).await.expect("read") > 0,
            "EOF before error"
        );
    }
}

#[tokio::test]
async fn ssl_request_is_answered_n_and_startup_continues_on_the_same_socket() {
    let srv = start_server(ServerConfig::default(), StartMode::Refuse).await;
    let mut s = TcpStream::connect(srv.addr).await.expect("connect");
    for pkt in [StartupPacket::SslRequest, StartupPacket::GssEncRequest] {
        let mut b = BytesMut::new();
        pkt.encode(&mut b);
        s.write_all(&b).await.expect("write");
        let mut answer = [0u8; 1];
        s.read_exact(&mut answer).await.expect("read");
        assert_eq!(&answer, b"N");
    }
    let mut c = ClientConn::connect_stream(s, &client_config(&srv))
        .await
        .expect("startup after negotiation");
    assert_eq!(
        c.simple_query("IDENTIFY_SYSTEM").await.expect("ok").len(),
        1
    );
}

/// A one-connection server on a fresh port, running `f` on the accepted connection.
async fn one_shot_server<F, Fut>(
    config: ServerConfig,
    f: F,
) -> (
    std::net::SocketAddr,
    tokio::task::JoinHandle<Result<(), PqError>>,
)
where
    F: FnOnce(ServerConn<TcpStream>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<(), PqError>> + Send,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let h = tokio::spawn(async move {
        let (sock, _) = listener.accept().await?;
        f(ServerConn::new(sock, config)).await
    });
    (addr, h)
}

#[tokio::test]
async fn cancel_request_and_garbage_startup_end_the_handshake() {
    let (addr, h) = one_shot_server(ServerConfig::default(), |mut c| async move {
        c.handshake().await.map(|_| ())
    })
    .await;
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let mut b = BytesMut::new();
    StartupPacket::CancelRequest {
        process_id: 5,
        secret_key: 6,
    }
    .encode(&mut b);
    s.write_all(&b).await.expect("write");
    let r = h.await.expect("join");
    assert!(
        matches!(
            r,
            Err(PqError::CancelRequest {
                process_id: 5,
                secret_key: 6
            })
        ),
        "{r:?}"
    );

    // A huge length prefix: FATAL 08P01, then close.
    let (addr, h) = one_shot_server(ServerConfig::default(), |mut c| async move {
        c.handshake().await.map(|_| ())
    })
    .await;
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(&[0x7f, 0xff, 0xff, 0xff, 0, 3, 0, 0])
        .await
        .expect("write");
    let e = read_error(&mut s).await;
    assert_eq!(e.code, sqlstate::PROTOCOL_VIOLATION);
    assert!(matches!(h.await.expect("join"), Err(PqError::Rejected(_))));

    // Protocol 2.0.
    let (addr, h) = one_shot_server(ServerConfig::default(), |mut c| async move {
        c.handshake().await.map(|_| ())
    })
    .await;
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(&[0, 0, 0, 9, 0, 2, 0, 0, 0])
        .await
        .expect("write");
    let e = read_error(&mut s).await;
    assert_eq!(e.code, sqlstate::FEATURE_NOT_SUPPORTED);
    assert!(e.message.contains("2.0"), "{e:?}");
    assert!(h.await.expect("join").is_err());
}

#[tokio::test]
async fn oversized_message_after_startup_is_a_protocol_error() {
    let config = ServerConfig {
        max_message_size: 1024,
        ..ServerConfig::default()
    };
    let (addr, h) = one_shot_server(config, |mut c| async move {
        c.handshake().await?;
        match c.read_message().await {
            Err(PqError::Protocol(ProtocolError::TooLarge {
                len: 1025,
                max: 1024,
            })) => Ok(()),
            other => panic!("expected TooLarge, got {other:?}"),
        }
    })
    .await;
    let mut s = raw_connect(addr).await;
    let mut b = BytesMut::new();
    FrontendMessage::CopyData(Bytes::from(vec![0u8; 1025])).encode(&mut b);
    s.write_all(&b).await.expect("send");
    h.await.expect("join").expect("server saw TooLarge");
}

/// Connects and runs the startup phase by hand, up to ReadyForQuery.
async fn raw_connect(addr: std::net::SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let mut b = BytesMut::new();
    StartupPacket::Startup {
        minor_version: 0,
        params: StartupParams(vec![
            ("user".into(), "u".into()),
            ("replication".into(), "true".into()),
        ]),
    }
    .encode(&mut b);
    s.write_all(&b).await.expect("write");
    let mut buf = BytesMut::new();
    loop {
        while let Some(m) = decode_backend(&mut buf, 1 << 20).expect("valid") {
            if matches!(m, BackendMessage::ReadyForQuery(_)) {
                return s;
            }
        }
        assert!(
            s.read_buf(&mut buf).await.expect("read") > 0,
            "EOF in startup"
        );
    }
}

/// The test server's START_REPLICATION with real duplex traffic: `w` then `k`, our `r`, the
/// server's CopyDone, ours, and the CommandComplete/ReadyForQuery tail.
#[tokio::test]
async fn copy_both_streams_wal_and_feedback_both_ways() {
    let srv = start_server(ServerConfig::default(), StartMode::Stream).await;
    let c = ClientConn::connect(&client_config(&srv))
        .await
        .expect("connect");
    let (mut r, mut w) = c
        .start_copy_both("START_REPLICATION PHYSICAL 0/1000000 TIMELINE 1")
        .await
        .expect("copy both");
    let mut wal_end = Lsn(0);
    let mut got_wal = Vec::new();
    while let CopyEvent::Data(d) = r.read().await.expect("read") {
        match ReplicationMessage::decode(d).expect("valid") {
            ReplicationMessage::XLogData {
                wal_start, data, ..
            } => {
                assert_eq!(wal_start, Lsn(0x100_0000));
                got_wal.extend_from_slice(&data);
                wal_end = Lsn(0x100_0000 + data.len() as u64);
            }
            ReplicationMessage::Keepalive {
                reply_requested, ..
            } => {
                assert!(reply_requested);
                w.write_standby_message(&StandbyMessage::StatusUpdate {
                    write: wal_end,
                    flush: wal_end,
                    apply: Lsn(0),
                    send_time: pq_proto::pg_now(),
                    reply_requested: false,
                });
                w.flush().await.expect("flush");
            }
        }
    }
    assert!(r.server_done());
    assert_eq!(got_wal, stream_bytes().to_vec());
    w.send_copy_done().await.expect("copy done");
    assert_eq!(
        r.read_message().await.expect("tail"),
        BackendMessage::CommandComplete("START_STREAMING".into())
    );
    assert!(matches!(
        r.read_message().await.expect("tail"),
        BackendMessage::ReadyForQuery(_)
    ));
    // Back in query mode on the same connection.
    let c = r.unsplit(w);
    assert_eq!(c.parameter("integer_datetimes"), Some("on"));
    c.close().await.expect("terminate");
    srv.log.wait_for("after copy:Terminate").await;
    let log = srv.log.entries();
    assert!(log.contains(&format!("r:{wal_end}/{wal_end}")), "{log:?}");
    assert!(log.contains(&"c".to_string()), "{log:?}");
}

/// START_WAL_PUSH-style echo: messages up to the size limit cross in both directions while the
/// server's reader and writer halves run in separate tasks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_halves_echo_large_copy_data_concurrently() {
    let (addr, h) = one_shot_server(ServerConfig::default(), |mut c| async move {
        c.handshake().await?;
        let Some(FrontendMessage::Query(q)) = c.read_message().await? else {
            panic!("expected a query");
        };
        assert_eq!(q, "START_WAL_PUSH (proto_version '3')");
        c.send_copy_both_response().await?;
        let (mut r, mut w) = c.split();
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(2);
        let reader = tokio::spawn(async move {
            while let Some(m) = r.read_message().await? {
                match m {
                    FrontendMessage::CopyData(d) => tx.send(d).await.expect("writer alive"),
                    FrontendMessage::CopyDone => break,
                    other => panic!("unexpected {other:?}"),
                }
            }
            Ok::<_, PqError>(r)
        });
        while let Some(d) = rx.recv().await {
            w.write_copy_bytes(&d);
            w.flush().await?;
        }
        let r = reader.await.expect("join")?;
        let mut c = r.unsplit(w);
        c.write_message(&BackendMessage::CopyDone);
        c.send_command_complete("COPY").await?;
        Ok(())
    })
    .await;
    let s = TcpStream::connect(addr).await.expect("connect");
    let c = ClientConn::connect_stream(s, &ClientConfig::new("x", 0, "u"))
        .await
        .expect("startup");
    let (mut r, mut w) = c
        .start_copy_both("START_WAL_PUSH (proto_version '3')")
        .await
        .expect("copy both");
    let sizes = [0usize, 1, 8192, 128 * 1024 + 49, DEFAULT_MAX_MESSAGE_SIZE];
    let sender = tokio::spawn(async move {
        for (i, n) in sizes.iter().enumerate() {
            let mut p = BytesMut::with_capacity(*n);
            p.put_bytes(i as u8, *n);
            w.send_copy_data(&p).await.expect("send");
        }
        w.send_copy_done().await.expect("done");
        w
    });
    for (i, n) in sizes.iter().enumerate() {
        let CopyEvent::Data(d) = r.read().await.expect("echo") else {
            panic!("early CopyDone")
        };
        assert_eq!(d.len(), *n);
        assert!(d.iter().all(|&b| b == i as u8));
    }
    assert_eq!(r.read().await.expect("done"), CopyEvent::Done);
    assert_eq!(
        r.read_message().await.expect("tag"),
        BackendMessage::CommandComplete("COPY".into())
    );
    sender.await.expect("sender");
    h.await.expect("join").expect("server");
}

/// `read_message` inside `select!` with a branch that keeps winning: bytes trickle in one at a
/// time and the read is cancelled after each; the message still arrives whole.
#[tokio::test]
async fn read_message_is_cancellation_safe() {
    let (client, server) = tokio::io::duplex(64);
    let (tick_tx, mut tick_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let mut wire = BytesMut::new();
    StartupPacket::Startup {
        minor_version: 0,
        params: StartupParams(vec![
            ("user".into(), "u".into()),
            ("replication".into(), "true".into()),
        ]),
    }
    .encode(&mut wire);
    let startup_len = wire.len();
    FrontendMessage::Query("IDENTIFY_SYSTEM".into()).encode(&mut wire);
    FrontendMessage::CopyData(Bytes::from_static(b"payload")).encode(&mut wire);
    let wire = wire.freeze();
    let writer = tokio::spawn(async move {
        let (mut rd, mut wr) = tokio::io::split(client);
        wr.write_all(&wire[..startup_len]).await.expect("write");
        // Drain the server's startup reply so the pipe never blocks it.
        let drain = tokio::spawn(async move {
            let mut sink = Vec::new();
            let _ = rd.read_to_end(&mut sink).await;
        });
        for b in &wire[startup_len..] {
            wr.write_all(&[*b]).await.expect("write");
            tick_tx.send(()).expect("ticks");
            tokio::task::yield_now().await;
        }
        drop(tick_tx);
        (wr, drain)
    });
    let mut conn = ServerConn::new(server, ServerConfig::default());
    conn.handshake().await.expect("handshake");
    let mut got = Vec::new();
    let mut cancelled = 0;
    while got.len() < 2 {
        tokio::select! {
            biased;
            Some(()) = tick_rx.recv() => { cancelled += 1; }
            m = conn.read_message() => got.push(m.expect("read").expect("message")),
        }
    }
    assert!(
        cancelled > 10,
        "the read was cancelled repeatedly ({cancelled})"
    );
    assert_eq!(
        got,
        vec![
            FrontendMessage::Query("IDENTIFY_SYSTEM".into()),
            FrontendMessage::CopyData(Bytes::from_static(b"payload")),
        ]
    );
    let _ = writer.await;
}

#[tokio::test]
async fn protocol_minor_version_above_zero_gets_negotiate_protocol_version() {
    let (addr, h) = one_shot_server(ServerConfig::default(), |mut c| async move {
        let p = c.handshake().await?;
        assert_eq!(p.get("_pq_.opt"), None, "protocol options are not returned");
        Ok(())
    })
    .await;
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let mut b = BytesMut::new();
    StartupPacket::Startup {
        minor_version: 2,
        params: StartupParams(vec![
            ("user".into(), "u".into()),
            ("replication".into(), "on".into()),
            ("_pq_.opt".into(), "1".into()),
        ]),
    }
    .encode(&mut b);
    s.write_all(&b).await.expect("write");
    let mut buf = BytesMut::new();
    let first = loop {
        if let Some(m) = decode_backend(&mut buf, 1 << 20).expect("valid") {
            break m;
        }
        s.read_buf(&mut buf).await.expect("read");
    };
    assert_eq!(
        first,
        BackendMessage::NegotiateProtocolVersion {
            newest_minor: 0,
            unrecognized: vec!["_pq_.opt".into()]
        }
    );
    h.await.expect("join").expect("handshake");
}

#[tokio::test]
async fn messages_before_authentication_are_capped_at_a_few_kib() {
    let config = ServerConfig {
        password: Some(b"token".to_vec()),
        ..ServerConfig::default()
    };
    let max = config.max_startup_message_size;
    assert!((4096..=8192).contains(&max), "{max}");
    let srv = start_server(config, StartMode::Refuse).await;

    // A startup packet over the cap (but under PostgreSQL's 10,000 bytes) is refused from its
    // length word, before the body is sent.
    let mut cfg = client_config(&srv);
    cfg.password = Some("token".into());
    cfg.options = Some("x".repeat(max));
    let err = ClientConn::connect(&cfg).await.err().expect("too large");
    assert_eq!(err.sqlstate(), Some(sqlstate::PROTOCOL_VIOLATION), "{err}");

    // A password over the cap is refused the same way, once its length word arrives.
    let mut s = TcpStream::connect(srv.addr).await.unwrap();
    let mut buf = BytesMut::new();
    StartupPacket::Startup {
        minor_version: 0,
        params: StartupParams(vec![
            ("user".into(), "postgres".into()),
            ("replication".into(), "true".into()),
        ]),
    }
    .encode(&mut buf);
    s.write_all(&buf).await.unwrap();
    let mut reply = BytesMut::new();
    let auth = loop {
        s.read_buf(&mut reply).await.unwrap();
        if let Some(m) = decode_backend(&mut reply, DEFAULT_MAX_MESSAGE_SIZE).unwrap() {
            break m;
        }
    };
    assert!(
        matches!(auth, BackendMessage::Authentication(_)),
        "{auth:?}"
    );
    let mut pw = BytesMut::new();
    pw.put_u8(b'p');
    pw.put_i32(4 + (1 << 20));
    s.write_all(&pw).await.unwrap(); // announces 1 MiB, sends nothing more
    let err = loop {
        match s.read_buf(&mut reply).await.unwrap() {
            0 => panic!("closed without an error"),
            _ => {
                if let Some(m) = decode_backend(&mut reply, DEFAULT_MAX_MESSAGE_SIZE).unwrap() {
                    break m;
                }
            }
        }
    };
    let BackendMessage::ErrorResponse(e) = err else {
        panic!("expected an error, got {err:?}");
    };
    assert_eq!(e.code, sqlstate::PROTOCOL_VIOLATION, "{e:?}");
    // And the server closes the connection.
    let mut rest = [0u8; 64];
    assert_eq!(s.read(&mut rest).await.unwrap(), 0);
}
