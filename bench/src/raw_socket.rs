//! The raw-socket baseline of a tcp transfer: the same bytes streamed over as many loopback
//! connections at once as the tcp pull uses (each an equal share, as the pull cuts its runs),
//! every socket's buffers set as the connector sets its own, each byte sent once per round
//! from a buffer as large as the transfer. A round's time includes its streams' connects.

use kvconnect_support::host_buffer::HostBuffer;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The byte every round sends.
pub const SENT: u8 = 7;

/// A sender thread serving a fixed number of rounds, and the receiving buffer.
pub struct RawSocket {
    addr: SocketAddr,
    dst: HostBuffer,
    streams: usize,
    buffer: usize,
    sender: Option<JoinHandle<io::Result<()>>>,
}

impl RawSocket {
    /// A sender of `bytes` bytes per round for `rounds` rounds over `streams` connections,
    /// with `buffer`-byte socket buffers (0: the system's).
    pub fn start(bytes: usize, rounds: usize, streams: usize, buffer: usize) -> io::Result<RawSocket> {
        let streams = streams.max(1);
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let share = bytes.div_ceil(streams).max(1);
        let sender = std::thread::spawn(move || -> io::Result<()> {
            // As many bytes as the transfer, each sent once per round from its own place, as
            // the producer sends its regions (a small buffer sent again and again would stay
            // in cache and skip the memory reads the transfer pays).
            // Allocated as the engine allocates KV regions (huge pages where the kernel gives
            // them), as well placed as the regions the transfer sends.
            let mut src = HostBuffer::zeroed(bytes).map_err(io::Error::other)?;
            src.bytes_mut().fill(SENT);
            let src = Arc::new(src);
            for _ in 0..rounds {
                let mut conns = Vec::with_capacity(streams);
                for _ in 0..streams {
                    let (s, _) = listener.accept()?;
                    s.set_nodelay(true)?;
                    kvconnect_nixl::tcp_data::set_buffers(&s, buffer)?;
                    conns.push(s);
                }
                let sends: Vec<_> = conns
                    .into_iter()
                    .enumerate()
                    .map(|(i, mut s)| {
                        let src = src.clone();
                        std::thread::spawn(move || -> io::Result<()> {
                            let src = src.bytes();
                            let from = (i * share).min(src.len());
                            s.write_all(&src[from..(from + share).min(src.len())])
                        })
                    })
                    .collect();
                for h in sends {
                    h.join().map_err(|_| io::Error::other("a raw-socket baseline sender panicked"))??;
                }
            }
            Ok(())
        });
        let mut dst = HostBuffer::zeroed(bytes).map_err(io::Error::other)?;
        dst.bytes_mut().fill(1);
        Ok(RawSocket { addr, dst, streams, buffer, sender: Some(sender) })
    }

    /// The streams of one round.
    pub fn streams(&self) -> usize {
        self.streams
    }

    /// One round: connects the streams and receives every share at once; its time.
    pub fn measure(&mut self) -> io::Result<Duration> {
        let t = Instant::now();
        let mut conns = Vec::with_capacity(self.streams);
        for _ in 0..self.streams {
            conns.push(kvconnect_nixl::tcp_data::connect(self.addr, Duration::from_secs(10), self.buffer)?);
        }
        let share = self.dst.bytes().len().div_ceil(self.streams).max(1);
        std::thread::scope(|scope| -> io::Result<()> {
            let recvs: Vec<_> = conns
                .iter_mut()
                .zip(self.dst.bytes_mut().chunks_mut(share))
                .map(|(s, d)| scope.spawn(move || s.read_exact(d)))
                .collect();
            for h in recvs {
                h.join().map_err(|_| io::Error::other("a raw-socket baseline receiver panicked"))??;
            }
            Ok(())
        })?;
        Ok(t.elapsed())
    }

    /// What the last round received (every byte [`SENT`] once a round has run).
    pub fn received(&self) -> &[u8] {
        self.dst.bytes()
    }

    /// Waits for the sender, which ends after its last round, and returns its error if any.
    /// Call it only once every round has been received.
    pub fn finish(&mut self) -> io::Result<()> {
        match self.sender.take() {
            Some(h) => h.join().map_err(|_| io::Error::other("the raw-socket baseline sender panicked"))?,
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_round_delivers_every_byte_over_every_stream() {
        let mut s = RawSocket::start(1 << 20, 2, 3, 0).unwrap();
        for _ in 0..2 {
            s.measure().unwrap();
            assert!(s.received().iter().all(|b| *b == SENT));
        }
        s.finish().unwrap();
    }
}
