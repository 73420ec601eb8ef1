//! Request ids as vLLM forms them: the base is the `X-Request-Id` header when a client (or a
//! P/D proxy) sends one, else the body's `request_id`, else a fresh one; the engine's id is
//! `cmpl-<base>` (`chatcmpl-<base>` for chat). A P/D proxy that sends prefill and decode the
//! same header therefore gets the same id on both sides.

use axum::http::HeaderMap;
use serde_json::Value;

/// The header vLLM's servers and P/D proxies use.
pub const HEADER: &str = "x-request-id";

/// Longest base id accepted.
const MAX_LEN: usize = 256;

/// The engine request id for a request, or why its id cannot be used.
pub fn engine_request_id(
    headers: &HeaderMap,
    body_id: Option<&Value>,
    chat: bool,
    fresh: impl FnOnce() -> String,
) -> Result<String, String> {
    let base = match (headers.get(HEADER), body_id) {
        (Some(h), _) => {
            let s = h.to_str().map_err(|_| "the X-Request-Id header is not visible ASCII".to_owned())?;
            checked(s, "the X-Request-Id header")?
        }
        (None, Some(Value::String(s))) => checked(s, "'request_id'")?,
        (None, None | Some(Value::Null)) => fresh(),
        (None, Some(other)) => return Err(format!("'request_id' must be a string, not {other}")),
    };
    Ok(format!("{}-{base}", if chat { "chatcmpl" } else { "cmpl" }))
}

fn checked(s: &str, what: &str) -> Result<String, String> {
    let s = s.trim();
    if s.is_empty() {
        return Err(format!("{what} is empty; send a unique id or none"));
    }
    if s.len() > MAX_LEN {
        return Err(format!("{what} is {} bytes long; at most {MAX_LEN} are accepted", s.len()));
    }
    if let Some(c) = s.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(format!("{what} contains {c:?}; use visible ASCII characters only"));
    }
    Ok(s.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn headers(id: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(HEADER, id.parse().unwrap());
        h
    }

    #[test]
    fn the_header_wins_then_the_body_then_a_fresh_id() {
        let fresh = || "e0-7".to_owned();
        let h = headers("3f2a-uuid");
        assert_eq!(engine_request_id(&h, Some(&json!("body")), false, fresh).unwrap(), "cmpl-3f2a-uuid");
        assert_eq!(engine_request_id(&h, None, true, fresh).unwrap(), "chatcmpl-3f2a-uuid");
        let none = HeaderMap::new();
        assert_eq!(engine_request_id(&none, Some(&json!("mine")), false, fresh).unwrap(), "cmpl-mine");
        assert_eq!(engine_request_id(&none, None, false, fresh).unwrap(), "cmpl-e0-7");
        assert_eq!(engine_request_id(&none, Some(&Value::Null), false, fresh).unwrap(), "cmpl-e0-7");
    }

    #[test]
    fn unusable_ids_are_refused_naming_where_they_came_from() {
        let fresh = || "x".to_owned();
        let e = engine_request_id(&headers("a b"), None, false, fresh).unwrap_err();
        assert!(e.contains("X-Request-Id") && e.contains("visible ASCII"), "{e}");
        let e = engine_request_id(&HeaderMap::new(), Some(&json!(5)), false, fresh).unwrap_err();
        assert!(e.contains("'request_id' must be a string"), "{e}");
        let e =
            engine_request_id(&HeaderMap::new(), Some(&json!("x".repeat(300))), false, fresh).unwrap_err();
        assert!(e.contains("300 bytes"), "{e}");
        let e = engine_request_id(&HeaderMap::new(), Some(&json!("  ")), false, fresh).unwrap_err();
        assert!(e.contains("empty"), "{e}");
    }
}
