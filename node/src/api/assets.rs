//! The web UI: whatever files `web/` holds at build time, embedded in the binary (release
//! builds; debug builds read `web/` from disk) and served at `/` with content types guessed
//! from their extensions; `/` and directory paths serve their `index.html`.
//! It does not template, compress or rewrite the files, and nothing under `/v1` comes from here.

use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

use super::error::ApiError;

#[derive(rust_embed::Embed)]
#[folder = "../web/"]
struct Web;

/// Serves an embedded file for GET and HEAD; the router's fallback.
pub async fn serve(method: Method, uri: Uri) -> Response {
    let path = uri.path().trim_start_matches('/');
    if path == "v1" || path.starts_with("v1/") {
        return ApiError::NoRoute(uri.path().to_string()).into_response();
    }
    if method != Method::GET && method != Method::HEAD {
        return StatusCode::METHOD_NOT_ALLOWED.into_response();
    }
    let candidates = if path.is_empty() || path.ends_with('/') { vec![format!("{path}index.html")] } else { vec![path.to_string(), format!("{path}/index.html")] };
    for name in candidates {
        if let Some(file) = Web::get(&name) {
            let mime = file.metadata.mimetype();
            let mut response = file.data.into_owned().into_response();
            let headers = response.headers_mut();
            if let Ok(v) = HeaderValue::from_str(mime) {
                headers.insert(header::CONTENT_TYPE, v);
            }
            // The UI changes with the binary: revalidate rather than serve a stale copy.
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            if let Ok(etag) = HeaderValue::from_str(&format!("\"{}\"", hex(&file.metadata.sha256_hash()[..12]))) {
                headers.insert(header::ETAG, etag);
            }
            return response;
        }
    }
    if path.is_empty() {
        return (StatusCode::NOT_FOUND, "this shoal binary was built without a web UI (web/index.html was missing)\n").into_response();
    }
    (StatusCode::NOT_FOUND, "not found\n").into_response()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The embedded file names, for tests and diagnostics.
pub fn embedded_files() -> Vec<String> {
    Web::iter().map(|f| f.into_owned()).collect()
}
