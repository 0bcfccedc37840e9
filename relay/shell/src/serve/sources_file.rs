//! The live namespace source list of `kvrelay serve --sources-file` (relay-facts §9.1, §12):
//! parsing, validation, the content revision, and the reload rule. Pure: bytes in, a
//! [`SourceList`] or a typed [`SourcesFileError`] out; the async poller lives in
//! [`super::sources_poller`].
//!
//! The file is `{"version":1,"connectionRevision"?: string,"sources":[{"namespace": ...}]}`:
//!
//! - at most [`SOURCES_FILE_BYTES_MAX`] bytes (checked before anything is decoded), at most
//!   [`SOURCES_MAX`] sources, unknown fields refused at every level;
//! - `version` is 1; every namespace matches `[A-Za-z0-9_-]{1,512}` and appears once;
//! - with the guard variable [`CONNECTION_REVISION_ENV`] set, `connectionRevision` must be
//!   present and equal to it (a file written for another connection is refused); without the
//!   guard any `connectionRevision` is accepted;
//! - an empty `sources` list is valid and selects no namespace (the relay then watches nothing).
//!
//! The revision is the lower-case hex SHA-256 of the canonical JSON: fields in the order
//! `version`, `connectionRevision` (omitted when absent), `sources`; sources sorted by namespace;
//! no whitespace; strings escaped the way Go's `encoding/json` does (HTML-safe: `<`, `>`, `&`,
//! U+2028 and U+2029 as `\u` escapes). Two files that differ only in source order or spacing
//! therefore have the same revision.
//!
//! Reload rule ([`SourcesState`]): a valid file replaces the selection; an invalid one (bad JSON,
//! limits, guard mismatch, read error, a missing file) keeps the last good selection and is
//! reported as the last error until a valid file is read again. A file that does not exist at
//! start-up is not an error: the relay starts with an explicitly empty selection (watching
//! nothing) and applies the file when it appears.
//!
//! Report ([`SourcesReport`], Dynamo's shape): `appliedRevision` is the revision in effect;
//! `desiredRevision` is the revision of the latest read, so it equals `appliedRevision` after a
//! valid read and is `null` while the latest read is refused.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use thiserror::Error;

/// Largest accepted file.
pub const SOURCES_FILE_BYTES_MAX: usize = 1 << 20;
/// Most sources in one file.
pub const SOURCES_MAX: usize = 4096;
/// Longest namespace, in bytes.
pub const NAMESPACE_BYTES_MAX: usize = 512;
/// The only file format version.
pub const SOURCES_FILE_VERSION: u64 = 1;
/// How often the file is read.
pub const SOURCES_POLL_INTERVAL: Duration = Duration::from_secs(1);
/// How long one read may take before it counts as failed.
pub const SOURCES_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// The guard variable: a file's `connectionRevision` must equal it when it is set.
pub const CONNECTION_REVISION_ENV: &str = "DYN_RELAY_CONNECTION_REVISION";

/// Longest part of a bad value echoed in an error.
const ECHO_BYTES_MAX: usize = 64;

/// Why a sources file (or one read of it) is refused. Every variant names the problem.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SourcesFileError {
    /// The file is larger than [`SOURCES_FILE_BYTES_MAX`].
    #[error("sources file has {bytes} bytes or more, more than {SOURCES_FILE_BYTES_MAX}")]
    TooLarge {
        /// Bytes seen (at least).
        bytes: usize,
    },
    /// The file is not JSON of the expected shape (syntax, types, unknown or missing fields).
    #[error("sources file is not a valid source list: {reason}")]
    Json {
        /// The decoder's description.
        reason: String,
    },
    /// `version` is not 1.
    #[error("sources file version {version} is not supported (expected 1)")]
    UnsupportedVersion {
        /// The version found.
        version: u64,
    },
    /// More than [`SOURCES_MAX`] sources.
    #[error("sources file lists {count} sources, more than {SOURCES_MAX}")]
    TooManySources {
        /// Sources listed.
        count: usize,
    },
    /// A namespace is empty, too long, or has a character outside `[A-Za-z0-9_-]`.
    #[error("source namespace {namespace:?} is invalid: {reason}")]
    InvalidNamespace {
        /// The namespace (cut to 64 bytes).
        namespace: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A namespace is listed twice.
    #[error("source namespace {namespace:?} is listed more than once")]
    DuplicateNamespace {
        /// The repeated namespace.
        namespace: String,
    },
    /// The guard is set and the file's `connectionRevision` is missing or different.
    #[error(
        "sources file connectionRevision {found:?} does not match {CONNECTION_REVISION_ENV}={expected:?}"
    )]
    ConnectionRevisionMismatch {
        /// The guard's value.
        expected: String,
        /// The file's value.
        found: Option<String>,
    },
    /// The file could not be read.
    #[error("sources file could not be read: {reason}")]
    Read {
        /// The I/O error.
        reason: String,
    },
    /// A read took longer than [`SOURCES_READ_TIMEOUT`].
    #[error("reading the sources file took longer than {SOURCES_READ_TIMEOUT:?}")]
    ReadTimeout,
    /// The file does not exist (yet, or any more).
    #[error("sources file is unavailable: it does not exist")]
    Missing,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSourcesFile {
    version: u64,
    #[serde(rename = "connectionRevision", default)]
    connection_revision: Option<String>,
    sources: Vec<RawSource>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSource {
    namespace: String,
}

/// A validated source list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceList {
    /// The selected namespaces (possibly none).
    pub namespaces: BTreeSet<String>,
    /// The file's `connectionRevision`, if it has one.
    pub connection_revision: Option<String>,
    /// Lower-case hex SHA-256 of the canonical JSON (see the module docs).
    pub revision: String,
}

/// Parse and validate one read of the file. `guard` is the value of
/// [`CONNECTION_REVISION_ENV`], if set.
pub fn parse_sources_file(
    bytes: &[u8],
    guard: Option<&str>,
) -> Result<SourceList, SourcesFileError> {
    if bytes.len() > SOURCES_FILE_BYTES_MAX {
        return Err(SourcesFileError::TooLarge { bytes: bytes.len() });
    }
    let raw: RawSourcesFile = serde_json::from_slice(bytes)
        .map_err(|error| SourcesFileError::Json { reason: error.to_string() })?;
    if raw.version != SOURCES_FILE_VERSION {
        return Err(SourcesFileError::UnsupportedVersion { version: raw.version });
    }
    if raw.sources.len() > SOURCES_MAX {
        return Err(SourcesFileError::TooManySources { count: raw.sources.len() });
    }
    let mut namespaces = BTreeSet::new();
    for source in raw.sources {
        validate_namespace(&source.namespace)?;
        if namespaces.contains(&source.namespace) {
            return Err(SourcesFileError::DuplicateNamespace { namespace: source.namespace });
        }
        namespaces.insert(source.namespace);
    }
    if let Some(expected) = guard
        && raw.connection_revision.as_deref() != Some(expected)
    {
        return Err(SourcesFileError::ConnectionRevisionMismatch {
            expected: expected.to_owned(),
            found: raw.connection_revision.map(|found| cut(&found)),
        });
    }
    let revision = revision_of(&namespaces, raw.connection_revision.as_deref());
    Ok(SourceList { namespaces, connection_revision: raw.connection_revision, revision })
}

fn validate_namespace(namespace: &str) -> Result<(), SourcesFileError> {
    let reason = if namespace.is_empty() {
        "must not be empty"
    } else if namespace.len() > NAMESPACE_BYTES_MAX {
        "is longer than 512 bytes"
    } else if !namespace.bytes().all(|byte| byte.is_ascii_alphanumeric() || b"_-".contains(&byte)) {
        "may only contain A-Z, a-z, 0-9, '_' and '-'"
    } else {
        return Ok(());
    };
    Err(SourcesFileError::InvalidNamespace { namespace: cut(namespace), reason })
}

/// The canonical JSON of a source list (see the module docs).
#[must_use]
pub fn canonical_json(namespaces: &BTreeSet<String>, connection_revision: Option<&str>) -> String {
    let mut json = format!("{{\"version\":{SOURCES_FILE_VERSION}");
    if let Some(revision) = connection_revision {
        json.push_str(",\"connectionRevision\":");
        push_go_string(&mut json, revision);
    }
    json.push_str(",\"sources\":[");
    for (index, namespace) in namespaces.iter().enumerate() {
        if index > 0 {
            json.push(',');
        }
        json.push_str("{\"namespace\":");
        push_go_string(&mut json, namespace);
        json.push('}');
    }
    json.push_str("]}");
    json
}

/// Lower-case hex SHA-256 of [`canonical_json`].
#[must_use]
pub fn revision_of(namespaces: &BTreeSet<String>, connection_revision: Option<&str>) -> String {
    let digest = Sha256::digest(canonical_json(namespaces, connection_revision).as_bytes());
    let mut hex = String::with_capacity(64);
    for byte in digest {
        let _ = write!(hex, "{byte:02x}");
    }
    hex
}

/// Append `text` as a JSON string literal escaped like Go's `encoding/json` (HTML-safe).
fn push_go_string(out: &mut String, text: &str) {
    out.push('"');
    for character in text.chars() {
        match character {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '<' | '>' | '&' | '\u{2028}' | '\u{2029}' => {
                let _ = write!(out, "\\u{:04x}", u32::from(character));
            }
            control if u32::from(control) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(control));
            }
            other => out.push(other),
        }
    }
    out.push('"');
}

fn cut(text: &str) -> String {
    if text.len() <= ECHO_BYTES_MAX {
        return text.to_owned();
    }
    let mut end = ECHO_BYTES_MAX;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// What `GET /engine/state` reports about the sources (the shape Dynamo's relay reports).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SourcesReport {
    /// Revision of the latest read; `None` while it is refused (or nothing was read).
    pub desired_revision: Option<String>,
    /// Revision of the selection in effect.
    pub applied_revision: Option<String>,
    /// Namespaces selected.
    pub count: usize,
    /// Why the last read was refused; cleared by the next valid read.
    pub last_error: Option<String>,
}

/// The reload state machine: the selection in effect and the last error.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SourcesState {
    applied: Option<SourceList>,
    last_error: Option<SourcesFileError>,
    reloads: u64,
    refusals: u64,
}

impl SourcesState {
    /// No file read yet.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Take one read's outcome. Returns the new namespace selection if it changed (the first
    /// valid read always counts as a change); an error keeps the last good selection.
    pub fn apply(
        &mut self,
        outcome: Result<SourceList, SourcesFileError>,
    ) -> Option<BTreeSet<String>> {
        match outcome {
            Ok(list) => {
                self.last_error = None;
                if self.applied.as_ref().is_some_and(|held| held.revision == list.revision) {
                    return None;
                }
                let namespaces = list.namespaces.clone();
                self.applied = Some(list);
                self.reloads = self.reloads.saturating_add(1);
                Some(namespaces)
            }
            Err(error) => {
                if self.last_error.as_ref() != Some(&error) {
                    self.refusals = self.refusals.saturating_add(1);
                }
                self.last_error = Some(error);
                None
            }
        }
    }

    /// The selection in effect, if a valid file was read.
    #[must_use]
    pub fn applied(&self) -> Option<&SourceList> {
        self.applied.as_ref()
    }

    /// The last refusal, if the latest read was refused.
    #[must_use]
    pub fn last_error(&self) -> Option<&SourcesFileError> {
        self.last_error.as_ref()
    }

    /// Selections applied (valid reads that changed the selection).
    #[must_use]
    pub fn reloads(&self) -> u64 {
        self.reloads
    }

    /// Distinct refusals in a row counted once each (a bad file read every second counts once).
    #[must_use]
    pub fn refusals(&self) -> u64 {
        self.refusals
    }

    /// The `/engine/state` view.
    #[must_use]
    pub fn report(&self) -> SourcesReport {
        let revision = self.applied.as_ref().map(|list| list.revision.clone());
        SourcesReport {
            desired_revision: if self.last_error.is_some() { None } else { revision.clone() },
            applied_revision: revision,
            count: self.applied.as_ref().map_or(0, |list| list.namespaces.len()),
            last_error: self.last_error.as_ref().map(ToString::to_string),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(items: &[&str]) -> BTreeSet<String> {
        items.iter().map(|item| (*item).to_owned()).collect()
    }

    #[test]
    fn a_valid_file_selects_its_namespaces() {
        let list = parse_sources_file(
            br#"{"version":1,"sources":[{"namespace":"ver"},{"namespace":"dynamo"}]}"#,
            None,
        )
        .unwrap();
        assert_eq!(list.namespaces, names(&["dynamo", "ver"]));
        assert_eq!(list.connection_revision, None);
        assert_eq!(list.revision.len(), 64);
        let empty = parse_sources_file(br#"{"version":1,"sources":[]}"#, None).unwrap();
        assert!(empty.namespaces.is_empty());
    }

    #[test]
    fn canonical_json_sorts_sources_and_escapes_like_go() {
        assert_eq!(
            canonical_json(&names(&["b", "a"]), Some("<r&1>\u{2028}\"\n\u{1}")),
            r#"{"version":1,"connectionRevision":"\u003cr\u00261\u003e\u2028\"\n\u0001","sources":[{"namespace":"a"},{"namespace":"b"}]}"#
        );
        assert_eq!(canonical_json(&BTreeSet::new(), None), r#"{"version":1,"sources":[]}"#);
    }

    #[test]
    fn revision_is_the_sha256_of_the_canonical_json() {
        // SHA-256 of `{"version":1,"sources":[]}` (computed with coreutils' sha256sum).
        assert_eq!(
            revision_of(&BTreeSet::new(), None),
            "b6e0bb87bd5035885d74e6e0a9345b7baad41e7ecfd1a03f366f11483213bd6e"
        );
        let spaced = parse_sources_file(
            b"{ \"sources\": [ {\"namespace\":\"b\"}, {\"namespace\":\"a\"} ], \"version\": 1 }",
            None,
        )
        .unwrap();
        let compact = parse_sources_file(
            br#"{"version":1,"sources":[{"namespace":"a"},{"namespace":"b"}]}"#,
            None,
        )
        .unwrap();
        assert_eq!(spaced.revision, compact.revision);
        let guarded = parse_sources_file(
            br#"{"version":1,"connectionRevision":"c1","sources":[{"namespace":"a"},{"namespace":"b"}]}"#,
            Some("c1"),
        )
        .unwrap();
        assert_ne!(guarded.revision, compact.revision);
    }

    #[test]
    fn bad_files_are_typed_errors_naming_the_problem() {
        let long = "n".repeat(513);
        let long_file = format!(r#"{{"version":1,"sources":[{{"namespace":"{long}"}}]}}"#);
        let many: Vec<String> =
            (0..=SOURCES_MAX).map(|i| format!(r#"{{"namespace":"n{i}"}}"#)).collect();
        let many_file = format!(r#"{{"version":1,"sources":[{}]}}"#, many.join(","));
        let huge = vec![b' '; SOURCES_FILE_BYTES_MAX + 1];
        type Check = fn(&SourcesFileError) -> bool;
        let cases: Vec<(&[u8], Check)> = vec![
            (b"{\"version\":1,\"sources\":[", |e| matches!(e, SourcesFileError::Json { .. })),
            (
                br#"{"version":1}"#,
                |e| matches!(e, SourcesFileError::Json { reason } if reason.contains("sources")),
            ),
            (
                br#"{"version":1,"sources":[],"extra":0}"#,
                |e| matches!(e, SourcesFileError::Json { reason } if reason.contains("extra")),
            ),
            (
                br#"{"version":1,"sources":[{"namespace":"a","weight":1}]}"#,
                |e| matches!(e, SourcesFileError::Json { reason } if reason.contains("weight")),
            ),
            (br#"{"version":2,"sources":[]}"#, |e| {
                *e == SourcesFileError::UnsupportedVersion { version: 2 }
            }),
            (br#"{"version":1,"sources":[{"namespace":""}]}"#, |e| {
                matches!(e, SourcesFileError::InvalidNamespace { reason: "must not be empty", .. })
            }),
            (
                br#"{"version":1,"sources":[{"namespace":"a.b"}]}"#,
                |e| matches!(e, SourcesFileError::InvalidNamespace { namespace, .. } if namespace == "a.b"),
            ),
            (br#"{"version":1,"sources":[{"namespace":" a"}]}"#, |e| {
                matches!(e, SourcesFileError::InvalidNamespace { .. })
            }),
            (br#"{"version":1,"sources":[{"namespace":"a"},{"namespace":"a"}]}"#, |e| {
                *e == SourcesFileError::DuplicateNamespace { namespace: "a".into() }
            }),
            (long_file.as_bytes(), |e| {
                matches!(
                    e,
                    SourcesFileError::InvalidNamespace { reason: "is longer than 512 bytes", .. }
                )
            }),
            (many_file.as_bytes(), |e| {
                *e == SourcesFileError::TooManySources { count: SOURCES_MAX + 1 }
            }),
            (&huge, |e| *e == SourcesFileError::TooLarge { bytes: SOURCES_FILE_BYTES_MAX + 1 }),
        ];
        for (bytes, expected) in cases {
            let error = parse_sources_file(bytes, None).unwrap_err();
            assert!(expected(&error), "{error}");
        }
        let ok_long =
            format!(r#"{{"version":1,"sources":[{{"namespace":"{}"}}]}}"#, "N".repeat(512));
        assert!(parse_sources_file(ok_long.as_bytes(), None).is_ok());
    }

    #[test]
    fn the_guard_requires_an_equal_connection_revision() {
        let file = br#"{"version":1,"connectionRevision":"conn-7","sources":[{"namespace":"a"}]}"#;
        assert!(parse_sources_file(file, Some("conn-7")).is_ok());
        assert!(parse_sources_file(file, None).is_ok());
        assert_eq!(
            parse_sources_file(file, Some("conn-8")).unwrap_err(),
            SourcesFileError::ConnectionRevisionMismatch {
                expected: "conn-8".into(),
                found: Some("conn-7".into())
            }
        );
        let unguarded = br#"{"version":1,"sources":[{"namespace":"a"}]}"#;
        assert_eq!(
            parse_sources_file(unguarded, Some("conn-8")).unwrap_err(),
            SourcesFileError::ConnectionRevisionMismatch { expected: "conn-8".into(), found: None }
        );
    }

    #[test]
    fn a_bad_reload_keeps_the_last_good_selection() {
        let mut state = SourcesState::new();
        let first = parse_sources_file(br#"{"version":1,"sources":[{"namespace":"ver"}]}"#, None);
        let first_revision = first.as_ref().unwrap().revision.clone();
        assert_eq!(state.apply(first.clone()), Some(names(&["ver"])));
        let report = state.report();
        assert_eq!(report.desired_revision.as_deref(), Some(first_revision.as_str()));
        assert_eq!(state.apply(first), None, "an unchanged file changes nothing");
        let torn = parse_sources_file(br#"{"version":1,"sources":[{"namesp"#, None);
        assert_eq!(state.apply(torn.clone()), None);
        assert_eq!(state.apply(torn), None);
        assert_eq!(state.applied().unwrap().namespaces, names(&["ver"]));
        assert!(matches!(state.last_error(), Some(SourcesFileError::Json { .. })));
        assert_eq!(state.refusals(), 1, "the same refusal read again counts once");
        let report = state.report();
        assert_eq!(report.count, 1);
        assert!(report.last_error.is_some());
        assert_eq!(report.desired_revision, None, "a refused read desires nothing");
        assert_eq!(report.applied_revision.as_deref(), Some(first_revision.as_str()));
        let wider = parse_sources_file(
            br#"{"version":1,"sources":[{"namespace":"ver"},{"namespace":"dynamo"}]}"#,
            None,
        );
        assert_eq!(state.apply(wider), Some(names(&["dynamo", "ver"])));
        assert_eq!(state.last_error(), None);
        assert_eq!(state.reloads(), 2);
        let json = serde_json::to_value(state.report()).unwrap();
        let revision = serde_json::Value::String(state.applied().unwrap().revision.clone());
        assert_eq!(json["appliedRevision"], revision);
        assert_eq!(json["desiredRevision"], revision, "a valid read desires what it applied");
    }
}
