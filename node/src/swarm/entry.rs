//! The entry side of a generation: waits for a plan that places the model, then drives the
//! pipeline one step at a time (prefill, then each sampled token) from the first stage, and
//! streams tokens to the caller. It keeps the token history, so when a stage fails or the plan
//! changes mid-request it rebuilds the request on the plan in force instead of failing, until
//! its deadline; then it reports an error. The rebuild replays the original steps (the prompt
//! as one batch, then each generated token alone): batched and single-token quantized kernels
//! round differently, and only the same steps give the same continuation (and replay the
//! seeded sampler's draws). Text (tokenizing, stop strings) is the caller's.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use shoal_proto::v1::{self, forward_request, forward_response};
use tokio::sync::mpsc;

use super::forward::{self, sampling_to_wire, HopContext};
use crate::engine::{FinishReason, SamplingParams};

pub struct GenerateRequest {
    pub model: String,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop_ids: Vec<u32>,
    /// How long to wait for a usable plan before the first token (placing and loading a model
    /// take a while).
    pub plan_wait: Duration,
    /// How long to keep rebuilding after a failure once tokens have reached the client: past
    /// it the client gets an error rather than a stream that stalls.
    pub failover_wait: Duration,
}

#[derive(Debug, Clone, PartialEq)]
pub enum TokenEvent {
    Token(u32),
    Done(FinishReason),
    Error(String),
}

/// Runs `request`; every path ends with `Done` or `Error` (unless the receiver went away).
pub async fn run(hop: HopContext, request: GenerateRequest, events: mpsc::Sender<TokenEvent>) {
    let mut tokens = request.prompt.clone();
    let mut generated = 0;
    let mut request_id: u64 = rand::random();
    let mut position = 0usize;
    let mut input = tokens.clone();
    let mut trouble_since: Option<Instant> = None;
    // Tokens the client already has, fed again one step at a time after a rebuild.
    let mut replay: VecDeque<u32> = VecDeque::new();
    // The last stage owns the request's sampler; a re-prefill starts a new one from the same
    // seed, so a greedy continuation is unchanged by a failover but a sampled one may differ.
    let sampling = Some(sampling_to_wire(&request.sampling));
    loop {
        if generated >= request.max_tokens {
            let _ = events.send(TokenEvent::Done(FinishReason::Length)).await;
            break;
        }
        if events.is_closed() {
            break;
        }
        let plan = hop.plan.borrow().clone();
        let first = plan.as_ref().and_then(|p| match p.placements.get(&request.model) {
            Some(Ok(pl)) => pl.stages.first().map(|s| (p.epoch.clone(), s.node.clone())),
            _ => None,
        });
        let placement_error = plan.as_ref().and_then(|p| match p.placements.get(&request.model) {
            Some(Err(e)) => Some(e.clone()),
            _ => None,
        });
        if let Some(e) = placement_error {
            // The leader has judged this model against the whole swarm: waiting will not help.
            let _ = events.send(TokenEvent::Error(e)).await;
            break;
        }
        let outcome = match &first {
            None => Err(format!("no plan places {} yet", request.model)),
            Some((epoch, node)) => {
                let f = v1::ForwardRequest {
                    version: shoal_proto::WIRE_VERSION,
                    request_id,
                    epoch_round: epoch.round,
                    epoch_leader: epoch.leader.clone(),
                    model: request.model.clone(),
                    position: position as u32,
                    input: Some(forward_request::Input::Tokens(v1::Tokens { ids: input.clone() })),
                    sampling: sampling.clone(),
                    history: {
                        let seen = &tokens[..position + input.len()];
                        seen[seen.len().saturating_sub(request.sampling.penalty_window)..].to_vec()
                    },
                    group_seq: 0,
                };
                // While rebuilding after a failure, a step (e.g. one waiting for a stage to load)
                // may take only what is left of the patience, so the client hears in time.
                let left = trouble_since.map(|since| patience(&request, generated).saturating_sub(since.elapsed()));
                let step = forward::send(&hop, node, f);
                let response = match left {
                    Some(left) => tokio::time::timeout(left, step).await.map_err(|_| "the pipeline was not rebuilt in time".to_string()),
                    None => Ok(step.await),
                };
                match response.map(|r| r.output) {
                    Err(e) => Err(e),
                    Ok(Some(forward_response::Output::Token(t))) => Ok(t),
                    Ok(Some(forward_response::Output::Error(e))) => Err(e.message),
                    Ok(_) => Err("a pipeline step returned no token".into()),
                }
            }
        };
        match outcome {
            Ok(token) => {
                trouble_since = None;
                position += input.len();
                if let Some(known) = replay.pop_front() {
                    input = vec![known];
                    continue;
                }
                tokens.push(token);
                generated += 1;
                if request.stop_ids.contains(&token) {
                    let _ = events.send(TokenEvent::Done(FinishReason::Stop)).await;
                    break;
                }
                if events.send(TokenEvent::Token(token)).await.is_err() {
                    break;
                }
                input = vec![token];
            }
            Err(e) => {
                let since = *trouble_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= patience(&request, generated) {
                    let _ = events.send(TokenEvent::Error(e)).await;
                    break;
                }
                // Rebuild under a fresh request id on whatever plan is in force.
                tracing::info!(target: "shoal::cluster", event = "request_failover", error = %e);
                request_id = rand::random();
                position = 0;
                input = request.prompt.clone();
                replay = tokens[request.prompt.len()..].iter().copied().collect();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    release_everywhere(&hop, &request.model, request_id).await;
}

/// How long a request may spend rebuilding: long before its first token (placing and loading
/// a model take a while), short once the client is reading a stream.
fn patience(request: &GenerateRequest, generated: usize) -> Duration {
    if generated == 0 {
        request.plan_wait
    } else {
        request.failover_wait
    }
}

/// Lets every stage of the plan forget the request (best effort).
async fn release_everywhere(hop: &HopContext, model: &str, request_id: u64) {
    let plan = hop.plan.borrow().clone();
    let Some(Ok(placement)) = plan.as_ref().and_then(|p| p.placements.get(model)).cloned() else { return };
    for node in placement.stages.iter().flat_map(|s| s.members()) {
        if *node == hop.me {
            hop.stages.release(model.to_string(), request_id);
        } else if let Some(peer) = super::coordinator::peer_of(node) {
            let release = v1::ControlRequest { version: shoal_proto::WIRE_VERSION, body: Some(v1::control_request::Body::Release(v1::Release { request_id })) };
            let _ = hop.net.request(peer, release, Duration::from_millis(500)).await;
        }
    }
}
