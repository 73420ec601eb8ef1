//! OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, as a response,
//! and the checks of a request body that answer with one.

use crate::params::ParamError;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

/// An OpenAI-style error response.
pub fn openai_error(
    status: StatusCode,
    kind: &str,
    message: impl Into<String>,
    param: Option<&str>,
) -> Response {
    let code = match status {
        StatusCode::NOT_FOUND => Some("model_not_found"),
        StatusCode::PAYLOAD_TOO_LARGE => Some("context_length_exceeded"),
        _ => None,
    };
    openai_error_with_code(status, kind, message, param, code)
}

/// [`openai_error`] with its `code` given.
pub fn openai_error_with_code(
    status: StatusCode,
    kind: &str,
    message: impl Into<String>,
    param: Option<&str>,
    code: Option<&str>,
) -> Response {
    (status, Json(json!({"error": {"message": message.into(), "type": kind, "param": param, "code": code}})))
        .into_response()
}

/// A refused or malformed parameter as OpenAI's error response.
pub fn param_error(e: ParamError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
    openai_error(status, "invalid_request_error", e.message, e.param)
}

/// The body as a JSON object, or the 400 to answer.
#[allow(clippy::result_large_err)]
pub fn json_object(raw: &[u8]) -> Result<Map<String, Value>, Response> {
    let bad = |m: String| openai_error(StatusCode::BAD_REQUEST, "invalid_request_error", m, None);
    match serde_json::from_slice(raw) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(bad("the body must be a JSON object".into())),
        Err(e) => Err(bad(format!("the body is not valid JSON: {e}"))),
    }
}
