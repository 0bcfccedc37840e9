//! A `kv-events` payload, read in two passes over its MessagePack without serde.
//!
//! The first pass ([`check_shape`]) walks the headers, counting events and blocks from their
//! declared lengths and keeping nothing, and checks that the records read by name
//! (`RouterEvent`, `KvCacheEvent`, the event data, a store or a removal) are maps. Only when
//! every count is within [`EVENTS_PER_MESSAGE_MAX`], [`BLOCKS_PER_EVENT_MAX`] and
//! [`BLOCKS_PER_MESSAGE_MAX`] does the second pass ([`read_events`]) build the events, each list
//! allocated once at its checked length.
//!
//! The second pass takes what serde's derived readers took from every Dynamo writer: fields by
//! name in any order, unknown fields skipped, a known field twice rejected (before its second
//! value is read), every required field present, `nil` or absence for every optional one,
//! integers of any width (unsigned where the model is, hashes of either sign reinterpreted
//! bitwise), strings as `str` or UTF-8 `bin`, a block as a map or a `[block_hash, tokens_hash]`
//! pair, the event data as `"cleared"` or a one-entry map. It compares keys as bytes and checks
//! as UTF-8 only the strings it keeps (`storage_tier`, `residency_domain`). Where it differs from
//! serde's readers, on forms no Dynamo writer produces: a block map's keys must be strings (serde
//! also took field indices and `bin` keys), a block cannot be a `bin` (serde read one as a list
//! of bytes), and a skipped value may nest deeper than serde's 32 levels (skipping does not
//! recurse). A message with several faults may be refused for a different one than serde's
//! readers named, as each event is finished before the next is read.

use super::errors::{InputError, echo};
use super::limits::{BLOCKS_PER_EVENT_MAX, BLOCKS_PER_MESSAGE_MAX, EVENTS_PER_MESSAGE_MAX};
use super::wire::{MsgpackCursor, check_segment};
use crate::model::hashing::{ExternalBlockHash, LocalBlockHash};
use crate::model::kv_events::{
    KvCacheEvent, KvCacheEventData, RemoveData, ResidencyDomain, RouterEvent, StoreData,
    StoredBlock, residency_domain_from_wire, storage_tier_from_wire,
};

/// What every error of the payload is reported as.
const WHAT: &str = "kv-events payload";

/// First pass over a `kv-events` payload: count events and blocks from the MessagePack headers,
/// keep nothing, and check that the records the second pass reads by name (`RouterEvent`,
/// `KvCacheEvent`, the event data, a store or a removal) are maps, so positional structs never
/// reach it. Returns the length in bytes of the event list (the caller refuses trailing bytes).
pub(super) fn check_shape(payload: &[u8]) -> Result<usize, InputError> {
    let mut cursor = MsgpackCursor::new(payload);
    let events = cursor.array_len().ok_or_else(|| shape_error("a list of events"))?;
    if events > EVENTS_PER_MESSAGE_MAX {
        return Err(InputError::TooMany {
            what: "events in one message",
            count: events,
            max: EVENTS_PER_MESSAGE_MAX,
        });
    }
    let mut total = 0usize;
    for _ in 0..events {
        let mut blocks = None;
        for_each_field(&mut cursor, "a RouterEvent map", |cursor, key| match key {
            b"event" => for_each_field(cursor, "a KvCacheEvent map", |cursor, key| match key {
                b"data" => {
                    // A repeated `data` is refused by the second pass, but counted here, so the
                    // total bounds whatever that pass reads before it refuses.
                    let counted = event_data_blocks(cursor)?;
                    blocks = Some(blocks.unwrap_or(0usize).saturating_add(counted));
                    Ok(())
                }
                _ => skip(cursor),
            }),
            _ => skip(cursor),
        })?;
        let blocks = blocks.ok_or_else(|| shape_error("an event with `data`"))?;
        total = total.saturating_add(blocks);
    }
    if total > BLOCKS_PER_MESSAGE_MAX {
        return Err(InputError::TooMany {
            what: "blocks in one message",
            count: total,
            max: BLOCKS_PER_MESSAGE_MAX,
        });
    }
    Ok(cursor.position())
}

/// The blocks an event's data declares: `"cleared"` (or any other bare variant, which the
/// second pass rejects) has none; `{"stored": {"blocks": [..]}}` and
/// `{"removed": {"block_hashes": [..]}}` have their list's length, at most
/// [`BLOCKS_PER_EVENT_MAX`] (a longer list is rejected from its header). Consumes the data.
fn event_data_blocks(cursor: &mut MsgpackCursor<'_>) -> Result<usize, InputError> {
    if cursor.str().is_some() {
        return Ok(0);
    }
    if cursor.clone().map_len() != Some(1) {
        return Err(shape_error("event data: a variant name or a one-entry map"));
    }
    let mut blocks = 0;
    for_each_field(cursor, "event data", |cursor, variant| {
        let list = match variant {
            b"stored" => b"blocks".as_slice(),
            b"removed" => b"block_hashes".as_slice(),
            _ => return skip(cursor),
        };
        for_each_field(cursor, "a stored or removed map", |cursor, key| {
            if key != list {
                return skip(cursor);
            }
            let count = cursor.array_len().ok_or_else(|| shape_error("a block list"))?;
            if count > BLOCKS_PER_EVENT_MAX {
                return Err(InputError::TooMany {
                    what: "blocks in one event",
                    count,
                    max: BLOCKS_PER_EVENT_MAX,
                });
            }
            blocks += count;
            (0..count).try_for_each(|_| skip(cursor))
        })
    })?;
    Ok(blocks)
}

/// Walk the map here, calling `field` with each key (positioned at its value, which `field` must
/// consume).
fn for_each_field<'a>(
    cursor: &mut MsgpackCursor<'a>,
    expected: &'static str,
    mut field: impl FnMut(&mut MsgpackCursor<'a>, &'a [u8]) -> Result<(), InputError>,
) -> Result<(), InputError> {
    let entries = cursor.map_len().ok_or_else(|| shape_error(expected))?;
    for _ in 0..entries {
        let key = cursor.str().ok_or_else(|| shape_error("a field name"))?;
        field(cursor, key)?;
    }
    Ok(())
}

fn skip(cursor: &mut MsgpackCursor<'_>) -> Result<(), InputError> {
    cursor.skip().ok_or_else(|| shape_error("a complete value"))
}

fn shape_error(expected: &'static str) -> InputError {
    InputError::MessagePack { what: WHAT, detail: format!("expected {expected}") }
}

/// Second pass: the events of a payload [`check_shape`] accepted.
pub(super) fn read_events(payload: &[u8]) -> Result<Vec<RouterEvent>, InputError> {
    let mut cursor = MsgpackCursor::new(payload);
    let count = cursor.array_len().ok_or_else(|| shape_error("a list of events"))?;
    debug_assert!(count <= EVENTS_PER_MESSAGE_MAX, "the first pass bounds the events");
    let mut events = Vec::with_capacity(count.min(EVENTS_PER_MESSAGE_MAX));
    for _ in 0..count {
        events.push(read_router_event(&mut cursor)?);
    }
    Ok(events)
}

/// Read the field `name` with `read` into `slot`, which must still be empty: a field given twice
/// is refused before its second value is read, so it costs nothing (the first pass counted only
/// what a record may hold once).
fn once<'a, T>(
    cursor: &mut MsgpackCursor<'a>,
    slot: &mut Option<T>,
    name: &'static str,
    read: impl FnOnce(&mut MsgpackCursor<'a>) -> Result<T, InputError>,
) -> Result<(), InputError> {
    if slot.is_some() {
        return Err(InputError::MessagePack {
            what: WHAT,
            detail: format!("duplicate field `{name}`"),
        });
    }
    *slot = Some(read(cursor)?);
    Ok(())
}

fn required<T>(slot: Option<T>, name: &'static str) -> Result<T, InputError> {
    slot.ok_or_else(|| InputError::MessagePack {
        what: WHAT,
        detail: format!("missing field `{name}`"),
    })
}

fn invalid(name: &'static str, expected: &'static str) -> InputError {
    InputError::MessagePack { what: WHAT, detail: format!("`{name}`: expected {expected}") }
}

/// An unsigned integer of any width.
fn unsigned(cursor: &mut MsgpackCursor<'_>, name: &'static str) -> Result<u64, InputError> {
    match cursor.int() {
        Some((value, false)) => Ok(value),
        _ => Err(invalid(name, "an unsigned integer")),
    }
}

/// A 64-bit hash: any integer, a negative one reinterpreted bitwise.
fn hash(cursor: &mut MsgpackCursor<'_>, name: &'static str) -> Result<u64, InputError> {
    cursor.int().map(|(value, _)| value).ok_or_else(|| invalid(name, "a 64-bit integer hash"))
}

/// `nil` as `None`, else what `read` reads.
fn optional<'a, T>(
    cursor: &mut MsgpackCursor<'a>,
    read: impl FnOnce(&mut MsgpackCursor<'a>) -> Result<T, InputError>,
) -> Result<Option<T>, InputError> {
    if cursor.nil() { Ok(None) } else { read(cursor).map(Some) }
}

/// A UTF-8 string, borrowed (serde's reader also took UTF-8 as binary).
fn text<'a>(cursor: &mut MsgpackCursor<'a>, name: &'static str) -> Result<&'a str, InputError> {
    let bytes = cursor.str().or_else(|| cursor.bin()).ok_or_else(|| invalid(name, "a string"))?;
    std::str::from_utf8(bytes).map_err(|_| invalid(name, "a UTF-8 string"))
}

fn read_router_event(cursor: &mut MsgpackCursor<'_>) -> Result<RouterEvent, InputError> {
    let (mut worker_id, mut tier, mut domain, mut event) = (None, None, None, None);
    for_each_field(cursor, "a RouterEvent map", |cursor, key| match key {
        b"worker_id" => once(cursor, &mut worker_id, "worker_id", |c| unsigned(c, "worker_id")),
        b"storage_tier" => {
            once(cursor, &mut tier, "storage_tier", |c| optional(c, |c| text(c, "storage_tier")))
        }
        b"residency_domain" => once(cursor, &mut domain, "residency_domain", |c| {
            optional(c, |c| text(c, "residency_domain"))
        }),
        b"event" => once(cursor, &mut event, "event", read_kv_cache_event),
        _ => skip(cursor),
    })?;
    let worker_id = required(worker_id, "worker_id")?;
    let event = required(event, "event")?;
    let tier = tier.flatten();
    let storage_tier = storage_tier_from_wire(tier)
        .ok_or_else(|| InputError::UnknownStorageTier { value: echo(tier.unwrap_or_default()) })?;
    let residency_domain = domain.flatten().map(residency_domain).transpose()?;
    Ok(RouterEvent { worker_id, storage_tier, residency_domain, event })
}

/// A residency domain's name, bounded like every name segment.
fn residency_domain(name: &str) -> Result<ResidencyDomain, InputError> {
    check_segment(name, "residency_domain")?;
    Ok(residency_domain_from_wire(name))
}

fn read_kv_cache_event(cursor: &mut MsgpackCursor<'_>) -> Result<KvCacheEvent, InputError> {
    let (mut event_id, mut data, mut dp_rank) = (None, None, None);
    for_each_field(cursor, "a KvCacheEvent map", |cursor, key| match key {
        b"event_id" => once(cursor, &mut event_id, "event_id", |c| unsigned(c, "event_id")),
        b"data" => once(cursor, &mut data, "data", read_event_data),
        b"dp_rank" => once(cursor, &mut dp_rank, "dp_rank", |c| {
            optional(c, |c| {
                let rank = unsigned(c, "dp_rank")?;
                u32::try_from(rank).map_err(|_| invalid("dp_rank", "a 32-bit unsigned integer"))
            })
        }),
        _ => skip(cursor),
    })?;
    Ok(KvCacheEvent {
        event_id: required(event_id, "event_id")?,
        dp_rank: dp_rank.flatten().unwrap_or(0),
        data: required(data, "data")?,
    })
}

/// `"cleared"`, or a one-entry map `{"stored": {..}}`, `{"removed": {..}}` or `{"cleared": nil}`.
fn read_event_data(cursor: &mut MsgpackCursor<'_>) -> Result<KvCacheEventData, InputError> {
    let unknown = || invalid("data", "`stored`, `removed` or `cleared`");
    if let Some(variant) = cursor.str() {
        return match variant {
            b"cleared" => Ok(KvCacheEventData::Cleared),
            _ => Err(unknown()),
        };
    }
    if cursor.map_len() != Some(1) {
        return Err(shape_error("event data: a variant name or a one-entry map"));
    }
    match cursor.str().ok_or_else(unknown)? {
        b"stored" => read_stored(cursor),
        b"removed" => read_removed(cursor),
        b"cleared" if cursor.nil() => Ok(KvCacheEventData::Cleared),
        _ => Err(unknown()),
    }
}

fn read_stored(cursor: &mut MsgpackCursor<'_>) -> Result<KvCacheEventData, InputError> {
    let (mut parent, mut start, mut blocks) = (None, None, None);
    for_each_field(cursor, "a stored map", |cursor, key| match key {
        b"parent_hash" => {
            once(cursor, &mut parent, "parent_hash", |c| optional(c, |c| hash(c, "parent_hash")))
        }
        b"start_position" => once(cursor, &mut start, "start_position", |c| {
            optional(c, |c| unsigned(c, "start_position"))
        }),
        b"blocks" => once(cursor, &mut blocks, "blocks", read_blocks),
        _ => skip(cursor),
    })?;
    let start_position = start
        .flatten()
        .map(|position| {
            u32::try_from(position).map_err(|_| InputError::InvalidField {
                field: "start_position",
                reason: "exceeds u32",
            })
        })
        .transpose()?;
    Ok(KvCacheEventData::Stored(StoreData {
        parent_hash: parent.flatten().map(ExternalBlockHash),
        start_position,
        blocks: required(blocks, "blocks")?,
    }))
}

/// A block list of at most [`BLOCKS_PER_EVENT_MAX`] entries (the first pass checked it).
fn list_len(cursor: &mut MsgpackCursor<'_>, name: &'static str) -> Result<usize, InputError> {
    let count = cursor.array_len().ok_or_else(|| invalid(name, "a list"))?;
    debug_assert!(count <= BLOCKS_PER_EVENT_MAX, "the first pass bounds every list");
    Ok(count.min(BLOCKS_PER_EVENT_MAX))
}

fn read_blocks(cursor: &mut MsgpackCursor<'_>) -> Result<Vec<StoredBlock>, InputError> {
    let count = list_len(cursor, "blocks")?;
    let mut blocks = Vec::with_capacity(count);
    for _ in 0..count {
        blocks.push(read_block(cursor)?);
    }
    Ok(blocks)
}

/// `{block_hash, tokens_hash}`, or the pair `[block_hash, tokens_hash]`.
fn read_block(cursor: &mut MsgpackCursor<'_>) -> Result<StoredBlock, InputError> {
    let (block_hash, tokens_hash) = if let Some(length) = cursor.array_len() {
        if length != 2 {
            return Err(invalid("blocks", "a block of two fields"));
        }
        (hash(cursor, "block_hash")?, hash(cursor, "tokens_hash")?)
    } else {
        let (mut block_hash, mut tokens_hash) = (None, None);
        for_each_field(cursor, "a block map", |cursor, key| match key {
            b"block_hash" => once(cursor, &mut block_hash, "block_hash", |c| hash(c, "block_hash")),
            b"tokens_hash" => {
                once(cursor, &mut tokens_hash, "tokens_hash", |c| hash(c, "tokens_hash"))
            }
            _ => skip(cursor),
        })?;
        (required(block_hash, "block_hash")?, required(tokens_hash, "tokens_hash")?)
    };
    Ok(StoredBlock {
        block_hash: ExternalBlockHash(block_hash),
        tokens_hash: LocalBlockHash(tokens_hash),
    })
}

fn read_removed(cursor: &mut MsgpackCursor<'_>) -> Result<KvCacheEventData, InputError> {
    let mut hashes = None;
    for_each_field(cursor, "a removed map", |cursor, key| match key {
        b"block_hashes" => once(cursor, &mut hashes, "block_hashes", |c| {
            let count = list_len(c, "block_hashes")?;
            let mut list = Vec::with_capacity(count);
            for _ in 0..count {
                list.push(ExternalBlockHash(hash(c, "block_hashes")?));
            }
            Ok(list)
        }),
        _ => skip(cursor),
    })?;
    Ok(KvCacheEventData::Removed(RemoveData { block_hashes: required(hashes, "block_hashes")? }))
}

#[cfg(test)]
mod tests {
    use rand_core::Rng;
    use serde::Deserialize;
    use serde::de::{self, Deserializer, Visitor};
    use serde_json::{Value, json};

    use super::*;
    use crate::inputs::wire::msgpack_value;
    use crate::model::kv_events::{removed_from_wire, stored_from_wire};
    use crate::rng::rng_from_seed;

    /// serde's derived readers of the same records: the reference the reader is held against.
    mod reference {
        use super::*;

        pub(super) struct Hash(pub(super) u64);

        impl<'de> Deserialize<'de> for Hash {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                struct HashVisitor;
                impl Visitor<'_> for HashVisitor {
                    type Value = Hash;
                    fn expecting(
                        &self,
                        formatter: &mut std::fmt::Formatter<'_>,
                    ) -> std::fmt::Result {
                        formatter.write_str("an integer hash")
                    }
                    fn visit_u64<E: de::Error>(self, value: u64) -> Result<Hash, E> {
                        Ok(Hash(value))
                    }
                    fn visit_i64<E: de::Error>(self, value: i64) -> Result<Hash, E> {
                        Ok(Hash(value as u64))
                    }
                }
                deserializer.deserialize_u64(HashVisitor)
            }
        }

        #[derive(Deserialize)]
        pub(super) struct Event<'a> {
            worker_id: u64,
            #[serde(default, borrow)]
            storage_tier: Option<&'a str>,
            #[serde(default, borrow)]
            residency_domain: Option<&'a str>,
            event: CacheEvent,
        }

        #[derive(Deserialize)]
        struct CacheEvent {
            event_id: u64,
            data: Data,
            #[serde(default)]
            dp_rank: Option<u32>,
        }

        #[derive(Deserialize)]
        #[serde(rename_all = "snake_case")]
        enum Data {
            Stored(Stored),
            Removed(Removed),
            Cleared,
        }

        #[derive(Deserialize)]
        struct Stored {
            #[serde(default)]
            parent_hash: Option<Hash>,
            #[serde(default)]
            start_position: Option<u64>,
            blocks: Vec<Block>,
        }

        #[derive(Deserialize)]
        struct Block {
            block_hash: Hash,
            tokens_hash: Hash,
        }

        #[derive(Deserialize)]
        struct Removed {
            block_hashes: Vec<Hash>,
        }

        pub(super) fn decode(payload: &[u8]) -> Result<Vec<RouterEvent>, InputError> {
            let events: Vec<Event<'_>> = msgpack_value(payload, WHAT)?;
            events.into_iter().map(Event::into_router_event).collect()
        }

        impl Event<'_> {
            fn into_router_event(self) -> Result<RouterEvent, InputError> {
                let storage_tier = storage_tier_from_wire(self.storage_tier).ok_or_else(|| {
                    InputError::UnknownStorageTier { value: echo(self.storage_tier.unwrap_or("")) }
                })?;
                let residency_domain = self.residency_domain.map(residency_domain).transpose()?;
                let data = match self.event.data {
                    Data::Stored(stored) => stored_from_wire(
                        stored.parent_hash.map(|hash| hash.0),
                        stored.start_position,
                        stored
                            .blocks
                            .into_iter()
                            .map(|block| (block.block_hash.0, block.tokens_hash.0)),
                    )
                    .map_err(|_| InputError::InvalidField {
                        field: "start_position",
                        reason: "exceeds u32",
                    })?,
                    Data::Removed(removed) => {
                        removed_from_wire(removed.block_hashes.into_iter().map(|hash| hash.0))
                    }
                    Data::Cleared => KvCacheEventData::Cleared,
                };
                Ok(RouterEvent {
                    worker_id: self.worker_id,
                    storage_tier,
                    residency_domain,
                    event: KvCacheEvent {
                        event_id: self.event.event_id,
                        dp_rank: self.event.dp_rank.unwrap_or(0),
                        data,
                    },
                })
            }
        }
    }

    fn decode(payload: &[u8]) -> Result<Vec<RouterEvent>, InputError> {
        check_shape(payload)?;
        read_events(payload)
    }

    /// An integer the wire may carry where a hash or an id goes: any width, either sign.
    fn any_int(rng: &mut impl Rng) -> Value {
        match rng.next_u32() % 6 {
            0 => json!(rng.next_u32() % 128),
            1 => json!(rng.next_u32() % 65_536),
            2 => json!(rng.next_u64()),
            3 => json!(-i64::from(rng.next_u32() % 40)),
            4 => json!(rng.next_u64() as i64),
            _ => json!(u64::from(rng.next_u32())),
        }
    }

    /// An optional field: absent, `nil`, or `value`.
    fn maybe(
        map: &mut serde_json::Map<String, Value>,
        key: &str,
        value: Value,
        rng: &mut impl Rng,
    ) {
        match rng.next_u32() % 3 {
            0 => {}
            1 => {
                map.insert(key.into(), Value::Null);
            }
            _ => {
                map.insert(key.into(), value);
            }
        }
    }

    fn random_event(rng: &mut impl Rng) -> Value {
        let data = match rng.next_u32() % 5 {
            0 => json!("cleared"),
            1 => {
                json!({"removed": {"block_hashes": (0..rng.next_u32() % 4).map(|_| any_int(rng)).collect::<Vec<_>>()}})
            }
            _ => {
                let mut stored = serde_json::Map::new();
                maybe(&mut stored, "parent_hash", any_int(rng), rng);
                maybe(&mut stored, "start_position", any_int(rng), rng);
                let blocks: Vec<Value> = (0..rng.next_u32() % 4)
                    .map(|_| {
                        if rng.next_u32().is_multiple_of(4) {
                            json!([any_int(rng), any_int(rng)])
                        } else {
                            json!({"block_hash": any_int(rng), "tokens_hash": any_int(rng), "x": [1]})
                        }
                    })
                    .collect();
                stored.insert("blocks".into(), json!(blocks));
                json!({"stored": stored})
            }
        };
        let mut event = serde_json::Map::new();
        event.insert("event_id".into(), any_int(rng));
        event.insert("data".into(), data);
        maybe(&mut event, "dp_rank", any_int(rng), rng);
        let mut record = serde_json::Map::new();
        record.insert("worker_id".into(), any_int(rng));
        record.insert("event".into(), Value::Object(event));
        let tiers = ["device", "host_pinned", "disk", "external", "tape"];
        maybe(&mut record, "storage_tier", json!(tiers[rng.next_u32() as usize % 5]), rng);
        let domains = ["worker", "cache_owner", "rack"];
        maybe(&mut record, "residency_domain", json!(domains[rng.next_u32() as usize % 3]), rng);
        if rng.next_u32().is_multiple_of(3) {
            record.insert("mm_extra_info".into(), json!({"nested": [1, "two", null]}));
        }
        Value::Object(record)
    }

    /// Random payloads, and random byte corruptions of them, that pass the counting pass: the
    /// reader accepts exactly what serde's derived readers accept, with the same events.
    #[test]
    fn the_reader_agrees_with_serdes_derived_readers() {
        let mut rng = rng_from_seed(43);
        let (mut accepted, mut rejected) = (0, 0);
        for round in 0..4_000 {
            let events: Vec<Value> =
                (0..1 + rng.next_u32() % 3).map(|_| random_event(&mut rng)).collect();
            let mut payload = rmp_serde::to_vec_named(&events).unwrap();
            if round % 2 == 1 {
                for _ in 0..1 + rng.next_u32() % 2 {
                    let at = rng.next_u32() as usize % payload.len();
                    payload[at] = rng.next_u32() as u8;
                }
            }
            let Ok(length) = check_shape(&payload) else { continue };
            let payload = &payload[..length];
            let ours = read_events(payload);
            let theirs = reference::decode(payload);
            match (&ours, &theirs) {
                (Ok(ours), Ok(theirs)) => {
                    assert_eq!(ours, theirs, "round {round}: {payload:02x?}");
                    accepted += 1;
                }
                (Err(_), Err(_)) => rejected += 1,
                _ => panic!("round {round}: ours {ours:?}, serde's {theirs:?}: {payload:02x?}"),
            }
        }
        assert!(accepted > 400 && rejected > 400, "{accepted} accepted, {rejected} rejected");
    }

    /// A required field missing, a hash of the wrong type, an id with a sign, a
    /// block pair of three, a rank beyond 32 bits, a field twice: each is rejected.
    #[test]
    fn malformed_records_are_rejected() {
        let cases = [
            json!([{"worker_id": 1, "event": {"event_id": 1}}]),
            json!([{"event": {"event_id": 1, "data": "cleared"}}]),
            json!([{"worker_id": 1, "event": {"event_id": 1, "data": {"removed": {"block_hashes": ["a"]}}}}]),
            json!([{"worker_id": 1, "event": {"event_id": -3, "data": "cleared"}}]),
            json!([{"worker_id": 1, "event": {"event_id": 1, "data": {"stored": {"blocks": [[1, 2, 3]]}}}}]),
            json!([{"worker_id": 1, "event": {"event_id": 1, "data": {"stored": {"blocks": [{"block_hash": 1}]}}}}]),
            json!([{"worker_id": 1, "event": {"event_id": 1, "dp_rank": 1u64 << 32, "data": "cleared"}}]),
            json!([{"worker_id": 1, "event": {"event_id": 1, "data": "stored"}}]),
            json!([{"worker_id": 1, "event": {"event_id": 1, "data": {"cleared": 1}}}]),
            json!([{"worker_id": 1, "storage_tier": 7, "event": {"event_id": 1, "data": "cleared"}}]),
        ];
        for case in cases {
            let payload = rmp_serde::to_vec_named(&case).unwrap();
            assert!(matches!(decode(&payload), Err(InputError::MessagePack { .. })), "{case}");
            assert!(reference::decode(&payload).is_err(), "serde accepts {case}");
        }
        // A key twice (serde_json keeps only the last, so built raw).
        let raw = [
            &[0x91, 0x82][..],
            &rmp_serde::to_vec("worker_id").unwrap(),
            &[0x01],
            &rmp_serde::to_vec("worker_id").unwrap(),
            &[0x02],
        ]
        .concat();
        assert!(decode(&raw).is_err());
    }

    fn str_key(key: &str) -> Vec<u8> {
        rmp_serde::to_vec(key).unwrap()
    }

    fn array32(count: usize) -> Vec<u8> {
        [&[0xdd][..], &(count as u32).to_be_bytes()].concat()
    }

    /// A field given twice is refused before its second value is read: a second block list
    /// whose block is not a block still reports the repetition.
    #[test]
    fn a_repeated_field_is_refused_before_its_value_is_read() {
        let record = [
            &[0x91, 0x82][..],
            &str_key("worker_id"),
            &[0x01],
            &str_key("event"),
            &[0x82],
            &str_key("event_id"),
            &[0x01],
            &str_key("data"),
            &[0x81],
            &str_key("stored"),
            &[0x82],
            &str_key("blocks"),
            &[0x91, 0x92, 0x01, 0x02],
            &str_key("blocks"),
            &[0x91, 0xc3],
        ]
        .concat();
        let Err(InputError::MessagePack { detail, .. }) = decode(&record) else {
            panic!("accepted a repeated field")
        };
        assert!(detail.contains("duplicate field `blocks`"), "{detail}");
    }

    /// The first pass counts every block list of a record, repeated ones too, so a record
    /// cannot carry more blocks than the message limit by repeating its `data`.
    #[test]
    fn repeated_data_counts_against_the_message_limit() {
        let data = [&str_key("data")[..], &[0x81], &str_key("stored"), &[0x81], &str_key("blocks")]
            .concat();
        let list = [array32(BLOCKS_PER_EVENT_MAX), vec![0xc0; BLOCKS_PER_EVENT_MAX]].concat();
        let mut record =
            [&[0x91, 0x82][..], &str_key("worker_id"), &[0x01], &str_key("event")].concat();
        record.push(0x83);
        for _ in 0..3 {
            record.extend(&data);
            record.extend(&list);
        }
        assert_eq!(
            check_shape(&record),
            Err(InputError::TooMany {
                what: "blocks in one message",
                count: 3 * BLOCKS_PER_EVENT_MAX,
                max: BLOCKS_PER_MESSAGE_MAX
            })
        );
    }

    /// A kept string may come as UTF-8 `bin`, as serde's reader took it.
    #[test]
    fn a_storage_tier_may_be_binary() {
        let record = [
            &[0x91, 0x83][..],
            &str_key("worker_id"),
            &[0x01],
            &str_key("storage_tier"),
            &[0xc4, 0x04],
            b"disk",
            &str_key("event"),
            &rmp_serde::to_vec_named(&json!({"event_id": 1, "data": "cleared"})).unwrap(),
        ]
        .concat();
        assert_eq!(
            decode(&record).unwrap()[0].storage_tier,
            crate::model::kv_events::StorageTier::Disk
        );
        assert_eq!(read_events(&record).is_ok(), reference::decode(&record).is_ok());
    }

    /// The forms serde's readers also take: a block pair, `{"cleared": nil}`, signed markers with
    /// non-negative ids; and skipped values nested deeper than serde followed (32 levels), which
    /// the reader skips without recursing.
    #[test]
    fn the_lenient_forms_decode() {
        let payload = rmp_serde::to_vec_named(&json!([
            {"worker_id": 1, "event": {"event_id": 2, "data": {"stored": {"blocks": [[-1, 5]]}}}},
            {"worker_id": 1, "event": {"event_id": 3, "data": {"cleared": null}}},
        ]))
        .unwrap();
        let events = decode(&payload).unwrap();
        let KvCacheEventData::Stored(stored) = &events[0].event.data else { panic!("not stored") };
        assert_eq!(stored.blocks[0].block_hash, ExternalBlockHash(u64::MAX));
        assert_eq!(events[1].event.data, KvCacheEventData::Cleared);
        let deep = [vec![0x91; 200], vec![0xc0]].concat();
        let record = [
            &[0x91, 0x83][..],
            &rmp_serde::to_vec("worker_id").unwrap(),
            &[0xd0, 0x07],
            &rmp_serde::to_vec("deep").unwrap(),
            &deep,
            &rmp_serde::to_vec_named(&json!("event")).unwrap(),
            &rmp_serde::to_vec_named(&json!({"event_id": 1, "data": "cleared"})).unwrap(),
        ]
        .concat();
        assert_eq!(decode(&record).unwrap()[0].worker_id, 7);
    }
}
