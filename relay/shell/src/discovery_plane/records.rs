//! The record differ: turns what a discovery transport saw (complete listings, single puts and
//! deletes of `(key, bytes)`) into typed [`DcInput`] facts and event-channel changes.
//!
//! It is sans-IO: no clock, no task, no file or socket. The file backend feeds it one listing per
//! poll, the etcd backend one listing per (re)list and one put/delete per watch event; tests feed
//! it by hand. Every transport therefore produces the same facts for the same records.
//!
//! What it emits, per record kind (dc-inputs §1.3, §3.1, §4):
//!
//! | record | facts |
//! | --- | --- |
//! | `v1/mdc/...` (Model) | `CardUpserted`, `CardTaintsUpdated` (only the taints changed), `CardRemoved`; `CardsListed` for the first listing and for a relist that changed any card |
//! | `v1/instances/...` (Endpoint) | `Instances{endpoint, Some(set)}` for every endpoint whose live set changed, from the first complete listing on; `Some(empty)` when its last instance went |
//! | `v1/event_sources/...` (EventSource, topic `kv-events`) | `SourceAdvertised`; `SourceWithdrawn{kv_state_endpoint, publisher_id}` when it goes or changes |
//! | `v1/event_channels/...` (EventChannel, any topic) | [`ChannelChange::Upsert`] / [`ChannelChange::Remove`] |
//!
//! Invariants:
//!
//! - **One record per key.** Records are held by their parsed [`DiscoveryKey`]; a value must
//!   describe the key it is stored under (else it is malformed). Facts therefore map one to one
//!   onto keys: a card identity, an `(endpoint, instance)` pair, a `(kv_state_endpoint,
//!   publisher)` advert, a channel.
//! - **The last good record stands.** A key whose new value is malformed (a torn write, a value
//!   this relay cannot read) keeps the record it held before; only a delete, an expiry or a
//!   listing without the key removes it. Malformed values are counted in [`InputCounters`] and
//!   logged once per distinct value: an unchanged value seen again by the next poll is neither
//!   decoded nor counted again (a 128-bit XXH3 digest of the bytes tells).
//! - **Availability is authoritative only after the first complete listing.** Until then no
//!   `Instances` fact is emitted. From then on an endpoint is announced once it has an instance,
//!   and every change of its set is emitted, down to `Some(empty)`. An endpoint that never had an
//!   instance is never announced: like Dynamo's client (`available_instance_ids()` is `None`
//!   until one instance was seen), its availability stays unknown.
//! - **Scope.** Cards and instances are kept only when the scope includes their endpoint. Event
//!   sources and channels are kept when the scope's namespace selection includes their scope
//!   endpoint's namespace: endpoint prefixes do not apply to them, because a card may name a
//!   `kv_state_endpoint` outside its own prefix. Records out of scope are not decoded at all.
//! - **Deterministic order.** Within one step the outputs come in this order: cards, instance
//!   sets, source withdrawals, source adverts, channel removals, channel upserts; within each
//!   group in key order ([`BTreeMap`] iteration).
//! - **Only the four record buckets.** Keys outside `v1/{instances,mdc,event_channels,
//!   event_sources}/` belong to other Dynamo subsystems sharing the store; they are ignored
//!   without being counted. Keys inside them that do not parse are counted as malformed.
//! - **Soft errors are reported, not dropped.** A card set's orphan adapters, invalid and
//!   ambiguous aliases ([`card_soft_errors`], recomputed whenever a card changes), keys a
//!   transport could not read and second spellings of a listed key are held in a
//!   [`SoftErrorLog`] whose report ([`RecordDiffer::soft_errors`]) the transports publish.
//! - **Bounded.** At most [`DISCOVERY_RECORDS_MAX`] keys are held; a listing or put beyond it is
//!   counted as [`InputErrorKind::TooMany`](kvrelay_core::inputs::InputErrorKind) and the extra keys are
//!   ignored (transports refuse such listings before they get here, see the backends).

use std::collections::{BTreeMap, BTreeSet};

use tracing::warn;
use xxhash_rust::xxh3::xxh3_128;

use super::soft_errors::{SoftErrorLog, SoftErrorReport};
use kvrelay_core::discovery::{
    DiscoveryScope, NamespaceSelection, SoftDiscoveryError, SoftErrorKind, card_soft_errors,
};
use kvrelay_core::inputs::{
    CardInstanceId, DcInput, DiscoveryKey, DiscoveryRecord, EndpointInstances, EventRecordKey,
    InputCounters, InputError, ModelCard, decode_discovery_record,
};
use kvrelay_core::model::identity::EndpointPath;

/// The buckets (`v1/{bucket}/...`) that hold discovery records.
pub const DISCOVERY_BUCKETS: [&str; 4] = ["instances", "mdc", "event_channels", "event_sources"];

/// Most discovery keys one differ holds (and most entries a backend accepts in one listing).
///
/// A worker registers about five keys (instance, card, adapters, source, channels), so this is
/// room for over ten thousand workers in one data center.
pub const DISCOVERY_RECORDS_MAX: usize = 1 << 16;

/// How the keys handed to a differ are spelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyForm {
    /// Logical keys as etcd stores them (`v1/mdc/dynamo/backend/generate/1f`).
    Logical,
    /// File-backend paths relative to the root (`v1/mdc/dynamo%2Fbackend%2Fgenerate%2F1f`).
    FilePath,
}

/// What kind of complete listing a transport hands in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListingMode {
    /// A reconciliation relist (etcd: initial list, after compaction, every 30 s): a changed card
    /// set is reported as one `CardsListed` that replaces the consumer's cards.
    Relist,
    /// A routine complete listing (file polls, periodic reconciling relists): changed cards
    /// are reported one by one, so a listing that finds what the differ holds reports nothing
    /// and one that finds drift reports exactly the difference. The first listing of a differ
    /// is always reported as `CardsListed`, whatever the mode.
    Poll,
}

/// The value a listing found under one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryValue {
    /// The stored bytes.
    Bytes(Vec<u8>),
    /// The transport already knows the value is unusable (e.g. larger than the record limit);
    /// it is counted like a malformed value.
    Rejected(InputError),
    /// The key exists but its value could not be read this time (an I/O error): whatever the
    /// key held before stays, and the next listing tries again. Nothing is counted here (I/O
    /// errors are the transport's to count).
    Unreadable,
    /// The transport knows the value is the one it handed in last time under this key (the
    /// file backend: same size and modification time) and did not read it again: whatever the
    /// key holds stays, and nothing is counted or logged again.
    Unchanged,
}

/// One key of a complete listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListingEntry {
    /// The key, spelled in the differ's [`KeyForm`].
    pub key: String,
    /// What was found under it.
    pub value: EntryValue,
}

impl ListingEntry {
    /// An entry holding `bytes`.
    #[must_use]
    pub fn bytes(key: impl Into<String>, bytes: impl Into<Vec<u8>>) -> Self {
        ListingEntry { key: key.into(), value: EntryValue::Bytes(bytes.into()) }
    }
}

/// A change of one publisher's event channel, for the event-plane transport (the type the ZMQ
/// event plane consumes).
pub use crate::event_plane::ChannelChange;

/// One output of the differ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoveryOutput {
    /// A DC fact for the relay's input boundary.
    Fact(DcInput),
    /// An event-channel change for the event-plane transport.
    Channel(ChannelChange),
}

/// What the differ holds under one key.
#[derive(Debug, Clone)]
struct Slot {
    /// The key as the transport spelled it (a delete must name the same spelling).
    raw_key: String,
    /// Digest of the last value seen under the key, good or not.
    digest: u128,
    /// The last good record; `None` if no value under this key was ever good.
    record: Option<DiscoveryRecord>,
}

/// Changes accumulated during one step, turned into outputs by [`RecordDiffer::finish`].
#[derive(Debug, Default)]
struct Changes {
    cards: Vec<DcInput>,
    endpoints: BTreeSet<EndpointPath>,
    withdrawn: Vec<DcInput>,
    advertised: Vec<DcInput>,
    channels_removed: Vec<ChannelChange>,
    channels_upserted: Vec<ChannelChange>,
}

/// The transport-independent record differ. See the module docs for its invariants.
#[derive(Debug)]
pub struct RecordDiffer {
    scope: DiscoveryScope,
    key_form: KeyForm,
    slots: BTreeMap<DiscoveryKey, Slot>,
    /// Raw keys that do not parse, with the digest of the value last seen under them, so a key
    /// that stays broken is counted once. Bounded by [`DISCOVERY_RECORDS_MAX`]; beyond it a
    /// broken key is counted every time it is seen.
    broken_keys: BTreeMap<String, u128>,
    /// Endpoints announced with a non-empty live set, and that set.
    announced: BTreeMap<EndpointPath, BTreeSet<u64>>,
    listed: bool,
    counters: InputCounters,
    /// A live narrowing of the scope's namespaces (`--sources-file`): `Some(set)` keeps only
    /// records of those namespaces (none when empty). Applied by the next complete listing.
    namespace_limit: Option<BTreeSet<String>>,
    /// The soft errors of the held card set, as of the last card change.
    card_errors: Vec<SoftDiscoveryError>,
    /// Key-level soft errors (unreadable keys, second spellings) by raw key: those of the last
    /// listing, plus unreadable keys watch events named since.
    key_errors: BTreeMap<String, SoftDiscoveryError>,
    soft_log: SoftErrorLog,
}

impl RecordDiffer {
    /// An empty differ for `scope`, reading keys spelled as `key_form`.
    #[must_use]
    pub fn new(scope: DiscoveryScope, key_form: KeyForm) -> Self {
        RecordDiffer {
            scope,
            key_form,
            slots: BTreeMap::new(),
            broken_keys: BTreeMap::new(),
            announced: BTreeMap::new(),
            listed: false,
            counters: InputCounters::new(),
            namespace_limit: None,
            card_errors: Vec::new(),
            key_errors: BTreeMap::new(),
            soft_log: SoftErrorLog::default(),
        }
    }

    /// The soft errors held now, with their counters.
    #[must_use]
    pub fn soft_errors(&self) -> &SoftErrorReport {
        self.soft_log.report()
    }

    /// A watch event put a key the transport cannot read (`lossy_key`: its text with
    /// unreadable bytes replaced): a soft error until a listing or a delete clears it.
    pub fn note_unreadable_put(&mut self, lossy_key: &str) {
        if self.key_errors.len() < DISCOVERY_RECORDS_MAX || self.key_errors.contains_key(lossy_key)
        {
            self.key_errors.insert(lossy_key.to_owned(), unreadable_key_error(lossy_key));
        }
        self.refresh_soft_errors(false);
    }

    /// A watch event deleted a key the transport cannot read.
    pub fn note_unreadable_delete(&mut self, lossy_key: &str) {
        if self.key_errors.remove(lossy_key).is_some() {
            self.refresh_soft_errors(false);
        }
    }

    /// Narrow the scope to `limit`'s namespaces (`None`: the scope alone decides). Held records
    /// the new limit excludes go, and records it newly includes arrive, with the next complete
    /// listing, so a transport relists after calling this.
    pub fn set_namespace_limit(&mut self, limit: Option<BTreeSet<String>>) {
        self.namespace_limit = limit;
    }

    /// The namespace narrowing in effect.
    #[must_use]
    pub fn namespace_limit(&self) -> Option<&BTreeSet<String>> {
        self.namespace_limit.as_ref()
    }

    /// Accepted and rejected values so far, each distinct value of a key counted once.
    #[must_use]
    pub fn counters(&self) -> &InputCounters {
        &self.counters
    }

    /// Whether a complete listing was applied (instance sets are authoritative from then on).
    #[must_use]
    pub fn is_listed(&self) -> bool {
        self.listed
    }

    /// Number of keys held (in scope, with a parseable key).
    #[must_use]
    pub fn key_count(&self) -> usize {
        self.slots.len()
    }

    /// Apply a complete listing: every key not in `entries` is gone.
    ///
    /// Entries may come in any order; a key listed twice keeps its first entry in key order.
    pub fn apply_listing(
        &mut self,
        entries: Vec<ListingEntry>,
        mode: ListingMode,
    ) -> Vec<DiscoveryOutput> {
        self.apply_listing_with_unreadable(entries, Vec::new(), mode)
    }

    /// [`RecordDiffer::apply_listing`] for a listing that also held keys the transport could not
    /// read (`unreadable_keys`, lossy text): each is a soft error until the next listing.
    pub fn apply_listing_with_unreadable(
        &mut self,
        entries: Vec<ListingEntry>,
        unreadable_keys: Vec<String>,
        mode: ListingMode,
    ) -> Vec<DiscoveryOutput> {
        let first = !self.listed;
        let mut key_errors: BTreeMap<String, SoftDiscoveryError> = unreadable_keys
            .into_iter()
            .take(DISCOVERY_RECORDS_MAX)
            .map(|key| {
                let error = unreadable_key_error(&key);
                (key, error)
            })
            .collect();
        let mut entries = entries;
        entries.sort_by(|left, right| left.key.cmp(&right.key));
        let mut next: BTreeMap<DiscoveryKey, ListingEntry> = BTreeMap::new();
        let mut broken_seen = BTreeSet::new();
        let mut over_limit = false;
        for entry in entries {
            if !in_discovery_bucket(&entry.key) {
                continue;
            }
            let Some(key) = self.parse_key(&entry.key, &entry.value) else {
                broken_seen.insert(entry.key);
                continue;
            };
            if !self.in_scope(&key) {
                continue;
            }
            if next.contains_key(&key) {
                if key_errors.len() < DISCOVERY_RECORDS_MAX {
                    let error = SoftDiscoveryError::new(
                        SoftErrorKind::DuplicateKey,
                        &entry.key,
                        "another spelling of a key already listed; only the first is read",
                    );
                    key_errors.insert(entry.key, error);
                }
                continue;
            }
            if next.len() >= DISCOVERY_RECORDS_MAX {
                over_limit = true;
                continue;
            }
            next.insert(key, entry);
        }
        if over_limit {
            self.count_too_many();
        }
        self.broken_keys.retain(|raw, _| broken_seen.contains(raw));
        self.key_errors = key_errors;

        let mut changes = Changes::default();
        let gone: Vec<DiscoveryKey> =
            self.slots.keys().filter(|key| !next.contains_key(*key)).cloned().collect();
        for key in gone {
            self.remove(&key, &mut changes);
        }
        for (key, entry) in next {
            self.upsert(key, entry.key, entry.value, &mut changes);
        }
        self.listed = true;
        let cards_listed = first || mode == ListingMode::Relist;
        self.finish(changes, cards_listed, first)
    }

    /// Apply one put (a watch event): `key` now holds `value`.
    pub fn apply_put(&mut self, key: &str, value: Vec<u8>) -> Vec<DiscoveryOutput> {
        if !in_discovery_bucket(key) {
            return Vec::new();
        }
        let value = EntryValue::Bytes(value);
        let Some(parsed) = self.parse_key(key, &value) else {
            return Vec::new();
        };
        if !self.in_scope(&parsed) {
            return Vec::new();
        }
        if !self.slots.contains_key(&parsed) && self.slots.len() >= DISCOVERY_RECORDS_MAX {
            self.count_too_many();
            return Vec::new();
        }
        let mut changes = Changes::default();
        self.upsert(parsed, key.to_owned(), value, &mut changes);
        self.finish(changes, false, false)
    }

    /// Apply one delete (a watch event): `key` is gone. Deleting a key the differ does not hold
    /// (out of scope, never valid, or held under another spelling) changes nothing.
    pub fn apply_delete(&mut self, key: &str) -> Vec<DiscoveryOutput> {
        self.broken_keys.remove(key);
        let parsed = match self.parse_raw_key(key) {
            Ok(parsed) => parsed,
            Err(_) => return Vec::new(),
        };
        if self.slots.get(&parsed).is_none_or(|slot| slot.raw_key != key) {
            return Vec::new();
        }
        let mut changes = Changes::default();
        self.remove(&parsed, &mut changes);
        self.finish(changes, false, false)
    }

    fn parse_raw_key(&self, key: &str) -> Result<DiscoveryKey, InputError> {
        match self.key_form {
            KeyForm::Logical => DiscoveryKey::parse_key_path(key),
            KeyForm::FilePath => DiscoveryKey::parse_file_path(key),
        }
    }

    /// Parse a key; a key that does not parse is counted (once per distinct value) and `None`.
    fn parse_key(&mut self, key: &str, value: &EntryValue) -> Option<DiscoveryKey> {
        match self.parse_raw_key(key) {
            Ok(parsed) => Some(parsed),
            Err(_)
                if matches!(value, EntryValue::Unchanged) && self.broken_keys.contains_key(key) =>
            {
                None
            }
            Err(error) => {
                let digest = value_digest(value);
                if self.broken_keys.get(key) != Some(&digest) {
                    self.counters.record_error(&error);
                    warn!(key, %error, "skipping a discovery key of unknown layout");
                    if self.broken_keys.len() < DISCOVERY_RECORDS_MAX
                        || self.broken_keys.contains_key(key)
                    {
                        self.broken_keys.insert(key.to_owned(), digest);
                    }
                }
                None
            }
        }
    }

    fn in_scope(&self, key: &DiscoveryKey) -> bool {
        if let Some(limit) = &self.namespace_limit {
            let namespace = match key {
                DiscoveryKey::Instance { endpoint, .. } => endpoint.namespace(),
                DiscoveryKey::Model(id) => id.endpoint.namespace(),
                DiscoveryKey::EventChannel(key) | DiscoveryKey::EventSource(key) => {
                    key.scope.namespace()
                }
            };
            if !limit.contains(namespace) {
                return false;
            }
        }
        match key {
            DiscoveryKey::Instance { endpoint, .. } => self.scope.includes(endpoint),
            DiscoveryKey::Model(id) => self.scope.includes(&id.endpoint),
            DiscoveryKey::EventChannel(key) | DiscoveryKey::EventSource(key) => {
                match self.scope.namespace_selection() {
                    NamespaceSelection::All => true,
                    NamespaceSelection::Namespaces(namespaces) => {
                        namespaces.contains(key.scope.namespace())
                    }
                }
            }
        }
    }

    fn count_too_many(&mut self) {
        let error = InputError::TooMany {
            what: "discovery keys",
            count: DISCOVERY_RECORDS_MAX + 1,
            max: DISCOVERY_RECORDS_MAX,
        };
        self.counters.record_error(&error);
        warn!(%error, "ignoring discovery keys beyond the limit");
    }

    /// Store `value` under `key`, recording the resulting change.
    fn upsert(
        &mut self,
        key: DiscoveryKey,
        raw_key: String,
        value: EntryValue,
        changes: &mut Changes,
    ) {
        if matches!(value, EntryValue::Unreadable) {
            return;
        }
        if matches!(value, EntryValue::Unchanged) {
            if let Some(slot) = self.slots.get_mut(&key) {
                slot.raw_key = raw_key;
            }
            return;
        }
        let digest = value_digest(&value);
        if let Some(slot) = self.slots.get_mut(&key)
            && slot.digest == digest
        {
            slot.raw_key = raw_key;
            return;
        }
        let decoded = match value {
            EntryValue::Unreadable | EntryValue::Unchanged => return,
            EntryValue::Rejected(error) => Err(error),
            EntryValue::Bytes(bytes) => decode_discovery_record(&bytes).and_then(|record| {
                if record.key() == key {
                    Ok(record)
                } else {
                    Err(InputError::MalformedKey {
                        key: cut(&raw_key),
                        reason: "the record describes another key than the one it is stored under",
                    })
                }
            }),
        };
        self.counters.record(&decoded);
        let slot = self.slots.entry(key).or_insert_with(|| Slot {
            raw_key: raw_key.clone(),
            digest,
            record: None,
        });
        slot.raw_key = raw_key;
        slot.digest = digest;
        match decoded {
            Ok(record) => {
                let old = slot.record.replace(record);
                let new = slot.record.as_ref();
                transition(old.as_ref(), new, changes);
            }
            Err(error) => {
                warn!(key = %slot.raw_key, %error, kept_last_good = slot.record.is_some(),
                    "skipping a malformed discovery record");
            }
        }
    }

    fn remove(&mut self, key: &DiscoveryKey, changes: &mut Changes) {
        if let Some(slot) = self.slots.remove(key) {
            transition(slot.record.as_ref(), None, changes);
        }
    }

    /// The live instance set of `endpoint` from the held records.
    fn live_instances(&self, endpoint: &EndpointPath) -> BTreeSet<u64> {
        let low = DiscoveryKey::Instance { endpoint: endpoint.clone(), instance_id: 0 };
        let high = DiscoveryKey::Instance { endpoint: endpoint.clone(), instance_id: u64::MAX };
        self.slots
            .range(low..=high)
            .filter(|(_, slot)| slot.record.is_some())
            .filter_map(|(key, _)| match key {
                DiscoveryKey::Instance { instance_id, .. } => Some(*instance_id),
                _ => None,
            })
            .collect()
    }

    /// Recompute the card set's soft errors if `cards_changed`, and hand the current set to
    /// the log.
    fn refresh_soft_errors(&mut self, cards_changed: bool) {
        if cards_changed {
            let cards = self.slots.values().filter_map(|slot| match &slot.record {
                Some(DiscoveryRecord::Model(model)) => Some((&model.id, &model.card)),
                _ => None,
            });
            self.card_errors = card_soft_errors(cards);
        }
        let mut errors = self.card_errors.clone();
        errors.extend(self.key_errors.values().cloned());
        self.soft_log.update(errors);
    }

    /// Every held card in identity order.
    fn cards(&self) -> Vec<(CardInstanceId, ModelCard)> {
        self.slots
            .values()
            .filter_map(|slot| match &slot.record {
                Some(DiscoveryRecord::Model(model)) => Some((model.id.clone(), model.card.clone())),
                _ => None,
            })
            .collect()
    }

    /// Turn one step's changes into outputs. `cards_listed`: report cards as one `CardsListed`
    /// (always on the first listing, else only if a card changed). `all_endpoints`: evaluate
    /// every endpoint's instance set (the first listing), not only the touched ones.
    fn finish(
        &mut self,
        changes: Changes,
        cards_listed: bool,
        all_endpoints: bool,
    ) -> Vec<DiscoveryOutput> {
        self.refresh_soft_errors(all_endpoints || !changes.cards.is_empty());
        let mut outputs = Vec::new();
        if cards_listed {
            if all_endpoints || !changes.cards.is_empty() {
                outputs.push(DiscoveryOutput::Fact(DcInput::CardsListed { cards: self.cards() }));
            }
        } else {
            outputs.extend(changes.cards.into_iter().map(DiscoveryOutput::Fact));
        }
        if self.listed {
            let mut endpoints = changes.endpoints;
            if all_endpoints {
                endpoints.extend(self.announced.keys().cloned());
                endpoints.extend(self.slots.keys().filter_map(|key| match key {
                    DiscoveryKey::Instance { endpoint, .. } => Some(endpoint.clone()),
                    _ => None,
                }));
            }
            for endpoint in endpoints {
                let live = self.live_instances(&endpoint);
                if self.announced.get(&endpoint) == Some(&live) {
                    continue;
                }
                if live.is_empty() {
                    if self.announced.remove(&endpoint).is_none() {
                        continue;
                    }
                } else {
                    self.announced.insert(endpoint.clone(), live.clone());
                }
                outputs.push(DiscoveryOutput::Fact(DcInput::Instances(EndpointInstances {
                    endpoint,
                    live_workers: Some(live),
                })));
            }
        }
        outputs.extend(changes.withdrawn.into_iter().map(DiscoveryOutput::Fact));
        outputs.extend(changes.advertised.into_iter().map(DiscoveryOutput::Fact));
        outputs.extend(changes.channels_removed.into_iter().map(DiscoveryOutput::Channel));
        outputs.extend(changes.channels_upserted.into_iter().map(DiscoveryOutput::Channel));
        outputs
    }
}

/// Record what changes when the record under one key goes from `old` to `new` (both of the
/// key's kind, since a record must describe its key).
fn transition(old: Option<&DiscoveryRecord>, new: Option<&DiscoveryRecord>, changes: &mut Changes) {
    let Some(either) = old.or(new) else {
        return;
    };
    match either {
        // Same key, same (endpoint, instance): only appearing or going changes the live set;
        // the transport details are not facts.
        DiscoveryRecord::Endpoint(record) => {
            if old.is_some() != new.is_some() {
                changes.endpoints.insert(record.endpoint.clone());
            }
        }
        DiscoveryRecord::Model(_) => card_transition(old, new, changes),
        DiscoveryRecord::EventSource(_) => source_transition(old, new, changes),
        DiscoveryRecord::EventChannel(_) => channel_transition(old, new, changes),
    }
}

fn card_transition(
    old: Option<&DiscoveryRecord>,
    new: Option<&DiscoveryRecord>,
    changes: &mut Changes,
) {
    let as_model = |record: Option<&DiscoveryRecord>| match record {
        Some(DiscoveryRecord::Model(model)) => Some(model.clone()),
        _ => None,
    };
    match (as_model(old), as_model(new)) {
        (None, None) => {}
        (Some(old), None) => changes.cards.push(DcInput::CardRemoved { id: old.id }),
        (None, Some(new)) => {
            changes.cards.push(DcInput::CardUpserted { id: new.id, card: Box::new(new.card) });
        }
        (Some(old), Some(new)) => {
            if old.card == new.card {
                return;
            }
            if same_except_taints(&old.card, &new.card) {
                changes.cards.push(DcInput::CardTaintsUpdated {
                    id: new.id,
                    taints_json: new.card.runtime_config.taints_json,
                });
            } else {
                changes.cards.push(DcInput::CardUpserted { id: new.id, card: Box::new(new.card) });
            }
        }
    }
}

fn source_transition(
    old: Option<&DiscoveryRecord>,
    new: Option<&DiscoveryRecord>,
    changes: &mut Changes,
) {
    let advert = |record: Option<&DiscoveryRecord>| match record {
        Some(DiscoveryRecord::EventSource(source)) => source.advert.clone(),
        _ => None,
    };
    let (old, new) = (advert(old), advert(new));
    if old == new {
        return;
    }
    if let Some(old) = old {
        changes.withdrawn.push(DcInput::SourceWithdrawn {
            kv_state_endpoint: old.kv_state_endpoint,
            publisher_id: old.publisher_id,
        });
    }
    if let Some(new) = new {
        changes.advertised.push(DcInput::SourceAdvertised(new));
    }
}

fn channel_transition(
    old: Option<&DiscoveryRecord>,
    new: Option<&DiscoveryRecord>,
    changes: &mut Changes,
) {
    let channel = |record: Option<&DiscoveryRecord>| match record {
        Some(DiscoveryRecord::EventChannel(channel)) => Some(channel.clone()),
        _ => None,
    };
    match (channel(old), channel(new)) {
        (None, None) => {}
        (Some(old), Some(new)) if old == new => {}
        (_, Some(new)) => changes.channels_upserted.push(ChannelChange::Upsert(new)),
        (Some(old), None) => changes.channels_removed.push(ChannelChange::Remove(EventRecordKey {
            scope: old.scope,
            topic: old.topic,
            publisher_id: old.publisher_id,
        })),
    }
}

/// Whether `key` lies in one of the [`DISCOVERY_BUCKETS`] (in either key form).
fn in_discovery_bucket(key: &str) -> bool {
    key.strip_prefix("v1/")
        .and_then(|rest| rest.split_once('/'))
        .is_some_and(|(bucket, _)| DISCOVERY_BUCKETS.contains(&bucket))
}

/// Whether two cards differ at most in their taints.
fn same_except_taints(old: &ModelCard, new: &ModelCard) -> bool {
    let mut old = old.clone();
    old.runtime_config.taints_json.clone_from(&new.runtime_config.taints_json);
    old == *new
}

/// A digest that tells two values under one key apart (for "unchanged, skip" and for counting
/// a bad value once).
fn value_digest(value: &EntryValue) -> u128 {
    match value {
        EntryValue::Bytes(bytes) => xxh3_128(bytes),
        // Rejections are keyed by their description; the marker keeps them apart from bytes
        // that happen to spell the same text.
        EntryValue::Rejected(error) => xxh3_128(format!("\0rejected\0{error}").as_bytes()),
        EntryValue::Unreadable | EntryValue::Unchanged => 0,
    }
}

/// A key cut for an error message (the same bound the decoders use).
fn cut(key: &str) -> String {
    let max = kvrelay_core::inputs::ERROR_ECHO_BYTES_MAX;
    if key.len() <= max {
        return key.to_owned();
    }
    let mut end = max;
    while !key.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &key[..end])
}

fn unreadable_key_error(lossy_key: &str) -> SoftDiscoveryError {
    SoftDiscoveryError::new(
        SoftErrorKind::UnreadableKey,
        lossy_key,
        "the key is not UTF-8; its record is skipped",
    )
}
