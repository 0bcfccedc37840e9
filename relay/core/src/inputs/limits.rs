//! Size limits of every wire input, checked before anything is allocated for it.
//!
//! The limits are generous on purpose: they exist to turn a corrupt or hostile input into a typed
//! rejection instead of an unbounded allocation, not to police normal traffic. Each constant says
//! what the reference deployment normally sends and why the bound is where it is. At a bound the
//! decoder rejects the whole input ([`super::InputError::TooLarge`] or
//! [`super::InputError::TooMany`]); it never truncates silently.

/// Largest discovery record (file-discovery file, etcd value) or bare card JSON, in bytes.
///
/// A card with its runtime config is a few KiB; 4 MiB leaves room for large `user_data` or
/// `runtime_data` blobs while bounding the JSON parser's allocations.
pub const DISCOVERY_RECORD_BYTES_MAX: usize = 4 << 20;

/// Largest event-plane envelope (NATS body or ZMQ event frame), in bytes.
///
/// Normal messages are a few hundred bytes to ~1 MiB (≤ 128 events, ≤ 8192 blocks). A single
/// oversized store event is sent whole, so the bound is sized for one event of
/// [`BLOCKS_PER_EVENT_MAX`] blocks in named MessagePack (~60 bytes per block).
pub const EVENT_ENVELOPE_BYTES_MAX: usize = 64 << 20;

/// Most `RouterEvent`s in one `kv-events` message.
///
/// Dynamo's publisher sends at most 128 per message; 32x headroom.
pub const EVENTS_PER_MESSAGE_MAX: usize = 4096;

/// Most blocks (stored blocks or removed hashes) in one event.
///
/// Normal batches stop at 128 blocks, but one engine store is never split: a prompt of 16 Mi
/// tokens at block size 16 is 1 Mi blocks.
pub const BLOCKS_PER_EVENT_MAX: usize = 1 << 20;

/// Most blocks (stored blocks plus removed hashes) in one `kv-events` message.
///
/// Normally ≤ 8192. This is the bound that caps memory: 2 Mi decoded blocks are 32 MiB.
pub const BLOCKS_PER_MESSAGE_MAX: usize = 1 << 21;

/// Longest free-text value: model names, source paths, aliases, LoRA names, transport
/// addresses, in UTF-8 bytes. Filesystem paths are at most 4096 bytes on Linux.
pub const TEXT_BYTES_MAX: usize = 4096;

/// Longest name segment: namespace, component, endpoint, model suffix, topic, residency domain,
/// in UTF-8 bytes. Real segments are a few dozen bytes.
pub const SEGMENT_BYTES_MAX: usize = 512;

/// Longest event-plane subject, in bytes: four segments at [`SEGMENT_BYTES_MAX`], each possibly
/// tripled by `%XX` escaping, plus the fixed words.
pub const EVENT_SUBJECT_BYTES_MAX: usize = 16 * SEGMENT_BYTES_MAX;

/// Longest logical discovery key, in bytes: like a subject, four escaped segments plus fixed
/// words and a hex id.
pub const DISCOVERY_KEY_BYTES_MAX: usize = 16 * SEGMENT_BYTES_MAX;

/// Longest file-discovery path, in bytes: a key whose every byte may be escaped again.
pub const DISCOVERY_FILE_PATH_BYTES_MAX: usize = 3 * DISCOVERY_KEY_BYTES_MAX;

/// Most aliases on one card.
pub const ALIASES_MAX: usize = 64;

/// Most alternatives (the outer OR list) in a card's `needs`.
pub const NEEDS_ALTERNATIVES_MAX: usize = 16;

/// Most roles in one alternative (the inner AND set) of a card's `needs`; four roles exist.
pub const NEEDS_ROLES_MAX: usize = 8;

/// Longest canonical taints JSON text kept from a card, in bytes.
pub const TAINTS_JSON_BYTES_MAX: usize = 64 << 10;

/// Deepest MessagePack nesting accepted. Real payloads nest about 8 levels (message, event,
/// data, store, blocks, block, multimodal info, offsets).
pub const MSGPACK_DEPTH_MAX: usize = 32;
