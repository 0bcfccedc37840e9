//! Discovery records (etcd values and discovery files, model cards inside Model records), and
//! the etcd key and file paths they are stored under.
//!
//! Input: a selector byte; even: a record value; odd: a key path and a file path.
#![no_main]

use kvrelay_core::inputs::{DiscoveryKey, decode_discovery_record};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, bytes)) = data.split_first() else { return };
    if selector % 2 == 0 {
        if let Ok(record) = decode_discovery_record(bytes) {
            // A decoded record names a key that parses back to itself.
            let key = record.key();
            assert_eq!(DiscoveryKey::parse_key_path(&key.key_path()).as_ref(), Ok(&key));
        }
        return;
    }
    let Ok(text) = std::str::from_utf8(bytes) else { return };
    if let Ok(key) = DiscoveryKey::parse_key_path(text) {
        let _ = DiscoveryKey::parse_file_path(&key.file_path());
    }
    let _ = DiscoveryKey::parse_file_path(text);
});
