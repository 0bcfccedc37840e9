//! CBI1 frame decoding (`kvrelay_core::filter::cbi1::decode`), then the snapshot assembler on each chunk.
//!
//! Input: a selector byte (low 2 bits: the expected format; bit 7: fix the body checksum so
//! mutations reach the body checks), then the frame.
#![no_main]

use kvrelay_core::filter::cbi1::{Frame, SnapshotAssembler, decode, decode_for_pool};
use kvrelay_fuzz::{DC_ID, FORMATS, fix_cbi1_checksum};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, frame)) = data.split_first() else { return };
    let format = FORMATS[usize::from(selector & 3) % FORMATS.len()];
    let mut frame = frame.to_vec();
    if selector & 0x80 != 0 {
        fix_cbi1_checksum(&mut frame);
    }
    let Ok(decoded) = decode(&frame, &format) else { return };
    let _ = decode_for_pool(&frame, &format, DC_ID);
    match decoded {
        Frame::SnapshotChunk(chunk) => {
            assert_eq!(chunk.words().len(), chunk.word_count());
            let mut assembler = SnapshotAssembler::new();
            if let Ok(Some(snapshot)) = assembler.accept(&chunk) {
                assert_eq!(snapshot.words().len() as u64, format.bucket_count);
                let _ = snapshot.nonzero_images().count();
            }
        }
        Frame::Delta(delta) => {
            assert_eq!(delta.images().len(), delta.image_count());
            for image in delta.images() {
                assert!(u64::from(image.bucket) < format.bucket_count);
            }
        }
    }
});
