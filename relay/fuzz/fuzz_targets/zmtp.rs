//! The event plane's ZMTP SUB decoder on a peer's byte stream, fed in fuzzed chunk sizes, with
//! small limits so every bound is reachable.
//!
//! Input: a selector byte (chunk size 1..=256), then the stream.
#![no_main]

use bytes::BytesMut;
use kvrelay::event_plane::{ZmtpEvent, ZmtpLimits, ZmtpSubDecoder};
use libfuzzer_sys::fuzz_target;

const LIMITS: ZmtpLimits =
    ZmtpLimits { frame_bytes_max: 4096, message_frames_max: 6, message_bytes_max: 8192 };

fuzz_target!(|data: &[u8]| {
    let Some((&selector, bytes)) = data.split_first() else { return };
    let chunk = usize::from(selector) + 1;
    let mut decoder = ZmtpSubDecoder::new(LIMITS);
    let mut input = BytesMut::new();
    for piece in bytes.chunks(chunk) {
        input.extend_from_slice(piece);
        loop {
            match decoder.decode(&mut input) {
                Ok(Some(ZmtpEvent::Message(frames))) => {
                    assert!(!frames.is_empty() && frames.len() <= LIMITS.message_frames_max);
                    let total: usize = frames.iter().map(|frame| frame.len()).sum();
                    assert!(total as u64 <= LIMITS.message_bytes_max);
                }
                Ok(Some(ZmtpEvent::Ping { context })) => assert!(context.len() <= 16),
                Ok(Some(ZmtpEvent::Ready { .. })) => assert!(decoder.is_ready()),
                Ok(None) => break,
                Err(_) => return,
            }
        }
        // Nothing is buffered beyond one frame's header and body plus the last chunk.
        assert!(input.len() <= 9 + LIMITS.frame_bytes_max as usize + chunk + 4096);
    }
});
