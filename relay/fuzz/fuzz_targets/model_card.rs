//! Model deployment cards (`card_json`), with the legacy prefill normalisation and the
//! model-type / worker-type parsers.
#![no_main]

use kvrelay_core::inputs::{
    decode_card_json, normalize_legacy_prefill, parse_model_type, parse_worker_type,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(mut card) = decode_card_json(data) {
        let _ = normalize_legacy_prefill(&mut card);
    }
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = parse_model_type(text);
        let _ = parse_worker_type(text, "worker_type");
    }
});
