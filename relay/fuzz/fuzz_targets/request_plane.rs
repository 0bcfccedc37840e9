//! The call-home response stream as it comes off the socket: two-part messages (`u64 BE
//! header_len, u64 BE body_len, u64 BE checksum, header, body`), the first one the handshake,
//! the rest through the frame decoders and the stream's order machine; also the request-plane
//! ACK text.
//!
//! Input: a selector byte (bit 0: MessagePack or JSON items; bit 1: a tree-dump or an events
//! request), then the stream.
#![no_main]

use kvrelay_core::model::kv_events::SourceKey;
use kvrelay::request_plane::PayloadCodec;
use kvrelay::request_plane::answer::decode_frame;
use kvrelay::request_plane::frame::{TWO_PART_PREFIX_BYTES, TwoPartPrefix};
use kvrelay::request_plane::message::{decode_control_frame, decode_handshake};
use kvrelay::request_plane::stream::ResponseStream;
use kvrelay_core::sources::RecoveryRequest;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, mut rest)) = data.split_first() else { return };
    let codec = if selector & 1 == 0 { PayloadCodec::MsgPack } else { PayloadCodec::Json };
    let mut request = RecoveryRequest::tree_dump(SourceKey { worker_id: 4, dp_rank: 0 });
    if selector & 2 != 0 {
        request.start_event_id = Some(10);
    }
    let mut stream = ResponseStream::new();
    let mut handshake_read = false;
    while rest.len() >= TWO_PART_PREFIX_BYTES {
        let (prefix, tail) = rest.split_at(TWO_PART_PREFIX_BYTES);
        let prefix = TwoPartPrefix::parse(prefix.try_into().expect("24 bytes"));
        // The reader bounds both parts by what it has before reading them.
        let Some(total) = prefix.header_len.checked_add(prefix.body_len) else { return };
        if total > tail.len() as u64 {
            return;
        }
        let (header, tail) = tail.split_at(prefix.header_len as usize);
        let (body, tail) = tail.split_at(prefix.body_len as usize);
        rest = tail;
        if !prefix.checksum_matches(header, body) {
            return;
        }
        if !handshake_read {
            handshake_read = true;
            let _ = decode_handshake(header);
            continue;
        }
        let _ = decode_control_frame(header);
        let Ok(frame) = decode_frame(codec, header, body, &request) else { return };
        match stream.handle(frame) {
            Ok(true) => break,
            Ok(false) => {}
            Err(_) => return,
        }
    }
    let _ = stream.finish();
});
