//! What this node says about itself and its swarm: `/v1/models` (loaded and local models, and
//! whether each fits the memory offered), `/v1/models/load`, `/v1/cluster` (every member, the
//! leader and epoch, the plan's stages with the cost model's predictions, link RTTs, load progress, placement errors, this
//! node's downloads) and `/health`. Memory comes from the OS, capped by `--memory-limit`.
//! It holds no state of its own: it reads the scheduler's published view, the swarm's
//! snapshot and the download progress registry.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::cluster::cost;
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
    /// Refuses a model larger than the memory the swarm may ever offer for it: this node's
    /// (`--memory-limit`, the machine's RAM, or its GPU's offer) plus that of the members that
    /// hold its files. What it takes is its footprint as placement counts it (weights and the KV
    /// cache reserved for the context), held as a GPU holds it where one of those offers (at
    /// most the CPU's figure: the least any plan needs), or its file's bytes where its header
    /// cannot be read. Less free memory right now only makes `fits` false: a user may load anyway.
    pub(super) async fn check_fits(&self, model: &LocalModel) -> Result<(), ApiError> {
        let (limit, store, local) = (self.config.memory_limit, self.store.clone(), model.clone());
        let (mut mine, footprint) = tokio::task::spawn_blocking(move || (offered_memory(limit, 0).0, store.details(&local).footprint)).await.unwrap_or((0, None));
        let mut on_gpu = false;
        let others: u64 = match self.swarm.snapshot().await {
            Ok(s) => {
                // A GPU node's shards live in GPU memory: its advert offers that, not RAM.
                if let Some(me) = s.members.iter().find(|m| m.id == s.me && m.gpu.is_some()) {
                    (mine, on_gpu) = (me.memory_offered, true);
                }
                let holders: Vec<_> = s.members.iter().filter(|m| m.id != s.me && m.models.contains(&model.id)).collect();
                on_gpu |= holders.iter().any(|m| m.gpu.is_some());
                holders.iter().map(|m| m.memory_offered).sum()
            }
            Err(_) => 0,
        };
        let offered = mine.saturating_add(others);
        let needed = footprint.map_or(model.size_bytes, |f| f.total_bytes_on(on_gpu));
        if needed > offered {
            let whom = if others == 0 { "this node offers" } else { "the swarm offers" };
            return Err(ApiError::ModelTooLarge { model: model.id.clone(), reason: format!("it needs {needed} bytes but {whom} {offered}") });
        }
        Ok(())
    }

    /// Memory a model could have now: loading replaces the loaded model, whose memory comes back.
    fn room_for_a_model(&self, state: &SchedulerState) -> u64 {
        let loaded = state.loaded.as_ref().map_or(0, |l| l.model.size_bytes);
        let (total, available) = offered_memory(self.config.memory_limit, loaded);
        total.min(available + loaded)
    }

    /// What this node offers from its GPU, when it computes on one (its advert's figure).
    async fn gpu_offer(&self) -> Option<u64> {
        let s = self.swarm.snapshot().await.ok()?;
        s.members.iter().find(|m| m.id == s.me && m.gpu.is_some()).map(|m| m.memory_offered)
    }

    /// Every model this node can serve: the loaded one first, then the rest on disk. A model
    /// `fits` when what this node's device would hold of it (its footprint: the weights as held
    /// there and the KV cache reserved for `--context`) fits the memory it could have now.
    async fn model_list(self: &Arc<Self>) -> Vec<Value> {
        let app = self.clone();
        let gpu_offer = self.gpu_offer().await;
        tokio::task::spawn_blocking(move || {
            let state = app.scheduler.state();
            let loaded = state.loaded.as_ref().map(|l| &l.model);
            let room = gpu_offer.unwrap_or_else(|| app.room_for_a_model(&state));
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
                    let needed = details.footprint.as_ref().map_or(m.size_bytes, |f| f.total_bytes_on(gpu_offer.is_some()));
                    let created = std::fs::metadata(&m.path).and_then(|md| md.modified()).ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or(0, |d| d.as_secs());
                    json!({
                        "id": m.id, "object": "model", "created": created, "owned_by": "shoal",
                        "shoal": {
                            "loaded": is_loaded, "size_bytes": m.size_bytes, "fits": is_loaded || needed <= room, "needed_bytes": needed,
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
    let Ok(snapshot) = app.swarm.snapshot().await else {
        return Json(json!({"self": app.node.id, "leader": null, "epoch": 0, "nodes": [], "links": [], "plans": [], "progress": [], "error": "the swarm runtime has stopped"}));
    };
    let me = snapshot.me.clone();
    let placements = snapshot.plan.as_ref().map(|p| p.placements.clone()).unwrap_or_default();
    // Bytes of our own stages, which count against our memory limit.
    let sizes: std::collections::HashMap<String, u64> = tokio::task::spawn_blocking({
        let app = app.clone();
        move || app.store.scan().into_iter().map(|m| (m.id, m.size_bytes)).collect()
    })
    .await
    .unwrap_or_default();
    let layers_of = |model: &str| placements.get(model).and_then(|p| p.as_ref().ok()).and_then(|p| p.stages.last()).map_or(1, |s| s.end.max(1));
    let loaded_bytes: u64 = snapshot.stages.iter().map(|(m, st)| sizes.get(m).copied().unwrap_or(0) * (st.end - st.start) as u64 / layers_of(m) as u64).sum();
    let limit = app.config.memory_limit;
    let (memory_total, memory_available) = tokio::task::spawn_blocking(move || offered_memory(limit, loaded_bytes)).await.unwrap_or((0, 0));
    let stages_on = |node: &str| -> Vec<&str> {
        placements.iter().filter(|(_, p)| p.as_ref().is_ok_and(|p| p.stage_of(node).is_some())).map(|(m, _)| m.as_str()).collect()
    };
    let nodes: Vec<Value> = snapshot
        .members
        .iter()
        .map(|m| {
            let is_me = m.id == me;
            // Our own RAM figures are fresher than our advert's; a GPU node's memory is the GPU's.
            let own_ram = is_me && m.gpu.is_none();
            json!({
                "id": m.id, "name": if is_me { app.node.name.clone() } else { m.name.clone() },
                "memory_total": if own_ram { memory_total } else { m.memory_total },
                "memory_available": if own_ram { memory_available } else { m.memory_offered },
                "backend": m.backend,
                "device": if is_me { app.node.device.clone() } else { m.gpu.as_ref().map_or_else(|| m.backend.clone(), |g| g.name.clone()) },
                "gpu": m.gpu,
                "flops": m.flops, "mem_bandwidth": m.mem_bandwidth,
                "addresses": if is_me { app.addresses.clone() } else { m.addresses.clone() },
                "models": stages_on(&m.id), "local_models": m.models,
            })
        })
        .collect();
    let links: Vec<Value> = snapshot.rtt_ms.iter().map(|(peer, rtt)| json!({"from": me, "to": peer, "rtt_ms": rtt})).collect();
    let epoch = snapshot.plan.as_ref().map_or(0, |p| p.epoch.round);
    // The cost model's inputs: measured speeds from adverts, our median ping RTT to peers.
    let speeds: Vec<cost::Speed> = snapshot.members.iter().map(|m| cost::Speed { node: m.id.clone(), mem_bandwidth: m.decode_rate(), flops: m.flops, memory_offered: m.memory_offered, gpu: m.gpu.is_some() }).collect();
    let mut rtts: Vec<f64> = snapshot.rtt_ms.values().copied().collect();
    rtts.sort_by(f64::total_cmp);
    let link = rtts.get(rtts.len() / 2).map_or(cost::LinkCost::LAN, |ms| cost::LinkCost { rtt_s: ms / 1e3, ..cost::LinkCost::LAN });
    let footprint = |model: &str| snapshot.members.iter().flat_map(|m| m.wants.iter()).find(|w| w.model == model).cloned();
    let plans: Vec<Value> = placements
        .iter()
        .filter_map(|(model, p)| p.as_ref().ok().map(|p| (model, p)))
        .map(|(model, p)| {
            let measured = state.loaded.as_ref().filter(|l| &l.model.id == model).and(state.last_decode_tok_s);
            let (predicted, predictions) = match footprint(model) {
                Some(f) => {
                    let stages: Option<Vec<(Vec<&cost::Speed>, usize)>> = p.stages.iter().map(|s| s.members().map(|n| speeds.iter().find(|x| &x.node == n)).collect::<Option<Vec<_>>>().map(|g| (g, s.end - s.start))).collect();
                    let predicted = stages.map(|st| cost::predict_stages(&f, &st, link).0);
                    let holders: Vec<cost::Speed> = speeds.iter().filter(|s| snapshot.members.iter().any(|m| m.id == s.node && m.models.iter().any(|x| x == model))).cloned().collect();
                    (predicted, cost::predict_all(&f, &holders, link))
                }
                None => (None, Vec::new()),
            };
            json!({
                "model": model, "epoch": epoch, "strategy": p.strategy,
                "predicted_tok_s": predicted, "measured_tok_s": measured, "predictions": predictions,
                "stages": p.stages.iter().map(|s| {
                    // `group` only for a tensor-parallel stage (its ranks 1..), as in the plan itself.
                    let mut v = json!({"node": s.node, "start": s.start, "end": s.end});
                    if !s.group.is_empty() {
                        v["group"] = json!(s.group);
                    }
                    v
                }).collect::<Vec<_>>(),
            })
        })
        .collect();
    let mut progress: Vec<Value> = snapshot
        .stages
        .iter()
        .filter(|(_, st)| st.state == crate::swarm::StageState::Loading)
        .map(|(model, st)| json!({"node": me, "model": model, "phase": "loading", "layers": [st.start, st.end], "fraction": null}))
        .collect();
    if let Some(m) = state.loading.as_ref().filter(|m| !snapshot.stages.contains_key(&m.id)) {
        progress.push(json!({"node": me, "model": m.id, "phase": "placing", "fraction": null}));
    }
    let placement_errors: Vec<String> = placements.iter().filter_map(|(_, p)| p.as_ref().err().cloned()).collect();
    let error = state.last_error.clone().or_else(|| (!placement_errors.is_empty()).then(|| placement_errors.join("; ")));
    Json(json!({
        "self": me, "leader": snapshot.leader, "epoch": epoch,
        "nodes": nodes, "links": links, "plans": plans, "progress": progress,
        "downloads": downloads(&app), "error": error,
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
