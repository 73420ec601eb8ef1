//! `kvconnect proxy`'s own watch over its servers, which no supervisor restarts (under
//! `kvconnect up` the supervisor marks them instead): every server's `GET /health`, every
//! [`INTERVAL`]. A server whose process is gone (its connection refused or reset) or whose
//! engine died (vLLM answers 5xx) is marked down: the proxy no longer picks it, so no request
//! pays a refused connection first, and the KV router forgets the blocks it held. It is marked
//! up again once `/health` answers 200, as a restarted server does; the KV router then starts
//! its event stream afresh. A server that gives no answer within [`TIMEOUT`] (it accepts
//! connections but hangs) is marked down too. One that answers slowly within it, or without a
//! `/health` route, is left as it is.

use crate::backends::{Backend, Backends};
use crate::client::{self, ClientError, Reply};
use std::sync::Arc;
use std::time::Duration;

/// How often each server is asked.
pub const INTERVAL: Duration = Duration::from_secs(1);

/// How long one `/health` answer may take: a server that gives none within it hangs, and is
/// marked down. Long, so that a busy server is not dropped from the KV index for being slow,
/// and one that does not answer for a while (busy, or stopped by a benchmark) holds one
/// pending question rather than a queue of abandoned ones that it would answer all at once
/// when it goes on.
pub const TIMEOUT: Duration = Duration::from_secs(30);

/// What one `/health` exchange says of a server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// It answered 200.
    Up,
    /// Its process is gone, or its engine died: why.
    Down(String),
    /// Nothing certain (slow, or no such route): leave it as it is.
    Unsure,
}

/// The verdict on one `/health` exchange.
pub fn judge(r: &Result<Reply, ClientError>) -> Verdict {
    match r {
        Ok(r) if r.status == 200 => Verdict::Up,
        Ok(r) if r.status >= 500 => {
            let body: String = r.body.chars().take(200).collect();
            Verdict::Down(format!("GET /health answered {}: {}", r.status, body.trim()))
        }
        Ok(_) => Verdict::Unsure,
        Err(e @ ClientError::Connect { .. }) => Verdict::Down(format!("GET /health: {e}")),
        Err(_) => Verdict::Unsure,
    }
}

/// Asks `b` once and marks it as its answer, or no answer within `limit`, says.
async fn check_one(backends: &Backends, b: &Backend, key: Option<&str>, limit: Duration) {
    let bearer = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = bearer.iter().map(|a| ("authorization", a.as_str())).collect();
    // The exchange's own limits are longer: running out of `limit` is told apart here.
    let call =
        client::Call { headers: &headers, ..client::Call::new(&b.http, "GET", "/health", None, limit * 2) };
    let verdict = match tokio::time::timeout(limit, client::call(call)).await {
        Ok(r) => judge(&r),
        Err(_) => Verdict::Down(format!(
            "GET /health gave no answer within {limit:?}: the server accepts connections but hangs"
        )),
    };
    match (verdict, &b.down) {
        (Verdict::Down(why), None) => {
            tracing::warn!(
                server = %b.name,
                http = %b.http,
                "{} server down, not routed to until its /health answers 200: {why}",
                b.role
            );
            backends.set_down(&b.name, &why);
        }
        (Verdict::Up, Some(_)) => {
            tracing::info!(server = %b.name, http = %b.http, "{} server up again (/health answered 200)", b.role);
            backends.set_up(&b.name, &b.http);
        }
        _ => {}
    }
}

/// Checks every server every [`INTERVAL`], each in a task of its own (one slow server delays
/// no other), for as long as the task runs; dropping it stops them all.
pub async fn watch(backends: Arc<Backends>, key: Option<String>) {
    let mut tasks = tokio::task::JoinSet::new();
    for name in backends.all().into_iter().map(|b| b.name) {
        let (backends, key) = (backends.clone(), key.clone());
        tasks.spawn(async move {
            loop {
                let Some(b) = backends.all().into_iter().find(|b| b.name == name) else { return };
                check_one(&backends, &b, key.as_deref(), TIMEOUT).await;
                tokio::time::sleep(INTERVAL).await;
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_api::Role;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// One round of the watch: every server asked once, one after another.
    async fn check(backends: &Backends, key: Option<&str>) {
        for b in backends.all() {
            check_one(backends, &b, key, TIMEOUT).await;
        }
    }

    fn reply(status: u16, body: &str) -> Result<Reply, ClientError> {
        Ok(Reply { status, body: body.to_owned() })
    }

    #[test]
    fn only_a_gone_process_or_a_dead_engine_is_down() {
        assert_eq!(judge(&reply(200, "")), Verdict::Up);
        assert_eq!(
            judge(&reply(503, "{\"error\": \"EngineDeadError\"}")),
            Verdict::Down("GET /health answered 503: {\"error\": \"EngineDeadError\"}".into())
        );
        // A server without the route, or an exchange cut off by the client's own limit (which
        // `check_one` sets beyond its own: a hung server is told apart there), stays as it is.
        assert_eq!(judge(&reply(404, "not found")), Verdict::Unsure);
        let slow = Err(ClientError::Io { addr: "h:1".into(), reason: "no answer within 30s".into() });
        assert_eq!(judge(&slow), Verdict::Unsure);
        let gone = Err(ClientError::Connect { addr: "h:1".into(), reason: "connection refused".into() });
        assert!(matches!(judge(&gone), Verdict::Down(w) if w.contains("connection refused")));
    }

    /// A server answering `GET /health` with 200 on `listener`, each connection once.
    async fn healthy(listener: tokio::net::TcpListener) {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let _ =
                    s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").await;
            });
        }
    }

    #[tokio::test]
    async fn a_server_that_goes_away_is_marked_down_and_up_again_when_it_answers() {
        let live = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let live_addr = live.local_addr().unwrap().to_string();
        tokio::spawn(healthy(live));
        // A port that was bound and let go: nothing listens there.
        let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let gone_addr = gone.local_addr().unwrap().to_string();
        drop(gone);
        let b = Backends::new([
            (Role::Prefill, "prefill-0".to_owned(), live_addr.clone()),
            (Role::Prefill, "prefill-1".to_owned(), gone_addr.clone()),
        ]);
        check(&b, None).await;
        let all = b.all();
        assert_eq!(all[0].down, None);
        assert!(all[1].down.as_deref().is_some_and(|w| w.contains("GET /health")), "{:?}", all[1].down);
        // Never picked while down.
        for _ in 0..4 {
            assert_eq!(b.pick(Role::Prefill, &[]).unwrap(), live_addr);
        }
        // Still down, and not marked again (its generation stays), while it stays away.
        let generation = b.all()[1].generation;
        check(&b, None).await;
        assert_eq!(b.all()[1].generation, generation);
        // Back on the same address: up again, a new generation (the KV router restarts its stream).
        let back = tokio::net::TcpListener::bind(&gone_addr).await.unwrap();
        tokio::spawn(healthy(back));
        check(&b, None).await;
        let all = b.all();
        assert_eq!(all[1].down, None);
        assert_eq!(all[1].generation, generation + 1);
    }

    #[tokio::test]
    async fn a_server_that_accepts_but_never_answers_is_marked_down() {
        // Connections accepted and held open, nothing ever written back.
        let hung = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let hung_addr = hung.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = hung.accept().await {
                held.push(s);
            }
        });
        let b = Backends::new([(Role::Decode, "decode-0".to_owned(), hung_addr)]);
        let limit = Duration::from_millis(300);
        let t0 = std::time::Instant::now();
        check_one(&b, &b.all()[0], None, limit).await;
        assert!(t0.elapsed() < limit * 2, "the check waited {:?}", t0.elapsed());
        let down = b.all()[0].down.clone();
        assert!(down.as_deref().is_some_and(|w| w.contains("gave no answer within 300ms")), "{down:?}");
        assert!(b.pick(Role::Decode, &[]).is_err(), "a hung server is not picked");
    }
}
