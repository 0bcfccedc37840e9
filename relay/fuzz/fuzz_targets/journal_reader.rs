//! The journal reader on a one-segment journal file holding the input bytes.
//!
//! Input: a selector byte (bit 0: rewrite every frame checksum so mutations reach the record
//! decoder), then the segment's bytes. The file is rewritten per input under the temp directory.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use kvrelay::journal::read_journal;
use kvrelay_fuzz::fix_journal_checksums;
use libfuzzer_sys::fuzz_target;

fn segment_path() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("kvrelay-fuzz-journal-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir.join("segment-00000000.kvrj")
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, bytes)) = data.split_first() else { return };
    let mut file = bytes.to_vec();
    if selector & 1 != 0 {
        fix_journal_checksums(&mut file);
    }
    let path = segment_path();
    std::fs::write(path, &file).expect("write the segment");
    if let Ok((_, records, _)) = read_journal(path) {
        assert!(records.len() <= file.len());
    }
});
