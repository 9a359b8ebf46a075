//! `POST /v1/models/pull {"model": name, "file"?, "revision"?}`: starts a background pull
//! (peers attached with `Server::attach_net` first, then the hub of `HF_ENDPOINT`/`HF_TOKEN`)
//! and answers 202 at once; progress and failures show in `/v1/cluster` `downloads`. A second
//! request for a name already being pulled joins it. Pulls stop when the server shuts down.
//! `GET /v1/catalogue` lists the models shoal knows before any download, each marked `local`
//! when this node has it. It knows HTTP and JSON only; `models` does the work.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::error::ApiError;
use super::App;
use crate::models::hub::{HubClient, HubConfig};
use crate::models::peer::PeerSource;
use crate::models::{self, PullRequest, Sources};

pub async fn catalogue(State(app): State<Arc<App>>) -> Json<Value> {
    let store = app.store.clone();
    let local = tokio::task::spawn_blocking(move || store.held()).await.unwrap_or_default();
    let data: Vec<Value> = models::catalogue::MODELS
        .iter()
        .map(|m| {
            let mut v = serde_json::to_value(m).unwrap_or(Value::Null);
            v["local"] = Value::Bool(local.iter().any(|id| id == m.id));
            v
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}

pub async fn pull_model(State(app): State<Arc<App>>, body: Bytes) -> Result<Response, ApiError> {
    let v: Value = serde_json::from_slice(&body).map_err(|e| ApiError::InvalidJson(e.to_string()))?;
    let Some(fields) = v.as_object() else { return Err(ApiError::InvalidJson("the body must be a JSON object".into())) };
    if let Some(k) = fields.keys().find(|k| !["model", "file", "revision"].contains(&k.as_str())) {
        return Err(ApiError::UnknownParameter(k.clone()));
    }
    let text = |k: &str| -> Result<Option<String>, ApiError> {
        match fields.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
            Some(_) => Err(ApiError::invalid(k, format!("{k} must be a non-empty string"))),
        }
    };
    let name = text("model")?.ok_or_else(|| ApiError::invalid("model", "model must name a catalogue id or a hub repo (owner/name)"))?;
    let mut req = PullRequest::new(&name);
    req.file = text("file")?;
    if let Some(r) = text("revision")? {
        req.revision = r;
    }
    {
        let mut running = app.pulls.lock().unwrap_or_else(|p| p.into_inner());
        if !running.insert(name.clone()) {
            return Ok((StatusCode::ACCEPTED, Json(json!({"status": "downloading", "model": name}))).into_response());
        }
    }
    let hub = HubClient::new(HubConfig::from_env()).map_err(|e| ApiError::Internal(e.to_string()))?;
    let task_app = app.clone();
    tokio::spawn(async move {
        let net = task_app.net.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let peers = match net {
            Some(net) => match net.connected_peers().await {
                Ok(connected) if !connected.is_empty() => Some(PeerSource::new(net, connected.into_iter().map(|(p, _)| p).collect())),
                _ => None,
            },
            None => None,
        };
        let sources = Sources { hub: Some(hub), peers };
        std::fs::create_dir_all(task_app.store.models_dir()).ok();
        match models::pull(&task_app.store, &req, &sources, &task_app.progress, &task_app.pull_cancel).await {
            Ok(outcome) => tracing::info!(target: "shoal::models", model = %outcome.model.id, from_hub = outcome.from_hub, from_peers = outcome.from_peers, "pulled"),
            // The failure stays visible in `/v1/cluster` `downloads` through the progress registry.
            Err(e) => tracing::warn!(target: "shoal::models", model = %req.name, error = %e, "pull failed"),
        }
        task_app.pulls.lock().unwrap_or_else(|p| p.into_inner()).remove(&req.name);
    });
    Ok((StatusCode::ACCEPTED, Json(json!({"status": "downloading", "model": name}))).into_response())
}
