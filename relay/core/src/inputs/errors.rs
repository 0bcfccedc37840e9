//! Why an input was rejected, and a tally of rejections that a shell keeps.
//!
//! Every decoder under `inputs` returns [`InputError`] for input it cannot turn into a fact:
//! malformed bytes, values outside the documented vocabulary, disagreeing fields, or sizes above
//! the limits in [`super::limits`]. Decoders never panic on input. Text copied from the input into
//! an error is cut to [`ERROR_ECHO_BYTES_MAX`] bytes, so a hostile input cannot make its own error
//! message large.
//!
//! [`InputCounters`] counts accepted inputs and rejections per [`InputErrorKind`]; a transport
//! shell keeps one per stream and exports it, so a deployment that drifts from the formats this
//! relay understands shows up as a counter rather than as silence.

use thiserror::Error;

use crate::model::identity::EndpointPathError;

/// Longest piece of input text (a key, a subject, an unknown name) copied into an error, in bytes.
pub const ERROR_ECHO_BYTES_MAX: usize = 128;

/// Why an input could not be decoded into a DC fact.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum InputError {
    /// The input, or a text field of it, is longer than its limit; nothing was decoded from it.
    #[error("{what} is {bytes} bytes, more than the limit of {max}")]
    TooLarge {
        /// What was too large.
        what: &'static str,
        /// Its size in bytes.
        bytes: usize,
        /// The limit in bytes.
        max: usize,
    },
    /// A list has more entries than its limit.
    #[error("{what}: {count} entries, more than the limit of {max}")]
    TooMany {
        /// Which list.
        what: &'static str,
        /// How many entries it has.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// Not JSON, or JSON of the wrong shape (missing field, wrong type, duplicate field).
    #[error("malformed JSON in {what}: {detail}")]
    Json {
        /// What was being decoded.
        what: &'static str,
        /// The parser's message (cut to [`ERROR_ECHO_BYTES_MAX`]).
        detail: String,
    },
    /// Not MessagePack, or MessagePack of the wrong shape.
    #[error("malformed MessagePack in {what}: {detail}")]
    MessagePack {
        /// What was being decoded.
        what: &'static str,
        /// The parser's message (cut to [`ERROR_ECHO_BYTES_MAX`]).
        detail: String,
    },
    /// Bytes follow a complete MessagePack value.
    #[error("{count} trailing bytes after the MessagePack value of {what}")]
    TrailingBytes {
        /// What was being decoded.
        what: &'static str,
        /// How many bytes were left over.
        count: usize,
    },
    /// A discovery record's `"type"` is not one of Endpoint, Model, EventSource, EventChannel.
    #[error("unknown discovery record type {record_type:?}")]
    UnknownRecordType {
        /// The type found.
        record_type: String,
    },
    /// A `model_type` flag name is not one of the known surfaces.
    #[error("unknown model_type flag {flag:?}")]
    UnknownModelTypeFlag {
        /// The flag name found.
        flag: String,
    },
    /// A worker type (in `worker_type` or `needs`) is not prefill, decode, encode or aggregated.
    #[error("unknown worker type {value:?} in {field}")]
    UnknownWorkerType {
        /// The field it appeared in.
        field: &'static str,
        /// The value found.
        value: String,
    },
    /// `model_input` is not Text, Tokens or Tensor.
    #[error("unknown model_input {value:?}")]
    UnknownModelInput {
        /// The value found.
        value: String,
    },
    /// A KV event's `storage_tier` is not device, host_pinned, disk or external.
    #[error("unknown storage_tier {value:?}")]
    UnknownStorageTier {
        /// The value found.
        value: String,
    },
    /// An event record is not endpoint-scoped; the relay consumes endpoint-scoped records only.
    #[error("unsupported event scope kind {kind:?}")]
    UnsupportedEventScope {
        /// The scope kind found.
        kind: String,
    },
    /// A transport this relay cannot use.
    #[error("unsupported transport {kind:?} in {field}")]
    UnsupportedTransport {
        /// The field it appeared in.
        field: &'static str,
        /// The transport kind found.
        kind: String,
    },
    /// A namespace/component/endpoint triple is not a valid endpoint path.
    #[error("invalid endpoint in {field}: {source}")]
    InvalidEndpoint {
        /// The field it appeared in.
        field: &'static str,
        /// What is wrong with it.
        source: EndpointPathError,
    },
    /// A field is present but its value cannot be represented or is missing where required.
    #[error("invalid {field}: {reason}")]
    InvalidField {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// An EventSource record and its `metadata` name different publishers.
    #[error(
        "event source record publisher {record} disagrees with its metadata publisher {metadata}"
    )]
    PublisherIdMismatch {
        /// The record's `publisher_id`.
        record: u64,
        /// The metadata's `publisher_id`.
        metadata: u64,
    },
    /// An EventSource record's scope is not the `kv_state_endpoint` its metadata names.
    #[error("event source scope {scope} disagrees with its metadata kv_state_endpoint {metadata}")]
    KvStateEndpointMismatch {
        /// The record's scope endpoint.
        scope: String,
        /// The metadata's `kv_state_endpoint`.
        metadata: String,
    },
    /// An event-plane message carries another topic than the decoder expects.
    #[error("expected topic {expected:?}, found {found:?}")]
    UnexpectedTopic {
        /// The topic the decoder handles.
        expected: &'static str,
        /// The topic found (cut to [`ERROR_ECHO_BYTES_MAX`]).
        found: String,
    },
    /// An event-plane subject does not have the endpoint-scoped shape.
    #[error("malformed event subject {subject:?}: {reason}")]
    MalformedSubject {
        /// The subject (cut to [`ERROR_ECHO_BYTES_MAX`]).
        subject: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A discovery key (etcd key or file-discovery path) does not have a known layout.
    #[error("malformed discovery key {key:?}: {reason}")]
    MalformedKey {
        /// The key (cut to [`ERROR_ECHO_BYTES_MAX`]).
        key: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A ZMQ event message does not have the 4-frame layout with a version-1 event frame.
    #[error("malformed ZMQ event message: {reason}")]
    MalformedEventFrame {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A ZMQ message's routing frames disagree with the envelope they carry.
    #[error("ZMQ {field} frame disagrees with the envelope")]
    FrameMismatch {
        /// Which frame (topic, publisher_id, sequence).
        field: &'static str,
    },
}

/// The kind of an [`InputError`], without its details: the key of [`InputCounters`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[allow(missing_docs)] // one variant per `InputError` variant, documented there
pub enum InputErrorKind {
    TooLarge,
    TooMany,
    Json,
    MessagePack,
    TrailingBytes,
    UnknownRecordType,
    UnknownModelTypeFlag,
    UnknownWorkerType,
    UnknownModelInput,
    UnknownStorageTier,
    UnsupportedEventScope,
    UnsupportedTransport,
    InvalidEndpoint,
    InvalidField,
    PublisherIdMismatch,
    KvStateEndpointMismatch,
    UnexpectedTopic,
    MalformedSubject,
    MalformedKey,
    MalformedEventFrame,
    FrameMismatch,
}

impl InputErrorKind {
    /// Every kind, in declaration order.
    pub const ALL: [InputErrorKind; 21] = [
        InputErrorKind::TooLarge,
        InputErrorKind::TooMany,
        InputErrorKind::Json,
        InputErrorKind::MessagePack,
        InputErrorKind::TrailingBytes,
        InputErrorKind::UnknownRecordType,
        InputErrorKind::UnknownModelTypeFlag,
        InputErrorKind::UnknownWorkerType,
        InputErrorKind::UnknownModelInput,
        InputErrorKind::UnknownStorageTier,
        InputErrorKind::UnsupportedEventScope,
        InputErrorKind::UnsupportedTransport,
        InputErrorKind::InvalidEndpoint,
        InputErrorKind::InvalidField,
        InputErrorKind::PublisherIdMismatch,
        InputErrorKind::KvStateEndpointMismatch,
        InputErrorKind::UnexpectedTopic,
        InputErrorKind::MalformedSubject,
        InputErrorKind::MalformedKey,
        InputErrorKind::MalformedEventFrame,
        InputErrorKind::FrameMismatch,
    ];

    /// A stable snake_case name, for metric labels and logs.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            InputErrorKind::TooLarge => "too_large",
            InputErrorKind::TooMany => "too_many",
            InputErrorKind::Json => "json",
            InputErrorKind::MessagePack => "message_pack",
            InputErrorKind::TrailingBytes => "trailing_bytes",
            InputErrorKind::UnknownRecordType => "unknown_record_type",
            InputErrorKind::UnknownModelTypeFlag => "unknown_model_type_flag",
            InputErrorKind::UnknownWorkerType => "unknown_worker_type",
            InputErrorKind::UnknownModelInput => "unknown_model_input",
            InputErrorKind::UnknownStorageTier => "unknown_storage_tier",
            InputErrorKind::UnsupportedEventScope => "unsupported_event_scope",
            InputErrorKind::UnsupportedTransport => "unsupported_transport",
            InputErrorKind::InvalidEndpoint => "invalid_endpoint",
            InputErrorKind::InvalidField => "invalid_field",
            InputErrorKind::PublisherIdMismatch => "publisher_id_mismatch",
            InputErrorKind::KvStateEndpointMismatch => "kv_state_endpoint_mismatch",
            InputErrorKind::UnexpectedTopic => "unexpected_topic",
            InputErrorKind::MalformedSubject => "malformed_subject",
            InputErrorKind::MalformedKey => "malformed_key",
            InputErrorKind::MalformedEventFrame => "malformed_event_frame",
            InputErrorKind::FrameMismatch => "frame_mismatch",
        }
    }

    /// Position in [`InputErrorKind::ALL`].
    const fn index(self) -> usize {
        self as usize
    }
}

impl InputError {
    /// The kind of this error.
    #[must_use]
    pub fn kind(&self) -> InputErrorKind {
        match self {
            InputError::TooLarge { .. } => InputErrorKind::TooLarge,
            InputError::TooMany { .. } => InputErrorKind::TooMany,
            InputError::Json { .. } => InputErrorKind::Json,
            InputError::MessagePack { .. } => InputErrorKind::MessagePack,
            InputError::TrailingBytes { .. } => InputErrorKind::TrailingBytes,
            InputError::UnknownRecordType { .. } => InputErrorKind::UnknownRecordType,
            InputError::UnknownModelTypeFlag { .. } => InputErrorKind::UnknownModelTypeFlag,
            InputError::UnknownWorkerType { .. } => InputErrorKind::UnknownWorkerType,
            InputError::UnknownModelInput { .. } => InputErrorKind::UnknownModelInput,
            InputError::UnknownStorageTier { .. } => InputErrorKind::UnknownStorageTier,
            InputError::UnsupportedEventScope { .. } => InputErrorKind::UnsupportedEventScope,
            InputError::UnsupportedTransport { .. } => InputErrorKind::UnsupportedTransport,
            InputError::InvalidEndpoint { .. } => InputErrorKind::InvalidEndpoint,
            InputError::InvalidField { .. } => InputErrorKind::InvalidField,
            InputError::PublisherIdMismatch { .. } => InputErrorKind::PublisherIdMismatch,
            InputError::KvStateEndpointMismatch { .. } => InputErrorKind::KvStateEndpointMismatch,
            InputError::UnexpectedTopic { .. } => InputErrorKind::UnexpectedTopic,
            InputError::MalformedSubject { .. } => InputErrorKind::MalformedSubject,
            InputError::MalformedKey { .. } => InputErrorKind::MalformedKey,
            InputError::MalformedEventFrame { .. } => InputErrorKind::MalformedEventFrame,
            InputError::FrameMismatch { .. } => InputErrorKind::FrameMismatch,
        }
    }
}

/// Accepted inputs and rejections per error kind, for one stream of inputs.
///
/// Counts saturate at `u64::MAX` instead of wrapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputCounters {
    accepted: u64,
    rejected: [u64; InputErrorKind::ALL.len()],
}

impl Default for InputCounters {
    fn default() -> Self {
        InputCounters { accepted: 0, rejected: [0; InputErrorKind::ALL.len()] }
    }
}

impl InputCounters {
    /// A tally with every count at zero.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Count one decode result: an `Ok` as accepted, an `Err` under its kind.
    pub fn record<T>(&mut self, result: &Result<T, InputError>) {
        match result {
            Ok(_) => self.accepted = self.accepted.saturating_add(1),
            Err(error) => self.record_error(error),
        }
    }

    /// Count one rejection.
    pub fn record_error(&mut self, error: &InputError) {
        let slot = &mut self.rejected[error.kind().index()];
        *slot = slot.saturating_add(1);
    }

    /// Inputs decoded successfully.
    #[must_use]
    pub fn accepted(&self) -> u64 {
        self.accepted
    }

    /// Inputs rejected with errors of `kind`.
    #[must_use]
    pub fn rejected(&self, kind: InputErrorKind) -> u64 {
        self.rejected[kind.index()]
    }

    /// Inputs rejected for any reason.
    #[must_use]
    pub fn rejected_total(&self) -> u64 {
        self.rejected.iter().fold(0u64, |total, count| total.saturating_add(*count))
    }

    /// The kinds with at least one rejection and their counts, in [`InputErrorKind::ALL`] order.
    pub fn rejections(&self) -> impl Iterator<Item = (InputErrorKind, u64)> + '_ {
        InputErrorKind::ALL
            .iter()
            .map(|kind| (*kind, self.rejected[kind.index()]))
            .filter(|(_, count)| *count > 0)
    }
}

/// `text` cut to at most [`ERROR_ECHO_BYTES_MAX`] bytes on a character boundary, for an error.
pub(crate) fn echo(text: &str) -> String {
    if text.len() <= ERROR_ECHO_BYTES_MAX {
        return text.to_owned();
    }
    let mut end = ERROR_ECHO_BYTES_MAX;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut cut = String::with_capacity(end + 3);
    cut.push_str(&text[..end]);
    cut.push('…');
    cut
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_kind_sits_at_its_own_index_in_all() {
        for (index, kind) in InputErrorKind::ALL.iter().enumerate() {
            assert_eq!(kind.index(), index, "{kind:?}");
        }
        let names: std::collections::BTreeSet<_> =
            InputErrorKind::ALL.iter().map(|kind| kind.name()).collect();
        assert_eq!(names.len(), InputErrorKind::ALL.len());
    }

    #[test]
    fn counters_tally_accepted_results_and_rejections_per_kind() {
        let mut counters = InputCounters::new();
        counters.record::<()>(&Ok(()));
        counters.record::<()>(&Ok(()));
        let topic = InputError::UnexpectedTopic { expected: "kv-events", found: "x".into() };
        counters.record::<()>(&Err(topic.clone()));
        counters.record_error(&topic);
        counters.record::<()>(&Err(InputError::MalformedEventFrame { reason: "r" }));
        assert_eq!(counters.accepted(), 2);
        assert_eq!(counters.rejected(InputErrorKind::UnexpectedTopic), 2);
        assert_eq!(counters.rejected(InputErrorKind::MalformedEventFrame), 1);
        assert_eq!(counters.rejected(InputErrorKind::Json), 0);
        assert_eq!(counters.rejected_total(), 3);
        assert_eq!(
            counters.rejections().collect::<Vec<_>>(),
            vec![(InputErrorKind::UnexpectedTopic, 2), (InputErrorKind::MalformedEventFrame, 1)]
        );
    }

    #[test]
    fn echoed_input_is_cut_on_a_character_boundary() {
        assert_eq!(echo("short"), "short");
        let long = "é".repeat(100); // 200 bytes
        let cut = echo(&long);
        assert!(cut.len() <= ERROR_ECHO_BYTES_MAX + '…'.len_utf8());
        assert!(cut.ends_with('…'));
        assert!(cut.starts_with("éé"));
    }
}
