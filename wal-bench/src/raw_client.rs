//! A minimal, independent protocol-v3 proposer: blocking `std` sockets and messages encoded by
//! hand from the protocol's byte layout, with none of the project's proposer, codec or runtime.
//! It elects itself at term 1 on a fresh timeline, then commits one append at a time: send it to
//! every safekeeper, wait until a majority has replied with a flush LSN at or past its end.
//! Nothing is batched, pipelined or optimised on this side, so a commit's latency is the
//! safekeepers' own cost plus the loopback round trip.

use std::io::{self, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use pg_wal::{Lsn, WalGenerator};

use sk_core::types::TenantTimelineId;

use crate::{SEG_SIZE, START, SYSID};

/// PostgreSQL 15.18, as the bench proposers say.
const PG_VERSION: u32 = 150018;

/// One libpq message: tag, length (itself included), body.
fn message(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(5 + body.len());
    m.push(tag);
    m.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
    m.extend_from_slice(body);
    m
}

fn read_message(r: &mut impl Read) -> io::Result<(u8, Vec<u8>)> {
    let mut hdr = [0u8; 5];
    r.read_exact(&mut hdr)?;
    let len = u32::from_be_bytes([hdr[1], hdr[2], hdr[3], hdr[4]]) as usize;
    if !(4..=(1 << 20)).contains(&len) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("message length {len}"),
        ));
    }
    let mut body = vec![0u8; len - 4];
    r.read_exact(&mut body)?;
    Ok((hdr[0], body))
}

/// The text of an ErrorResponse's message field.
fn error_text(body: &[u8]) -> String {
    body.split(|&b| b == 0)
        .find_map(|f| f.strip_prefix(b"M"))
        .map(|m| String::from_utf8_lossy(m).into_owned())
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned())
}

/// Reads messages until one tagged `want`, failing on an ErrorResponse.
fn expect(r: &mut impl Read, want: u8) -> anyhow::Result<Vec<u8>> {
    loop {
        let (tag, body) = read_message(r)?;
        match tag {
            t if t == want => return Ok(body),
            b'E' => bail!("server error: {}", error_text(&body)),
            // AuthenticationOk, ParameterStatus, BackendKeyData, notices.
            b'R' if body.get(..4) != Some(&[0, 0, 0, 0]) => {
                bail!("the server asks for authentication; this client only does trust")
            }
            _ => {}
        }
    }
}

/// An empty membership configuration (generation 0, no members): the protocol's default.
fn mconf(out: &mut Vec<u8>) {
    out.extend_from_slice(&0u32.to_be_bytes()); // generation
    out.extend_from_slice(&0u32.to_be_bytes()); // members
    out.extend_from_slice(&0u32.to_be_bytes()); // new members
}

fn copy_data(payload: &[u8]) -> Vec<u8> {
    message(b'd', payload)
}

/// Connects, starts the WAL push, greets and wins the vote at term 1, and sends
/// ProposerElected. Returns the stream (to write appends to) and its reader.
fn elect(
    addr: SocketAddr,
    t: TenantTimelineId,
) -> anyhow::Result<(TcpStream, BufReader<TcpStream>)> {
    let mut w = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    w.set_nodelay(true)?;
    let mut reader = BufReader::new(w.try_clone()?);
    let (tenant, timeline) = (t.tenant_id.to_string(), t.timeline_id.to_string());

    let mut startup = Vec::new();
    startup.extend_from_slice(&196608u32.to_be_bytes());
    for (k, v) in [
        ("user", "raw-client".to_string()),
        ("application_name", "raw-client".to_string()),
        // A physical replication connection, as the safekeeper requires.
        ("replication", "true".to_string()),
        (
            "options",
            format!("-c tenant_id={tenant} timeline_id={timeline}"),
        ),
    ] {
        startup.extend_from_slice(k.as_bytes());
        startup.push(0);
        startup.extend_from_slice(v.as_bytes());
        startup.push(0);
    }
    startup.push(0);
    let mut framed = (startup.len() as u32 + 4).to_be_bytes().to_vec();
    framed.extend_from_slice(&startup);
    w.write_all(&framed)?;
    expect(&mut reader, b'Z')?;

    w.write_all(&message(b'Q', b"START_WAL_PUSH (proto_version '3')\0"))?;
    expect(&mut reader, b'W')?;

    let mut g = vec![b'g'];
    for id in [&tenant, &timeline] {
        g.extend_from_slice(id.as_bytes());
        g.push(0);
    }
    mconf(&mut g);
    g.extend_from_slice(&PG_VERSION.to_be_bytes());
    g.extend_from_slice(&SYSID.to_be_bytes());
    g.extend_from_slice(&(SEG_SIZE as u32).to_be_bytes());
    w.write_all(&copy_data(&g))?;
    let reply = expect(&mut reader, b'd')?;
    ensure!(reply.first() == Some(&b'g'), "expected AcceptorGreeting");
    // AcceptorGreeting ends with the acceptor's term: a fresh timeline is at term 0.
    let term = u64::from_be_bytes(reply[reply.len() - 8..].try_into()?);
    ensure!(term == 0, "the timeline exists already (term {term})");

    let mut v = vec![b'v'];
    v.extend_from_slice(&0u32.to_be_bytes());
    v.extend_from_slice(&1u64.to_be_bytes());
    w.write_all(&copy_data(&v))?;
    let reply = expect(&mut reader, b'd')?;
    // 'v', generation (4), term (8), vote_given (1).
    ensure!(
        reply.len() > 13 && reply[0] == b'v' && reply[13] == 1,
        "vote not given"
    );

    let mut e = vec![b'e'];
    e.extend_from_slice(&0u32.to_be_bytes());
    e.extend_from_slice(&1u64.to_be_bytes());
    e.extend_from_slice(&START.0.to_be_bytes());
    e.extend_from_slice(&1u32.to_be_bytes());
    e.extend_from_slice(&1u64.to_be_bytes());
    e.extend_from_slice(&START.0.to_be_bytes());
    w.write_all(&copy_data(&e))?;
    Ok((w, reader))
}

/// The CopyData frame of an AppendRequest of `wal` at `begin` (term 1), committing `commit`:
/// encoded once, sent as is to every safekeeper.
fn append_frame(begin: Lsn, wal: &[u8], commit: Lsn) -> Vec<u8> {
    let mut a = Vec::with_capacity(45 + wal.len());
    a.push(b'a');
    a.extend_from_slice(&0u32.to_be_bytes());
    a.extend_from_slice(&1u64.to_be_bytes());
    a.extend_from_slice(&begin.0.to_be_bytes());
    a.extend_from_slice(&(begin.0 + wal.len() as u64).to_be_bytes());
    a.extend_from_slice(&commit.0.to_be_bytes());
    a.extend_from_slice(&0u64.to_be_bytes()); // truncate_lsn
    a.extend_from_slice(wal);
    copy_data(&a)
}

/// The flush LSN of an AppendResponse (`None`: another message); an ErrorResponse is an error.
fn flush_of(i: usize, tag: u8, body: &[u8]) -> anyhow::Result<Option<u64>> {
    if tag == b'E' {
        bail!("safekeeper {i}: {}", error_text(body));
    }
    if tag != b'd' || body.len() < 21 || body[0] != b'a' {
        return Ok(None);
    }
    // 'a', generation (4), term (8), flush_lsn (8).
    Ok(Some(u64::from_be_bytes(
        body[13..21].try_into().expect("8 bytes"),
    )))
}

/// Waits until a connection has bytes to read (buffered ones first) and returns it. Blocks in
/// `poll(2)` on the caller's thread, as the echo baseline blocks in its `read`: no thread
/// hand-off is added to what is measured.
fn readable(readers: &[BufReader<TcpStream>]) -> anyhow::Result<usize> {
    if let Some(i) = readers.iter().position(|r| !r.buffer().is_empty()) {
        return Ok(i);
    }
    if readers.len() == 1 {
        return Ok(0);
    }
    let mut fds: Vec<libc::pollfd> = readers
        .iter()
        .map(|r| libc::pollfd {
            fd: r.get_ref().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    loop {
        // SAFETY: `fds` is a valid array of `fds.len()` pollfd structs for the whole call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 30_000) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e.into());
        }
        ensure!(n > 0, "no AppendResponse for 30 s");
        return Ok(fds
            .iter()
            .position(|f| f.revents != 0)
            .expect("poll reported a ready descriptor"));
    }
}

/// Latencies of `commits` commits of one ~`size`-byte record each, on a fresh timeline `t` of
/// the safekeepers at `addrs` (all of them greeted and elected first; a commit needs a
/// majority). One thread sends each append to every safekeeper and reads the replies until a
/// majority covers it.
pub fn commit_latencies(
    addrs: &[SocketAddr],
    t: TenantTimelineId,
    size: usize,
    commits: usize,
) -> anyhow::Result<Vec<Duration>> {
    ensure!(!addrs.is_empty(), "no safekeeper");
    ensure!(size > 100, "size {size} is below one record");
    let quorum = addrs.len() / 2 + 1;
    let mut conns = Vec::new();
    let mut readers = Vec::new();
    for &a in addrs {
        let (c, r) = elect(a, t)?;
        r.get_ref()
            .set_read_timeout(Some(Duration::from_secs(30)))?;
        conns.push(c);
        readers.push(r);
    }
    let mut generator = WalGenerator::new(SYSID, SEG_SIZE, START)?;
    let payload = vec![b'x'; size - crate::COMMIT_RECORD_OVERHEAD];
    let mut committed = START;
    let mut flushed = vec![0u64; addrs.len()];
    let mut out = Vec::with_capacity(commits);
    for _ in 0..commits {
        let (pos, wal) = generator.next_record(&payload);
        let begin = pos.chunk_start;
        let end = begin.0 + wal.len() as u64;
        let t = Instant::now();
        let frame = append_frame(begin, &wal, committed);
        for c in &mut conns {
            c.write_all(&frame)?;
        }
        while flushed.iter().filter(|&&f| f >= end).count() < quorum {
            let i = readable(&readers)?;
            let (tag, body) = read_message(&mut readers[i])
                .with_context(|| format!("reading safekeeper {i}'s reply"))?;
            if let Some(f) = flush_of(i, tag, &body)? {
                flushed[i] = flushed[i].max(f);
            }
        }
        out.push(t.elapsed());
        committed = Lsn(end);
    }
    Ok(out)
}

/// `d` in microseconds, from its whole nanoseconds (exact for whole microseconds).
pub fn micros(d: Duration) -> f64 {
    d.as_nanos() as f64 / 1e3
}

/// Summary of a latency sample: the figures the bench report puts side by side.
#[derive(Debug, Clone, Copy)]
pub struct Tail {
    /// Samples.
    pub n: usize,
    /// Mean, in µs.
    pub mean_us: f64,
    /// Median, in µs.
    pub p50_us: f64,
    /// 90th percentile, in µs.
    pub p90_us: f64,
    /// 99th percentile, in µs.
    pub p99_us: f64,
    /// 99.9th percentile, in µs.
    pub p999_us: f64,
    /// The slowest, in µs.
    pub max_us: f64,
}

impl Tail {
    /// The summary of `samples` (nearest-rank percentiles). None if empty.
    pub fn of(samples: &[Duration]) -> Option<Tail> {
        if samples.is_empty() {
            return None;
        }
        let mut us: Vec<f64> = samples.iter().copied().map(micros).collect();
        us.sort_by(f64::total_cmp);
        let rank = |p: f64| us[((p * us.len() as f64).ceil() as usize).clamp(1, us.len()) - 1];
        Some(Tail {
            n: us.len(),
            mean_us: us.iter().sum::<f64>() / us.len() as f64,
            p50_us: rank(0.50),
            p90_us: rank(0.90),
            p99_us: rank(0.99),
            p999_us: rank(0.999),
            max_us: us[us.len() - 1],
        })
    }

    /// One JSON object, with `name` and the rate by the mean (per second).
    pub fn json(&self, name: &str) -> String {
        format!(
            "{{\"name\":\"{name}\",\"n\":{},\"mean_us\":{:.1},\"p50_us\":{:.1},\"p90_us\":{:.1},\
             \"p99_us\":{:.1},\"p999_us\":{:.1},\"max_us\":{:.1},\"per_sec\":{:.1}}}",
            self.n,
            self.mean_us,
            self.p50_us,
            self.p90_us,
            self.p99_us,
            self.p999_us,
            self.max_us,
            1e6 / self.mean_us
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let samples: Vec<_> = (1..=1000).map(Duration::from_micros).collect();
        let t = Tail::of(&samples).expect("samples");
        assert_eq!((t.p50_us, t.p90_us, t.p99_us), (500.0, 900.0, 990.0));
        assert_eq!((t.p999_us, t.max_us, t.n), (999.0, 1000.0, 1000));
        assert!((t.mean_us - 500.5).abs() < 1e-9);
        assert!(Tail::of(&[]).is_none());
        let one = Tail::of(&[Duration::from_micros(7)]).expect("one");
        assert_eq!((one.p50_us, one.p99_us, one.max_us), (7.0, 7.0, 7.0));
    }
}
