//! The journal's on-disk format, as pure functions of bytes (docs/journal.md has the layout).
//!
//! A segment is [`SEGMENT_MAGIC`], the format version (`u16` little-endian), two reserved zero
//! bytes, then frames. A frame is the payload length (`u32` LE), the payload's xxh3-64 (`u64`
//! LE) and the payload: one [`Record`] in MessagePack (rmp-serde, structs as arrays). The first
//! record of every segment is a [`Record::Header`], so each segment describes itself.

use serde::{Deserialize, Serialize};
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

use super::checkpoint::{Checkpoint, NO_CADENCE};
use crate::node::{NodeConfig, StartPoint};
use kvrelay_core::inputs::{DcInput, RecoveryTarget};
use kvrelay_core::pool::PublicationPoint;
use kvrelay_core::sources::{RecoveryFailure, RecoveryRequest, RecoveryResponse};

/// The first four bytes of every segment.
pub const SEGMENT_MAGIC: [u8; 4] = *b"KVRJ";

/// The format version this build writes. Version 4 records recovery failures as
/// [`RecoveryFailure`] values; version 5 records where each pool start was applied
/// ([`Record::PoolStart`]); version 6 records the node's timer firings ([`Record::Timer`]) and no
/// longer the pools' timer publications.
pub const FORMAT_VERSION: u16 = 6;

/// The first format version that records timer firings. An older recording's pools published
/// on their timers as script points instead, which this build does not replay (it reads them).
pub const FORMAT_VERSION_TIMERS: u16 = 6;

/// The oldest format version this build reads. Version 3 kept a recovery failure as its text
/// only; it is read as [`RecoveryFailure::Unreachable`] with that text (every failure kind
/// drives recovery the same way, so such a journal replays exactly).
pub const FORMAT_VERSION_OLDEST: u16 = 3;

/// Bytes before the first frame of a segment.
pub const SEGMENT_PREAMBLE_BYTES: usize = 8;

/// Bytes of a frame's length and checksum.
pub const FRAME_HEADER_BYTES: usize = 12;

/// Largest payload a frame may carry; longer lengths are corruption, refused before reading.
pub const RECORD_BYTES_MAX: usize = 64 * 1024 * 1024;

/// When a record was taken: monotonic time since the node started (the node's own clock, the
/// one the control plane sees) and the wall clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Stamp {
    /// Nanoseconds since the node's start.
    pub mono_ns: u64,
    /// Wall clock, microseconds since the Unix epoch.
    pub wall_us: u64,
}

impl Stamp {
    /// The monotonic part as a duration.
    #[must_use]
    pub fn mono(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.mono_ns)
    }
}

/// What a journal was recorded from; repeated at the start of every segment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalHeader {
    /// The recording kvrelay's version.
    pub kvrelay_version: String,
    /// The node configuration, rendered with `{:?}`, for people reading a journal.
    pub config: String,
    /// The node configuration itself, from which a replay rebuilds the node (version 2); replay
    /// refuses a different one (fields added since the recording decode to their defaults).
    pub node: Box<NodeConfig>,
    /// The data center id every pool carries.
    pub dc_id: u64,
    /// The relay incarnation.
    pub relay_incarnation: u64,
    /// The seed the node's generator started from.
    pub rng_seed: u64,
    /// Wall clock when recording started, microseconds since the Unix epoch.
    pub wall_origin_us: u64,
    /// Checkpoint cadence: after this many inputs...
    pub checkpoint_every_inputs: u64,
    /// ...or this many nanoseconds with at least one input, whichever comes first.
    pub checkpoint_interval_ns: u64,
    /// This segment's number (from 0).
    pub segment: u64,
}

impl JournalHeader {
    /// Whether the header has no checkpoint cadence ([`NO_CADENCE`] for both): a window cut out
    /// of a recording, whose checkpoints are the recorded ones of the window, renumbered to its
    /// own inputs, and are compared in their [`Checkpoint::window_view`].
    #[must_use]
    pub fn is_window(&self) -> bool {
        self.checkpoint_every_inputs == NO_CADENCE && self.checkpoint_interval_ns == NO_CADENCE
    }
}

/// The outcome of one recovery query as the transport delivered it.
pub type RecoveryOutcome = Result<RecoveryResponse, RecoveryFailure>;

/// A recorded recovery failure: a value (format 4) or the text format 3 kept.
#[derive(Deserialize)]
#[serde(untagged)]
enum RecordedFailure {
    Value(RecoveryFailure),
    Text(String),
}

fn decode_outcome<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<RecoveryOutcome, D::Error> {
    let outcome = Result::<RecoveryResponse, RecordedFailure>::deserialize(deserializer)?;
    Ok(outcome.map_err(|failure| match failure {
        RecordedFailure::Value(failure) => failure,
        RecordedFailure::Text(text) => RecoveryFailure::Unreachable(text),
    }))
}

/// One journal record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Record {
    /// The segment's header (first record of every segment, and only there).
    Header(JournalHeader),
    /// A DC input, stamped when the node took it.
    Input {
        /// When.
        at: Stamp,
        /// The fact.
        input: DcInput,
    },
    /// A recovery query's answer (or transport failure), stamped when it arrived.
    Recovery {
        /// When.
        at: Stamp,
        /// Where the query went.
        target: RecoveryTarget,
        /// What it asked.
        request: RecoveryRequest,
        /// What came back.
        #[serde(deserialize_with = "decode_outcome")]
        outcome: RecoveryOutcome,
    },
    /// The node's logical state after the input counted in it.
    Checkpoint {
        /// When.
        at: Stamp,
        /// The state.
        checkpoint: Checkpoint,
    },
    /// Records the recorder lost (queue full or disk failure) just before this point: a
    /// replay past a gap is not expected to match.
    Gap {
        /// When the loss was noticed.
        at: Stamp,
        /// How many records were lost.
        lost: u64,
    },
    /// A pool's publication point that its commands do not determine (version 3).
    Publication {
        /// When the pool reported it.
        at: Stamp,
        /// The pool id (`<domain>/<dc>`).
        pool: String,
        /// The generation.
        layout_generation: u64,
        /// What happened, after which of the pool's deterministic commands.
        point: PublicationPoint,
    },
    /// The node fired the relay's timers (version 6): an input like [`Record::Input`], which a
    /// replay performs at the same time after the same inputs.
    Timer {
        /// When: the time the relay was given.
        at: Stamp,
        /// Inputs the node had handled.
        inputs_handled: u64,
    },
    /// A pool start applied by the node: where in its step sequence, and whether the pool
    /// started (version 5). The allocation runs off the node's loop, so this point is not a
    /// function of the inputs.
    PoolStart {
        /// When it was applied.
        at: Stamp,
        /// The pool id (`<domain>/<dc>`).
        pool: String,
        /// The generation.
        layout_generation: u64,
        /// Where it was applied.
        point: StartPoint,
        /// The pool started (`false`: the allocation failed).
        started: bool,
    },
}

impl Record {
    /// The record's stamp (`None` for a header).
    #[must_use]
    pub fn stamp(&self) -> Option<Stamp> {
        match self {
            Record::Header(_) => None,
            Record::Input { at, .. }
            | Record::Recovery { at, .. }
            | Record::Checkpoint { at, .. }
            | Record::Gap { at, .. }
            | Record::Publication { at, .. }
            | Record::Timer { at, .. }
            | Record::PoolStart { at, .. } => Some(*at),
        }
    }

    /// The record's stamp, to change (`None` for a header).
    pub fn stamp_mut(&mut self) -> Option<&mut Stamp> {
        match self {
            Record::Header(_) => None,
            Record::Input { at, .. }
            | Record::Recovery { at, .. }
            | Record::Checkpoint { at, .. }
            | Record::Gap { at, .. }
            | Record::Publication { at, .. }
            | Record::Timer { at, .. }
            | Record::PoolStart { at, .. } => Some(at),
        }
    }
}

/// A record could not be encoded.
#[derive(Debug, Error)]
pub enum EncodeError {
    /// The serializer refused it.
    #[error("encoding a journal record: {0}")]
    Serialize(#[from] rmp_serde::encode::Error),
    /// It is larger than [`RECORD_BYTES_MAX`].
    #[error("journal record of {0} bytes exceeds the {RECORD_BYTES_MAX}-byte limit")]
    TooLarge(usize),
}

/// The segment preamble: magic, format version, reserved.
#[must_use]
pub fn segment_preamble() -> [u8; SEGMENT_PREAMBLE_BYTES] {
    let mut preamble = [0u8; SEGMENT_PREAMBLE_BYTES];
    preamble[..4].copy_from_slice(&SEGMENT_MAGIC);
    preamble[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    preamble
}

/// Append `record` as one frame to `out`; returns the frame's length.
pub fn encode_frame(record: &Record, out: &mut Vec<u8>) -> Result<usize, EncodeError> {
    let start = out.len();
    out.extend_from_slice(&[0u8; FRAME_HEADER_BYTES]);
    if let Err(error) = rmp_serde::encode::write(out, record) {
        out.truncate(start);
        return Err(error.into());
    }
    let payload_len = out.len() - start - FRAME_HEADER_BYTES;
    let Some(len) = u32::try_from(payload_len).ok().filter(|_| payload_len <= RECORD_BYTES_MAX)
    else {
        out.truncate(start);
        return Err(EncodeError::TooLarge(payload_len));
    };
    let checksum = xxh3_64(&out[start + FRAME_HEADER_BYTES..]);
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    out[start + 4..start + FRAME_HEADER_BYTES].copy_from_slice(&checksum.to_le_bytes());
    Ok(out.len() - start)
}

/// What is wrong with a segment at some offset.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FormatError {
    /// The file does not start with [`SEGMENT_MAGIC`].
    #[error("not a kvrelay journal segment (bad magic)")]
    BadMagic,
    /// Written by another format version.
    #[error(
        "journal format version {found}; this build reads versions {FORMAT_VERSION_OLDEST} to {FORMAT_VERSION}"
    )]
    Version {
        /// The version in the file.
        found: u16,
    },
    /// The file ends inside a preamble or frame.
    #[error("truncated: {needed} more bytes expected, {available} present")]
    Truncated {
        /// Bytes the structure needs.
        needed: u64,
        /// Bytes left in the file.
        available: u64,
    },
    /// A frame announces a payload above [`RECORD_BYTES_MAX`].
    #[error("frame length {0} exceeds the {RECORD_BYTES_MAX}-byte limit")]
    FrameTooLarge(u64),
    /// The payload's checksum does not match.
    #[error("checksum mismatch (stored {stored:#018x}, computed {computed:#018x})")]
    Checksum {
        /// Checksum in the frame.
        stored: u64,
        /// Checksum of the bytes read.
        computed: u64,
    },
    /// The payload is not a record.
    #[error("undecodable record: {0}")]
    Decode(String),
    /// The first record of a segment is not its header, or a header appears later.
    #[error("{0}")]
    Structure(&'static str),
}

/// Check a segment's preamble.
pub fn check_preamble(preamble: &[u8]) -> Result<u16, FormatError> {
    if preamble.len() < SEGMENT_PREAMBLE_BYTES {
        if !SEGMENT_MAGIC.starts_with(&preamble[..preamble.len().min(4)]) {
            return Err(FormatError::BadMagic);
        }
        return Err(FormatError::Truncated {
            needed: SEGMENT_PREAMBLE_BYTES as u64,
            available: preamble.len() as u64,
        });
    }
    if preamble[..4] != SEGMENT_MAGIC {
        return Err(FormatError::BadMagic);
    }
    let found = u16::from_le_bytes([preamble[4], preamble[5]]);
    if !(FORMAT_VERSION_OLDEST..=FORMAT_VERSION).contains(&found) {
        return Err(FormatError::Version { found });
    }
    Ok(found)
}

/// A frame header's payload length and checksum; the length is checked against the limit.
pub fn parse_frame_header(header: &[u8; FRAME_HEADER_BYTES]) -> Result<(usize, u64), FormatError> {
    let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    let mut checksum = [0u8; 8];
    checksum.copy_from_slice(&header[4..]);
    let len = usize::try_from(len).map_err(|_| FormatError::FrameTooLarge(u64::from(len)))?;
    if len > RECORD_BYTES_MAX {
        return Err(FormatError::FrameTooLarge(len as u64));
    }
    Ok((len, u64::from_le_bytes(checksum)))
}

/// Verify and decode a frame's payload.
pub fn decode_payload(payload: &[u8], stored: u64) -> Result<Record, FormatError> {
    let computed = xxh3_64(payload);
    if computed != stored {
        return Err(FormatError::Checksum { stored, computed });
    }
    rmp_serde::from_slice(payload).map_err(|error| FormatError::Decode(error.to_string()))
}
