//! Connections a consumer keeps to a producer sit idle between requests, and the producer
//! closes one that stays idle past its `idle_timeout` (a normal event on its side). So before
//! a kept connection is used again the consumer looks for that close ([`still_open`]), and
//! opens a new connection in its place. A close that lands between that look and the request
//! shows as the connection ending before any byte of the answer ([`send_and_await`]); the
//! consumer then sends the request once more, on a new connection ([`crate::puller::Streams::call`]).
//!
//! Sending again is safe for every request: `hold`, `pin` and `read` change nothing a second
//! one would undo (a lease renewed twice, bytes received into the same place twice),
//! and a `done` the producer had already applied is answered "already completed", a failed
//! load, never a false success. A producer that is really gone refuses the new connection,
//! which fails at once with the connect error.

use crate::wire::{write_frame, ClientMsg};
use std::io;
use std::net::TcpStream;

/// Whether `s`, kept idle, is still open with nothing waiting to be read. A producer sends
/// nothing unasked, so a connection that is closed (end of stream or reset) or that holds an
/// unread byte (out of step with the protocol) is not to be used again.
pub fn still_open(s: &TcpStream) -> bool {
    // One look that does not block (MSG_DONTWAIT) and leaves the byte (MSG_PEEK): nothing
    // waiting is the only answer that keeps the connection.
    let mut byte = [std::mem::MaybeUninit::<u8>::uninit(); 1];
    let looked = socket2::SockRef::from(s).recv_with_flags(&mut byte, libc::MSG_PEEK | libc::MSG_DONTWAIT);
    matches!(looked, Err(e) if e.kind() == io::ErrorKind::WouldBlock)
}

/// Whether `e`, of writing a request or of waiting for its answer, says the peer closed or
/// reset the connection.
pub fn is_closed(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::NotConnected
            | io::ErrorKind::UnexpectedEof
    )
}

/// Why no answer came.
#[derive(Debug)]
pub enum NoAnswer {
    /// The producer closed the connection before any byte of the answer arrived.
    Closed(io::Error),
    /// Any other socket error, a timeout included.
    Io(io::Error),
}

impl NoAnswer {
    fn of(e: io::Error) -> NoAnswer {
        if is_closed(&e) {
            NoAnswer::Closed(e)
        } else {
            NoAnswer::Io(e)
        }
    }
}

/// Sends `msg` on `s` and waits (up to the socket's read timeout) for the first byte of its
/// answer, leaving it unread.
pub fn send_and_await(s: &mut TcpStream, msg: &ClientMsg) -> Result<(), NoAnswer> {
    write_frame(s, msg).map_err(NoAnswer::of)?;
    await_answer(s)
}

/// Waits (up to the socket's read timeout) for the first byte of the answer to what was sent
/// on `s`, leaving it unread.
pub fn await_answer(s: &mut TcpStream) -> Result<(), NoAnswer> {
    match s.peek(&mut [0u8; 1]) {
        Ok(0) => Err(NoAnswer::Closed(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed by the producer before it answered",
        ))),
        Ok(_) => Ok(()),
        Err(e) => Err(NoAnswer::of(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;
    use std::time::{Duration, Instant};

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        (c, l.accept().unwrap().0)
    }

    /// Polls `still_open` until it says `want` (the peer's FIN takes a moment to arrive).
    fn settles(c: &TcpStream, want: bool) -> bool {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(5) {
            if still_open(c) == want {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    }

    #[test]
    fn an_idle_open_connection_is_kept_a_closed_or_unsynced_one_is_not() {
        let (c, s) = pair();
        assert!(still_open(&c));
        assert!(still_open(&c), "looking consumes nothing and leaves the socket blocking");
        assert!(c.read_timeout().unwrap().is_some());
        drop(s);
        assert!(settles(&c, false), "a connection the peer closed is seen closed");
        let (c, mut s) = pair();
        s.write_all(b"x").unwrap();
        assert!(settles(&c, false), "an unasked byte puts the connection out of step");
    }

    #[test]
    fn a_close_before_the_answer_is_told_from_a_timeout_and_from_an_answer() {
        let msg = ClientMsg::Hold { request: "r".into(), capability: "c".into() };
        let (mut c, s) = pair();
        drop(s);
        std::thread::sleep(Duration::from_millis(50));
        assert!(matches!(send_and_await(&mut c, &msg), Err(NoAnswer::Closed(_))));
        let (mut c, mut s) = pair();
        c.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        assert!(matches!(send_and_await(&mut c, &msg), Err(NoAnswer::Io(_))), "a silent peer times out");
        s.write_all(b"answer").unwrap();
        send_and_await(&mut c, &msg).unwrap();
        let mut first = [0u8; 1];
        std::io::Read::read_exact(&mut c, &mut first).unwrap();
        assert_eq!(&first, b"a", "the answer is left unread");
    }
}
