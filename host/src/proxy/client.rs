//! A minimal HTTP/1.1 client over tokio's TcpStream (one request per connection,
//! `Connection: close`), enough for the proxy to talk to its workers without a client crate.

use serde_json::Value;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest response the client reads.
const MAX_RESPONSE: usize = 64 << 20;

/// Why a request to a worker got no answer.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No connection.
    #[error("cannot connect to {addr}: {source}; is the worker running?")]
    Connect {
        /// The worker's address.
        addr: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The connection broke or timed out.
    #[error("{addr} broke off the exchange: {reason}")]
    Io {
        /// The worker's address.
        addr: String,
        /// What happened.
        reason: String,
    },
    /// The answer was not HTTP.
    #[error("{addr} answered something that is not an HTTP response")]
    Malformed {
        /// The worker's address.
        addr: String,
    },
}

/// A response: status and body text.
#[derive(Debug, Clone)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    /// The body (de-chunked).
    pub body: String,
}

impl Reply {
    /// The body as JSON (`Value::String` of the raw text when it is not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|_| Value::String(self.body.clone()))
    }
}

/// Connects within `timeout` and returns the stream with the request (head and JSON body)
/// to write on it.
async fn connect(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
    timeout: Duration,
) -> Result<(TcpStream, Vec<u8>), ClientError> {
    let s = tokio::time::timeout(timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| ClientError::Io {
            addr: addr.to_owned(),
            reason: format!("no connection within {timeout:?}"),
        })?
        .map_err(|source| ClientError::Connect { addr: addr.to_owned(), source })?;
    let payload = body.map(Value::to_string).unwrap_or_default();
    let mut message = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        payload.len()
    )
    .into_bytes();
    message.extend_from_slice(payload.as_bytes());
    Ok((s, message))
}

/// Sends one request and reads the whole answer within `timeout`.
pub async fn request(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
    timeout: Duration,
) -> Result<Reply, ClientError> {
    let io = |reason: String| ClientError::Io { addr: addr.to_owned(), reason };
    let (mut s, message) = connect(addr, method, path, body, timeout).await?;
    let exchange = async {
        s.write_all(&message).await?;
        let mut raw = Vec::new();
        (&mut s).take(MAX_RESPONSE as u64).read_to_end(&mut raw).await?;
        Ok::<_, std::io::Error>(raw)
    };
    let raw = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| io(format!("no answer within {timeout:?}")))?
        .map_err(|e| io(e.to_string()))?;
    parse(addr, &raw)
}

/// An answer whose body is still arriving: the status, and the body's bytes (de-chunked) as
/// they come, on a channel that closes at the body's end (an `Err` item when the connection
/// broke or the chunking was malformed).
pub struct Streaming {
    /// HTTP status.
    pub status: u16,
    /// Body pieces as they arrive.
    pub body: tokio::sync::mpsc::Receiver<Result<Vec<u8>, ClientError>>,
}

/// Sends one request and returns once the response head is in (within `timeout`); the body
/// then streams on, each read within `timeout` of the last.
pub async fn request_streaming(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
    timeout: Duration,
) -> Result<Streaming, ClientError> {
    let io = |reason: String| ClientError::Io { addr: addr.to_owned(), reason };
    let (mut s, message) = connect(addr, method, path, body, timeout).await?;
    let mut raw = Vec::new();
    let read_head = async {
        s.write_all(&message).await?;
        let mut buf = [0u8; 16384];
        loop {
            if let Some(at) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                return Ok::<_, std::io::Error>(at);
            }
            if raw.len() > MAX_RESPONSE {
                return Err(std::io::Error::other("the response head is too long"));
            }
            let n = s.read(&mut buf).await?;
            if n == 0 {
                return Err(std::io::Error::other("the connection closed before the response head"));
            }
            raw.extend_from_slice(&buf[..n]);
        }
    };
    let split = tokio::time::timeout(timeout, read_head)
        .await
        .map_err(|_| io(format!("no answer within {timeout:?}")))?
        .map_err(|e| io(e.to_string()))?;
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let status = head
        .strip_prefix("http/1.")
        .and_then(|h| h.split_whitespace().nth(1))
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| ClientError::Malformed { addr: addr.to_owned() })?;
    let chunked = head.contains("transfer-encoding: chunked");
    let rest = raw[split + 4..].to_vec();
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let addr = addr.to_owned();
    tokio::spawn(async move {
        let mut pending = rest;
        let mut buf = vec![0u8; 65536];
        loop {
            // Hand on what is complete so far.
            let piece = if chunked {
                match take_chunks(&mut pending) {
                    Ok((data, last)) => {
                        if !data.is_empty() && tx.send(Ok(data)).await.is_err() {
                            return;
                        }
                        if last {
                            return;
                        }
                        None
                    }
                    Err(()) => {
                        let _ = tx.send(Err(ClientError::Malformed { addr: addr.clone() })).await;
                        return;
                    }
                }
            } else {
                Some(std::mem::take(&mut pending))
            };
            if let Some(p) = piece.filter(|p| !p.is_empty()) {
                if tx.send(Ok(p)).await.is_err() {
                    return;
                }
            }
            match tokio::time::timeout(timeout, s.read(&mut buf)).await {
                Ok(Ok(0)) => return,
                Ok(Ok(n)) => pending.extend_from_slice(&buf[..n]),
                Ok(Err(e)) => {
                    let _ = tx.send(Err(ClientError::Io { addr: addr.clone(), reason: e.to_string() })).await;
                    return;
                }
                Err(_) => {
                    let reason = format!("no more of the answer within {timeout:?}");
                    let _ = tx.send(Err(ClientError::Io { addr: addr.clone(), reason })).await;
                    return;
                }
            }
        }
    });
    Ok(Streaming { status, body: rx })
}

/// Takes the complete chunks off the front of `b`: their data, and whether the last (empty)
/// chunk was among them. A size line that is not hex is an error.
fn take_chunks(b: &mut Vec<u8>) -> Result<(Vec<u8>, bool), ()> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(eol) = b[at..].windows(2).position(|w| w == b"\r\n") {
        let size_line = String::from_utf8_lossy(&b[at..at + eol]).into_owned();
        let size_hex = size_line.split(';').next().unwrap_or("").trim();
        let n = usize::from_str_radix(size_hex, 16).map_err(|_| ())?;
        let start = at + eol + 2;
        if n == 0 {
            b.drain(..start.min(b.len()));
            return Ok((out, true));
        }
        if b.len() < start + n + 2 {
            break;
        }
        out.extend_from_slice(&b[start..start + n]);
        at = start + n + 2;
    }
    b.drain(..at);
    Ok((out, false))
}

fn parse(addr: &str, raw: &[u8]) -> Result<Reply, ClientError> {
    let malformed = || ClientError::Malformed { addr: addr.to_owned() };
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or_else(malformed)?;
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let status = head
        .strip_prefix("http/1.")
        .and_then(|h| h.split_whitespace().nth(1))
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(malformed)?;
    let body = &raw[split + 4..];
    let body = if head.contains("transfer-encoding: chunked") {
        dechunk(body).ok_or_else(malformed)?
    } else {
        body.to_vec()
    };
    Ok(Reply { status, body: String::from_utf8_lossy(&body).into_owned() })
}

fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n")?;
        let size = std::str::from_utf8(&b[..eol]).ok()?.split(';').next()?.trim();
        let n = usize::from_str_radix(size, 16).ok()?;
        b = &b[eol + 2..];
        if n == 0 {
            return Some(out);
        }
        out.extend_from_slice(b.get(..n)?);
        b = b.get(n + 2..)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_taken_as_they_complete() {
        let mut b = b"3\r\nabc\r\n2\r\nd".to_vec();
        assert_eq!(take_chunks(&mut b), Ok((b"abc".to_vec(), false)));
        b.extend_from_slice(b"e\r\n0\r\n\r\n");
        assert_eq!(take_chunks(&mut b), Ok((b"de".to_vec(), true)));
        assert_eq!(take_chunks(&mut b"zz\r\n".to_vec()), Err(()));
    }

    #[test]
    fn parses_plain_and_chunked_answers() {
        let r = parse("a", b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}").unwrap();
        assert_eq!((r.status, r.body.as_str()), (200, "{}"));
        let r = parse(
            "a",
            b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!((r.status, r.body.as_str()), (404, "abcde"));
        assert!(parse("a", b"garbage").is_err());
        assert!(parse("a", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n").is_err());
    }
}
