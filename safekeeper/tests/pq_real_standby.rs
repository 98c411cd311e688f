//! The whole chain with real PostgreSQL on both ends and our protocol layer in the middle:
//!
//! ```text
//! real PG15 primary --(pq_proto::client)--> relay --(pq_proto::server)--> real PG15 hot standby
//! ```
//!
//! The relay answers the standby's IDENTIFY_SYSTEM with the primary's answer and, on
//! START_REPLICATION, opens a replication stream from the primary through a physical slot and
//! forwards CopyData both ways (WAL `w`/`k` down, feedback `r`/`h` up), decoding each message on
//! the way. The standby comes from `pg_basebackup -X none`, so every WAL byte it replays went
//! through both halves of our layer. Rows written on the primary must be visible on the standby.

mod pq_common;

use std::time::Duration;

use pq_common::{Log, PgCluster};
use pq_proto::PqError;
use pq_proto::client::{ClientConfig, ClientConn, CopyEvent};
use pq_proto::replication::{ReplicationMessage, StandbyMessage};
use pq_proto::server::{ServerConfig, ServerConn};
use pq_proto::{ErrorFields, FrontendMessage, sqlstate};
use safekeeper::command::{ReplicationCommand, parse_command};
use sk_core::types::Lsn;
use tokio::net::{TcpListener, TcpStream};

async fn relay_connection(
    sock: TcpStream,
    upstream: ClientConfig,
    log: Log,
) -> Result<(), PqError> {
    sock.set_nodelay(true)?;
    let mut down = ServerConn::new(sock, ServerConfig::default());
    let params = down.handshake().await?;
    log.push(format!(
        "startup:application_name={}",
        params.application_name().unwrap_or("")
    ));
    loop {
        let Some(msg) = down.read_message().await? else {
            return Ok(());
        };
        let FrontendMessage::Query(q) = msg else {
            log.push(format!("unexpected:{msg:?}"));
            return Ok(());
        };
        log.push(format!("Q:{q}"));
        match parse_command(&q) {
            Ok(ReplicationCommand::IdentifySystem) => {
                let mut up = ClientConn::connect(&upstream).await?;
                let r = up.simple_query_full("IDENTIFY_SYSTEM").await?;
                down.send_result_set(&r.columns, &r.rows, "IDENTIFY_SYSTEM")
                    .await?;
                up.close().await?;
            }
            Ok(ReplicationCommand::StartReplication {
                start_lsn,
                timeline,
                ..
            }) => {
                let up = ClientConn::connect(&upstream).await?;
                let cmd = format!(
                    "START_REPLICATION SLOT relay PHYSICAL {start_lsn} TIMELINE {}",
                    timeline.unwrap_or(1)
                );
                let (mut up_r, mut up_w) = match up.start_copy_both(&cmd).await {
                    Ok(halves) => halves,
                    Err(PqError::Server(e)) => {
                        down.send_error(e).await?;
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                down.send_copy_both_response().await?;
                let (mut down_r, mut down_w) = down.split();
                // WAL down: check contiguity while forwarding the bytes unchanged.
                let wlog = log.clone();
                let down_task = tokio::spawn(async move {
                    let mut next = start_lsn;
                    loop {
                        match up_r.read().await {
                            Ok(CopyEvent::Data(d)) => {
                                match ReplicationMessage::decode(d.clone()) {
                                    Ok(ReplicationMessage::XLogData {
                                        wal_start, data, ..
                                    }) => {
                                        if wal_start != next {
                                            wlog.push(format!("gap:{next}->{wal_start}"));
                                        }
                                        next = Lsn(wal_start.0 + data.len() as u64);
                                        wlog.push("w");
                                    }
                                    Ok(ReplicationMessage::Keepalive { .. }) => wlog.push("k"),
                                    Err(e) => wlog.push(format!("bad:{e}")),
                                }
                                down_w.write_copy_bytes(&d);
                                down_w.flush().await?;
                            }
                            Ok(CopyEvent::Done) => return Ok::<_, PqError>(()),
                            Err(PqError::Server(e)) => {
                                down_w.write_message(&pq_proto::BackendMessage::ErrorResponse(e));
                                down_w.flush().await?;
                                return Ok(());
                            }
                            Err(e) => return Err(e),
                        }
                    }
                });
                // Feedback up.
                loop {
                    match down_r.read_message().await? {
                        Some(FrontendMessage::CopyData(d)) => {
                            match StandbyMessage::decode(d.clone()) {
                                Ok(StandbyMessage::StatusUpdate { flush, .. }) => {
                                    log.push(format!("r:{flush}"))
                                }
                                Ok(StandbyMessage::HotStandbyFeedback { .. }) => log.push("h"),
                                Ok(StandbyMessage::NeonFeedback(_)) => log.push("z"),
                                Err(e) => log.push(format!("bad:{e}")),
                            }
                            up_w.send_copy_data(&d).await?;
                        }
                        Some(FrontendMessage::CopyDone) => {
                            up_w.send_copy_done().await?;
                        }
                        // A walreceiver that gives up sends Terminate inside the copy.
                        Some(FrontendMessage::Terminate) | None => break,
                        Some(other) => log.push(format!("unexpected:{other:?}")),
                    }
                }
                down_task.abort();
                return Ok(());
            }
            Ok(_) | Err(_) => {
                down.send_error(ErrorFields::error(
                    sqlstate::FEATURE_NOT_SUPPORTED,
                    format!("relay does not serve {q}"),
                ))
                .await?;
            }
        }
    }
}

async fn start_relay(upstream: ClientConfig) -> (u16, Log) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let log = Log::default();
    let log2 = log.clone();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let (up, log) = (upstream.clone(), log2.clone());
            tokio::spawn(async move {
                if let Err(e) = relay_connection(sock, up, log.clone()).await {
                    log.push(format!("error:{e}"));
                }
            });
        }
    });
    (port, log)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_standby_replays_wal_relayed_through_our_client_and_server() {
    let Some(primary) = tokio::task::spawn_blocking(PgCluster::init_primary)
        .await
        .expect("thread")
    else {
        return;
    };
    let primary = std::sync::Arc::new(primary);
    let p = primary.clone();
    tokio::task::spawn_blocking(move || {
        p.psql("SELECT pg_create_physical_replication_slot('relay', true)")
    })
    .await
    .expect("thread");
    let (relay_port, log) = start_relay(primary.client_config("relay")).await;

    let p = primary.clone();
    let standby = tokio::task::spawn_blocking(move || PgCluster::start_standby(&p, relay_port))
        .await
        .expect("standby started: it reached consistency from WAL we relayed");

    let p = primary.clone();
    let target: Lsn = tokio::task::spawn_blocking(move || {
        p.psql("CREATE TABLE t AS SELECT generate_series(1, 1000) AS g");
        p.psql("UPDATE t SET g = g * 2 WHERE g <= 10");
        p.psql("SELECT pg_current_wal_lsn()")
    })
    .await
    .expect("thread")
    .parse()
    .expect("lsn");

    let standby = std::sync::Arc::new(standby);
    let s = standby.clone();
    let result = tokio::task::spawn_blocking(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let replayed: Lsn = s
                .psql("SELECT pg_last_wal_replay_lsn()")
                .parse()
                .expect("lsn");
            if replayed >= target {
                return s.psql("SELECT count(*), sum(g) FROM t");
            }
            assert!(
                std::time::Instant::now() < deadline,
                "standby stuck at {replayed} < {target}\n{}",
                s.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    })
    .await
    .expect("standby caught up");
    // sum(1..=1000) + sum(1..=10) because the first ten values were doubled.
    assert_eq!(result, "1000|500555");

    // The walreceiver sends `h` once the standby accepts connections, at its status interval.
    log.wait_for("h").await;

    // An idle period longer than the standby's wal_receiver_timeout (5 s): its reply requests
    // and the primary's keepalives cross the relay, so the standby does not reconnect.
    tokio::time::sleep(Duration::from_secs(7)).await;
    let starts = log
        .entries()
        .iter()
        .filter(|e| e.starts_with("Q:START_REPLICATION"))
        .count();
    assert_eq!(starts, 1, "the standby reconnected: {:?}", log.entries());
    assert!(
        log.entries().iter().any(|e| e == "k"),
        "keepalives went down"
    );
    let entries = log.entries();
    let queries: Vec<_> = entries.iter().filter(|e| e.starts_with("Q:")).collect();
    assert_eq!(
        queries.first().map(|s| s.as_str()),
        Some("Q:IDENTIFY_SYSTEM")
    );
    let start = queries
        .iter()
        .find_map(|q| q.strip_prefix("Q:START_REPLICATION "))
        .expect("the standby asked for WAL");
    let lsn: Lsn = start
        .split_whitespace()
        .next()
        .expect("lsn")
        .parse()
        .expect("X/X");
    assert_eq!(
        lsn.segment_offset(pq_common::SEG_SIZE),
        0,
        "segment start: {start}"
    );
    assert!(entries.iter().any(|e| e == "w"), "WAL went down");
    assert!(
        entries.iter().any(|e| e.starts_with("r:")),
        "status updates went up"
    );
    assert!(
        entries.iter().any(|e| e == "h"),
        "hot standby feedback went up"
    );
    assert!(
        !entries.iter().any(|e| e.starts_with("gap:")
            || e.starts_with("bad:")
            || e.starts_with("unexpected:")
            || e.starts_with("error:")),
        "{entries:?}"
    );
    assert!(entries.contains(&"startup:application_name=standby1".to_string()));
    drop(standby);
}
