//! The typed trace of one run: faults, relay boots, what the relay published, what the truth
//! model said, and what each long-lived consumer saw — each stamped with simulated milliseconds.
//! Observers record a state only when it changed, so the trace stays compact; its digest is
//! the determinism witness and its JSON lines are `--trace FILE`.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::{Arc, Mutex, PoisonError};

use kvrelay_consumer::ConsumerSnapshot;
use kvrelay_core::host::PoolDescriptor;
use kvrelay_core::model::identity::ProducerIdentity;
use kvrelay_core::readiness::ReadinessState;
use kvrelay_core::readiness::topology::TopologyEntry;
use serde::Serialize;

use crate::planes::PlaneCounters;
use crate::scenario::Fault;

/// A producer as the trace names it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct ProducerTrace {
    /// Serving endpoint.
    pub endpoint: String,
    /// Pool id (`domain/dc`).
    pub pool: String,
    /// Relay incarnation.
    pub incarnation: u64,
    /// Layout generation.
    pub generation: u64,
}

impl ProducerTrace {
    /// Name `producer` published for `endpoint`.
    #[must_use]
    pub fn new(endpoint: String, producer: &ProducerIdentity) -> Self {
        ProducerTrace {
            endpoint,
            pool: producer.pool_id().to_string(),
            incarnation: producer.producer_incarnation(),
            generation: producer.layout_generation(),
        }
    }

    /// From a catalog descriptor.
    #[must_use]
    pub fn of(descriptor: &PoolDescriptor) -> Self {
        ProducerTrace::new(descriptor.serving_endpoint.to_string(), &descriptor.producer)
    }
}

/// A readiness entry as the trace names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EntryTrace {
    /// Canonical model id.
    pub model: String,
    /// State.
    pub state: &'static str,
    /// Missing roles.
    pub missing: Vec<String>,
}

/// Name of a readiness state.
#[must_use]
pub fn state_name(state: ReadinessState) -> &'static str {
    match state {
        ReadinessState::Unknown => "unknown",
        ReadinessState::Unavailable => "unavailable",
        ReadinessState::Ready => "ready",
    }
}

impl EntryTrace {
    /// From a topology entry.
    #[must_use]
    pub fn of(entry: &TopologyEntry) -> Self {
        EntryTrace {
            model: entry.canonical_model_id.clone(),
            state: state_name(entry.state),
            missing: entry.missing_roles.iter().map(|role| format!("{role:?}")).collect(),
        }
    }
}

/// One pool replica of a long-lived consumer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplicaTrace {
    /// The producer.
    pub producer: ProducerTrace,
    /// Filter status.
    pub status: &'static str,
    /// Applied sequence.
    pub sequence: Option<u64>,
}

/// What one long-lived consumer saw.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConsumerTrace {
    /// The consumer's host (`consumer-a`, ...).
    pub consumer: String,
    /// Catalog revision.
    pub catalog_revision: Option<u64>,
    /// Pool replicas.
    pub pools: Vec<ReplicaTrace>,
    /// Readiness entries.
    pub readiness: Vec<EntryTrace>,
    /// Filter subscriptions opened so far.
    pub subscriptions: u64,
    /// Replicas dropped so far.
    pub replicas_dropped: u64,
    /// Faults counted so far, by `plane/kind`.
    pub faults: BTreeMap<String, u64>,
}

impl ConsumerTrace {
    /// Whether two snapshots agree on everything [`ConsumerTrace::of`] shows, so the trace (whose
    /// identities are formatted as text) need not be built again.
    #[must_use]
    pub fn shows_the_same(a: &ConsumerSnapshot, b: &ConsumerSnapshot) -> bool {
        a.catalog_revision == b.catalog_revision
            && a.pools == b.pools
            && a.readiness == b.readiness
            && a.counters.subscriptions == b.counters.subscriptions
            && a.counters.replicas_dropped == b.counters.replicas_dropped
            && a.counters.faults == b.counters.faults
    }

    /// From a snapshot of the consumer on host `consumer`.
    #[must_use]
    pub fn of(consumer: &str, snapshot: &ConsumerSnapshot) -> Self {
        ConsumerTrace {
            consumer: consumer.to_owned(),
            catalog_revision: snapshot.catalog_revision,
            pools: snapshot
                .pools
                .iter()
                .map(|pool| ReplicaTrace {
                    producer: ProducerTrace::new(
                        pool.descriptor.serving_endpoint.to_string(),
                        &pool.producer,
                    ),
                    status: pool.status.name(),
                    sequence: pool.sequence,
                })
                .collect(),
            readiness: snapshot.readiness.iter().map(EntryTrace::of).collect(),
            subscriptions: snapshot.counters.subscriptions,
            replicas_dropped: snapshot.counters.replicas_dropped,
            faults: snapshot
                .counters
                .faults
                .iter()
                .map(|((plane, kind), count)| (format!("{}/{kind}", plane.name()), *count))
                .collect(),
        }
    }
}

/// One trace event.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum TraceEvent {
    /// A fault of the script was applied.
    Fault {
        /// The fault.
        fault: Fault,
    },
    /// The relay host (re)booted.
    RelayBoot {
        /// Boot number from 0.
        boot: u64,
        /// The relay's incarnation.
        incarnation: u64,
    },
    /// The relay published a catalog.
    RelayCatalog {
        /// Boot.
        boot: u64,
        /// Revision.
        revision: u64,
        /// Pools.
        pools: Vec<ProducerTrace>,
    },
    /// The relay published readiness.
    RelayReadiness {
        /// Boot.
        boot: u64,
        /// Revision.
        revision: u64,
        /// Entries.
        entries: Vec<EntryTrace>,
    },
    /// A catalogued producer that had a live publication lost it while still catalogued.
    TeardownBeforeWithdrawal {
        /// Boot.
        boot: u64,
        /// The producer.
        producer: ProducerTrace,
    },
    /// The truth model after a change of the DC: per model, whether it can serve.
    Truth {
        /// Whether the relay can see the DC right now (no DC-plane partition).
        visible: bool,
        /// Per base model: a listed worker exists and every listed typed worker's needs are met.
        servable: BTreeMap<String, bool>,
    },
    /// A long-lived consumer's view changed.
    Consumer(ConsumerTrace),
    /// Traffic stopped; the system quiesces.
    TrafficOff {
        /// What the DC planes did.
        planes: PlaneCounters,
    },
    /// The node's status showed an invariant failure or an unexplained unhealthy state
    /// (recorded when it starts or changes).
    NodeFault {
        /// Boot.
        boot: u64,
        /// What the status showed.
        detail: String,
    },
    /// The relay published a catalog or readiness update that fails the wire validation.
    InvalidUpdate {
        /// Boot.
        boot: u64,
        /// `catalog` or `readiness`.
        plane: &'static str,
        /// The validation error.
        error: String,
    },
}

impl TraceEvent {
    /// The event's kind name.
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self {
            TraceEvent::Fault { .. } => "fault",
            TraceEvent::RelayBoot { .. } => "relay-boot",
            TraceEvent::RelayCatalog { .. } => "relay-catalog",
            TraceEvent::RelayReadiness { .. } => "relay-readiness",
            TraceEvent::TeardownBeforeWithdrawal { .. } => "teardown-before-withdrawal",
            TraceEvent::Truth { .. } => "truth",
            TraceEvent::Consumer(_) => "consumer",
            TraceEvent::TrafficOff { .. } => "traffic-off",
            TraceEvent::NodeFault { .. } => "node-fault",
            TraceEvent::InvalidUpdate { .. } => "invalid-update",
        }
    }
}

/// A trace event at a simulated time.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Stamped {
    /// Simulated milliseconds since the start.
    pub ms: u64,
    /// The event.
    #[serde(flatten)]
    pub event: TraceEvent,
}

/// The shared, append-only trace of a run.
#[derive(Debug, Clone, Default)]
pub struct Trace(Arc<Mutex<Vec<Stamped>>>);

impl Trace {
    /// Append `event` at the current simulated time.
    pub fn record(&self, event: TraceEvent) {
        let ms = crate::sim_ms();
        self.0.lock().unwrap_or_else(PoisonError::into_inner).push(Stamped { ms, event });
    }

    /// Every event so far.
    #[must_use]
    pub fn events(&self) -> Vec<Stamped> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

/// JSON text of one event.
#[must_use]
pub fn json_line(event: &Stamped) -> String {
    serde_json::to_string(event).unwrap_or_else(|error| format!("{{\"error\":\"{error}\"}}"))
}

/// The digest of a trace: blake3 of its JSON lines, 16 hex digits.
#[must_use]
pub fn digest(events: &[Stamped]) -> String {
    let mut hasher = blake3::Hasher::new();
    for event in events {
        hasher.update(json_line(event).as_bytes());
        hasher.update(b"\n");
    }
    hasher.finalize().to_hex()[..16].to_owned()
}

/// Write `events` as JSON lines.
pub fn write_json_lines(events: &[Stamped], out: &mut impl Write) -> std::io::Result<()> {
    for event in events {
        writeln!(out, "{}", json_line(event))?;
    }
    Ok(())
}

/// Counts of events by kind.
#[must_use]
pub fn counts(events: &[Stamped]) -> BTreeMap<&'static str, usize> {
    let mut counts = BTreeMap::new();
    for event in events {
        *counts.entry(event.event.kind()).or_default() += 1;
    }
    counts
}
