//! The event plane's MessagePack envelope and its payloads (NATS message bodies and the ZMQ
//! event frame), then the 4-frame ZMQ message.
//!
//! Input: a selector byte, then the bytes. Selector 0: a NATS body (envelope, then the
//! `kv-events` or `kv_metrics` payload it names); 1: a ZMQ event frame; 2: a bare payload; 3: a
//! ZMQ message whose frames are split at the next bytes' values.
#![no_main]

use kvrelay_core::model::identity::EndpointPath;
use kvrelay_core::inputs::{
    decode_event_envelope, decode_kv_event_batch, decode_kv_events_payload,
    decode_load_observation, decode_zmq_event_message, zmq_event_frame_envelope,
};
use libfuzzer_sys::fuzz_target;

fn endpoint() -> EndpointPath {
    EndpointPath::new("dynamo", "backend", "generate").expect("a valid path")
}

fn envelope(bytes: &[u8]) {
    let Ok(envelope) = decode_event_envelope(bytes) else { return };
    let _ = decode_kv_event_batch(endpoint(), &envelope);
    let _ = decode_load_observation(&envelope);
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, bytes)) = data.split_first() else { return };
    match selector % 4 {
        0 => envelope(bytes),
        1 => {
            if let Ok(inner) = zmq_event_frame_envelope(bytes) {
                envelope(inner);
            }
        }
        2 => {
            let _ = decode_kv_events_payload(bytes);
        }
        _ => {
            // Three split points from the first three bytes, then the frames.
            if bytes.len() < 3 {
                return;
            }
            let (cuts, rest) = bytes.split_at(3);
            let mut frames: Vec<&[u8]> = Vec::new();
            let mut remaining = rest;
            for &cut in cuts {
                let (frame, tail) = remaining.split_at(usize::from(cut).min(remaining.len()));
                frames.push(frame);
                remaining = tail;
            }
            frames.push(remaining);
            if let Ok(envelope) = decode_zmq_event_message(&frames) {
                let _ = decode_kv_event_batch(endpoint(), &envelope);
            }
        }
    }
});
