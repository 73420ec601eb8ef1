//! What the OpenAI routes (`/v1/...`) of a server and of the proxy check before their handler
//! runs: the API key, as vLLM's `--api-key` does it (`Authorization: Bearer <key>`; `/health`
//! and `/metrics` stay open, as vLLM's), and a bound on requests in flight, answered with 503
//! past it instead of queueing without limit. A request holds its place until its answer,
//! streamed or not, has been sent. The body is read here, whole, within a size limit (413
//! past it) and a deadline (408 past it), so no handler waits on a slow or endless upload.
//! And the whole request, body read, run and streamed answer, has one deadline: past it a
//! whole answer is 504, a stream ends with an error event, and the request is dropped, which
//! cancels its engine requests and frees their blocks (as a client that disconnects does).

use crate::error::{openai_error, openai_error_with_code};
use axum::body::Body;
use axum::body::{Bytes, HttpBody};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use http_body_util::BodyExt;
use hyper::body::Frame;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Environment variables read for the API key when no `--api-key` is given, in order.
pub const API_KEY_ENV: [&str; 2] = ["KVCONNECT_API_KEY", "VLLM_API_KEY"];

/// Requests in flight by default.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 512;

/// The largest request body taken by default (a prompt of token ids is well under it).
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;

/// How long a client may take to send a request's body, by default.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a whole request may run, by default: far above any generation of the reference
/// engine's 4096-token context.
pub const DEFAULT_RUN_TIMEOUT: Duration = Duration::from_secs(600);

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
    run_timeout: Duration,
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
            run_timeout: DEFAULT_RUN_TIMEOUT,
        }
    }

    /// Whole requests (body, run and streamed answer) of at most `timeout`.
    pub fn with_run_timeout(self, timeout: Duration) -> Gate {
        Gate { run_timeout: timeout, ..self }
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
        crate::metrics::http_refused("body_too_large");
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
            crate::metrics::http_refused("body_timeout");
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
                "missing or wrong API key: send 'Authorization: Bearer <key>' with the key this server was \
                    started with (--api-key)",
                None,
            );
        }
    }
    let deadline = tokio::time::Instant::now() + g.run_timeout;
    let Ok(permit) = g.in_flight.clone().try_acquire_owned() else {
        crate::metrics::http_refused("too_many_requests");
        return openai_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            format!(
                "{} requests are in flight, the most this server takes (--max-concurrent-requests); retry \
                    shortly",
                g.limit
            ),
            None,
        );
    };
    let req = match read_body(&g, req).await {
        Ok(r) => r,
        Err(answer) => return answer,
    };
    // Dropping the handler at the deadline drops its engine requests, which are cancelled.
    let Ok(answer) = tokio::time::timeout_at(deadline, next.run(req)).await else {
        return ran_too_long(&g);
    };
    let (parts, body) = answer.into_parts();
    if axum::body::HttpBody::size_hint(&body).exact().is_some() {
        // A whole answer: the work is done.
        return Response::from_parts(parts, body);
    }
    // A stream (SSE): the place is held until the body is done, cut or dropped.
    let sse = parts
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let last = sse.then(|| Bytes::from(format!("data: {}\n\n", run_timeout_error(&g))));
    let body = UntilDeadline {
        body: Some(body),
        deadline: Box::pin(tokio::time::sleep_until(deadline)),
        last,
        _permit: permit,
    };
    Response::from_parts(parts, Body::new(body))
}

/// What a request cut at its deadline is told, as OpenAI's error body.
fn run_timeout_error(g: &Gate) -> serde_json::Value {
    serde_json::json!({"error": {
        "message": format!(
            "the request ran past {} s, the most this server gives one (--request-timeout), and was ended",
            g.run_timeout.as_secs_f64()
        ),
        "type": "timeout_error",
        "param": null,
        "code": "request_run_timeout",
    }})
}

fn ran_too_long(g: &Gate) -> Response {
    crate::metrics::http_refused("run_timeout");
    let e = run_timeout_error(g);
    (StatusCode::GATEWAY_TIMEOUT, axum::Json(e)).into_response()
}

/// A streamed answer that ends at the request's deadline: the stream is dropped then (which
/// cancels its engine request), and an SSE client gets one last error event.
struct UntilDeadline {
    body: Option<Body>,
    deadline: Pin<Box<tokio::time::Sleep>>,
    last: Option<Bytes>,
    _permit: OwnedSemaphorePermit,
}

impl HttpBody for UntilDeadline {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let Some(body) = this.body.as_mut() else { return Poll::Ready(None) };
        if this.deadline.as_mut().poll(cx).is_ready() {
            this.body = None;
            crate::metrics::http_refused("run_timeout");
            tracing::warn!("HTTP: a streamed request ran past its deadline (--request-timeout); ended it");
            return Poll::Ready(this.last.take().map(|b| Ok(Frame::data(b))));
        }
        let next = Pin::new(body).poll_frame(cx);
        if matches!(next, Poll::Ready(None)) {
            this.body = None;
        }
        next
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_none()
    }
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

    /// One SSE event, then nothing more, ever.
    struct Forever(bool);

    impl HttpBody for Forever {
        type Data = Bytes;
        type Error = axum::Error;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
            let this = self.get_mut();
            if std::mem::replace(&mut this.0, true) {
                return Poll::Pending;
            }
            Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"data: {\"token\": 1}\n\n")))))
        }
    }

    #[tokio::test]
    async fn a_request_past_its_deadline_gets_504_and_a_stream_ends_with_an_error_event() {
        let r = Router::new()
            .route(
                "/v1/slow",
                get(|| async {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    "slow"
                }),
            )
            .route(
                "/v1/stream",
                get(|| async {
                    Response::builder()
                        .header(header::CONTENT_TYPE, "text/event-stream")
                        .body(Body::new(Forever(false)))
                        .unwrap()
                }),
            );
        let a = Gate::new(None, 1).with_run_timeout(Duration::from_millis(200)).wrap(r);
        let t0 = std::time::Instant::now();
        let slow = a.clone().oneshot(axum::http::Request::get("/v1/slow").body(Body::empty()).unwrap());
        let slow = slow.await.unwrap();
        assert_eq!(slow.status(), StatusCode::GATEWAY_TIMEOUT);
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        let e: serde_json::Value =
            serde_json::from_slice(&slow.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!(e["error"]["code"], "request_run_timeout", "{e}");
        assert!(e["error"]["message"].as_str().unwrap().contains("--request-timeout"), "{e}");
        let stream = a.clone().oneshot(axum::http::Request::get("/v1/stream").body(Body::empty()).unwrap());
        let stream = stream.await.unwrap();
        assert_eq!(stream.status(), StatusCode::OK);
        let body = tokio::time::timeout(Duration::from_secs(5), stream.into_body().collect())
            .await
            .expect("the stream was not cut at its deadline")
            .unwrap()
            .to_bytes();
        let text = String::from_utf8_lossy(&body);
        assert!(text.starts_with("data: {\"token\": 1}\n\ndata: {\"error\":"), "{text}");
        assert!(text.contains("request_run_timeout") && text.ends_with("\n\n"), "{text}");
        // The cut stream gave its place back.
        assert_eq!(status(&a, "/v1/stream", None).await, 200);
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
