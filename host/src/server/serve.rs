//! The HTTP accept loop of servers and of the proxy: hyper's HTTP/1 server with a deadline on
//! every request head, so a client that drips its headers (or sends none) is cut off and
//! counted instead of holding a connection for ever; shutdown lets requests in flight finish.

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::time::Duration;
use tokio::net::TcpListener;

/// How long a client may take to send a request's head (its line and headers), by default.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves `app` on `listener` until `shutdown` completes, then waits for the connections'
/// requests in flight to end.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    header_timeout: Duration,
    shutdown: impl Future<Output = ()>,
) {
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
        let _ = stream.set_nodelay(true);
        let conn = http1.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                if e.is_timeout() {
                    crate::server::metrics::http_refused("header_timeout");
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
