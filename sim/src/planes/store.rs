//! The discovery store of the planes host: an etcd-like key/value map with a revision, a
//! bounded watch history and leases. Pure: times are passed in, nothing is awaited.
//!
//! Invariants:
//!
//! - every put or delete bumps the revision by one and is appended to the history; the history
//!   keeps the last [`HISTORY_MAX`] changes, so a watch from an older revision is *compacted*
//!   and must relist;
//! - a key lives under the lease of the process that wrote it; a lease not kept alive for its
//!   TTL expires, and every key under it is deleted at that moment (one change per key);
//! - [`Store::sync`] writes only differences: an unchanged value is not rewritten.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::records::Registration;

/// Changes kept for watchers that resume from an older revision.
pub const HISTORY_MAX: usize = 4096;

/// One change of the store, as a watch delivers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    /// The revision of this change.
    pub revision: u64,
    /// The key.
    pub key: String,
    /// The new value, `None` for a delete.
    #[serde(with = "serde_bytes_option")]
    pub value: Option<Vec<u8>>,
}

/// What a watcher resuming after `revision` must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// Apply these changes (possibly none), in order.
    Changes(Vec<Change>),
    /// The history no longer reaches back: relist.
    Compacted,
}

#[derive(Debug, Clone)]
struct Lease {
    /// Simulated time (ms) at which it expires unless kept alive.
    deadline_ms: u64,
    /// Whether its owner still sends keep-alives.
    alive: bool,
}

/// The store. See the module docs for its invariants.
#[derive(Debug, Default)]
pub struct Store {
    revision: u64,
    entries: BTreeMap<String, Registration>,
    history: VecDeque<Change>,
    leases: BTreeMap<u64, Lease>,
    /// Leases that expired and were not granted again: writes under them are refused (as etcd
    /// refuses a put under a revoked lease), so a registration sent before the expiry and
    /// arriving after it cannot bring the keys back.
    revoked: BTreeSet<u64>,
}

impl Store {
    /// The current revision (0 before any write).
    #[must_use]
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// Every key and value, at [`Self::revision`].
    #[must_use]
    pub fn listing(&self) -> Vec<(String, Vec<u8>)> {
        self.entries.iter().map(|(key, entry)| (key.clone(), entry.value.clone())).collect()
    }

    /// Forget the whole watch history (a restart with compaction at the current revision): a
    /// watch from an older revision is then compacted.
    pub fn compact(&mut self) {
        self.history.clear();
    }

    /// The changes after `revision`, or [`Resume::Compacted`] if some were forgotten.
    #[must_use]
    pub fn since(&self, revision: u64) -> Resume {
        let oldest = self.history.front().map_or(self.revision + 1, |change| change.revision);
        if revision + 1 < oldest && revision < self.revision {
            return Resume::Compacted;
        }
        Resume::Changes(
            self.history.iter().filter(|change| change.revision > revision).cloned().collect(),
        )
    }

    fn record(&mut self, key: String, value: Option<Vec<u8>>) -> Change {
        self.revision += 1;
        let change = Change { revision: self.revision, key, value };
        if self.history.len() >= HISTORY_MAX {
            self.history.pop_front();
        }
        self.history.push_back(change.clone());
        change
    }

    /// Make the store hold exactly `desired` (what the live processes have registered): puts for
    /// new or changed values, deletes for keys no process registers any more. Leases of the
    /// writers are granted as needed (alive, expiring `ttl` after `now_ms`). Returns the changes.
    pub fn sync(
        &mut self,
        desired: &BTreeMap<String, Registration>,
        now_ms: u64,
        ttl: Duration,
    ) -> Vec<Change> {
        let mut changes = Vec::new();
        let gone: Vec<String> = self
            .entries
            .keys()
            .filter(|key| desired.get(*key).is_none_or(|r| self.revoked.contains(&r.lease)))
            .cloned()
            .collect();
        for key in gone {
            self.entries.remove(&key);
            changes.push(self.record(key, None));
        }
        for (key, registration) in desired {
            if self.revoked.contains(&registration.lease) {
                continue;
            }
            self.leases
                .entry(registration.lease)
                .or_insert(Lease { deadline_ms: now_ms + ttl_ms(ttl), alive: true });
            if self.entries.get(key) == Some(registration) {
                continue;
            }
            self.entries.insert(key.clone(), registration.clone());
            changes.push(self.record(key.clone(), Some(registration.value.clone())));
        }
        let held: std::collections::BTreeSet<u64> =
            self.entries.values().map(|entry| entry.lease).collect();
        self.leases.retain(|lease, _| held.contains(lease));
        changes
    }

    /// Lease `lease` may be written under again (its owner registers anew after an expiry).
    pub fn grant(&mut self, lease: u64) {
        self.revoked.remove(&lease);
    }

    /// The owner of `lease` stops (`false`) or resumes (`true`) its keep-alives.
    pub fn set_keepalive(&mut self, lease: u64, alive: bool) {
        if let Some(entry) = self.leases.get_mut(&lease) {
            entry.alive = alive;
        }
    }

    /// Keep alive every lease whose owner still sends keep-alives, then expire the others whose
    /// deadline passed: their keys are deleted. Returns the expired leases and the changes.
    pub fn tick(&mut self, now_ms: u64, ttl: Duration) -> (Vec<u64>, Vec<Change>) {
        let mut expired = Vec::new();
        for (id, lease) in &mut self.leases {
            if lease.alive {
                lease.deadline_ms = now_ms + ttl_ms(ttl);
            } else if lease.deadline_ms <= now_ms {
                expired.push(*id);
            }
        }
        let mut changes = Vec::new();
        for id in &expired {
            self.leases.remove(id);
            self.revoked.insert(*id);
            let keys: Vec<String> = self
                .entries
                .iter()
                .filter(|(_, entry)| entry.lease == *id)
                .map(|(key, _)| key.clone())
                .collect();
            for key in keys {
                self.entries.remove(&key);
                changes.push(self.record(key, None));
            }
        }
        (expired, changes)
    }
}

fn ttl_ms(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX)
}

/// `Option<Vec<u8>>` as MessagePack binary.
mod serde_bytes_option {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(
        value: &Option<Vec<u8>>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match value {
            Some(bytes) => serializer.serialize_some(serde_bytes::Bytes::new(bytes)),
            None => serializer.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<Vec<u8>>, D::Error> {
        Option::<serde_bytes::ByteBuf>::deserialize(deserializer)
            .map(|bytes| bytes.map(serde_bytes::ByteBuf::into_vec))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(1);

    fn desired(entries: &[(&str, &str, u64)]) -> BTreeMap<String, Registration> {
        entries
            .iter()
            .map(|(key, value, lease)| {
                (
                    (*key).to_owned(),
                    Registration { value: value.as_bytes().to_vec(), lease: *lease },
                )
            })
            .collect()
    }

    #[test]
    fn sync_writes_only_differences_and_a_watch_resumes_from_its_revision() {
        let mut store = Store::default();
        assert_eq!(store.sync(&desired(&[("a", "1", 1), ("b", "2", 2)]), 0, TTL).len(), 2);
        let listed = store.revision();
        assert_eq!(listed, 2);
        let changes = store.sync(&desired(&[("a", "1", 1), ("c", "3", 2)]), 0, TTL);
        assert_eq!(
            changes,
            vec![
                Change { revision: 3, key: "b".into(), value: None },
                Change { revision: 4, key: "c".into(), value: Some(b"3".to_vec()) },
            ]
        );
        assert_eq!(store.since(listed), Resume::Changes(changes));
        assert_eq!(store.since(4), Resume::Changes(Vec::new()));
        assert_eq!(store.listing(), vec![("a".into(), b"1".to_vec()), ("c".into(), b"3".to_vec())]);
    }

    #[test]
    fn a_lease_without_keepalives_expires_after_its_ttl_and_takes_its_keys() {
        let mut store = Store::default();
        store.sync(&desired(&[("a", "1", 1), ("a2", "1", 1), ("b", "2", 2)]), 0, TTL);
        store.set_keepalive(1, false);
        assert_eq!(store.tick(500, TTL), (Vec::new(), Vec::new()));
        let (expired, changes) = store.tick(1000, TTL);
        assert_eq!(expired, vec![1]);
        assert_eq!(changes.iter().map(|c| c.key.as_str()).collect::<Vec<_>>(), ["a", "a2"]);
        assert!(changes.iter().all(|c| c.value.is_none()));
        // Lease 2 was kept alive all along.
        assert_eq!(store.tick(5000, TTL).0, Vec::<u64>::new());
        assert_eq!(store.listing().len(), 1);
        // A registration under the expired lease (sent before the expiry) writes nothing.
        let late = desired(&[("a", "1", 1), ("b", "2", 2)]);
        assert!(store.sync(&late, 5000, TTL).is_empty());
        assert_eq!(store.listing().len(), 1);
        // Granted again (the owner registers anew), it writes.
        store.grant(1);
        assert_eq!(store.sync(&late, 6000, TTL).len(), 1);
        assert_eq!(store.listing().len(), 2);
    }

    #[test]
    fn a_watch_older_than_the_history_is_compacted() {
        let mut store = Store::default();
        for round in 0..=HISTORY_MAX {
            store.sync(&desired(&[("k", &round.to_string(), 1)]), 0, TTL);
        }
        assert_eq!(store.since(0), Resume::Compacted);
        assert!(matches!(store.since(store.revision() - 1), Resume::Changes(c) if c.len() == 1));
    }

    #[test]
    fn a_restart_with_compaction_compacts_every_older_watch_and_keeps_the_keys() {
        let mut store = Store::default();
        store.sync(&desired(&[("a", "1", 1)]), 0, TTL);
        store.sync(&desired(&[("a", "2", 1), ("b", "1", 2)]), 0, TTL);
        let behind = store.revision() - 1;
        assert!(matches!(store.since(behind), Resume::Changes(c) if c.len() == 1));
        store.compact();
        assert_eq!(store.since(behind), Resume::Compacted);
        // A watch already at the current revision resumes; the keys are all still there.
        assert_eq!(store.since(store.revision()), Resume::Changes(Vec::new()));
        assert_eq!(store.listing().len(), 2);
    }
}
