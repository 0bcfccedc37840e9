//! The sources file (`parse_sources_file`), with and without a connection-revision guard, and
//! its canonical form re-parsed.
#![no_main]

use kvrelay::serve::sources_file::{canonical_json, parse_sources_file};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = parse_sources_file(data, Some("rev-1"));
    let Ok(list) = parse_sources_file(data, None) else { return };
    let canonical = canonical_json(&list.namespaces, list.connection_revision.as_deref());
    let again = parse_sources_file(canonical.as_bytes(), None);
    assert_eq!(again.as_ref().map(|again| &again.namespaces), Ok(&list.namespaces));
});
