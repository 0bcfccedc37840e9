//! Explicit identity material: the card's optional `indexer_identity` override.
//!
//! An operator may replace the default inputs of cache semantics (the model source path) or of
//! routing scope (the serving endpoint triple) with a small string map. The map is part of
//! identity, so it is validated strictly and bounded before anything is allocated for it:
//! at most [`EXPLICIT_IDENTITY_ENTRIES_MAX`] entries, keys of 1..=128 bytes, values of
//! 1..=1024 bytes, and no duplicate keys — also not in JSON, where a plain map would silently
//! keep the last duplicate and so let two different documents claim the same identity.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use thiserror::Error;

/// Most entries an explicit identity map may hold.
pub const EXPLICIT_IDENTITY_ENTRIES_MAX: usize = 32;
/// Longest key, in UTF-8 bytes.
pub const EXPLICIT_IDENTITY_KEY_BYTES_MAX: usize = 128;
/// Longest value, in UTF-8 bytes.
pub const EXPLICIT_IDENTITY_VALUE_BYTES_MAX: usize = 1024;

/// Why explicit identity material is rejected.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ExplicitIdentityMapError {
    /// The map has no entries; an absent map must be expressed as absent, not empty.
    #[error("explicit identity map must not be empty")]
    Empty,
    /// The map has more than [`EXPLICIT_IDENTITY_ENTRIES_MAX`] entries.
    #[error("explicit identity map has more than {EXPLICIT_IDENTITY_ENTRIES_MAX} entries")]
    TooManyEntries,
    /// A key is the empty string.
    #[error("explicit identity key must not be empty")]
    EmptyKey,
    /// A key is longer than [`EXPLICIT_IDENTITY_KEY_BYTES_MAX`] bytes.
    #[error(
        "explicit identity key of {bytes} bytes exceeds {EXPLICIT_IDENTITY_KEY_BYTES_MAX} bytes"
    )]
    KeyTooLong {
        /// Length of the rejected key in bytes.
        bytes: usize,
    },
    /// The value of `key` is the empty string.
    #[error("explicit identity value for key {key:?} must not be empty")]
    EmptyValue {
        /// The (valid) key whose value is empty.
        key: String,
    },
    /// The value of `key` is longer than [`EXPLICIT_IDENTITY_VALUE_BYTES_MAX`] bytes.
    #[error(
        "explicit identity value for key {key:?} of {bytes} bytes exceeds \
         {EXPLICIT_IDENTITY_VALUE_BYTES_MAX} bytes"
    )]
    ValueTooLong {
        /// The (valid) key whose value is too long.
        key: String,
        /// Length of the rejected value in bytes.
        bytes: usize,
    },
    /// `key` appears more than once.
    #[error("explicit identity key {key:?} appears more than once")]
    DuplicateKey {
        /// The (valid) repeated key.
        key: String,
    },
}

/// Validated explicit identity material: 1..=32 entries, iterated in key order.
///
/// Invariants: non-empty; at most [`EXPLICIT_IDENTITY_ENTRIES_MAX`] entries; every key is
/// 1..=[`EXPLICIT_IDENTITY_KEY_BYTES_MAX`] UTF-8 bytes; every value is
/// 1..=[`EXPLICIT_IDENTITY_VALUE_BYTES_MAX`] UTF-8 bytes. Entry order in the input never matters.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ExplicitIdentityMap {
    entries: BTreeMap<String, String>,
}

impl ExplicitIdentityMap {
    /// Build from key/value pairs in any order; a repeated key is an error, not an overwrite.
    ///
    /// Stops at the first invalid entry, so an oversized input is rejected after at most
    /// `EXPLICIT_IDENTITY_ENTRIES_MAX + 1` entries.
    pub fn try_from_pairs<I, K, V>(pairs: I) -> Result<Self, ExplicitIdentityMapError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        let mut builder = Builder::default();
        for (key, value) in pairs {
            builder.insert(key.into(), value.into())?;
        }
        builder.finish()
    }

    /// Number of entries (1..=32).
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Always false: a validated map has at least one entry. Present for API symmetry.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The value of `key`, if present.
    #[must_use]
    pub fn get(&self, key: &str) -> Option<&str> {
        self.entries.get(key).map(String::as_str)
    }

    /// Entries in ascending key order (byte-wise), the order used by the canonical material.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &str)> {
        self.entries.iter().map(|(key, value)| (key.as_str(), value.as_str()))
    }

    /// The validated entries.
    #[must_use]
    pub fn as_map(&self) -> &BTreeMap<String, String> {
        &self.entries
    }
}

impl TryFrom<BTreeMap<String, String>> for ExplicitIdentityMap {
    type Error = ExplicitIdentityMapError;

    /// Validate an already-deduplicated map.
    fn try_from(entries: BTreeMap<String, String>) -> Result<Self, Self::Error> {
        Self::try_from_pairs(entries)
    }
}

/// Incremental validation shared by [`ExplicitIdentityMap::try_from_pairs`] and the JSON visitor.
#[derive(Default)]
struct Builder {
    entries: BTreeMap<String, String>,
}

impl Builder {
    fn insert(&mut self, key: String, value: String) -> Result<(), ExplicitIdentityMapError> {
        if self.entries.len() >= EXPLICIT_IDENTITY_ENTRIES_MAX {
            return Err(ExplicitIdentityMapError::TooManyEntries);
        }
        if key.is_empty() {
            return Err(ExplicitIdentityMapError::EmptyKey);
        }
        if key.len() > EXPLICIT_IDENTITY_KEY_BYTES_MAX {
            return Err(ExplicitIdentityMapError::KeyTooLong { bytes: key.len() });
        }
        if value.is_empty() {
            return Err(ExplicitIdentityMapError::EmptyValue { key });
        }
        if value.len() > EXPLICIT_IDENTITY_VALUE_BYTES_MAX {
            return Err(ExplicitIdentityMapError::ValueTooLong { key, bytes: value.len() });
        }
        if self.entries.contains_key(&key) {
            return Err(ExplicitIdentityMapError::DuplicateKey { key });
        }
        self.entries.insert(key, value);
        Ok(())
    }

    fn finish(self) -> Result<ExplicitIdentityMap, ExplicitIdentityMapError> {
        if self.entries.is_empty() {
            return Err(ExplicitIdentityMapError::Empty);
        }
        debug_assert!(self.entries.len() <= EXPLICIT_IDENTITY_ENTRIES_MAX);
        Ok(ExplicitIdentityMap { entries: self.entries })
    }
}

impl Serialize for ExplicitIdentityMap {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.iter())
    }
}

impl<'de> Deserialize<'de> for ExplicitIdentityMap {
    /// Deserialize a string-to-string map, rejecting duplicate keys and every limit violation.
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(ExplicitIdentityMapVisitor)
    }
}

struct ExplicitIdentityMapVisitor;

impl<'de> Visitor<'de> for ExplicitIdentityMapVisitor {
    type Value = ExplicitIdentityMap;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a map of 1 to 32 unique string keys to string values")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Self::Value, A::Error> {
        let mut builder = Builder::default();
        while let Some((key, value)) = access.next_entry::<String, String>()? {
            builder.insert(key, value).map_err(de::Error::custom)?;
        }
        builder.finish().map_err(de::Error::custom)
    }
}

/// A card's `indexer_identity`: optional explicit material per identity dimension.
///
/// An absent dimension falls back to its defaults. JSON field names are `semantics` and
/// `routing_scope`; both may be omitted or `null`. Unknown fields are ignored (cards evolve).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct IndexerIdentitySpec {
    /// Replaces the model source path in cache semantics (block size and hash format stay).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub semantics: Option<ExplicitIdentityMap>,
    /// Replaces the serving endpoint triple in routing scope.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing_scope: Option<ExplicitIdentityMap>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map_of(count: usize) -> Result<ExplicitIdentityMap, ExplicitIdentityMapError> {
        ExplicitIdentityMap::try_from_pairs((0..count).map(|i| (format!("k{i:02}"), "v")))
    }

    fn single(key: &str, value: &str) -> Result<ExplicitIdentityMap, ExplicitIdentityMapError> {
        ExplicitIdentityMap::try_from_pairs([(key, value)])
    }

    #[test]
    fn explicit_identity_map_entry_count_is_bounded_on_both_sides() {
        assert_eq!(map_of(0), Err(ExplicitIdentityMapError::Empty));
        assert_eq!(map_of(1).map(|map| map.len()), Ok(1));
        assert_eq!(map_of(EXPLICIT_IDENTITY_ENTRIES_MAX).map(|map| map.len()), Ok(32));
        assert_eq!(
            map_of(EXPLICIT_IDENTITY_ENTRIES_MAX + 1),
            Err(ExplicitIdentityMapError::TooManyEntries)
        );
    }

    #[test]
    fn explicit_identity_map_does_not_consume_unbounded_input() {
        let mut pulled = 0usize;
        let endless = std::iter::repeat_with(|| {
            pulled += 1;
            (format!("k{pulled}"), "v".to_owned())
        });
        assert_eq!(
            ExplicitIdentityMap::try_from_pairs(endless),
            Err(ExplicitIdentityMapError::TooManyEntries)
        );
        assert_eq!(pulled, EXPLICIT_IDENTITY_ENTRIES_MAX + 1);
    }

    #[test]
    fn explicit_identity_key_length_is_bounded_in_utf8_bytes() {
        assert_eq!(single("", "v"), Err(ExplicitIdentityMapError::EmptyKey));
        assert!(single("k", "v").is_ok());
        assert!(single(&"k".repeat(128), "v").is_ok());
        assert_eq!(
            single(&"k".repeat(129), "v"),
            Err(ExplicitIdentityMapError::KeyTooLong { bytes: 129 })
        );
        // 64 two-byte characters are exactly 128 bytes; 43 three-byte characters are 129.
        assert!(single(&"é".repeat(64), "v").is_ok());
        assert_eq!(
            single(&"€".repeat(43), "v"),
            Err(ExplicitIdentityMapError::KeyTooLong { bytes: 129 })
        );
    }

    #[test]
    fn explicit_identity_value_length_is_bounded_in_utf8_bytes() {
        assert_eq!(single("k", ""), Err(ExplicitIdentityMapError::EmptyValue { key: "k".into() }));
        assert!(single("k", "v").is_ok());
        assert!(single("k", &"v".repeat(1024)).is_ok());
        assert_eq!(
            single("k", &"v".repeat(1025)),
            Err(ExplicitIdentityMapError::ValueTooLong { key: "k".into(), bytes: 1025 })
        );
        assert!(single("k", &"é".repeat(512)).is_ok());
        assert_eq!(
            single("k", &"é".repeat(513)),
            Err(ExplicitIdentityMapError::ValueTooLong { key: "k".into(), bytes: 1026 })
        );
    }

    #[test]
    fn explicit_identity_map_rejects_duplicate_pairs() {
        assert_eq!(
            ExplicitIdentityMap::try_from_pairs([("a", "1"), ("b", "2"), ("a", "1")]),
            Err(ExplicitIdentityMapError::DuplicateKey { key: "a".into() })
        );
    }

    #[test]
    fn explicit_identity_map_rejects_duplicate_json_keys() {
        for json in [r#"{"a":"1","a":"2"}"#, r#"{"a":"1","b":"2","a":"1"}"#] {
            let error = serde_json::from_str::<ExplicitIdentityMap>(json).unwrap_err();
            assert!(error.to_string().contains("appears more than once"), "{json}: {error}");
        }
        let spec = r#"{"semantics":{"model":"x","model":"y"}}"#;
        assert!(serde_json::from_str::<IndexerIdentitySpec>(spec).is_err());
        let spec = r#"{"routing_scope":{"pool":"x","pool":"x"}}"#;
        assert!(serde_json::from_str::<IndexerIdentitySpec>(spec).is_err());
    }

    #[test]
    fn explicit_identity_json_enforces_limits_and_string_values() {
        for bad in [r#"{}"#, r#"{"":"v"}"#, r#"{"k":""}"#, r#"{"k":1}"#, r#"["k","v"]"#, "null"] {
            assert!(serde_json::from_str::<ExplicitIdentityMap>(bad).is_err(), "{bad}");
        }
        let too_many: serde_json::Map<String, serde_json::Value> =
            (0..33).map(|i| (format!("k{i}"), serde_json::Value::from("v"))).collect();
        let json = serde_json::Value::Object(too_many).to_string();
        assert!(serde_json::from_str::<ExplicitIdentityMap>(&json).is_err());
    }

    #[test]
    fn explicit_identity_map_json_round_trips_in_key_order() {
        let map: ExplicitIdentityMap = serde_json::from_str(r#"{"b":"2","a":"1"}"#).unwrap();
        assert_eq!(map.iter().collect::<Vec<_>>(), [("a", "1"), ("b", "2")]);
        assert_eq!(map.get("b"), Some("2"));
        assert!(!map.is_empty());
        assert_eq!(serde_json::to_string(&map).unwrap(), r#"{"a":"1","b":"2"}"#);
    }

    #[test]
    fn indexer_identity_spec_uses_card_field_names_and_optional_dimensions() {
        let spec: IndexerIdentitySpec =
            serde_json::from_str(r#"{"semantics":{"model":"m"},"future":1}"#).unwrap();
        assert_eq!(spec.semantics, Some(single("model", "m").unwrap()));
        assert_eq!(spec.routing_scope, None);
        let spec: IndexerIdentitySpec =
            serde_json::from_str(r#"{"semantics":null,"routing_scope":{"scope":"s"}}"#).unwrap();
        assert_eq!(spec.semantics, None);
        assert_eq!(spec.routing_scope, Some(single("scope", "s").unwrap()));
        assert_eq!(serde_json::to_string(&spec).unwrap(), r#"{"routing_scope":{"scope":"s"}}"#);
        assert_eq!(serde_json::from_str::<IndexerIdentitySpec>("{}").unwrap(), Default::default());
    }
}
