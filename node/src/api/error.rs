//! Every error the HTTP API can answer with, and the one place that maps each to an HTTP
//! status and OpenAI's error JSON (`{"error": {"message", "type", "param", "code"}}`),
//! including `EngineError`. Streams reuse `ApiError::body` for their in-band error event.
//! It does not log or count errors: the handlers' middleware and the metrics do that.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use crate::engine::EngineError;

/// A failed API request, as the client will see it.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ApiError {
    /// The body is not valid JSON or not a JSON object.
    #[error("could not parse the JSON body: {0}")]
    InvalidJson(String),
    /// A field has the wrong type or a value out of range.
    #[error("{message}")]
    InvalidRequest { message: String, param: Option<String> },
    /// A field OpenAI defines but shoal does not implement, set to a value that needs it.
    #[error("{message}")]
    Unsupported { param: String, message: String },
    /// A field neither OpenAI nor shoal defines.
    #[error("unrecognized request argument supplied: {0}")]
    UnknownParameter(String),
    /// The request names no model and none is loaded.
    #[error("no model is loaded: name one in `model` (see GET /v1/models)")]
    ModelRequired,
    /// The request names a model this node neither runs nor has on disk.
    #[error("the model `{model}` does not exist on this node (available: {available})")]
    ModelNotFound { model: String, available: String },
    /// The swarm cannot hold the model (the reason says by how much).
    #[error("the model `{model}` does not fit: {reason}")]
    ModelTooLarge { model: String, reason: String },
    /// Loading a model from disk failed.
    #[error("loading the model `{model}` failed: {reason}")]
    ModelLoad { model: String, reason: String },
    /// The prompt does not fit the model's context window.
    #[error("this model's context is {context} tokens but the prompt has {prompt_tokens}; shorten the prompt")]
    ContextLengthExceeded { prompt_tokens: usize, context: usize },
    /// The model ships no chat template (or it failed), so chat requests cannot be rendered.
    #[error("{0}")]
    ChatTemplate(String),
    /// `Authorization: Bearer <key>` is missing or wrong.
    #[error("missing or invalid API key: send `Authorization: Bearer <key>`")]
    Unauthorized,
    /// No route has this path.
    #[error("no such endpoint: {0}")]
    NoRoute(String),
    /// The wait queue is at its bound.
    #[error("the node is busy: {waiting} requests are already waiting; retry later")]
    QueueFull { waiting: usize },
    /// The request waited in the queue past its deadline.
    #[error("the request waited {waited_s:.0}s in the queue without starting; retry later")]
    QueueTimeout { waited_s: f64 },
    /// The node is shutting down.
    #[error("the node is shutting down")]
    ShuttingDown,
    /// The swarm could not run the request (a stage failed and no new plan took over in time).
    #[error("the swarm could not finish the request: {0}")]
    Swarm(String),
    /// Anything else inside the engine.
    #[error("internal error: {0}")]
    Internal(String),
}

/// The error's code, left on the response for the metrics middleware.
#[derive(Debug, Clone, Copy)]
pub struct ErrorCode(pub &'static str);

/// How long a client should wait before retrying a 503, in seconds.
pub const RETRY_AFTER_S: u64 = 2;

impl ApiError {
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::InvalidRequest { message: message.into(), param: Some(param.into()) }
    }

    pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::Unsupported { param: param.into(), message: message.into() }
    }

    /// HTTP status, OpenAI error type, `param` and `code`.
    fn parts(&self) -> (StatusCode, &'static str, Option<&str>, Option<&'static str>) {
        use ApiError::*;
        let bad = StatusCode::BAD_REQUEST;
        let invalid = "invalid_request_error";
        match self {
            InvalidJson(_) => (bad, invalid, None, Some("invalid_json")),
            InvalidRequest { param, .. } => (bad, invalid, param.as_deref(), Some("invalid_value")),
            Unsupported { param, .. } => (bad, invalid, Some(param.as_str()), Some("unsupported_parameter")),
            UnknownParameter(p) => (bad, invalid, Some(p.as_str()), Some("unknown_parameter")),
            ModelRequired => (bad, invalid, Some("model"), Some("model_required")),
            ModelNotFound { .. } => (StatusCode::NOT_FOUND, invalid, Some("model"), Some("model_not_found")),
            ModelTooLarge { .. } => (bad, invalid, Some("model"), Some("model_too_large")),
            ModelLoad { .. } => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", Some("model"), Some("model_load_failed")),
            ContextLengthExceeded { .. } => (bad, invalid, None, Some("context_length_exceeded")),
            ChatTemplate(_) => (bad, invalid, Some("messages"), Some("chat_template_unavailable")),
            Unauthorized => (StatusCode::UNAUTHORIZED, invalid, None, Some("invalid_api_key")),
            NoRoute(_) => (StatusCode::NOT_FOUND, invalid, None, Some("not_found")),
            QueueFull { .. } => (StatusCode::SERVICE_UNAVAILABLE, "server_error", None, Some("queue_full")),
            QueueTimeout { .. } => (StatusCode::SERVICE_UNAVAILABLE, "server_error", None, Some("queue_timeout")),
            ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, "server_error", None, Some("shutting_down")),
            Swarm(_) => (StatusCode::SERVICE_UNAVAILABLE, "server_error", None, Some("swarm_unavailable")),
            Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None, Some("internal_error")),
        }
    }

    pub fn status(&self) -> StatusCode {
        self.parts().0
    }

    /// The error's `code`, also the label under which metrics count it.
    pub fn code(&self) -> &'static str {
        self.parts().3.unwrap_or("error")
    }

    /// OpenAI's error object, as sent in a response body or a stream's error event.
    pub fn body(&self) -> Value {
        let (_, kind, param, code) = self.parts();
        json!({ "error": { "message": self.to_string(), "type": kind, "param": param, "code": code } })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let mut response = (status, axum::Json(self.body())).into_response();
        response.extensions_mut().insert(ErrorCode(self.code()));
        if status == StatusCode::SERVICE_UNAVAILABLE {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_S));
        }
        if status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::PromptTooLong { prompt_tokens, context } => ApiError::ContextLengthExceeded { prompt_tokens, context },
            EngineError::ChatTemplate(m) => ApiError::ChatTemplate(format!("{m} (chat template)")),
            EngineError::InvalidRequest(m) => ApiError::InvalidRequest { message: m, param: None },
            EngineError::ShutDown => ApiError::ShuttingDown,
            other => ApiError::Internal(other.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_errors_map_to_client_errors_where_the_client_is_at_fault() {
        let too_long: ApiError = EngineError::PromptTooLong { prompt_tokens: 10, context: 8 }.into();
        assert_eq!((too_long.status(), too_long.code()), (StatusCode::BAD_REQUEST, "context_length_exceeded"));
        let template: ApiError = EngineError::ChatTemplate("no template".into()).into();
        assert_eq!(template.status(), StatusCode::BAD_REQUEST);
        let compute: ApiError = EngineError::Shard("x".into()).into();
        assert_eq!(compute.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = ApiError::ModelNotFound { model: "m".into(), available: "a".into() }.body();
        assert_eq!(body["error"]["code"], "model_not_found");
        assert_eq!(body["error"]["param"], "model");
    }
}
