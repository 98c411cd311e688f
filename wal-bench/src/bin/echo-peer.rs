//! A zero-cost echo peer: the other end of the `echo_rtt` bench (`benches/e2e.rs`), which
//! measures what one loopback round trip between two processes costs on this machine, the part
//! of an end-to-end commit that is not the disk.
//!
//! Listens on 127.0.0.1 (an ephemeral port, printed as the first line of stdout) and answers
//! every length-prefixed frame (4-byte big-endian length, then that many bytes) it reads with
//! a 64-byte reply, the size of a safekeeper's AppendResponse frame. One thread per
//! connection, blocking I/O, `TCP_NODELAY`: nothing between the two kernels' wake-ups but a
//! `read` and a `write`. Exits when stdin closes (its parent is gone).

use std::io::{self, BufRead, Read, Write};
use std::net::{TcpListener, TcpStream};

/// Bytes of every reply.
const REPLY: usize = 64;
/// The largest frame accepted.
const MAX_FRAME: usize = 1 << 20;

fn main() -> io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    println!("{}", listener.local_addr()?.port());
    io::stdout().flush()?;
    std::thread::spawn(|| {
        // Our parent holds our stdin: EOF means it has exited.
        let _ = io::stdin().lock().fill_buf();
        std::process::exit(0);
    });
    for stream in listener.incoming() {
        let stream = stream?;
        std::thread::spawn(move || {
            if let Err(e) = serve(stream) {
                eprintln!("echo-peer: {e}");
            }
        });
    }
    Ok(())
}

fn serve(mut s: TcpStream) -> io::Result<()> {
    s.set_nodelay(true)?;
    let mut len = [0u8; 4];
    let mut frame = Vec::new();
    let reply = [0u8; REPLY];
    loop {
        match s.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let n = u32::from_be_bytes(len) as usize;
        if n > MAX_FRAME {
            return Err(io::Error::other(format!("frame of {n} bytes")));
        }
        frame.resize(n, 0);
        s.read_exact(&mut frame)?;
        s.write_all(&reply)?;
    }
}
