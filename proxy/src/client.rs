//! The proxy's HTTP client to its servers: hyper-util's pooled HTTP/1.1 client, so requests
//! reuse kept-alive connections instead of opening one each.

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use std::sync::OnceLock;
use std::time::Duration;

/// Largest response body the client reads whole.
const MAX_RESPONSE: usize = 64 << 20;

/// Why a request to a server got no answer.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No connection, or the connection went away before any answer.
    #[error("cannot connect to {addr}: {reason}; is the worker running?")]
    Connect {
        /// The server's address.
        addr: String,
        /// What the connection attempt said.
        reason: String,
    },
    /// The connection broke or timed out.
    #[error("{addr} broke off the exchange: {reason}")]
    Io {
        /// The server's address.
        addr: String,
        /// What happened.
        reason: String,
    },
    /// The request could not be formed (a bad address or header).
    #[error("cannot send a request to {addr}: {reason}")]
    Request {
        /// The server's address.
        addr: String,
        /// What is wrong.
        reason: String,
    },
}

/// A response: status and body text.
#[derive(Debug, Clone)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    /// The body.
    pub body: String,
}

impl Reply {
    /// The body as JSON (`Value::String` of the raw text when it is not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|_| Value::String(self.body.clone()))
    }
}

/// One request to a server.
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    /// `host:port`.
    pub addr: &'a str,
    /// `GET` or `POST`.
    pub method: &'a str,
    /// The path, e.g. `/v1/completions`.
    pub path: &'a str,
    /// A JSON body.
    pub body: Option<&'a Value>,
    /// Extra headers.
    pub headers: &'a [(&'a str, &'a str)],
    /// Limit for the connection and the answer's head (and, streaming, each later piece).
    pub timeout: Duration,
}

impl<'a> Call<'a> {
    /// A call without extra headers.
    pub fn new(
        addr: &'a str,
        method: &'a str,
        path: &'a str,
        body: Option<&'a Value>,
        timeout: Duration,
    ) -> Self {
        Call { addr, method, path, body, headers: &[], timeout }
    }
}

/// How long a kept-alive connection to a server waits in the pool. Below every server's own
/// idle limit, so that the pool drops a connection before the server closes it under a
/// request sent on it: vLLM's API server closes one idle for 5 s
/// (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`), kvconnect's workers at their request-header deadline
/// (30 s by default).
pub const POOL_IDLE: Duration = Duration::from_secs(4);

fn client() -> &'static Client<HttpConnector, Full<Bytes>> {
    static CLIENT: OnceLock<Client<HttpConnector, Full<Bytes>>> = OnceLock::new();
    CLIENT.get_or_init(|| {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(Duration::from_secs(5)));
        Client::builder(TokioExecutor::new()).pool_idle_timeout(POOL_IDLE).build(http)
    })
}

/// Sends the request; returns the response with its body still to read.
async fn send(c: &Call<'_>) -> Result<hyper::Response<hyper::body::Incoming>, ClientError> {
    let bad = |reason: String| ClientError::Request { addr: c.addr.to_owned(), reason };
    let payload = c.body.map(Value::to_string).unwrap_or_default();
    let mut req = hyper::Request::builder()
        .method(c.method)
        .uri(format!("http://{}{}", c.addr, c.path))
        .header(hyper::header::CONTENT_TYPE, "application/json");
    for (k, v) in c.headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::from(payload))).map_err(|e| bad(e.to_string()))?;
    match tokio::time::timeout(c.timeout, client().request(req)).await {
        Err(_) => Err(ClientError::Io {
            addr: c.addr.to_owned(),
            reason: format!("no answer within {:?}", c.timeout),
        }),
        Ok(Err(e)) if e.is_connect() || dropped_unanswered(&e) => {
            Err(ClientError::Connect { addr: c.addr.to_owned(), reason: chain(&e) })
        }
        Ok(Err(e)) => Err(ClientError::Io { addr: c.addr.to_owned(), reason: chain(&e) }),
        Ok(Ok(r)) => Ok(r),
    }
}

/// The connection went away before any answer came (a server killed while a kept-alive
/// connection to it sat in the pool): reset, aborted, a broken pipe, or a message cut short.
fn dropped_unanswered(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut at: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = at {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::*;
            if matches!(io.kind(), ConnectionReset | ConnectionAborted | BrokenPipe | ConnectionRefused) {
                return true;
            }
        }
        if let Some(h) = err.downcast_ref::<hyper::Error>() {
            if h.is_canceled() || h.is_incomplete_message() {
                return true;
            }
        }
        at = err.source();
    }
    false
}

/// An error with its sources, as one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut at = e.source();
    while let Some(src) = at {
        s.push_str(": ");
        s.push_str(&src.to_string());
        at = src.source();
    }
    s
}

/// Sends one request and reads the whole answer within the call's timeout.
pub async fn call(c: Call<'_>) -> Result<Reply, ClientError> {
    let io = |reason: String| ClientError::Io { addr: c.addr.to_owned(), reason };
    let r = send(&c).await?;
    let status = r.status().as_u16();
    let body = http_body_util::Limited::new(r.into_body(), MAX_RESPONSE);
    let bytes = tokio::time::timeout(c.timeout, body.collect())
        .await
        .map_err(|_| io(format!("no whole answer within {:?}", c.timeout)))?
        .map_err(|e| io(chain(e.as_ref())))?
        .to_bytes();
    Ok(Reply { status, body: String::from_utf8_lossy(&bytes).into_owned() })
}

/// [`call`] without extra headers.
pub async fn request(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
    timeout: Duration,
) -> Result<Reply, ClientError> {
    call(Call::new(addr, method, path, body, timeout)).await
}

/// An answer whose body is still arriving: the status, and the body's bytes as they come, on
/// a channel that closes at the body's end (an `Err` item when the connection broke).
pub struct Streaming {
    /// HTTP status.
    pub status: u16,
    /// Body pieces as they arrive.
    pub body: tokio::sync::mpsc::Receiver<Result<Vec<u8>, ClientError>>,
}

/// Sends one request and returns once the response head is in; the body then streams on,
/// each piece within the call's timeout of the last.
pub async fn call_streaming(c: Call<'_>) -> Result<Streaming, ClientError> {
    let r = send(&c).await?;
    let status = r.status().as_u16();
    let mut body = r.into_body();
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let (addr, timeout) = (c.addr.to_owned(), c.timeout);
    tokio::spawn(async move {
        loop {
            let piece = match tokio::time::timeout(timeout, body.frame()).await {
                Err(_) => Err(ClientError::Io {
                    addr: addr.clone(),
                    reason: format!("no more of the answer within {timeout:?}"),
                }),
                Ok(None) => return,
                Ok(Some(Err(e))) => Err(ClientError::Io { addr: addr.clone(), reason: chain(&e) }),
                Ok(Some(Ok(frame))) => match frame.into_data() {
                    Ok(d) if d.is_empty() => continue,
                    Ok(d) => Ok(d.to_vec()),
                    Err(_) => continue, // trailers
                },
            };
            let last = piece.is_err();
            if tx.send(piece).await.is_err() || last {
                return;
            }
        }
    });
    Ok(Streaming { status, body: rx })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_closed_port_is_a_connect_error_and_answers_are_read_over_one_pooled_connection() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let closed = l.local_addr().unwrap().to_string();
        drop(l);
        let e = request(&closed, "GET", "/health", None, Duration::from_secs(2)).await.unwrap_err();
        assert!(matches!(e, ClientError::Connect { .. }), "{e}");
        assert!(e.to_string().contains("is the worker running?"), "{e}");

        // A server that counts its connections and answers keep-alive requests.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let conns = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = conns.clone();
        let app = axum::Router::new().route("/x", axum::routing::post(|b: String| async move { b }));
        tokio::spawn(async move {
            loop {
                let (s, _) = listener.accept().await.unwrap();
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let svc = hyper_util::service::TowerToHyperService::new(app.clone());
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                        .await;
                });
            }
        });
        for i in 0..5 {
            let body = serde_json::json!({"i": i});
            let r = call(Call {
                headers: &[("x-request-id", "abc")],
                ..Call::new(&addr, "POST", "/x", Some(&body), Duration::from_secs(5))
            })
            .await
            .unwrap();
            assert_eq!((r.status, r.json()), (200, body));
        }
        assert_eq!(conns.load(std::sync::atomic::Ordering::SeqCst), 1, "one kept-alive connection");
    }
}
