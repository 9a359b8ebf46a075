//! The shape of control RPCs: checks that an arriving `ControlRequest` or `ControlResponse`
//! speaks our version, has a body and carries consistent hidden states, and small builders
//! (error replies, hidden states from and to f32). What a Forward means is the pipeline's
//! business, not this file's: it never looks at epochs, models or positions beyond their size.

use shoal_proto::v1::{self, control_request, control_response, forward_request, forward_response};
use shoal_proto::WIRE_VERSION;

use super::wire::{check_count, check_len, WireError, MAX_ERROR_BYTES, MAX_HIDDEN_SIZE, MAX_STRING_BYTES};

/// Checks an inbound request before the application sees it.
pub fn check_request(request: &v1::ControlRequest) -> Result<(), WireError> {
    if request.version != WIRE_VERSION {
        return Err(WireError::Version { got: request.version });
    }
    match request.body.as_ref().ok_or(WireError::Missing("request.body"))? {
        control_request::Body::Forward(forward) => check_forward_request(forward),
        control_request::Body::Release(_) => Ok(()),
        control_request::Body::Invite(i) => {
            if i.version != WIRE_VERSION {
                return Err(WireError::Version { got: i.version });
            }
            check_count("invite.transports", &i.transports, 8)?;
            for s in [&i.model, &i.epoch_leader, &i.host_id, &i.shm_path, &i.tcp_addr, &i.token] {
                check_len("invite", s, MAX_STRING_BYTES * 4)?;
            }
            Ok(())
        }
        control_request::Body::Frame(f) => {
            if f.version != WIRE_VERSION {
                return Err(WireError::Version { got: f.version });
            }
            check_len("frame.model", &f.model, MAX_STRING_BYTES)?;
            check_len("frame.epoch_leader", &f.epoch_leader, MAX_STRING_BYTES)?;
            if f.data.len() % 4 != 0 {
                return Err(WireError::OutOfRange { field: "frame.data" });
            }
            Ok(())
        }
    }
}

/// Checks a response before it is handed to the caller of `NetHandle::request`.
pub fn check_response(response: &v1::ControlResponse) -> Result<(), WireError> {
    if response.version != WIRE_VERSION {
        return Err(WireError::Version { got: response.version });
    }
    match response.body.as_ref().ok_or(WireError::Missing("response.body"))? {
        control_response::Body::Forward(forward) => {
            if forward.version != WIRE_VERSION {
                return Err(WireError::Version { got: forward.version });
            }
            match forward.output.as_ref().ok_or(WireError::Missing("forward.output"))? {
                forward_response::Output::Hidden(hidden) => check_hidden(hidden),
                forward_response::Output::Token(_) | forward_response::Output::Ack(_) => Ok(()),
                forward_response::Output::Error(e) => check_len("forward.error.message", &e.message, MAX_ERROR_BYTES),
            }
        }
        control_response::Body::Released(_) | control_response::Body::FrameAck(_) => Ok(()),
        control_response::Body::Answer(a) => check_count("answer.established", &a.established, 8),
        control_response::Body::Error(e) => check_len("response.error.message", &e.message, MAX_ERROR_BYTES),
    }
}

fn check_forward_request(forward: &v1::ForwardRequest) -> Result<(), WireError> {
    if forward.version != WIRE_VERSION {
        return Err(WireError::Version { got: forward.version });
    }
    check_len("forward.model", &forward.model, MAX_STRING_BYTES)?;
    check_len("forward.epoch_leader", &forward.epoch_leader, MAX_STRING_BYTES)?;
    match forward.input.as_ref().ok_or(WireError::Missing("forward.input"))? {
        forward_request::Input::Tokens(tokens) if tokens.ids.is_empty() => Err(WireError::Missing("forward.input.tokens")),
        forward_request::Input::Tokens(_) => Ok(()),
        forward_request::Input::Hidden(hidden) => check_hidden(hidden),
    }
}

/// Rows x hidden_size little-endian f32 values, no more and no fewer, at least one row.
pub fn check_hidden(hidden: &v1::HiddenStates) -> Result<(), WireError> {
    let expected = u64::from(hidden.rows) * u64::from(hidden.hidden_size) * 4;
    let shape_ok = hidden.rows > 0 && hidden.hidden_size > 0 && hidden.hidden_size <= MAX_HIDDEN_SIZE;
    if !shape_ok || expected != hidden.data.len() as u64 {
        return Err(WireError::HiddenShape { rows: hidden.rows, hidden_size: hidden.hidden_size, bytes: hidden.data.len() });
    }
    Ok(())
}

/// Packs `values` (row-major, `rows` rows) as hidden states.
pub fn hidden_from_f32(rows: u32, hidden_size: u32, values: &[f32]) -> Result<v1::HiddenStates, WireError> {
    let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let hidden = v1::HiddenStates { rows, hidden_size, data };
    check_hidden(&hidden)?;
    Ok(hidden)
}

/// Unpacks checked hidden states into f32 values, row-major.
pub fn hidden_to_f32(hidden: &v1::HiddenStates) -> Result<Vec<f32>, WireError> {
    check_hidden(hidden)?;
    Ok(hidden.data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
}

/// A request envelope around `body`.
pub fn request(body: control_request::Body) -> v1::ControlRequest {
    v1::ControlRequest { version: WIRE_VERSION, body: Some(body) }
}

/// A response envelope around `body`.
pub fn response(body: control_response::Body) -> v1::ControlResponse {
    v1::ControlResponse { version: WIRE_VERSION, body: Some(body) }
}

/// The reply to a request that could not be served at all.
pub fn error_response(code: v1::ErrorCode, message: impl Into<String>) -> v1::ControlResponse {
    response(control_response::Body::Error(v1::RpcError { code: code as i32, message: message.into() }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forward(input: forward_request::Input) -> v1::ControlRequest {
        request(control_request::Body::Forward(v1::ForwardRequest { version: WIRE_VERSION, input: Some(input), ..Default::default() }))
    }

    #[test]
    fn hidden_states_round_trip_and_bad_shapes_are_refused() {
        let values = [1.0f32, -2.5, 3.25, 0.0, 7.0, 8.0];
        let hidden = hidden_from_f32(2, 3, &values).unwrap();
        assert_eq!(hidden_to_f32(&hidden).unwrap(), values);
        assert!(hidden_from_f32(2, 2, &values).is_err());
        let mut lying = hidden.clone();
        lying.rows = u32::MAX;
        assert!(matches!(check_hidden(&lying), Err(WireError::HiddenShape { .. })));
        assert!(check_request(&forward(forward_request::Input::Hidden(lying))).is_err());
        assert!(check_request(&forward(forward_request::Input::Hidden(hidden))).is_ok());
    }

    #[test]
    fn envelopes_without_body_input_or_our_version_are_refused() {
        assert_eq!(check_request(&v1::ControlRequest { version: WIRE_VERSION, body: None }), Err(WireError::Missing("request.body")));
        let mut old = forward(forward_request::Input::Tokens(v1::Tokens { ids: vec![1] }));
        old.version = 0;
        assert_eq!(check_request(&old), Err(WireError::Version { got: 0 }));
        assert!(check_request(&forward(forward_request::Input::Tokens(v1::Tokens { ids: vec![] }))).is_err());
        let release = request(control_request::Body::Release(v1::Release { request_id: 3 }));
        assert!(check_request(&release).is_ok());
        assert!(check_response(&error_response(v1::ErrorCode::Busy, "later")).is_ok());
        assert!(check_response(&v1::ControlResponse { version: WIRE_VERSION, body: None }).is_err());
    }
}
