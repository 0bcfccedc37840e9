//! Soft discovery errors: records (or parts of records) the relay leaves out while the rest of
//! what they belong to stays valid — an adapter card without its base card, an alias that
//! cannot be a request name, a key a transport cannot read.
//!
//! They are not materialization conflicts (nothing is fenced), so nothing else would show them:
//! the discovery transports report the current set through their stats, the operations surface
//! counts and lists it. Each error is identified by `(kind, key)`; the reason says what is
//! wrong in words, bounded in length.

use std::fmt;

use serde::Serialize;

use crate::inputs::{CardInstanceId, ERROR_ECHO_BYTES_MAX};

/// What was left out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SoftErrorKind {
    /// An adapter card whose worker has no single base card on the same endpoint: the adapter
    /// is not served.
    OrphanAdapter,
    /// An alias that is empty or has surrounding whitespace: the alias is dropped.
    InvalidAlias,
    /// An alias that two bindings in the view claim: it is dropped from both.
    AmbiguousAlias,
    /// A discovery key the transport cannot read (not UTF-8): its record is skipped.
    UnreadableKey,
    /// A second spelling of a key already listed (two file names decoding to one key): only
    /// the first spelling in key order is read.
    DuplicateKey,
}

impl SoftErrorKind {
    /// Every kind, in metric order.
    pub const ALL: [SoftErrorKind; 5] = [
        SoftErrorKind::OrphanAdapter,
        SoftErrorKind::InvalidAlias,
        SoftErrorKind::AmbiguousAlias,
        SoftErrorKind::UnreadableKey,
        SoftErrorKind::DuplicateKey,
    ];

    /// The kind as a metric label and JSON value.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            SoftErrorKind::OrphanAdapter => "orphan_adapter",
            SoftErrorKind::InvalidAlias => "invalid_alias",
            SoftErrorKind::AmbiguousAlias => "ambiguous_alias",
            SoftErrorKind::UnreadableKey => "unreadable_key",
            SoftErrorKind::DuplicateKey => "duplicate_key",
        }
    }
}

impl fmt::Display for SoftErrorKind {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.as_str())
    }
}

/// One soft error. `key` and `reason` are cut to [`ERROR_ECHO_BYTES_MAX`] bytes (on a
/// character boundary, marked with `…`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct SoftDiscoveryError {
    /// What was left out.
    pub kind: SoftErrorKind,
    /// Which record: a card identity `namespace/component/endpoint/instance[/suffix]`, an
    /// endpoint path, or a raw key.
    pub key: String,
    /// Why, in words.
    pub reason: String,
}

impl SoftDiscoveryError {
    /// A soft error, with `key` and `reason` cut to their bound.
    #[must_use]
    pub fn new(kind: SoftErrorKind, key: &str, reason: &str) -> Self {
        SoftDiscoveryError { kind, key: cut(key), reason: cut(reason) }
    }
}

/// A card identity as the key of a soft error: `namespace/component/endpoint/instance` in
/// lowercase hex, then `/suffix` for an adapter (the etcd key's spelling, without `v1/mdc/`).
#[must_use]
pub fn card_key(id: &CardInstanceId) -> String {
    match &id.model_suffix {
        Some(suffix) => format!("{}/{:x}/{suffix}", id.endpoint, id.instance_id),
        None => format!("{}/{:x}", id.endpoint, id.instance_id),
    }
}

fn cut(text: &str) -> String {
    if text.len() <= ERROR_ECHO_BYTES_MAX {
        return text.to_owned();
    }
    let mut end = ERROR_ECHO_BYTES_MAX;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::identity::EndpointPath;

    #[test]
    fn keys_and_reasons_are_bounded_on_a_character_boundary() {
        let long = "é".repeat(ERROR_ECHO_BYTES_MAX);
        let error = SoftDiscoveryError::new(SoftErrorKind::InvalidAlias, &long, &long);
        assert!(error.key.len() <= ERROR_ECHO_BYTES_MAX + '…'.len_utf8());
        assert!(error.key.ends_with('…'));
        assert_eq!(error.reason, error.key);
        let short = SoftDiscoveryError::new(SoftErrorKind::DuplicateKey, "k", "r");
        assert_eq!((short.key.as_str(), short.reason.as_str()), ("k", "r"));
    }

    #[test]
    fn card_keys_spell_the_identity_like_the_etcd_key() {
        let endpoint = EndpointPath::new("ns", "backend", "generate").unwrap();
        let base =
            CardInstanceId { endpoint: endpoint.clone(), instance_id: 31, model_suffix: None };
        assert_eq!(card_key(&base), "ns/backend/generate/1f");
        let adapter = CardInstanceId { model_suffix: Some("ad-1".into()), ..base };
        assert_eq!(card_key(&adapter), "ns/backend/generate/1f/ad-1");
        let names: Vec<&str> = SoftErrorKind::ALL.iter().map(|kind| kind.as_str()).collect();
        assert_eq!(
            names,
            [
                "orphan_adapter",
                "invalid_alias",
                "ambiguous_alias",
                "unreadable_key",
                "duplicate_key"
            ]
        );
    }
}
