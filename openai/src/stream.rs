//! What both a server and the proxy stream: the response body that carries a stream's
//! server-sent events, and the reading of such a stream back into its chunks (for clients,
//! the proxy and tests).

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::sync::{mpsc, oneshot};

/// A `text/event-stream` response of `body`: a stream's events, whole or as they come
/// ([`Events`], [`EventsThen`]).
pub fn sse(body: impl Into<Body>) -> Response {
    ([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], body.into())
        .into_response()
}

/// A stream's events as a response body (the proxy's streams use it too).
pub struct Events(pub mpsc::Receiver<Bytes>);

impl futures_core::Stream for Events {
    type Item = Result<Bytes, std::convert::Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx).map(|e| e.map(Ok))
    }
}

/// [`Events`] that says when the connection has taken the first event: `first` is sent to
/// as the body hands it over, just before the connection writes it. The proxy starts decode's
/// request then (`--first-token prefill`), not before: on a busy machine decode's work could
/// otherwise take the core that the write to the client waits for.
pub struct EventsThen {
    events: Events,
    first: Option<oneshot::Sender<()>>,
}

impl EventsThen {
    /// The body of `events`, telling `first` when the first is taken.
    pub fn new(events: mpsc::Receiver<Bytes>, first: oneshot::Sender<()>) -> EventsThen {
        EventsThen { events: Events(events), first: Some(first) }
    }
}

impl futures_core::Stream for EventsThen {
    type Item = <Events as futures_core::Stream>::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let next = Pin::new(&mut self.events).poll_next(cx);
        if next.is_ready() {
            if let Some(first) = self.first.take() {
                // The waiting side may be gone (its task ended): nothing to tell.
                let _ = first.send(());
            }
        }
        next
    }
}

/// The data of each event of a stream, parsed; `None` when a chunk is not JSON or `[DONE]`
/// is missing.
pub fn events(stream: &str) -> Option<Vec<Value>> {
    let mut out = Vec::new();
    let mut done = false;
    for ev in stream.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let data = ev.trim().strip_prefix("data: ")?;
        if data == "[DONE]" {
            done = true;
            continue;
        }
        out.push(serde_json::from_str(data).ok()?);
    }
    done.then_some(out)
}

/// Each choice's text and token ids, joined from a stream's chunks, in `index` order (for
/// clients and tests); `None` as for [`collect_text`].
pub fn collect_choices(stream: &str) -> Option<Vec<(String, Vec<u32>)>> {
    let mut out: Vec<(String, Vec<u32>)> = Vec::new();
    for c in events(stream)? {
        for ch in c["choices"].as_array().into_iter().flatten() {
            let i = ch["index"].as_u64().unwrap_or(0) as usize;
            if out.len() <= i {
                out.resize(i + 1, Default::default());
            }
            if let Some(t) = ch["text"].as_str().or(ch["delta"]["content"].as_str()) {
                out[i].0.push_str(t);
            }
            if let Some(a) = ch["token_ids"].as_array() {
                out[i].1.extend(a.iter().filter_map(|t| t.as_u64().and_then(|n| u32::try_from(n).ok())));
            }
        }
    }
    Some(out)
}

/// The text a stream carries, joined from its chunks (choice 0's); `None` when a chunk is not
/// JSON or `[DONE]` is missing.
pub fn collect_text(stream: &str) -> Option<String> {
    Some(collect_choices(stream)?.into_iter().next().map(|c| c.0).unwrap_or_default())
}

/// The token ids a stream carries (choice 0's `token_ids`), joined; `None` as for
/// [`collect_text`]. Byte-level tokens that are not whole UTF-8 characters arrive as U+FFFD in
/// a chunk's text, so the ids are what to compare exactly.
pub fn collect_token_ids(stream: &str) -> Option<Vec<u32>> {
    Some(collect_choices(stream)?.into_iter().next().map(|c| c.1).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_core::Stream;
    use std::task::Waker;

    fn poll(s: &mut EventsThen) -> Poll<Option<Result<Bytes, std::convert::Infallible>>> {
        Pin::new(s).poll_next(&mut Context::from_waker(Waker::noop()))
    }

    #[test]
    fn the_first_event_taken_is_told_once_and_nothing_before() {
        let (tx, rx) = mpsc::channel(4);
        let (first, mut told) = oneshot::channel();
        let mut body = EventsThen::new(rx, first);
        assert!(poll(&mut body).is_pending());
        assert_eq!(told.try_recv(), Err(oneshot::error::TryRecvError::Empty), "nothing taken yet");
        tx.try_send(Bytes::from_static(b"data: 1\n\n")).unwrap();
        tx.try_send(Bytes::from_static(b"data: 2\n\n")).unwrap();
        assert!(matches!(poll(&mut body), Poll::Ready(Some(Ok(b))) if b == "data: 1\n\n"));
        assert_eq!(told.try_recv(), Ok(()));
        assert!(matches!(poll(&mut body), Poll::Ready(Some(Ok(b))) if b == "data: 2\n\n"));
        drop(tx);
        assert!(matches!(poll(&mut body), Poll::Ready(None)));
    }

    #[test]
    fn a_body_dropped_unread_tells_the_waiting_side_by_closing() {
        let (_tx, rx) = mpsc::channel::<Bytes>(1);
        let (first, mut told) = oneshot::channel();
        drop(EventsThen::new(rx, first));
        assert_eq!(told.try_recv(), Err(oneshot::error::TryRecvError::Closed));
    }
}
