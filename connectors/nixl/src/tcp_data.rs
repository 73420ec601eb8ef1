//! Backend tcp's data path: sockets with large buffers, the producer's vectored send straight
//! out of the KV regions, and the consumer's receive of one stream's share straight into its
//! destination blocks. A large pull is cut into shares received on parallel streams
//! (`copy_plan::split_runs`), each an authenticated connection of its own.

use crate::idle_link::NoAnswer;
use crate::wire::{read_frame, ClientMsg, FrameError, ServerMsg};
use socket2::{Domain, Protocol, SockRef, Socket, Type};
use std::io::{self, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Default of `tcp_socket_buffer`: each data socket's send and receive buffer, in bytes (the
/// kernel caps it at `net.core.wmem_max` / `rmem_max`).
pub const DEFAULT_SOCKET_BUFFER: usize = 4 << 20;

/// Default of `tcp_stream_min_bytes`, the least a parallel stream carries: a pull of fewer
/// bytes than two of these uses one stream (opening more costs more than it saves).
pub const STREAM_MIN_BYTES: u64 = 64 << 20;

/// Default of `tcp_streams`: one stream per two cores (each stream keeps a sending and a
/// receiving core busy on loopback), at least one, at most 4.
pub fn default_tcp_streams() -> usize {
    (std::thread::available_parallelism().map_or(1, |n| n.get()) / 2).clamp(1, 4)
}

/// How many streams a pull of `bytes` uses when `streams` are allowed, each carrying at
/// least `min_bytes`.
pub fn streams_for(bytes: u64, streams: usize, min_bytes: u64) -> usize {
    let most = usize::try_from(bytes / min_bytes.max(1)).unwrap_or(usize::MAX);
    streams.clamp(1, most.max(1))
}

/// Sets a socket's send and receive buffers to `bytes`; 0 leaves the kernel's autotuning.
pub fn set_buffers(stream: &TcpStream, bytes: usize) -> io::Result<()> {
    if bytes > 0 {
        let s = SockRef::from(stream);
        s.set_send_buffer_size(bytes)?;
        s.set_recv_buffer_size(bytes)?;
    }
    Ok(())
}

/// Connects to `addr` with buffers of `bytes` set before the handshake (so the window scale
/// agreed on can use them), `TCP_NODELAY` on.
pub fn connect(addr: SocketAddr, timeout: Duration, bytes: usize) -> io::Result<TcpStream> {
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    if bytes > 0 {
        s.set_send_buffer_size(bytes)?;
        s.set_recv_buffer_size(bytes)?;
    }
    s.connect_timeout(&addr.into(), timeout)?;
    s.set_tcp_nodelay(true)?;
    Ok(s.into())
}

/// Writes every byte of `bufs` with as few `writev` calls as the socket takes.
pub fn write_all_vectored<W: Write>(w: &mut W, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "the peer takes no more bytes")),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Why one stream's share was not received.
#[derive(Debug, thiserror::Error)]
pub enum ShareError {
    /// Asking, or reading the answer's frame.
    #[error("{0}")]
    Frame(#[from] FrameError),
    /// Reading the block bytes.
    #[error("{0}")]
    Io(io::Error),
    /// The producer closed the connection before any byte of the answer arrived.
    #[error("{0}")]
    Closed(io::Error),
    /// The producer refused the read.
    #[error("{0}")]
    Refused(String),
    /// The producer answered out of protocol.
    #[error("{0}")]
    Protocol(String),
}

/// Asks for one share (`read`, whose runs are the views' sources in order) on `stream` and
/// receives its bytes straight into `views`. `cap` bounds the answer's frame.
pub fn receive_share(
    stream: &mut TcpStream,
    read: &ClientMsg,
    views: Vec<&mut [u8]>,
    cap: usize,
) -> Result<(), ShareError> {
    let want: u64 = views.iter().map(|v| v.len() as u64).sum();
    match crate::idle_link::send_and_await(stream, read) {
        Ok(()) => {}
        Err(NoAnswer::Closed(e)) => return Err(ShareError::Closed(e)),
        Err(NoAnswer::Io(e)) => return Err(ShareError::Frame(FrameError::Io(e))),
    }
    match read_frame::<_, ServerMsg>(stream, cap)? {
        ServerMsg::Data { bytes } if bytes == want => {}
        ServerMsg::Error { reason } => return Err(ShareError::Refused(reason)),
        other => return Err(ShareError::Protocol(format!("answered {other:?} to a read of {want} bytes"))),
    }
    for v in views {
        stream.read_exact(v).map_err(ShareError::Io)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that takes at most 5 bytes per call, and none on every third call.
    struct Trickle {
        got: Vec<u8>,
        calls: usize,
    }

    impl Write for Trickle {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.write_vectored(&[IoSlice::new(buf)])
        }

        fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
            self.calls += 1;
            if self.calls.is_multiple_of(3) {
                return Err(io::Error::new(io::ErrorKind::Interrupted, "signal"));
            }
            let mut n = 0;
            for b in bufs {
                let take = b.len().min(5 - n);
                self.got.extend_from_slice(&b[..take]);
                n += take;
                if n == 5 {
                    break;
                }
            }
            Ok(n)
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn vectored_writes_deliver_every_byte_in_order_across_partial_writes() {
        let parts: [&[u8]; 4] = [b"", b"abcdefg", b"hi", b"jklmnopqrstuvwxyz"];
        let mut bufs: Vec<IoSlice> = parts.iter().map(|p| IoSlice::new(p)).collect();
        let mut w = Trickle { got: Vec::new(), calls: 0 };
        write_all_vectored(&mut w, &mut bufs).unwrap();
        assert_eq!(w.got, b"abcdefghijklmnopqrstuvwxyz");
    }

    #[test]
    fn a_writer_that_takes_nothing_is_an_error_not_a_loop() {
        struct Full;
        impl Write for Full {
            fn write(&mut self, _: &[u8]) -> io::Result<usize> {
                Ok(0)
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let e = write_all_vectored(&mut Full, &mut [IoSlice::new(b"x")]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WriteZero);
    }

    #[test]
    fn small_pulls_use_one_stream_large_ones_up_to_the_setting() {
        let m = STREAM_MIN_BYTES;
        assert_eq!(streams_for(0, 4, m), 1);
        assert_eq!(streams_for(m * 2 - 1, 4, m), 1);
        assert_eq!(streams_for(m * 2, 4, m), 2);
        assert_eq!(streams_for(m * 100, 4, m), 4);
        assert_eq!(streams_for(m * 100, 0, m), 1);
        assert_eq!(streams_for(10, 4, 0), 4);
        assert!((1..=4).contains(&default_tcp_streams()));
    }

    #[test]
    fn buffers_are_set_on_both_ends() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = connect(l.local_addr().unwrap(), Duration::from_secs(5), 1 << 20).unwrap();
        let (s, _) = l.accept().unwrap();
        set_buffers(&s, 1 << 20).unwrap();
        // Linux doubles what it is asked for (bookkeeping) after capping it at the sysctl.
        let cap = |f: &str| -> usize {
            std::fs::read_to_string(f).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(usize::MAX)
        };
        let want_rcv = (1usize << 20).min(cap("/proc/sys/net/core/rmem_max"));
        let want_snd = (1usize << 20).min(cap("/proc/sys/net/core/wmem_max"));
        assert!(SockRef::from(&c).recv_buffer_size().unwrap() >= want_rcv);
        assert!(SockRef::from(&s).send_buffer_size().unwrap() >= want_snd);
        assert!(c.nodelay().unwrap());
    }
}
