//! Scenarios as data: the TOML schema of `scenarios/*.toml` (documented in
//! `scenarios/README.md`), its validation, and what the simulator derives from it — the
//! deployment, the traffic, the fault script (with faults drawn from the seed) and the expected
//! outcomes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kvrelay_core::inputs::{ModelTypeFlags, WorkerType};
use kvrelay_core::model::identity::{EndpointPath, ExplicitIdentityMap, IndexerIdentitySpec};
use kvrelay_core::readiness::ReadinessState;
use kvrelay_core::rng::{derive_seed, rng_from_seed};
use kvrelay_dc::{Deployment, TrafficConfig, WorkerSpec};
use rand_core::Rng;
use serde::{Deserialize, Serialize};

/// Longest story a scenario may tell (simulated time before traffic stops).
pub const RUN_MS_MAX: u64 = 300_000;
/// Most worker processes a scenario may deploy.
pub const WORKERS_MAX: usize = 2_048;
/// Most pools one worker group may be repeated over ([`WorkerGroup::pools`]).
pub const GROUP_POOLS_MAX: usize = 256;
/// Most long-lived WAN consumer hosts a scenario may run (`consumer-a` ..= `consumer-bl`).
pub const CONSUMERS_MAX: usize = 64;
/// Smallest and largest HTTP/2 receive window a scenario may give its consumers (HTTP/2's
/// initial window and its maximum).
pub const CONSUMER_WINDOW_MIN: u32 = 65_535;
/// See [`CONSUMER_WINDOW_MIN`].
pub const CONSUMER_WINDOW_MAX: u32 = (1 << 31) - 1;
/// Long-lived WAN consumer hosts when the topology does not say.
pub const CONSUMERS_DEFAULT: usize = 2;

/// The host name of long-lived consumer `index`: `consumer-a`, `consumer-b`, ...
#[must_use]
pub fn consumer_host(index: usize) -> String {
    format!("consumer-{}", consumer_label(index))
}

/// The letters naming consumer `index` in scenario files: `a` for 0 ... `z` for 25, then `aa`,
/// `ab`, ... (bijective base 26, like spreadsheet columns).
#[must_use]
pub fn consumer_label(index: usize) -> String {
    let mut letters = Vec::new();
    let mut rest = index + 1;
    while rest > 0 {
        rest -= 1;
        letters.push(b'a' + (rest % 26) as u8);
        rest /= 26;
    }
    letters.reverse();
    String::from_utf8(letters).expect("ASCII letters")
}

/// The index [`consumer_label`] names, if `label` is one (at most three letters).
fn consumer_index(label: &str) -> Option<usize> {
    if label.is_empty() || label.len() > 3 || !label.bytes().all(|b| b.is_ascii_lowercase()) {
        return None;
    }
    let number = label.bytes().fold(0usize, |n, b| n * 26 + usize::from(b - b'a') + 1);
    Some(number - 1)
}

/// Which long-lived consumer(s) a WAN fault or an expectation names.
///
/// Written as a letter (`"b"`), a host name (`"consumer-b"`), an index from 0 (`1`) or `"all"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ConsumerTarget {
    /// One consumer, by index from 0.
    One(usize),
    /// Every long-lived consumer.
    All,
}

impl ConsumerTarget {
    /// Parse a consumer name as scenario files write it.
    pub fn parse(text: &str) -> Result<ConsumerTarget, String> {
        if text == "all" {
            return Ok(ConsumerTarget::All);
        }
        let label = text.strip_prefix("consumer-").unwrap_or(text);
        match consumer_index(label) {
            Some(index) => Ok(ConsumerTarget::One(index)),
            None => Err(format!("unknown consumer {text:?}: letters, consumer-<letters> or all")),
        }
    }

    /// The consumer indices it names among `consumers`.
    #[must_use]
    pub fn indices(self, consumers: usize) -> Vec<usize> {
        match self {
            ConsumerTarget::One(index) => vec![index],
            ConsumerTarget::All => (0..consumers).collect(),
        }
    }

    /// Whether it names only consumers that exist among `consumers`.
    #[must_use]
    pub fn fits(self, consumers: usize) -> bool {
        match self {
            ConsumerTarget::One(index) => index < consumers,
            ConsumerTarget::All => true,
        }
    }
}

impl Serialize for ConsumerTarget {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            ConsumerTarget::One(index) => serializer.serialize_str(&consumer_label(*index)),
            ConsumerTarget::All => serializer.serialize_str("all"),
        }
    }
}

impl<'de> Deserialize<'de> for ConsumerTarget {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Index(usize),
            Name(String),
        }
        match Written::deserialize(deserializer)? {
            Written::Index(index) => Ok(ConsumerTarget::One(index)),
            Written::Name(name) => ConsumerTarget::parse(&name).map_err(serde::de::Error::custom),
        }
    }
}

/// One scenario file.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// The scenario's name (defaults to the file stem).
    #[serde(default)]
    pub name: String,
    /// What the scenario exercises.
    #[serde(default)]
    pub description: String,
    /// Simulated milliseconds of traffic and faults before traffic stops and the system
    /// quiesces.
    pub run_ms: u64,
    /// The DC's workers.
    pub topology: Topology,
    /// The DC's traffic and the relay's filter sizing.
    #[serde(default)]
    pub workload: Workload,
    /// The fault script, at simulated times.
    #[serde(default)]
    pub faults: Vec<ScriptedFault>,
    /// Faults drawn from the seed on top of the script.
    #[serde(default)]
    pub random_faults: Option<RandomFaults>,
    /// What must hold once the system has quiesced.
    pub expect: Expect,
    /// The relay's bounds where a scenario needs other than the defaults.
    #[serde(default)]
    pub relay: RelayBounds,
    /// Where the scenario was loaded from (not part of the schema).
    #[serde(skip)]
    pub path: Option<PathBuf>,
}

/// The DC's workers: the demo preset and/or explicit worker groups.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    /// `"demo"`: the five workers of `kvrelay demo` first (indices 0..=4).
    #[serde(default)]
    pub preset: Option<String>,
    /// Further worker groups, appended in order.
    #[serde(default)]
    pub workers: Vec<WorkerGroup>,
    /// Long-lived WAN consumer hosts (`consumer-a`, `consumer-b`, ...).
    #[serde(default = "default_consumers")]
    pub consumers: usize,
    /// The long-lived consumers' HTTP/2 receive windows in bytes (each stream's and the
    /// connection's); unset: the HTTP/2 client's defaults. Small windows bound how much of a
    /// slow link's backlog the consumer absorbs before the relay's sends wait.
    #[serde(default)]
    pub consumer_window_bytes: Option<u32>,
}

fn default_consumers() -> usize {
    CONSUMERS_DEFAULT
}

/// A worker role as written in scenario files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// Aggregated (prefill and decode in one).
    Aggregated,
    /// Prefill.
    Prefill,
    /// Decode.
    Decode,
    /// Encode (no KV events).
    Encode,
    /// A legacy card without `worker_type`.
    Legacy,
    /// A legacy prefill card: no `worker_type`, `model_type` `Prefill` (the relay normalizes it
    /// to a prefill worker needing decode unless it declares needs).
    LegacyPrefill,
}

impl Role {
    fn worker_type(self) -> Option<WorkerType> {
        match self {
            Role::Aggregated => Some(WorkerType::Aggregated),
            Role::Prefill => Some(WorkerType::Prefill),
            Role::Decode => Some(WorkerType::Decode),
            Role::Encode => Some(WorkerType::Encode),
            Role::Legacy | Role::LegacyPrefill => None,
        }
    }

    fn default_needs(self) -> Vec<Vec<Role>> {
        match self {
            Role::Prefill => vec![vec![Role::Decode]],
            Role::Decode => vec![vec![Role::Prefill]],
            Role::Encode => vec![vec![Role::Prefill, Role::Decode], vec![Role::Aggregated]],
            Role::Aggregated | Role::Legacy | Role::LegacyPrefill => Vec::new(),
        }
    }
}

/// `replicas` identical worker processes.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerGroup {
    /// Serving endpoint `namespace/component/endpoint`.
    pub endpoint: String,
    /// Served model name.
    pub model: String,
    /// Role.
    #[serde(default = "default_role")]
    pub role: Role,
    /// Peer roles needed (alternatives of role sets); defaults by role.
    #[serde(default)]
    pub needs: Option<Vec<Vec<Role>>>,
    /// Data-parallel ranks per worker.
    #[serde(default = "one")]
    pub dp_ranks: u32,
    /// Blocks each rank caches before evicting.
    #[serde(default = "default_capacity")]
    pub capacity_blocks: usize,
    /// Tokens per block.
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    /// Eagle hash windows.
    #[serde(default)]
    pub eagle: bool,
    /// Whether the worker answers recovery queries.
    #[serde(default = "yes")]
    pub local_indexer: bool,
    /// LoRA adapters loaded at start.
    #[serde(default)]
    pub adapters: Vec<String>,
    /// Extra served names.
    #[serde(default)]
    pub aliases: Vec<String>,
    /// Explicit routing-scope pool name in the card's `indexer_identity`.
    #[serde(default)]
    pub routing_pool: Option<String>,
    /// Identical processes of this group.
    #[serde(default = "one_usize")]
    pub replicas: usize,
    /// Pools the group is repeated over (a fleet): copy `i` (from 0) serves the endpoint whose
    /// component is `<component>-<i>` and the model `<model>-<i>`, with `replicas` workers each.
    /// With 1 (the default) the names are used as written.
    #[serde(default = "one_usize")]
    pub pools: usize,
}

fn default_role() -> Role {
    Role::Aggregated
}
fn one() -> u32 {
    1
}
fn one_usize() -> usize {
    1
}
fn yes() -> bool {
    true
}
fn default_capacity() -> usize {
    4096
}
fn default_block_size() -> u32 {
    16
}

/// The DC's traffic and the relay's filter sizing.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Workload {
    /// Requests served per tick.
    pub requests_per_tick: usize,
    /// Tick length in simulated milliseconds.
    pub tick_ms: u64,
    /// Occupancy reports every this many ticks.
    pub load_every_ticks: u64,
    /// Distinct shared prefixes.
    pub prefix_count: usize,
    /// Tokens per shared prefix.
    pub prefix_tokens: usize,
    /// Most unique tokens appended per request.
    pub tail_tokens_max: usize,
    /// The relay's expected unique blocks per pool (filter sizing).
    pub expected_unique_blocks: u64,
}

impl Default for Workload {
    fn default() -> Self {
        let traffic = TrafficConfig::default();
        Workload {
            requests_per_tick: 8,
            tick_ms: 50,
            load_every_ticks: 10,
            prefix_count: traffic.prefix_count,
            prefix_tokens: traffic.prefix_tokens,
            tail_tokens_max: traffic.tail_tokens_max,
            expected_unique_blocks: 65_536,
        }
    }
}

/// The relay's WAN admission bounds a scenario may set (`[relay]`, named as the WAN tuning
/// names them, each `DYN_RELAY_<NAME>` in production); unset ones keep the production default
/// (64 each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RelayBounds {
    /// Pools with an initialized publication hub at once.
    #[serde(default)]
    pub max_initialized_pool_hubs: Option<usize>,
    /// Subscribers of one pool.
    #[serde(default)]
    pub max_subscribers_per_pool: Option<usize>,
    /// Pool filter streams across all pools.
    #[serde(default)]
    pub max_pool_streams_total: Option<usize>,
    /// Catalog streams.
    #[serde(default)]
    pub max_catalog_subscribers: Option<usize>,
    /// Readiness streams.
    #[serde(default)]
    pub max_readiness_subscribers: Option<usize>,
    /// Load streams.
    #[serde(default)]
    pub max_load_subscribers: Option<usize>,
}

/// A fault at a simulated time (milliseconds since the start).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct ScriptedFault {
    /// When, in simulated milliseconds since the start.
    pub at_ms: u64,
    /// What.
    #[serde(flatten)]
    pub fault: Fault,
}

/// Which event-plane faults apply to messages on their way into the relay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Noise {
    /// Probability a message is lost.
    #[serde(default)]
    pub loss: f64,
    /// Probability a message is delivered twice.
    #[serde(default)]
    pub duplicate: f64,
    /// Probability a message is held back behind the next one.
    #[serde(default)]
    pub reorder: f64,
}

impl Noise {
    /// Every probability is in `0..=0.5`.
    pub fn validate(&self) -> Result<(), String> {
        if [self.loss, self.duplicate, self.reorder].iter().all(|p| (0.0..=0.5).contains(p)) {
            Ok(())
        } else {
            Err("event-noise probabilities must be in 0..=0.5".into())
        }
    }

    /// No fault at all.
    #[must_use]
    pub fn is_quiet(&self) -> bool {
        self.loss <= 0.0 && self.duplicate <= 0.0 && self.reorder <= 0.0
    }
}

/// What a DC-plane partition does to event-plane messages (discovery always queues, as a watch
/// resumes from its revision).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PartitionMode {
    /// Messages are lost (the relay must recover the gaps from the workers).
    Drop,
    /// Messages queue and arrive in a burst at the repair.
    Stall,
}

/// One fault.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(tag = "action", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Fault {
    /// Crash worker `worker` and start it again (new incarnations, empty caches).
    RestartWorker {
        /// Worker index.
        worker: usize,
        /// Keep the worker id (Kubernetes) instead of drawing a new one (etcd).
        #[serde(default)]
        same_id: bool,
    },
    /// Crash worker `worker` (it stays down until `start-worker`).
    CrashWorker {
        /// Worker index.
        worker: usize,
    },
    /// Start a crashed worker again.
    StartWorker {
        /// Worker index.
        worker: usize,
        /// Keep the worker id.
        #[serde(default)]
        same_id: bool,
    },
    /// The worker's discovery lease expires; the process lives on.
    ExpireLease {
        /// Worker index.
        worker: usize,
    },
    /// The worker registers again with its old ids.
    RenewLease {
        /// Worker index.
        worker: usize,
    },
    /// A new incarnation of the worker starts under the same worker id while the old one is
    /// still advertised and keeps publishing (stale events).
    BeginOverlap {
        /// Worker index.
        worker: usize,
    },
    /// The old incarnation's adverts are withdrawn.
    EndOverlap {
        /// Worker index.
        worker: usize,
    },
    /// Load a LoRA adapter.
    LoadAdapter {
        /// Worker index.
        worker: usize,
        /// Adapter name.
        adapter: String,
    },
    /// Unload a LoRA adapter.
    UnloadAdapter {
        /// Worker index.
        worker: usize,
        /// Adapter name.
        adapter: String,
    },
    /// The worker resets one rank's cache (`Cleared`).
    ClearRank {
        /// Worker index.
        worker: usize,
        /// Rank.
        #[serde(default)]
        rank: u32,
    },
    /// Cut the WAN between the relay and a long-lived consumer.
    WanPartition {
        /// Which consumer(s); the script resolves a missing one to the first.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        consumer: Option<ConsumerTarget>,
    },
    /// Restore it.
    WanRepair {
        /// Which consumer(s); the script resolves a missing one to the first.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        consumer: Option<ConsumerTarget>,
    },
    /// Hold (queue) WAN messages between relay and a consumer: a stalled consumer.
    WanHold {
        /// Which consumer(s); the script resolves a missing one to the first.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        consumer: Option<ConsumerTarget>,
    },
    /// Deliver the held messages.
    WanRelease {
        /// Which consumer(s); the script resolves a missing one to the first.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        consumer: Option<ConsumerTarget>,
    },
    /// Put a long-lived consumer behind a link of `bytes_per_s` bytes per second in each
    /// direction: its connection's reads and writes are paced by a token bucket on simulated
    /// time, so the relay meets the backpressure of a slow link (HTTP/2 flow control, then its
    /// own publication queue) and the consumer applies frames no faster than the link carries
    /// them.
    ConsumerBandwidth {
        /// Which consumer(s); the script resolves a missing one to the first.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        consumer: Option<ConsumerTarget>,
        /// Bytes per second, each direction.
        bytes_per_s: u64,
    },
    /// Lift the consumer's bandwidth limit.
    ConsumerBandwidthLift {
        /// Which consumer(s); the script resolves a missing one to the first.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        consumer: Option<ConsumerTarget>,
    },
    /// Partition the relay from its DC planes.
    DcPartition {
        /// What happens to event-plane messages meanwhile.
        mode: PartitionMode,
    },
    /// Repair the DC-plane partition.
    DcRepair,
    /// Set event-plane loss / duplication / reordering (all zero turns it off).
    EventNoise(Noise),
    /// Crash the relay host and boot it again (new incarnation, every state rebuilt).
    RelayRestart,
    /// The event-plane server restarts: every relay connection to the planes host drops,
    /// messages published until the relay subscribes again are lost.
    EventPlaneRestart,
    /// The discovery store restarts with its watch history compacted: every relay connection
    /// drops, and a relay behind the current revision must relist.
    DiscoveryRestart,
    /// Skew the relay's wall clock by `ms` (from the true simulated time).
    ClockSkew {
        /// Milliseconds, positive ahead, negative behind.
        ms: i64,
    },
}

impl Fault {
    /// The fault's `action` as written in scenario files.
    #[must_use]
    pub fn action(&self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|value| value.get("action").and_then(|a| a.as_str()).map(str::to_owned))
            .unwrap_or_default()
    }

    /// The worker index the fault names, if any.
    #[must_use]
    pub fn worker(&self) -> Option<usize> {
        match self {
            Fault::RestartWorker { worker, .. }
            | Fault::CrashWorker { worker }
            | Fault::StartWorker { worker, .. }
            | Fault::ExpireLease { worker }
            | Fault::RenewLease { worker }
            | Fault::BeginOverlap { worker }
            | Fault::EndOverlap { worker }
            | Fault::LoadAdapter { worker, .. }
            | Fault::UnloadAdapter { worker, .. }
            | Fault::ClearRank { worker, .. } => Some(*worker),
            _ => None,
        }
    }

    /// The consumer(s) a WAN fault names, if it is one.
    #[must_use]
    pub fn consumer(&self) -> Option<Option<ConsumerTarget>> {
        match self {
            Fault::WanPartition { consumer }
            | Fault::WanRepair { consumer }
            | Fault::WanHold { consumer }
            | Fault::WanRelease { consumer }
            | Fault::ConsumerBandwidth { consumer, .. }
            | Fault::ConsumerBandwidthLift { consumer } => Some(*consumer),
            _ => None,
        }
    }

    /// A WAN fault naming the first consumer when it names none (other faults unchanged).
    fn resolved(mut self) -> Fault {
        if let Fault::WanPartition { consumer }
        | Fault::WanRepair { consumer }
        | Fault::WanHold { consumer }
        | Fault::WanRelease { consumer }
        | Fault::ConsumerBandwidth { consumer, .. }
        | Fault::ConsumerBandwidthLift { consumer } = &mut self
        {
            consumer.get_or_insert(ConsumerTarget::One(0));
        }
        self
    }
}

/// Kinds of faults a sweep draws at random (each drawn fault is repaired within its window).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RandomKind {
    /// A worker restart, same or new id.
    WorkerRestart,
    /// A lease expiry and renewal.
    LeaseExpiry,
    /// A burst of event loss / duplication / reordering.
    EventNoise,
    /// A WAN partition shorter or longer than keepalive, then repair.
    WanPartition,
    /// A stalled consumer (WAN hold), then release.
    StalledConsumer,
    /// A DC-plane partition (drop or stall), then repair.
    DcPartition,
    /// A relay crash and restart.
    RelayRestart,
    /// The event-plane server restarts: the relay's connection to the planes host drops and
    /// the messages published until it subscribes again are lost.
    EventPlaneRestart,
    /// The discovery store restarts with its watch history compacted: the relay's connection
    /// drops and it must relist unless it was already at the current revision.
    DiscoveryRestart,
    /// A skew of the relay's wall clock.
    ClockSkew,
    /// A worker crash, and its start (same or new id) at the window's end.
    WorkerCrash,
    /// Overlapping incarnations: a new process under the same worker id while the old one is
    /// advertised, the old one withdrawn at the window's end (it keeps publishing stale events).
    Overlap,
    /// A rank's cache cleared (`Cleared`).
    CacheClear,
    /// A LoRA adapter (`drawn-adapter`) loaded, and unloaded at the window's end.
    AdapterChurn,
    /// A consumer behind a bandwidth-limited link (2 KiB/s to 256 KiB/s), lifted at the
    /// window's end.
    ConsumerBandwidth,
}

/// Slowest and fastest link a scenario may give a consumer (bytes per second).
pub const BANDWIDTH_RANGE: std::ops::RangeInclusive<u64> = 1024..=(1 << 30);

/// The adapters [`RandomFaults::adapter_churn`] loads and unloads (a few names, so churn on
/// several workers of one or more pools shares and collides names).
pub const CHURN_ADAPTERS: [&str; 4] = ["churn-a", "churn-b", "churn-c", "churn-d"];

/// The adapter [`RandomKind::AdapterChurn`] loads and unloads.
pub const DRAWN_ADAPTER: &str = "drawn-adapter";

/// Faults drawn from the seed.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RandomFaults {
    /// How many to draw.
    pub count: usize,
    /// From which kinds.
    pub kinds: Vec<RandomKind>,
    /// Earliest start (simulated ms).
    #[serde(default = "default_from")]
    pub from_ms: u64,
    /// Every drawn fault is repaired by then (simulated ms).
    pub until_ms: u64,
    /// LoRA churn under every drawn fault: each drawn fault, whatever its kind, comes with an
    /// adapter of [`CHURN_ADAPTERS`] loaded on a drawn worker while the fault is active and, for
    /// three in four, unloaded later in the window (the others stay loaded to the end).
    #[serde(default)]
    pub adapter_churn: bool,
}

fn default_from() -> u64 {
    1_000
}

/// How the long-lived consumers must have followed the relay: one expectation for every
/// consumer, or a table by consumer letter (consumers it leaves out: `any`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum ConsumerExpectations {
    /// The same for every consumer.
    Every(ConsumerExpectation),
    /// Per consumer letter, e.g. `{ a = "kept-streams", b = "resubscribed" }`.
    Each(BTreeMap<String, ConsumerExpectation>),
}

impl Default for ConsumerExpectations {
    fn default() -> Self {
        ConsumerExpectations::Every(ConsumerExpectation::Any)
    }
}

impl ConsumerExpectations {
    /// What consumer `index` must have done.
    #[must_use]
    pub fn of(&self, index: usize) -> ConsumerExpectation {
        match self {
            ConsumerExpectations::Every(expectation) => *expectation,
            ConsumerExpectations::Each(table) => table
                .iter()
                .find(|(name, _)| ConsumerTarget::parse(name) == Ok(ConsumerTarget::One(index)))
                .map_or(ConsumerExpectation::Any, |(_, expectation)| *expectation),
        }
    }
}

/// How one long-lived consumer must have followed the relay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ConsumerExpectation {
    /// No requirement.
    #[default]
    Any,
    /// It lost its streams and subscribed afresh.
    Resubscribed,
    /// It kept every stream it opened (no resubscription, no replica dropped).
    KeptStreams,
    /// The relay ended at least one of its streams as a lagging subscriber (its publication
    /// queue overflowed, or a send waited past the deadline) and it subscribed afresh.
    Lagged,
}

/// A readiness state as written in scenario files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ExpectedState {
    /// UNKNOWN.
    Unknown,
    /// UNAVAILABLE.
    Unavailable,
    /// READY.
    Ready,
}

impl ExpectedState {
    /// The relay's state.
    #[must_use]
    pub fn state(self) -> ReadinessState {
        match self {
            ExpectedState::Unknown => ReadinessState::Unknown,
            ExpectedState::Unavailable => ReadinessState::Unavailable,
            ExpectedState::Ready => ReadinessState::Ready,
        }
    }
}

/// What must hold after quiescence.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    /// Pools in the catalog.
    pub pools: usize,
    /// Readiness entries by canonical model id (exactly these entries, plus
    /// [`Expect::other_models`]).
    #[serde(default)]
    pub readiness: BTreeMap<String, ExpectedState>,
    /// For fleets: this many readiness entries besides those `readiness` names, each in one
    /// state.
    #[serde(default)]
    pub other_models: Option<OtherModels>,
    /// How the long-lived consumers followed.
    #[serde(default)]
    pub consumer: ConsumerExpectations,
    /// Pools may exceed their filter capacity: blocks the relay could not place are capacity
    /// omissions, and the no-false-negatives oracle is bounded by the filter's occupancy.
    #[serde(default)]
    pub capacity_omissions: bool,
}

/// Readiness entries a scenario counts instead of naming (`[expect.other_models]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct OtherModels {
    /// How many.
    pub count: usize,
    /// The state of each.
    pub state: ExpectedState,
}

/// Why a scenario file is unusable.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The TOML does not match the schema.
    #[error("{path}: {source}")]
    Parse {
        /// The file.
        path: String,
        /// The cause.
        source: toml::de::Error,
    },
    /// The values are inconsistent.
    #[error("{path}: {reason}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
}

impl Scenario {
    /// Parse and validate scenario `text`; `name` is used when the file has none.
    pub fn parse(text: &str, name: &str) -> Result<Scenario, ScenarioError> {
        let mut scenario: Scenario = toml::from_str(text)
            .map_err(|source| ScenarioError::Parse { path: name.to_owned(), source })?;
        if scenario.name.is_empty() {
            name.clone_into(&mut scenario.name);
        }
        scenario
            .validate()
            .map_err(|reason| ScenarioError::Invalid { path: name.to_owned(), reason })?;
        Ok(scenario)
    }

    /// Load and validate the scenario at `path`.
    pub fn load(path: &Path) -> Result<Scenario, ScenarioError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|source| ScenarioError::Read { path: shown.clone(), source })?;
        let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("scenario");
        let mut scenario = Scenario::parse(&text, stem).map_err(|error| match error {
            ScenarioError::Parse { source, .. } => {
                ScenarioError::Parse { path: shown.clone(), source }
            }
            ScenarioError::Invalid { reason, .. } => {
                ScenarioError::Invalid { path: shown.clone(), reason }
            }
            read @ ScenarioError::Read { .. } => read,
        })?;
        scenario.path = Some(path.to_owned());
        Ok(scenario)
    }

    /// Every `*.toml` scenario in `dir`, sorted by file name.
    pub fn load_dir(dir: &Path) -> Result<Vec<Scenario>, ScenarioError> {
        let read = |source| ScenarioError::Read { path: dir.display().to_string(), source };
        toml_files(dir).map_err(read)?.iter().map(|path| Scenario::load(path)).collect()
    }

    /// The file to name in a reproduction command.
    #[must_use]
    pub fn file(&self) -> String {
        self.path.as_ref().map_or_else(
            || format!("scenarios/{}.toml", self.name),
            |path| path.display().to_string(),
        )
    }

    fn validate(&self) -> Result<(), String> {
        if self.run_ms == 0 || self.run_ms > RUN_MS_MAX {
            return Err(format!("run_ms must be in 1..={RUN_MS_MAX}"));
        }
        let deployment = self.deployment()?;
        let workers = deployment.workers.len();
        if workers == 0 || workers > WORKERS_MAX {
            return Err(format!("the topology must have 1..={WORKERS_MAX} workers"));
        }
        let w = &self.workload;
        if w.tick_ms == 0 || w.requests_per_tick > 10_000 || w.load_every_ticks == 0 {
            return Err("workload: tick_ms and load_every_ticks must be positive, \
                        requests_per_tick at most 10000"
                .into());
        }
        if w.expected_unique_blocks == 0 || w.expected_unique_blocks > 1 << 24 {
            return Err("workload.expected_unique_blocks must be in 1..=2^24".into());
        }
        if let Some(window) = self.topology.consumer_window_bytes
            && !(CONSUMER_WINDOW_MIN..=CONSUMER_WINDOW_MAX).contains(&window)
        {
            return Err(format!(
                "topology.consumer_window_bytes must be in {CONSUMER_WINDOW_MIN}..={CONSUMER_WINDOW_MAX}"
            ));
        }
        let consumers = self.topology.consumers;
        if consumers == 0 || consumers > CONSUMERS_MAX {
            return Err(format!("topology.consumers must be in 1..={CONSUMERS_MAX}"));
        }
        if let ConsumerExpectations::Each(table) = &self.expect.consumer {
            for name in table.keys() {
                match ConsumerTarget::parse(name)? {
                    ConsumerTarget::One(index) if index < consumers => {}
                    _ => return Err(format!("expect.consumer names {name:?} of {consumers}")),
                }
            }
        }
        for scripted in &self.faults {
            if let Some(Some(target)) = scripted.fault.consumer()
                && !target.fits(consumers)
            {
                return Err(format!("fault names consumer {target:?} of {consumers}"));
            }
            if scripted.at_ms > self.run_ms {
                return Err(format!("fault at {} ms is after run_ms", scripted.at_ms));
            }
            if let Some(index) = scripted.fault.worker()
                && index >= workers
            {
                return Err(format!("fault names worker {index} of {workers}"));
            }
            if let Fault::EventNoise(noise) = &scripted.fault {
                noise.validate()?;
            }
            if let Fault::ConsumerBandwidth { bytes_per_s, .. } = &scripted.fault
                && !BANDWIDTH_RANGE.contains(bytes_per_s)
            {
                return Err(format!(
                    "consumer-bandwidth bytes_per_s must be in {}..={}",
                    BANDWIDTH_RANGE.start(),
                    BANDWIDTH_RANGE.end()
                ));
            }
        }
        if let Some(random) = &self.random_faults
            && (random.kinds.is_empty()
                || random.count > 16
                || random.from_ms >= random.until_ms
                || random.until_ms > self.run_ms)
        {
            return Err("random_faults: 1..=16 of non-empty kinds within from_ms < until_ms \
                        <= run_ms"
                .into());
        }
        Ok(())
    }

    /// The DC's workers, in index order.
    pub fn deployment(&self) -> Result<Deployment, String> {
        let mut workers = match self.topology.preset.as_deref() {
            None => Vec::new(),
            Some("demo") => Deployment::demo().workers,
            Some(other) => return Err(format!("unknown preset {other:?}")),
        };
        for group in &self.topology.workers {
            if group.pools == 0 || group.pools > GROUP_POOLS_MAX {
                return Err(format!("pools must be in 1..={GROUP_POOLS_MAX}"));
            }
            for copy in 0..group.pools {
                let (endpoint, model) = group.names(copy)?;
                workers.extend(group.specs(endpoint, &model)?);
            }
            if workers.len() > WORKERS_MAX {
                return Err(format!("the topology must have 1..={WORKERS_MAX} workers"));
            }
        }
        Ok(Deployment { workers })
    }
}

impl WorkerGroup {
    /// The endpoint and model of the group's copy `copy` (see [`WorkerGroup::pools`]).
    fn names(&self, copy: usize) -> Result<(EndpointPath, String), String> {
        let parsed: EndpointPath =
            self.endpoint.parse().map_err(|e| format!("endpoint {}: {e}", self.endpoint))?;
        if self.pools == 1 {
            return Ok((parsed, self.model.clone()));
        }
        let text =
            format!("{}/{}-{copy}/{}", parsed.namespace(), parsed.component(), parsed.endpoint());
        let endpoint = text.parse().map_err(|e| format!("endpoint {text}: {e}"))?;
        Ok((endpoint, format!("{}-{copy}", self.model)))
    }

    /// The group's `replicas` worker specs serving `endpoint` and `model`.
    fn specs(&self, endpoint: EndpointPath, model: &str) -> Result<Vec<WorkerSpec>, String> {
        let group = self;
        {
            let mut spec = WorkerSpec::aggregated(endpoint, model);
            spec.worker_type = group.role.worker_type();
            let needs = group.needs.clone().unwrap_or_else(|| group.role.default_needs());
            spec.needs = needs
                .iter()
                .map(|alternative| alternative.iter().filter_map(|r| r.worker_type()).collect())
                .collect();
            spec.data_parallel_size = group.dp_ranks.clamp(1, 64);
            spec.capacity_blocks_per_rank = group.capacity_blocks.max(1);
            spec.block_size = group.block_size.clamp(1, 1024);
            spec.eagle = group.eagle;
            spec.enable_local_indexer = group.local_indexer;
            spec.adapters.clone_from(&group.adapters);
            spec.aliases.clone_from(&group.aliases);
            spec.publishes_kv = group.role != Role::Encode;
            if group.role == Role::LegacyPrefill {
                spec.model_type = Some(ModelTypeFlags(ModelTypeFlags::PREFILL));
            }
            if let Some(pool) = &group.routing_pool {
                let map = ExplicitIdentityMap::try_from_pairs([("pool", pool.as_str())])
                    .map_err(|e| format!("routing_pool {pool:?}: {e:?}"))?;
                spec.indexer_identity =
                    Some(IndexerIdentitySpec { semantics: None, routing_scope: Some(map) });
            }
            if group.replicas == 0 || group.replicas > WORKERS_MAX {
                return Err(format!("replicas must be in 1..={WORKERS_MAX}"));
            }
            Ok(vec![spec; group.replicas])
        }
    }
}

impl Scenario {
    /// The DC's traffic.
    #[must_use]
    pub fn traffic(&self) -> TrafficConfig {
        TrafficConfig {
            prefix_count: self.workload.prefix_count.clamp(1, 100_000),
            prefix_tokens: self.workload.prefix_tokens.min(100_000),
            tail_tokens_max: self.workload.tail_tokens_max.min(100_000),
            ..TrafficConfig::default()
        }
    }

    /// The fault script for `seed`: the scripted faults and the drawn ones, by time (scripted
    /// first at equal times).
    #[must_use]
    pub fn script(&self, seed: u64, workers: usize) -> Vec<ScriptedFault> {
        let mut script = self.faults.clone();
        if let Some(random) = &self.random_faults {
            script.extend(draw(random, seed, workers, self.topology.consumers));
        }
        script.sort_by_key(|scripted| scripted.at_ms);
        script
            .into_iter()
            .map(|ScriptedFault { at_ms, fault }| ScriptedFault { at_ms, fault: fault.resolved() })
            .collect()
    }
}

/// Every `*.toml` file in `dir` (not its subdirectories), sorted by name.
pub fn toml_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "toml"))
        .collect();
    paths.sort();
    Ok(paths)
}

/// Draw `random.count` faults, each with its repair, inside the window.
fn draw(random: &RandomFaults, seed: u64, workers: usize, consumers: usize) -> Vec<ScriptedFault> {
    let mut rng = rng_from_seed(derive_seed(seed, "sim/random-faults"));
    let mut below = |n: u64| if n == 0 { 0 } else { rng.next_u64() % n };
    let mut faults = Vec::new();
    let span = random.until_ms - random.from_ms;
    for _ in 0..random.count {
        let kind = random.kinds[below(random.kinds.len() as u64) as usize];
        let start = random.from_ms + below(span / 2);
        let end = (start + 200 + below(span - (start - random.from_ms))).min(random.until_ms);
        let worker = below(workers as u64) as usize;
        if random.adapter_churn {
            // Drawn after the fault's own choices only when asked for, so files without churn
            // draw what they always drew.
            let churner = below(workers as u64) as usize;
            let adapter = CHURN_ADAPTERS[below(CHURN_ADAPTERS.len() as u64) as usize].to_owned();
            // Loaded after the fault began and by its repair; unloaded by the window's end.
            let load = start + 1 + below(end - start);
            let unload = (below(4) != 0 && load < random.until_ms)
                .then(|| load + 1 + below(random.until_ms - load));
            faults.push(ScriptedFault {
                at_ms: load,
                fault: Fault::LoadAdapter { worker: churner, adapter: adapter.clone() },
            });
            if let Some(at_ms) = unload {
                faults.push(ScriptedFault {
                    at_ms,
                    fault: Fault::UnloadAdapter { worker: churner, adapter },
                });
            }
        }
        let mut at = |at_ms, fault| faults.push(ScriptedFault { at_ms, fault });
        match kind {
            RandomKind::WorkerRestart => {
                let same_id = below(2) == 0;
                at(start, Fault::RestartWorker { worker, same_id });
            }
            RandomKind::LeaseExpiry => {
                at(start, Fault::ExpireLease { worker });
                at(end, Fault::RenewLease { worker });
            }
            RandomKind::EventNoise => {
                let p = |x: u64| x as f64 / 100.0;
                let noise =
                    Noise { loss: p(below(10)), duplicate: p(below(10)), reorder: p(below(10)) };
                at(start, Fault::EventNoise(noise));
                at(end, Fault::EventNoise(Noise::default()));
            }
            RandomKind::WanPartition => {
                let consumer = Some(ConsumerTarget::One(below(consumers as u64) as usize));
                at(start, Fault::WanPartition { consumer });
                at(end, Fault::WanRepair { consumer });
            }
            RandomKind::StalledConsumer => {
                let consumer = Some(ConsumerTarget::One(below(consumers as u64) as usize));
                at(start, Fault::WanHold { consumer });
                at(end, Fault::WanRelease { consumer });
            }
            RandomKind::DcPartition => {
                let mode = if below(2) == 0 { PartitionMode::Drop } else { PartitionMode::Stall };
                at(start, Fault::DcPartition { mode });
                at(end, Fault::DcRepair);
            }
            RandomKind::RelayRestart => at(start, Fault::RelayRestart),
            RandomKind::EventPlaneRestart => at(start, Fault::EventPlaneRestart),
            RandomKind::DiscoveryRestart => at(start, Fault::DiscoveryRestart),
            RandomKind::ClockSkew => {
                let ms = i64::try_from(below(20_000)).unwrap_or(0) - 10_000;
                at(start, Fault::ClockSkew { ms });
            }
            RandomKind::WorkerCrash => {
                let same_id = below(2) == 0;
                at(start, Fault::CrashWorker { worker });
                at(end, Fault::StartWorker { worker, same_id });
            }
            RandomKind::Overlap => {
                at(start, Fault::BeginOverlap { worker });
                at(end, Fault::EndOverlap { worker });
            }
            RandomKind::CacheClear => {
                let rank = u32::try_from(below(64)).unwrap_or(0);
                at(start, Fault::ClearRank { worker, rank });
            }
            RandomKind::AdapterChurn => {
                let adapter = DRAWN_ADAPTER.to_owned();
                at(start, Fault::LoadAdapter { worker, adapter: adapter.clone() });
                at(end, Fault::UnloadAdapter { worker, adapter });
            }
            RandomKind::ConsumerBandwidth => {
                let consumer = Some(ConsumerTarget::One(below(consumers as u64) as usize));
                let bytes_per_s = 2048 << below(8);
                at(start, Fault::ConsumerBandwidth { consumer, bytes_per_s });
                at(end, Fault::ConsumerBandwidthLift { consumer });
            }
        }
    }
    faults
}

/// How long the script runs before traffic stops.
#[must_use]
pub fn run_duration(scenario: &Scenario) -> Duration {
    Duration::from_millis(scenario.run_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
run_ms = 1000
[topology]
preset = "demo"
[expect]
pools = 4
readiness = { tiny-llm = "ready" }
"#;

    #[test]
    fn a_minimal_file_takes_its_name_and_defaults() {
        let scenario = Scenario::parse(MINIMAL, "minimal").unwrap();
        assert_eq!(scenario.name, "minimal");
        assert_eq!(scenario.workload, Workload::default());
        assert_eq!(scenario.deployment().unwrap().workers.len(), 5);
        assert_eq!(scenario.expect.readiness["tiny-llm"], ExpectedState::Ready);
    }

    #[test]
    fn faults_parse_by_action_and_are_checked_against_the_topology() {
        let text = format!(
            "{MINIMAL}\n[[faults]]\nat_ms = 500\naction = \"restart-worker\"\nworker = 1\n\
             same_id = true\n[[faults]]\nat_ms = 600\naction = \"event-noise\"\nloss = 0.1\n"
        );
        let scenario = Scenario::parse(&text, "x").unwrap();
        assert_eq!(scenario.faults[0].fault, Fault::RestartWorker { worker: 1, same_id: true });
        assert_eq!(
            scenario.faults[1].fault,
            Fault::EventNoise(Noise { loss: 0.1, ..Noise::default() })
        );
        let bad = text.replace("worker = 1", "worker = 9");
        assert!(matches!(Scenario::parse(&bad, "x"), Err(ScenarioError::Invalid { .. })));
        let late = text.replace("at_ms = 500", "at_ms = 5000");
        assert!(matches!(Scenario::parse(&late, "x"), Err(ScenarioError::Invalid { .. })));
    }

    #[test]
    fn wan_faults_name_consumers_and_default_to_the_first() {
        let text = format!(
            "{MINIMAL}\n[[faults]]\nat_ms = 100\naction = \"wan-partition\"\nconsumer = \"b\"\n\
             [[faults]]\nat_ms = 200\naction = \"wan-hold\"\nconsumer = \"consumer-b\"\n\
             [[faults]]\nat_ms = 300\naction = \"wan-repair\"\nconsumer = 1\n\
             [[faults]]\nat_ms = 400\naction = \"wan-release\"\nconsumer = \"all\"\n\
             [[faults]]\nat_ms = 500\naction = \"wan-partition\"\n"
        );
        let scenario = Scenario::parse(&text, "x").unwrap();
        assert_eq!(scenario.topology.consumers, CONSUMERS_DEFAULT);
        let b = Some(ConsumerTarget::One(1));
        let written: Vec<Option<Option<ConsumerTarget>>> =
            scenario.faults.iter().map(|f| f.fault.consumer()).collect();
        let all = Some(ConsumerTarget::All);
        assert_eq!(written, vec![Some(b), Some(b), Some(b), Some(all), Some(None)]);
        let script = scenario.script(0, 5);
        assert_eq!(script[4].fault, Fault::WanPartition { consumer: Some(ConsumerTarget::One(0)) });
        assert_eq!(serde_json::to_value(&script[0].fault).unwrap()["consumer"], "b");
        assert_eq!(ConsumerTarget::All.indices(3), vec![0, 1, 2]);
        assert_eq!(consumer_host(2), "consumer-c");
        let missing = text.replace("consumer = 1", "consumer = 2");
        assert!(matches!(Scenario::parse(&missing, "x"), Err(ScenarioError::Invalid { .. })));
        let garbled = text.replace("consumer = \"b\"", "consumer = \"b-e\"");
        assert!(matches!(Scenario::parse(&garbled, "x"), Err(ScenarioError::Parse { .. })));
        let none = MINIMAL.replace("preset = \"demo\"", "preset = \"demo\"\nconsumers = 0");
        assert!(matches!(Scenario::parse(&none, "x"), Err(ScenarioError::Invalid { .. })));
    }

    #[test]
    fn consumers_past_z_are_named_like_spreadsheet_columns() {
        let labels: Vec<String> = [0, 25, 26, 27, 51, 52, 63].map(consumer_label).to_vec();
        assert_eq!(labels, ["a", "z", "aa", "ab", "az", "ba", "bl"]);
        for index in 0..CONSUMERS_MAX {
            let parsed = ConsumerTarget::parse(&consumer_host(index)).unwrap();
            assert_eq!(parsed, ConsumerTarget::One(index));
        }
        assert!(ConsumerTarget::parse("consumer-").is_err());
        assert!(ConsumerTarget::parse("A").is_err());
        assert!(ConsumerTarget::parse("abcd").is_err(), "at most three letters");
    }

    #[test]
    fn a_fleet_group_repeats_over_numbered_pools_within_the_worker_cap() {
        let fleet = |pools: usize, replicas: usize| {
            format!(
                "run_ms = 1000\n[topology]\nconsumers = 64\n[[topology.workers]]\n\
                 endpoint = \"dynamo/backend/generate\"\nmodel = \"m\"\n\
                 replicas = {replicas}\npools = {pools}\n[expect]\npools = {pools}\n"
            )
        };
        let scenario = Scenario::parse(&fleet(100, 10), "fleet").unwrap();
        let workers = scenario.deployment().unwrap().workers;
        assert_eq!(workers.len(), 1000);
        assert_eq!(workers[0].endpoint.to_string(), "dynamo/backend-0/generate");
        assert_eq!(workers[999].endpoint.to_string(), "dynamo/backend-99/generate");
        assert_eq!(workers[999].model, "m-99");
        let endpoints: std::collections::BTreeSet<String> =
            workers.iter().map(|w| w.endpoint.to_string()).collect();
        assert_eq!(endpoints.len(), 100);
        assert!(matches!(
            Scenario::parse(&fleet(256, 9), "too-many"),
            Err(ScenarioError::Invalid { .. })
        ));
        assert!(matches!(
            Scenario::parse(&fleet(0, 1), "none"),
            Err(ScenarioError::Invalid { .. })
        ));
    }

    #[test]
    fn consumer_expectations_apply_to_every_consumer_or_per_letter() {
        let every = format!("{MINIMAL}consumer = \"kept-streams\"\n");
        let scenario = Scenario::parse(&every, "x").unwrap();
        assert_eq!(scenario.expect.consumer.of(0), ConsumerExpectation::KeptStreams);
        assert_eq!(scenario.expect.consumer.of(1), ConsumerExpectation::KeptStreams);
        let each = format!("{MINIMAL}consumer = {{ b = \"resubscribed\" }}\n");
        let scenario = Scenario::parse(&each, "x").unwrap();
        assert_eq!(scenario.expect.consumer.of(0), ConsumerExpectation::Any);
        assert_eq!(scenario.expect.consumer.of(1), ConsumerExpectation::Resubscribed);
        let beyond = format!("{MINIMAL}consumer = {{ c = \"resubscribed\" }}\n");
        assert!(matches!(Scenario::parse(&beyond, "x"), Err(ScenarioError::Invalid { .. })));
    }

    #[test]
    fn a_legacy_prefill_group_is_a_card_without_worker_type_marked_prefill() {
        let text = "run_ms = 1000\n[topology]\n[[topology.workers]]\n\
                    endpoint = \"lp/prefill/generate\"\nmodel = \"m\"\nrole = \"legacy-prefill\"\n\
                    [expect]\npools = 1\nreadiness = {}\n";
        let scenario = Scenario::parse(text, "x").unwrap();
        let spec = &scenario.deployment().unwrap().workers[0];
        assert_eq!(spec.worker_type, None);
        assert!(spec.needs.is_empty());
        assert!(spec.card_model_type().supports_prefill());
        assert!(spec.publishes_kv);
    }

    #[test]
    fn drawn_wan_faults_pick_a_consumer_from_the_seed() {
        let text = format!(
            "{MINIMAL}\n[random_faults]\ncount = 8\nkinds = [\"wan-partition\", \
             \"stalled-consumer\"]\nfrom_ms = 100\nuntil_ms = 900\n"
        );
        let scenario = Scenario::parse(
            &text.replace("preset = \"demo\"", "preset = \"demo\"\nconsumers = 3"),
            "x",
        )
        .unwrap();
        let mut targets = std::collections::BTreeSet::new();
        for seed in 0..8 {
            for scripted in scenario.script(seed, 5) {
                let Some(Some(ConsumerTarget::One(index))) = scripted.fault.consumer() else {
                    panic!("a drawn WAN fault names one consumer: {scripted:?}");
                };
                assert!(index < 3);
                targets.insert(index);
            }
        }
        assert_eq!(targets.len(), 3, "every consumer is drawn for some seed");
    }

    #[test]
    fn drawn_worker_faults_come_with_their_repair_on_the_same_worker() {
        let text = format!(
            "{MINIMAL}\n[random_faults]\ncount = 16\nkinds = [\"worker-crash\", \"overlap\", \
             \"cache-clear\", \"adapter-churn\"]\nfrom_ms = 100\nuntil_ms = 900\n"
        );
        let scenario = Scenario::parse(&text, "x").unwrap();
        let mut actions = std::collections::BTreeSet::new();
        for seed in 0..4 {
            let script = scenario.script(seed, 5);
            for scripted in &script {
                actions.insert(scripted.fault.action());
                let worker = scripted.fault.worker().expect("a worker-level fault");
                assert!(worker < 5 && (100..=900).contains(&scripted.at_ms));
                let repair = match &scripted.fault {
                    Fault::CrashWorker { .. } => "start-worker",
                    Fault::BeginOverlap { .. } => "end-overlap",
                    Fault::LoadAdapter { adapter, .. } => {
                        assert_eq!(adapter, DRAWN_ADAPTER);
                        "unload-adapter"
                    }
                    _ => continue,
                };
                assert!(
                    script.iter().any(|later| later.at_ms >= scripted.at_ms
                        && later.fault.action() == repair
                        && later.fault.worker() == Some(worker)),
                    "{scripted:?} has no {repair} in {script:?}"
                );
            }
        }
        let drawn = ["clear-rank", "crash-worker", "begin-overlap", "load-adapter"];
        assert!(drawn.iter().all(|action| actions.contains(*action)), "{actions:?}");
    }

    #[test]
    fn a_bandwidth_limit_names_a_consumer_and_a_rate_in_range() {
        let text = format!(
            "{MINIMAL}\n[[faults]]\nat_ms = 100\naction = \"consumer-bandwidth\"\nconsumer = \"b\"\n\
             bytes_per_s = 4096\n[[faults]]\nat_ms = 900\naction = \"consumer-bandwidth-lift\"\n\
             consumer = \"b\"\n"
        );
        let scenario = Scenario::parse(&text, "x").unwrap();
        let b = Some(ConsumerTarget::One(1));
        assert_eq!(
            scenario.faults[0].fault,
            Fault::ConsumerBandwidth { consumer: b, bytes_per_s: 4096 }
        );
        assert_eq!(scenario.faults[1].fault.action(), "consumer-bandwidth-lift");
        assert_eq!(scenario.faults[1].fault.consumer(), Some(b));
        for rate in ["0", "1023", "1073741825"] {
            let bad = text.replace("bytes_per_s = 4096", &format!("bytes_per_s = {rate}"));
            assert!(matches!(Scenario::parse(&bad, "x"), Err(ScenarioError::Invalid { .. })));
        }
        let beyond = text.replace("consumer = \"b\"\nbytes", "consumer = \"c\"\nbytes");
        assert!(matches!(Scenario::parse(&beyond, "x"), Err(ScenarioError::Invalid { .. })));
        let window =
            MINIMAL.replace("preset = \"demo\"", "preset = \"demo\"\nconsumer_window_bytes = 100");
        assert!(matches!(Scenario::parse(&window, "x"), Err(ScenarioError::Invalid { .. })));
    }

    #[test]
    fn a_drawn_bandwidth_limit_is_lifted_on_the_same_consumer() {
        let text = format!(
            "{MINIMAL}\n[random_faults]\ncount = 8\nkinds = [\"consumer-bandwidth\"]\n\
             from_ms = 100\nuntil_ms = 900\n"
        );
        let scenario = Scenario::parse(&text, "x").unwrap();
        let mut rates = std::collections::BTreeSet::new();
        for seed in 0..8 {
            let script = scenario.script(seed, 5);
            assert_eq!(script.len(), 16);
            for (index, scripted) in script.iter().enumerate() {
                let Fault::ConsumerBandwidth { consumer, bytes_per_s } = scripted.fault else {
                    continue;
                };
                assert!((2048..=262_144).contains(&bytes_per_s));
                rates.insert(bytes_per_s);
                assert!(
                    script[index..]
                        .iter()
                        .any(|later| later.fault == Fault::ConsumerBandwidthLift { consumer })
                );
            }
        }
        assert!(rates.len() > 3, "{rates:?}");
    }

    #[test]
    fn adapter_churn_accompanies_every_drawn_fault_kind() {
        let kinds = [
            "worker-restart",
            "worker-crash",
            "overlap",
            "cache-clear",
            "adapter-churn",
            "lease-expiry",
            "event-noise",
            "wan-partition",
            "stalled-consumer",
            "dc-partition",
            "relay-restart",
            "clock-skew",
            "event-plane-restart",
            "discovery-restart",
            "consumer-bandwidth",
        ];
        let churn = |fault: &Fault| match fault {
            Fault::LoadAdapter { adapter, .. } | Fault::UnloadAdapter { adapter, .. } => {
                CHURN_ADAPTERS.contains(&adapter.as_str())
            }
            _ => false,
        };
        let (mut kept, mut unloaded) = (0, 0);
        for kind in kinds {
            let without = format!(
                "{MINIMAL}\n[random_faults]\ncount = 4\nkinds = [\"{kind}\"]\nfrom_ms = 100\n\
                 until_ms = 900\n"
            );
            let with =
                without.replace("until_ms = 900\n", "until_ms = 900\nadapter_churn = true\n");
            let plain = Scenario::parse(&without, "x").unwrap();
            let churned = Scenario::parse(&with, "x").unwrap();
            for seed in 0..4 {
                assert!(plain.script(seed, 5).iter().all(|f| !churn(&f.fault)), "{kind}");
                let script = churned.script(seed, 5);
                let loads: Vec<&ScriptedFault> = script
                    .iter()
                    .filter(|f| churn(&f.fault) && f.fault.action() == "load-adapter")
                    .collect();
                assert_eq!(loads.len(), 4, "{kind}: one churn per drawn fault");
                for load in loads {
                    // Loaded while a fault of the kind is under way: after some fault began.
                    assert!(
                        script.iter().any(|f| !churn(&f.fault) && f.at_ms < load.at_ms),
                        "{kind}: {load:?} in {script:?}"
                    );
                    assert!((101..=900).contains(&load.at_ms));
                }
                // Each churn unload follows a load of its adapter on its worker, in the window.
                for unload in script.iter().filter(|f| churn(&f.fault)) {
                    let Fault::UnloadAdapter { worker, adapter } = &unload.fault else {
                        continue;
                    };
                    let load = Fault::LoadAdapter { worker: *worker, adapter: adapter.clone() };
                    assert!(unload.at_ms <= 900);
                    assert!(script.iter().any(|f| f.fault == load && f.at_ms < unload.at_ms));
                    unloaded += 1;
                }
                kept += 4;
            }
        }
        kept -= unloaded;
        assert!(kept > 0 && unloaded > kept, "{kept} kept, {unloaded} unloaded");
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let text = MINIMAL.replace("run_ms", "run_msec");
        assert!(matches!(Scenario::parse(&text, "x"), Err(ScenarioError::Parse { .. })));
    }

    #[test]
    fn random_faults_are_a_function_of_the_seed_and_stay_in_their_window() {
        let text = format!(
            "{MINIMAL}\n[random_faults]\ncount = 6\nkinds = [\"lease-expiry\", \"event-noise\", \
             \"dc-partition\"]\nfrom_ms = 100\nuntil_ms = 900\n"
        );
        let scenario = Scenario::parse(&text, "x").unwrap();
        let one = scenario.script(3, 5);
        assert_eq!(one, scenario.script(3, 5));
        assert_ne!(one, scenario.script(4, 5));
        assert!(one.len() >= 12);
        assert!(one.iter().all(|f| (100..=900).contains(&f.at_ms)));
        assert!(one.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
    }
}
