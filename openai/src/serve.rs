//! The HTTP accept loop of servers and of the proxy: hyper's HTTP/1 server with a deadline on
//! every request head, so a client that drips its headers (or sends none) is cut off and
//! counted instead of holding a connection for ever, and a cap on open connections, past which
//! a new one is answered 503 and closed (counted); shutdown lets requests in flight finish.

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::time::Duration;
use tokio::net::TcpListener;

/// How long a client may take to send a request's head (its line and headers), by default.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(30);

/// Connections open at once, by default (kept-alive idle ones count).
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// What a connection past the cap is sent before it is closed.
fn over_cap_answer(cap: usize) -> Vec<u8> {
    let body = serde_json::json!({"error": {
        "message": format!("{cap} connections are open, the most this server takes (--max-connections); \
            retry shortly"),
        "type": "service_unavailable",
        "param": null,
        "code": null,
    }})
    .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: \
            {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Serves `app` on `listener`, at most `max_connections` connections at once, until
/// `shutdown` completes, then waits for the connections' requests in flight to end.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    header_timeout: Duration,
    max_connections: usize,
    shutdown: impl Future<Output = ()>,
) {
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1.timer(TokioTimer::new()).header_read_timeout(header_timeout);
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of descriptors, most likely: let connections end before accepting more.
                    tracing::warn!(error = %e, "HTTP accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            // A fresh socket's send buffer is empty: one non-blocking write sends the answer.
            if let Ok(mut s) = stream.into_std() {
                let _ = std::io::Write::write(&mut s, &over_cap_answer(max_connections));
            }
            crate::metrics::http_refused("too_many_connections");
            tracing::warn!(
                "HTTP: refused a connection past the cap of {max_connections} (--max-connections)"
            );
            continue;
        };
        let _ = stream.set_nodelay(true);
        let conn = http1.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(e) = conn.await {
                if e.is_timeout() {
                    crate::metrics::http_refused("header_timeout");
                    tracing::warn!(
                        "HTTP: closed a connection whose request head did not arrive whole within {} s",
                        header_timeout.as_secs_f64()
                    );
                } else {
                    tracing::debug!(error = %e, "HTTP connection ended with an error");
                }
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}
