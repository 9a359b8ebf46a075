//! What this node says about itself: `/v1/models` (loaded and local models, and whether each
//! fits the memory offered), `/v1/models/load`, `/v1/cluster` (one node, its measured figures,
//! its single-stage plan and its downloads) and `/health`. Memory comes from the OS, capped by
//! `--memory-limit`. It holds no state of its own: it reads the scheduler's published view.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::models::LocalModel;
use super::error::ApiError;
use super::scheduler::SchedulerState;
use super::App;
use crate::engine::model::WeightFormat;

/// Physical memory now, in bytes: (total, available).
fn system_memory() -> (u64, u64) {
    let mut system = sysinfo::System::new();
    system.refresh_memory();
    (system.total_memory(), system.available_memory())
}

/// Memory this node offers: (total, available), both capped by `--memory-limit`; the loaded
/// model counts against the limit.
pub fn offered_memory(limit: Option<u64>, loaded_bytes: u64) -> (u64, u64) {
    let (total, available) = system_memory();
    match limit {
        Some(l) => (l.min(total), available.min(l.saturating_sub(loaded_bytes))),
        None => (total, available),
    }
}

impl App {
    /// Refuses a model larger than the memory this node may ever offer (`--memory-limit`, or
    /// the machine's RAM). Less free memory right now only makes `fits` false: a user may load anyway.
    pub(super) fn check_fits(&self, model: &LocalModel) -> Result<(), ApiError> {
        let (total, _) = offered_memory(self.config.memory_limit, 0);
        if model.size_bytes > total {
            return Err(ApiError::ModelTooLarge { model: model.id.clone(), size: model.size_bytes, offered: total });
        }
        Ok(())
    }

    /// Memory a model could have now: loading replaces the loaded model, whose memory comes back.
    fn room_for_a_model(&self, state: &SchedulerState) -> u64 {
        let loaded = state.loaded.as_ref().map_or(0, |l| l.model.size_bytes);
        let (total, available) = offered_memory(self.config.memory_limit, loaded);
        total.min(available + loaded)
    }

    /// Every model this node can serve: the loaded one first, then the rest on disk.
    async fn model_list(self: &Arc<Self>) -> Vec<Value> {
        let app = self.clone();
        tokio::task::spawn_blocking(move || {
            let state = app.scheduler.state();
            let loaded = state.loaded.as_ref().map(|l| &l.model);
            let room = app.room_for_a_model(&state);
            let mut models = app.store.scan();
            if let Some(l) = loaded {
                models.retain(|m| m.path != l.path);
                models.insert(0, l.clone());
            }
            models
                .iter()
                .map(|m| {
                    let is_loaded = loaded.is_some_and(|l| l.path == m.path);
                    let details = app.store.details(m);
                    let created = std::fs::metadata(&m.path).and_then(|md| md.modified()).ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or(0, |d| d.as_secs());
                    json!({
                        "id": m.id, "object": "model", "created": created, "owned_by": "shoal",
                        "shoal": {
                            "loaded": is_loaded, "size_bytes": m.size_bytes, "fits": is_loaded || m.size_bytes <= room,
                            "family": details.family, "layers": details.layers,
                            "format": match m.format { WeightFormat::Gguf => "gguf", WeightFormat::Safetensors => "safetensors" },
                            "path": m.path.display().to_string(),
                        }
                    })
                })
                .collect()
        })
        .await
        .unwrap_or_default()
    }
}

pub async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

pub async fn list_models(State(app): State<Arc<App>>) -> Json<Value> {
    Json(json!({"object": "list", "data": app.model_list().await}))
}

pub async fn get_model(State(app): State<Arc<App>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let models = app.model_list().await;
    let available = models.iter().filter_map(|m| m["id"].as_str()).collect::<Vec<_>>().join(", ");
    models.iter().find(|m| m["id"] == id.as_str()).cloned().map(Json).ok_or(ApiError::ModelNotFound { model: id, available })
}

/// `POST /v1/models/load {"model": id}`: 202 while it loads, 200 when it already is loaded.
pub async fn load_model(State(app): State<Arc<App>>, body: Bytes) -> Result<Response, ApiError> {
    let v: Value = serde_json::from_slice(&body).map_err(|e| ApiError::InvalidJson(e.to_string()))?;
    let Some(fields) = v.as_object() else { return Err(ApiError::InvalidJson("the body must be a JSON object".into())) };
    if let Some(k) = fields.keys().find(|k| *k != "model") {
        return Err(ApiError::UnknownParameter(k.clone()));
    }
    let name = fields.get("model").and_then(Value::as_str).ok_or_else(|| ApiError::invalid("model", "model must be a string naming a local model"))?;
    let model = app.resolve(Some(name)).await?;
    let state = app.scheduler.state();
    if state.loaded.as_ref().is_some_and(|l| l.model.path == model.path) {
        return Ok(Json(json!({"status": "loaded", "model": model.id})).into_response());
    }
    app.scheduler.load(model.clone());
    Ok((StatusCode::ACCEPTED, Json(json!({"status": "loading", "model": model.id}))).into_response())
}

pub async fn cluster(State(app): State<Arc<App>>) -> Json<Value> {
    let state = app.scheduler.state();
    let loaded_bytes = state.loaded.as_ref().map_or(0, |l| l.model.size_bytes);
    let (memory_total, memory_available) = tokio::task::spawn_blocking({
        let limit = app.config.memory_limit;
        move || offered_memory(limit, loaded_bytes)
    })
    .await
    .unwrap_or((0, 0));
    let me = &app.node.id;
    let loaded_ids: Vec<&str> = state.loaded.iter().map(|l| l.model.id.as_str()).collect();
    let plans: Vec<Value> = state
        .loaded
        .iter()
        .map(|l| {
            json!({
                "model": l.model.id, "epoch": 1, "strategy": "single",
                "predicted_tok_s": null, "measured_tok_s": state.last_decode_tok_s,
                "stages": [{"node": me, "start": 0, "end": l.layers}],
            })
        })
        .collect();
    let progress: Vec<Value> = state.loading.iter().map(|m| json!({"node": me, "model": m.id, "phase": "loading", "fraction": null})).collect();
    Json(json!({
        "self": me, "leader": me, "epoch": 1,
        "nodes": [{
            "id": me, "name": app.node.name, "memory_total": memory_total, "memory_available": memory_available,
            "backend": "cpu", "device": app.node.device, "flops": app.machine.flops, "mem_bandwidth": app.machine.mem_bandwidth,
            "addresses": app.addresses, "models": loaded_ids,
        }],
        "links": [],
        "plans": plans,
        "progress": progress,
        "downloads": downloads(&app),
        "error": state.last_error,
    }))
}

/// `/v1/cluster` `downloads`: this node's pulls and peer copies (running, or ended within
/// the last 30 s), from the progress registry.
pub fn downloads(app: &App) -> Vec<Value> {
    let me = &app.node.id;
    app.progress
        .snapshot()
        .into_iter()
        .map(|t| {
            json!({
                "node": me, "model": t.model, "phase": t.phase, "source": t.source, "file": t.file,
                "bytes_done": t.bytes_done, "bytes_total": t.bytes_total, "fraction": t.fraction,
                "bytes_per_s": t.bytes_per_s, "error": t.error,
            })
        })
        .collect()
}

/// The addresses a client can reach this listener on: every interface's address when bound to
/// an unspecified address, else the bound address itself.
pub fn listen_addresses(bound: SocketAddr) -> Vec<String> {
    if !bound.ip().is_unspecified() {
        return vec![bound.to_string()];
    }
    let v6 = bound.is_ipv6();
    let networks = sysinfo::Networks::new_with_refreshed_list();
    let mut ips: Vec<IpAddr> = networks.values().flat_map(|n| n.ip_networks().iter().map(|i| i.addr)).filter(|ip| v6 || ip.is_ipv4()).filter(|ip| !matches!(ip, IpAddr::V6(a) if a.segments()[0] & 0xffc0 == 0xfe80)).collect();
    ips.sort();
    ips.dedup();
    ips.into_iter().map(|ip| SocketAddr::new(ip, bound.port()).to_string()).collect()
}
