//! What the OpenAI routes (`/v1/...`) of a server and of the proxy check before their handler
//! runs: the API key, as vLLM's `--api-key` does it (`Authorization: Bearer <key>`; `/health`
//! and `/metrics` stay open, as vLLM's), and a bound on requests in flight, answered with 503
//! past it instead of queueing without limit. A request holds its place until its answer,
//! streamed or not, has been sent. The body is read here, whole, within a size limit (413
//! past it) and a deadline (408 past it), so no handler waits on a slow or endless upload.

use crate::server::openai::{openai_error, openai_error_with_code};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use axum::Router;
use http_body_util::BodyExt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// Environment variables read for the API key when no `--api-key` is given, in order.
pub const API_KEY_ENV: [&str; 2] = ["KVCONNECT_API_KEY", "VLLM_API_KEY"];

/// Requests in flight by default.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 512;

/// The largest request body taken by default (a prompt of token ids is well under it).
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;

/// How long a client may take to send a request's body, by default.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// The key from `--api-key`, else from the environment; empty means none.
pub fn api_key(flag: Option<&str>) -> Option<String> {
    flag.map(str::to_owned)
        .or_else(|| API_KEY_ENV.iter().find_map(|k| std::env::var(k).ok()))
        .filter(|k| !k.is_empty())
}

/// The checks.
#[derive(Debug, Clone)]
pub struct Gate {
    api_key: Option<Arc<str>>,
    in_flight: Arc<Semaphore>,
    limit: usize,
    max_body: usize,
    body_timeout: Duration,
}

impl Gate {
    /// Requires `api_key` when given; at most `max_in_flight` requests at once; bodies within
    /// the default size and time.
    pub fn new(api_key: Option<String>, max_in_flight: usize) -> Gate {
        let limit = max_in_flight.max(1);
        Gate {
            api_key: api_key.map(Arc::from),
            in_flight: Arc::new(Semaphore::new(limit)),
            limit,
            max_body: DEFAULT_MAX_BODY_BYTES,
            body_timeout: DEFAULT_BODY_TIMEOUT,
        }
    }

    /// Bodies of at most `max_bytes`, sent within `timeout`.
    pub fn with_body_limits(self, max_bytes: usize, timeout: Duration) -> Gate {
        Gate { max_body: max_bytes, body_timeout: timeout, ..self }
    }

    /// `router` with the checks in front of its `/v1/` routes.
    pub fn wrap(self, router: Router) -> Router {
        // The gate reads `/v1/` bodies itself; other routes keep the same cap.
        let cap = axum::extract::DefaultBodyLimit::max(self.max_body);
        router.layer(axum::middleware::from_fn_with_state(self, check)).layer(cap)
    }
}

/// Reads the body whole: within the size limit and the deadline, else the OpenAI-style error
/// to answer (counted by reason).
async fn read_body(g: &Gate, req: Request) -> Result<Request, Response> {
    let too_large = |what: String| {
        crate::server::metrics::http_refused("body_too_large");
        openai_error_with_code(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("{what}; this server takes at most {} bytes (--max-request-body-bytes)", g.max_body),
            None,
            Some("request_too_large"),
        )
    };
    let declared =
        req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if let Some(n) = declared.filter(|n| *n > g.max_body as u64) {
        return Err(too_large(format!("the request body is {n} bytes")));
    }
    let (parts, body) = req.into_parts();
    let limited = http_body_util::Limited::new(body, g.max_body);
    match tokio::time::timeout(g.body_timeout, limited.collect()).await {
        Ok(Ok(b)) => Ok(Request::from_parts(parts, Body::from(b.to_bytes()))),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            Err(too_large("the request body is larger than the limit".into()))
        }
        Ok(Err(e)) => Err(openai_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!("the request body could not be read: {e}"),
            None,
        )),
        Err(_) => {
            crate::server::metrics::http_refused("body_timeout");
            Err(openai_error_with_code(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!(
                    "the request body did not arrive whole within {} s; send it at once",
                    g.body_timeout.as_secs_f64()
                ),
                None,
                Some("request_timeout"),
            ))
        }
    }
}

/// Compares in time independent of where the two differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// True when `authorization` carries `Bearer <key>`.
pub fn authorized(authorization: Option<&str>, key: &str) -> bool {
    authorization
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|given| same(given.trim().as_bytes(), key.as_bytes()))
}

async fn check(State(g): State<Gate>, req: Request, next: Next) -> Response {
    if !req.uri().path().starts_with("/v1/") {
        return next.run(req).await;
    }
    if let Some(key) = &g.api_key {
        let auth = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        if !authorized(auth, key) {
            return openai_error(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "missing or wrong API key: send 'Authorization: Bearer <key>' with the key this server was started with (--api-key)",
                None,
            );
        }
    }
    let Ok(permit) = g.in_flight.clone().try_acquire_owned() else {
        return openai_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            format!(
                "{} requests are in flight, the most this server takes (--max-concurrent-requests); retry shortly",
                g.limit
            ),
            None,
        );
    };
    let req = match read_body(&g, req).await {
        Ok(r) => r,
        Err(answer) => return answer,
    };
    let (parts, body) = next.run(req).await.into_parts();
    if axum::body::HttpBody::size_hint(&body).exact().is_some() {
        // A whole answer: the work is done.
        return Response::from_parts(parts, body);
    }
    // A stream (SSE): the place is held until the body is done or dropped.
    let body = body.map_frame(move |f| {
        let _held = &permit;
        f
    });
    Response::from_parts(parts, Body::new(body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tower::ServiceExt;

    fn app(key: Option<&str>, limit: usize) -> Router {
        let r = Router::new()
            .route("/v1/models", get(|| async { "models" }))
            .route(
                "/v1/slow",
                get(|| async {
                    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                    "slow"
                }),
            )
            .route("/health", get(|| async { "ok" }));
        Gate::new(key.map(str::to_owned), limit).wrap(r)
    }

    async fn status(app: &Router, path: &str, auth: Option<&str>) -> u16 {
        let mut req = axum::http::Request::builder().uri(path);
        if let Some(a) = auth {
            req = req.header(header::AUTHORIZATION, a);
        }
        app.clone().oneshot(req.body(Body::empty()).unwrap()).await.unwrap().status().as_u16()
    }

    #[tokio::test]
    async fn the_key_guards_v1_only() {
        let a = app(Some("s3cret"), 8);
        assert_eq!(status(&a, "/v1/models", None).await, 401);
        assert_eq!(status(&a, "/v1/models", Some("Bearer wrong")).await, 401);
        assert_eq!(status(&a, "/v1/models", Some("s3cret")).await, 401, "the Bearer scheme is required");
        assert_eq!(status(&a, "/v1/models", Some("Bearer s3cret")).await, 200);
        assert_eq!(status(&a, "/health", None).await, 200);
        assert_eq!(status(&app(None, 8), "/v1/models", None).await, 200);
    }

    #[tokio::test]
    async fn past_the_limit_requests_get_503_not_a_queue() {
        let a = app(None, 1);
        let slow = tokio::spawn({
            let a = a.clone();
            async move { status(&a, "/v1/slow", None).await }
        });
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert_eq!(status(&a, "/v1/models", None).await, 503);
        assert_eq!(slow.await.unwrap(), 200);
        assert_eq!(status(&a, "/v1/models", None).await, 200, "the place was given back");
    }
}
