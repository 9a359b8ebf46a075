//! One pipeline hop: serving a `ForwardRequest` at this node's stage (checked against the plan
//! in force: right epoch, a stage of ours), running it on the stage thread, and passing the
//! hidden states on to the next stage, whose answer travels back up the chain. Sending a step
//! to a stage on this node short-cuts the network. Every failure becomes an `RpcError` reply.
//! A tensor-parallel stage is reached through its leader (rank 0): the leader numbers the step,
//! hands it to every follower (which runs its slice in the group's order and acknowledges),
//! runs its own slice, and passes the result on once every member has answered.

use std::sync::Arc;
use std::time::Duration;

use shoal_proto::v1::{self, control_request, control_response, forward_request, forward_response, ErrorCode, RpcError};
use tokio::sync::{oneshot, watch};

use crate::cluster::Plan;
use crate::engine::stage::{Step, StepInput, StepOutput};
use crate::engine::stage_host::StageHost;
use crate::engine::SamplingParams;
use crate::net::NetHandle;

/// What a hop needs; cheap to clone into each pipeline task.
#[derive(Clone)]
pub struct HopContext {
    pub me: String,
    pub net: NetHandle,
    pub stages: StageHost,
    /// The plan in force, kept current by the coordinator.
    pub plan: watch::Receiver<Option<Arc<Plan>>>,
    pub hop_deadline: Duration,
    /// Data-plane links set up on invites, until this node's group formation takes them.
    pub links: super::tp_group::LinkBook,
    /// Where inbound libp2p data-plane frames go.
    pub frames: super::p2p_link::FrameRoutes,
    /// The order of tensor groups' steps on this node.
    pub order: super::tp_group::GroupOrder,
    pub dataplane: super::tp_group::DataplaneConfig,
}

pub fn error(code: ErrorCode, message: impl Into<String>) -> RpcError {
    RpcError { code: code as i32, message: message.into() }
}

fn forward_error(request_id: u64, e: RpcError) -> v1::ForwardResponse {
    v1::ForwardResponse { version: shoal_proto::WIRE_VERSION, request_id, output: Some(forward_response::Output::Error(e)) }
}

/// Answers a control RPC addressed to this node.
pub async fn serve(hop: &HopContext, from: libp2p::PeerId, request: v1::ControlRequest) -> v1::ControlResponse {
    let body = match request.body {
        Some(control_request::Body::Forward(f)) => control_response::Body::Forward(serve_forward(hop, f).await),
        Some(control_request::Body::Release(r)) => {
            for model in loaded_models(hop) {
                hop.stages.release(model, r.request_id);
            }
            control_response::Body::Released(v1::Released { known: true })
        }
        Some(control_request::Body::Frame(f)) => match hop.frames.deliver(f) {
            Ok(()) => control_response::Body::FrameAck(v1::GroupAck {}),
            Err(e) => control_response::Body::Error(error(ErrorCode::NotServing, e)),
        },
        Some(control_request::Body::Invite(i)) => match super::tp_group::answer_invite(hop, from, i).await {
            Ok(a) => control_response::Body::Answer(a),
            Err(e) => control_response::Body::Error(error(ErrorCode::BadRequest, e)),
        },
        None => control_response::Body::Error(error(ErrorCode::BadRequest, "empty control request")),
    };
    v1::ControlResponse { version: shoal_proto::WIRE_VERSION, body: Some(body) }
}

fn loaded_models(hop: &HopContext) -> Vec<String> {
    let plan = hop.plan.borrow().clone();
    plan.map(|p| p.placements.iter().filter(|(_, pl)| pl.as_ref().is_ok_and(|pl| pl.stage_of(&hop.me).is_some())).map(|(m, _)| m.clone()).collect()).unwrap_or_default()
}

/// Runs our stage of `f` and, unless we are the last stage, the rest of the chain.
pub async fn serve_forward(hop: &HopContext, f: v1::ForwardRequest) -> v1::ForwardResponse {
    let id = f.request_id;
    let Some(plan) = hop.plan.borrow().clone() else {
        return forward_error(id, error(ErrorCode::NotServing, "this node has no plan yet"));
    };
    if plan.epoch.round != f.epoch_round || plan.epoch.leader != f.epoch_leader {
        return forward_error(id, error(ErrorCode::StaleEpoch, format!("the plan in force is round {} by {}", plan.epoch.round, plan.epoch.leader)));
    }
    let Some(Ok(placement)) = plan.placements.get(&f.model) else {
        return forward_error(id, error(ErrorCode::NotServing, format!("the plan in force does not place {}", f.model)));
    };
    let Some((index, rank)) = placement.stage_of(&hop.me) else {
        return forward_error(id, error(ErrorCode::NotServing, format!("this node holds no stage of {}", f.model)));
    };
    let stage = &placement.stages[index];
    let group = (stage.tp_size() > 1).then(|| super::tp_group::group_id(&plan.epoch, stage.members()));
    if f.group_seq != 0 && (rank == 0 || group.is_none()) {
        return forward_error(id, error(ErrorCode::BadRequest, "a numbered group step sent to a node that is no group follower"));
    }
    if group.is_some() && rank > 0 && f.group_seq == 0 {
        return forward_error(id, error(ErrorCode::NotServing, format!("this node follows a tensor group of {}; steps go to its leader", f.model)));
    }
    let input = match f.input.clone() {
        Some(forward_request::Input::Tokens(t)) => StepInput::Tokens(t.ids),
        Some(forward_request::Input::Hidden(h)) => StepInput::Hidden { rows: h.rows as usize, hidden: h.hidden_size as usize, data: h.data },
        None => return forward_error(id, error(ErrorCode::BadRequest, "a forward step without input")),
    };
    let step = Step { request_id: id, position: f.position as usize, input, sampling: sampling_from_wire(f.sampling.as_ref()), history: f.history.clone() };
    let (tx, rx) = oneshot::channel();
    let reply: Box<dyn FnOnce(crate::engine::Result<StepOutput>) + Send> = Box::new(move |r| {
        let _ = tx.send(r);
    });
    let mut followers = Vec::new();
    match &group {
        None => hop.stages.step(f.model.clone(), step, reply),
        Some(g) if rank == 0 => {
            let Some(seq) = hop.order.lead(&f.model, g, || hop.stages.step(f.model.clone(), step, reply)) else {
                return forward_error(id, error(ErrorCode::NotServing, format!("the tensor group of {} is still loading", f.model)));
            };
            for node in stage.group.iter() {
                let (hop, node, numbered) = (hop.clone(), node.clone(), v1::ForwardRequest { group_seq: seq, ..f.clone() });
                followers.push((node.clone(), tokio::spawn(async move { send_remote(&hop, &node, numbered).await })));
            }
        }
        Some(g) => return follow(hop, g, f.model.clone(), f.group_seq, step, reply, rx).await,
    }
    let own = rx.await;
    for (node, task) in followers {
        match task.await.map(|r| r.output) {
            Ok(Some(forward_response::Output::Ack(_))) => {}
            Ok(Some(forward_response::Output::Error(e))) => return forward_error(id, error(ErrorCode::NotServing, format!("group member {node}: {}", e.message))),
            Ok(_) => return forward_error(id, error(ErrorCode::BadRequest, format!("group member {node} answered a step with something else"))),
            Err(e) => return forward_error(id, error(ErrorCode::NotServing, format!("group member {node}: {e}"))),
        }
    }
    let output = match own {        Ok(Ok(o)) => o,
        Ok(Err(e)) => return forward_error(id, error(ErrorCode::BadRequest, e.to_string())),
        Err(_) => return forward_error(id, error(ErrorCode::NotServing, "the stage thread stopped")),
    };
    match output {
        StepOutput::Token(t) => v1::ForwardResponse { version: shoal_proto::WIRE_VERSION, request_id: id, output: Some(forward_response::Output::Token(t)) },
        StepOutput::Hidden { rows, hidden, data } => {
            let Some(next) = placement.stages.get(index + 1) else {
                return forward_error(id, error(ErrorCode::BadRequest, "the last stage produced hidden states"));
            };
            let hidden = v1::HiddenStates { rows: rows as u32, hidden_size: hidden as u32, data };
            let next_request = v1::ForwardRequest { input: Some(forward_request::Input::Hidden(hidden)), ..f };
            Box::pin(send(hop, &next.node, next_request)).await
        }
    }
}

/// A follower's step: submitted to the stage thread in the group's order (`seq`), then
/// acknowledged. A step whose predecessor never came is run after the hop deadline anyway
/// (the leader's all-reduce of the missing step has failed by then).
async fn follow(hop: &HopContext, group: &str, model: String, seq: u64, step: Step, reply: Box<dyn FnOnce(crate::engine::Result<StepOutput>) + Send>, mut rx: oneshot::Receiver<crate::engine::Result<StepOutput>>) -> v1::ForwardResponse {
    let id = step.request_id;
    let stages = hop.stages.clone();
    let submit_model = model.clone();
    if !hop.order.follow(&model, group, seq, Box::new(move || stages.step(submit_model, step, reply))) {
        return forward_error(id, error(ErrorCode::BadRequest, format!("group step {seq} came after its turn")));
    }
    let result = match tokio::time::timeout(hop.hop_deadline, &mut rx).await {
        Ok(r) => r,
        Err(_) => {
            hop.order.skip_to(&model, group, seq);
            match tokio::time::timeout(hop.hop_deadline, rx).await {
                Ok(r) => r,
                Err(_) => return forward_error(id, error(ErrorCode::NotServing, "the group step timed out")),
            }
        }
    };
    match result {
        Ok(Ok(_)) => v1::ForwardResponse { version: shoal_proto::WIRE_VERSION, request_id: id, output: Some(forward_response::Output::Ack(v1::GroupAck {})) },
        Ok(Err(e)) => forward_error(id, error(ErrorCode::BadRequest, e.to_string())),
        Err(_) => forward_error(id, error(ErrorCode::NotServing, "the stage thread stopped")),
    }
}

/// Sends a step to the stage on `node` (this node: directly; else over the network).
pub async fn send(hop: &HopContext, node: &str, f: v1::ForwardRequest) -> v1::ForwardResponse {
    if node == hop.me {
        return serve_forward(hop, f).await;
    }
    send_remote(hop, node, f).await
}

/// Sends a step to the stage on another node over the network.
async fn send_remote(hop: &HopContext, node: &str, f: v1::ForwardRequest) -> v1::ForwardResponse {
    let id = f.request_id;
    let Some(peer) = super::coordinator::peer_of(node) else {
        return forward_error(id, error(ErrorCode::BadRequest, format!("`{node}` is not a peer id")));
    };
    let request = v1::ControlRequest { version: shoal_proto::WIRE_VERSION, body: Some(control_request::Body::Forward(f)) };
    match hop.net.request(peer, request, hop.hop_deadline).await {
        Ok(v1::ControlResponse { body: Some(control_response::Body::Forward(r)), .. }) => r,
        Ok(v1::ControlResponse { body: Some(control_response::Body::Error(e)), .. }) => forward_error(id, e),
        Ok(_) => forward_error(id, error(ErrorCode::BadRequest, format!("{node} answered a forward step with something else"))),
        Err(e) => forward_error(id, error(ErrorCode::NotServing, format!("stage on {node} failed: {e}"))),
    }
}

pub fn sampling_to_wire(s: &SamplingParams) -> v1::Sampling {
    v1::Sampling {
        temperature: s.temperature,
        top_k: s.top_k.unwrap_or(0) as u32,
        top_p: s.top_p,
        min_p: s.min_p,
        seed: s.seed.unwrap_or(0),
        repetition_penalty: s.repetition_penalty,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
    }
}

fn sampling_from_wire(s: Option<&v1::Sampling>) -> SamplingParams {
    match s {
        None => SamplingParams::greedy(),
        Some(s) => SamplingParams {
            temperature: s.temperature,
            top_k: (s.top_k > 0).then_some(s.top_k as usize),
            top_p: s.top_p,
            min_p: s.min_p,
            repetition_penalty: s.repetition_penalty,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            seed: Some(s.seed),
            ..SamplingParams::default()
        },
    }
}
