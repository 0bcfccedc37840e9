//! The relay's configuration: command-line values over `DYN_*` environment variables, validated
//! once at start-up (relay-facts §12). Every error names the setting it is about.
//!
//! Precedence: a command-line value replaces the environment's (a CLI prefix list replaces the
//! environment list, it does not extend it). Booleans accept `1/0, true/false, yes/no, on/off`
//! (case-insensitive, trimmed). Unknown `DYN_RELAY_*` names are ignored. WAN tuning variables
//! require a listener (`--bind`). The accept / reject decisions are those of Dynamo's launcher
//! (`python -m dynamo.kv_dc_relay`): `DYN_DC_ID` or a `DYN_RELAY_*` variable that is set but
//! empty is a bad value, not an absent one (`DYN_RELAY_NAMESPACES=` selects nothing and is
//! refused); endpoint prefixes are taken as given, so one with surrounding whitespace is refused;
//! every tuning value is a positive integer (capacities up to tokio's semaphore maximum, the load
//! fan-out up to [`LOAD_FANOUT_CAPACITY_MAX`]). The runtime's own variables
//! (`DYN_DISCOVERY_BACKEND`, `NATS_SERVER`, ...) and the guard `DYN_RELAY_CONNECTION_REVISION`
//! treat an empty value as unset.
//!
//! Scope: `--watch-all`, `--namespaces`, `--namespace-filter` (Dynamo's legacy single-namespace
//! form: one namespace, non-empty, no surrounding whitespace) and `--sources-file` exclude each
//! other on the command line; any of them replaces the environment's `DYN_RELAY_NAMESPACES` /
//! `DYN_RELAY_WATCH_ALL`.
//! With `--sources-file` the static scope watches every namespace (narrowed by the endpoint
//! prefixes) and the file's namespaces narrow it at run time; `DYN_RELAY_CONNECTION_REVISION`
//! is read only then. The operations listener (`--ops-bind` / `DYN_RELAY_OPS_BIND`) defaults to
//! loopback [`OPS_BIND_DEFAULT`] and `off` disables it.
//!
//! Recording (`--record DIR` / `DYN_RELAY_RECORD_DIR`) keeps at most `--record-max-bytes` /
//! `DYN_RELAY_RECORD_MAX_BYTES` (default 1 GiB, at least 1 MiB) and closes a segment after
//! `--record-max-age` / `DYN_RELAY_RECORD_MAX_AGE_SECS` seconds (default 3600); either limit
//! without a directory is a conflict. Checkpoints are taken every
//! `DYN_RELAY_RECORD_CHECKPOINT_INPUTS` inputs (default 10,000) or
//! `DYN_RELAY_RECORD_CHECKPOINT_INTERVAL_MS` (default 10,000) with at least one input.

mod describe;
#[cfg(test)]
mod dynamo_cli_tests;
mod limits;
mod memory;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;

use crate::discovery_plane::{DiscoveryBackend, DiscoveryPlaneError};
use kvrelay_core::discovery::{DiscoveryScope, ScopeError};
use kvrelay_core::filter::ckf::{CkfFormat, bucket_count_for_expected_blocks};
use kvrelay_core::model::identity::{DcId, stable_dc_id};

use crate::event_plane::{NatsSecurity, NatsSecurityError};
use crate::wan::{WanTlsSettings, WanTlsValues, resolve_wan_tls};
pub use describe::describe;
pub use limits::{
    LISTENER_BYTES_MAX, ListenerLimits, MAX_HEADER_LIST_BYTES_MIN, MAX_REQUEST_BYTES_MIN,
    SHUTDOWN_TIMEOUT_DEFAULT,
};
pub use memory::{BYTE_BUDGET_MAX, BYTE_BUDGET_MIN, MemoryBudgets};

/// Default CKF sizing per pool.
pub const EXPECTED_UNIQUE_BLOCKS_DEFAULT: u64 = 1_048_576;
/// Smallest accepted gRPC message limit: a full snapshot chunk plus headers.
pub const MAX_MESSAGE_BYTES_MIN: u64 = 4_259_904;
/// Smallest accepted per-subscriber queue byte budget: one full chunk plus overhead.
pub const PUBLICATION_QUEUE_BYTES_MIN: u64 = 4_194_624;
/// Largest accepted timer value.
pub const TIMER_MS_MAX: u64 = 31_536_000_000;
/// Largest accepted load fan-out capacity (windows buffered per load stream, allocated up front).
pub const LOAD_FANOUT_CAPACITY_MAX: u64 = 65_536;
/// Largest accepted admission limit or queue capacity: tokio's semaphore maximum.
pub const CAPACITY_MAX: u64 = tokio::sync::Semaphore::MAX_PERMITS as u64;
/// Default number of snapshot chunks encoded at once across the relay.
pub const PUBLICATION_ENCODING_CONCURRENCY_DEFAULT: usize = 2;

/// Values given on the command line (`None`/empty = not given).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CliValues {
    /// `--dc-id`.
    pub dc_id: Option<String>,
    /// `--namespaces` (comma list).
    pub namespaces: Option<String>,
    /// `--watch-all`.
    pub watch_all: bool,
    /// `--endpoint-prefix`, repeatable.
    pub endpoint_prefixes: Vec<String>,
    /// `--expected-unique-blocks`.
    pub expected_unique_blocks: Option<String>,
    /// `--bind`.
    pub bind: Option<String>,
    /// `--sources-file`.
    pub sources_file: Option<PathBuf>,
    /// `--ops-bind`.
    pub ops_bind: Option<String>,
    /// `--record` (journal root directory).
    pub record: Option<PathBuf>,
    /// `--record-max-bytes`.
    pub record_max_bytes: Option<String>,
    /// `--record-max-age` (seconds).
    pub record_max_age: Option<String>,
    /// `--namespace-filter` (one namespace).
    pub namespace_filter: Option<String>,
    /// `--tls-cert`, `--tls-key`, `--tls-client-ca`.
    pub wan_tls: WanTlsValues,
}

/// Default address of the operations HTTP endpoints (`--ops-bind`): loopback only.
pub const OPS_BIND_DEFAULT: &str = "127.0.0.1:9090";

/// Default bound on a recording's total size (`--record-max-bytes`): 1 GiB.
pub const RECORD_MAX_BYTES_DEFAULT: u64 = 1 << 30;
/// Smallest accepted `--record-max-bytes`: 1 MiB (segments of 64 KiB).
pub const RECORD_MAX_BYTES_MIN: u64 = 1 << 20;
/// Default age at which a journal segment is closed (`--record-max-age`): one hour.
pub const RECORD_MAX_AGE_SECS_DEFAULT: u64 = 3600;

/// `--record`: journal every input into a directory (docs/journal.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordSettings {
    /// The root directory; each start records into a fresh subdirectory of it.
    pub root: PathBuf,
    /// Bound on the recording's total size in bytes.
    pub max_total_bytes: u64,
    /// A segment is closed once its records span this long.
    pub max_segment_age: Duration,
    /// A checkpoint after this many inputs (`DYN_RELAY_RECORD_CHECKPOINT_INPUTS`, default
    /// 10,000)...
    pub checkpoint_every_inputs: u64,
    /// ...or after this long with at least one input
    /// (`DYN_RELAY_RECORD_CHECKPOINT_INTERVAL_MS`, default 10 s).
    pub checkpoint_interval: Duration,
}

/// A configuration the relay cannot start with.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConfigError {
    /// A required setting is missing.
    #[error("{setting} is required")]
    Missing {
        /// The setting's flag or variable name.
        setting: &'static str,
    },
    /// A setting has a value that cannot be used.
    #[error("{setting}={value:?}: {reason}")]
    Invalid {
        /// The setting's flag or variable name.
        setting: &'static str,
        /// The value given.
        value: String,
        /// Why it is refused.
        reason: String,
    },
    /// Two settings contradict each other.
    #[error("{first} conflicts with {second}")]
    Conflict {
        /// One setting.
        first: &'static str,
        /// The other.
        second: &'static str,
    },
    /// The discovery scope is invalid.
    #[error("discovery scope: {0}")]
    Scope(#[from] ScopeError),
}

/// Which event plane carries `kv-events` and `kv_metrics`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventPlane {
    /// NATS at this URL.
    Nats {
        /// `NATS_SERVER`.
        url: String,
        /// `NATS_AUTH_*` / `NATS_TLS_*`.
        security: NatsSecurity,
    },
    /// ZMQ channels advertised in discovery.
    Zmq,
}

/// kvrelay's own setting (not Dynamo's): publication deadlines on a precise timer.
pub const PRECISE_TIMER_ENV: &str = "KVRELAY_PRECISE_PUBLICATION_TIMER";

/// Producer tuning (valid without a listener).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProducerTuning {
    /// Applied events per publication.
    pub publication_threshold_events: u32,
    /// Delay after the first pending event.
    pub publication_delay: Duration,
    /// Per-attempt recovery timeout.
    pub recovery_attempt_timeout: Duration,
    /// Publication deadlines wait on a real-time timer to the nanosecond
    /// (`KVRELAY_PRECISE_PUBLICATION_TIMER`; see [`crate::pool::PoolConfig::precise_timer`]).
    pub precise_publication_timer: bool,
}

/// WAN listener tuning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WanTuning {
    /// Largest gRPC message.
    pub max_message_bytes: usize,
    /// HTTP/2 keepalive interval.
    pub keepalive_interval: Duration,
    /// HTTP/2 keepalive timeout.
    pub keepalive_timeout: Duration,
    /// Pool stream heartbeat.
    pub pool_heartbeat_interval: Duration,
    /// Readiness stream heartbeat.
    pub readiness_heartbeat_interval: Duration,
    /// Catalog stream heartbeat.
    pub catalog_heartbeat_interval: Duration,
    /// Snapshot progress timeout per frame.
    pub snapshot_progress_timeout: Duration,
    /// Load window length.
    pub load_window: Duration,
    /// Load windows buffered per subscriber.
    pub load_fanout_capacity: usize,
    /// Frames queued per pool subscriber.
    pub publication_queue_frames: usize,
    /// Bytes queued per pool subscriber.
    pub publication_queue_bytes: usize,
    /// Initialized hubs across pools.
    pub max_initialized_pool_hubs: usize,
    /// Catalog streams.
    pub max_catalog_subscribers: usize,
    /// Pool streams across pools.
    pub max_pool_streams_total: usize,
    /// Pool streams per pool.
    pub max_subscribers_per_pool: usize,
    /// Readiness streams.
    pub max_readiness_subscribers: usize,
    /// Load streams.
    pub max_load_subscribers: usize,
    /// Snapshot chunks encoded at once across the relay.
    pub publication_encoding_concurrency: usize,
    /// Connection, stream, size and send-deadline limits of the listener.
    pub limits: ListenerLimits,
}

impl Default for WanTuning {
    fn default() -> Self {
        WanTuning {
            max_message_bytes: 8_388_608,
            keepalive_interval: Duration::from_secs(20),
            keepalive_timeout: Duration::from_secs(10),
            pool_heartbeat_interval: Duration::from_secs(10),
            readiness_heartbeat_interval: Duration::from_secs(10),
            catalog_heartbeat_interval: Duration::from_secs(10),
            snapshot_progress_timeout: Duration::from_secs(60),
            load_window: Duration::from_secs(1),
            load_fanout_capacity: 16,
            publication_queue_frames: 16,
            publication_queue_bytes: 16_777_216,
            max_initialized_pool_hubs: 64,
            max_catalog_subscribers: 64,
            max_pool_streams_total: 64,
            max_subscribers_per_pool: 64,
            max_readiness_subscribers: 64,
            max_load_subscribers: 64,
            publication_encoding_concurrency: PUBLICATION_ENCODING_CONCURRENCY_DEFAULT,
            limits: ListenerLimits::default(),
        }
    }
}

/// A validated relay configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayConfig {
    /// The operator's DC name.
    pub dc_name: String,
    /// Its derived id.
    pub dc_id: DcId,
    /// Which endpoints to watch.
    pub scope: DiscoveryScope,
    /// CKF sizing per pool.
    pub expected_unique_blocks: u64,
    /// The filter format every pool uses.
    pub ckf_format: CkfFormat,
    /// `DYN_RELAY_POOL_FILTER_BYTES_MAX`: the bytes all pools' filters may take together.
    pub pool_filter_bytes_max: u64,
    /// The byte budgets of each pool's exact state, the input queue and the NATS backlog.
    pub memory: MemoryBudgets,
    /// WAN listener, if any.
    pub bind: Option<SocketAddr>,
    /// Live-reloaded namespace source list, if any. With it, `scope` watches every namespace
    /// (narrowed by the endpoint prefixes) and the file's namespaces narrow it at run time.
    pub sources_file: Option<PathBuf>,
    /// `DYN_RELAY_CONNECTION_REVISION`: the `connectionRevision` a sources file must carry
    /// (only read with `--sources-file`).
    pub connection_revision: Option<String>,
    /// Operations HTTP listener (`/metrics`, `/health`, `/ready`, ...); `None` = disabled.
    pub ops_bind: Option<SocketAddr>,
    /// Producer tuning.
    pub producer: ProducerTuning,
    /// WAN tuning (defaults when there is no listener).
    pub wan: WanTuning,
    /// Discovery backend.
    pub discovery: DiscoveryBackend,
    /// Event plane.
    pub event_plane: EventPlane,
    /// Input journal (`--record` / `DYN_RELAY_RECORD_DIR`), if any.
    pub record: Option<RecordSettings>,
    /// `POD_UID`: the Kubernetes pod this relay runs in, reported by `/engine/state`.
    pub pod_uid: Option<String>,
    /// TLS on the WAN listener (`--tls-cert` ...), if any; plaintext otherwise.
    pub wan_tls: Option<WanTlsSettings>,
    /// `DYN_RELAY_SHUTDOWN_TIMEOUT_MS`: a shutdown completes within this, stalled clients or not.
    pub shutdown_timeout: Duration,
}

struct Env<'a>(&'a BTreeMap<String, String>);

impl Env<'_> {
    /// The variable's value. `DYN_DC_ID` and the launcher's `DYN_RELAY_*` variables count as set
    /// when empty (and then fail their validation, as in Dynamo's launcher); every other variable
    /// counts as unset when blank.
    fn get(&self, name: &str) -> Option<&str> {
        let value = self.0.get(name).map(String::as_str)?;
        let empty_is_set = name == "DYN_DC_ID"
            || (name.starts_with("DYN_RELAY_") && name != CONNECTION_REVISION_ENV);
        (empty_is_set || !value.trim().is_empty()).then_some(value)
    }
}

/// The period of the discovery backends' reconciling relist, in milliseconds.
pub const RELIST_INTERVAL_ENV: &str = "DYN_RELAY_DISCOVERY_RELIST_INTERVAL_MS";
/// Its default: relay-facts §12's reconcile interval.
const RELIST_INTERVAL_DEFAULT_MS: u64 = 30_000;

/// The sources file guard variable (empty counts as unset).
const CONNECTION_REVISION_ENV: &str = "DYN_RELAY_CONNECTION_REVISION";

fn invalid(setting: &'static str, value: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { setting, value: value.to_owned(), reason: reason.into() }
}

/// Parse a boolean the way the reference does.
pub fn parse_bool(setting: &'static str, value: &str) -> Result<bool, ConfigError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(invalid(setting, value, "expected 1/0, true/false, yes/no or on/off")),
    }
}

fn parse_positive(setting: &'static str, value: &str, max: u64) -> Result<u64, ConfigError> {
    let parsed: u64 =
        value.trim().parse().map_err(|_| invalid(setting, value, "expected a positive integer"))?;
    if parsed == 0 || parsed > max {
        return Err(invalid(setting, value, format!("must be in 1..={max}")));
    }
    Ok(parsed)
}

fn comma_list(setting: &'static str, value: &str) -> Result<Vec<String>, ConfigError> {
    let items: Vec<String> = value.split(',').map(|item| item.trim().to_owned()).collect();
    if items.iter().any(String::is_empty) {
        return Err(invalid(setting, value, "list items must be non-empty"));
    }
    let mut unique = items.clone();
    unique.sort();
    unique.dedup();
    if unique.len() != items.len() {
        return Err(invalid(setting, value, "list items must be unique"));
    }
    Ok(items)
}

/// Resolve and validate the configuration from command-line values and the environment.
pub fn resolve(
    cli: &CliValues,
    environment: &BTreeMap<String, String>,
) -> Result<RelayConfig, ConfigError> {
    let env = Env(environment);
    let dc_name = match (&cli.dc_id, env.get("DYN_DC_ID")) {
        (Some(value), _) => value.clone(),
        (None, Some(value)) => value.to_owned(),
        (None, None) => return Err(ConfigError::Missing { setting: "--dc-id / DYN_DC_ID" }),
    };
    if dc_name.trim().is_empty() {
        return Err(ConfigError::Missing { setting: "--dc-id / DYN_DC_ID" });
    }
    let dc_id = stable_dc_id(&dc_name)
        .map_err(|error| invalid("--dc-id / DYN_DC_ID", &dc_name, error.to_string()))?;

    let scope = resolve_scope(cli, &env)?;

    let expected_unique_blocks =
        match (&cli.expected_unique_blocks, env.get("DYN_RELAY_EXPECTED_UNIQUE_BLOCKS")) {
            (Some(value), _) => parse_positive("--expected-unique-blocks", value, u64::MAX)?,
            (None, Some(value)) => {
                parse_positive("DYN_RELAY_EXPECTED_UNIQUE_BLOCKS", value, u64::MAX)?
            }
            (None, None) => EXPECTED_UNIQUE_BLOCKS_DEFAULT,
        };
    let bucket_count =
        bucket_count_for_expected_blocks(expected_unique_blocks).map_err(|error| {
            invalid(
                "--expected-unique-blocks",
                &expected_unique_blocks.to_string(),
                error.to_string(),
            )
        })?;
    let ckf_format = CkfFormat::v1(kvrelay_core::filter::ckf::DEFAULT_SEED, bucket_count);

    let bind_text = cli.bind.clone().or_else(|| env.get("DYN_RELAY_BIND").map(str::to_owned));
    let bind = bind_text
        .map(|text| {
            if text.trim().is_empty() {
                return Err(invalid("--bind / DYN_RELAY_BIND", &text, "must not be empty"));
            }
            text.trim().parse::<SocketAddr>().map_err(|_| {
                invalid("--bind / DYN_RELAY_BIND", &text, "expected a numeric IP:port")
            })
        })
        .transpose()?;

    let producer = ProducerTuning {
        publication_threshold_events: env
            .get("DYN_RELAY_PUBLICATION_THRESHOLD")
            .map(|v| parse_positive("DYN_RELAY_PUBLICATION_THRESHOLD", v, u64::from(u32::MAX)))
            .transpose()?
            .map_or(16, |v| v as u32),
        publication_delay: millis(&env, "DYN_RELAY_PUBLICATION_DELAY_MS", 1)?,
        recovery_attempt_timeout: millis(&env, "DYN_RELAY_RECOVERY_ATTEMPT_TIMEOUT_MS", 30_000)?,
        precise_publication_timer: env
            .get(PRECISE_TIMER_ENV)
            .map(|v| parse_bool(PRECISE_TIMER_ENV, v))
            .transpose()?
            .unwrap_or(false),
    };
    let wan = resolve_wan(&env, bind.is_some())?;
    let connection_revision = match (&cli.sources_file, env.get(CONNECTION_REVISION_ENV)) {
        (Some(_), Some(value)) => {
            if value.trim() != value {
                return Err(invalid(
                    "DYN_RELAY_CONNECTION_REVISION",
                    value,
                    "must not have surrounding whitespace",
                ));
            }
            Some(value.to_owned())
        }
        _ => None,
    };
    let ops_text = cli
        .ops_bind
        .clone()
        .or_else(|| env.get("DYN_RELAY_OPS_BIND").map(str::to_owned))
        .unwrap_or_else(|| OPS_BIND_DEFAULT.to_owned());
    let ops_bind = match ops_text.trim() {
        "off" => None,
        text => Some(text.parse::<SocketAddr>().map_err(|_| {
            invalid(
                "--ops-bind / DYN_RELAY_OPS_BIND",
                &ops_text,
                "expected a numeric IP:port or off",
            )
        })?),
    };
    Ok(RelayConfig {
        dc_name,
        dc_id,
        scope,
        expected_unique_blocks,
        pool_filter_bytes_max: limits::resolve_pool_filter_bytes_max(&env, &ckf_format)?,
        memory: memory::resolve_memory_budgets(&env, &ckf_format)?,
        ckf_format,
        bind,
        sources_file: cli.sources_file.clone(),
        connection_revision,
        ops_bind,
        producer,
        wan,
        discovery: {
            let mut discovery = resolve_discovery(&env)?;
            discovery.set_relist_interval(millis(
                &env,
                RELIST_INTERVAL_ENV,
                RELIST_INTERVAL_DEFAULT_MS,
            )?);
            discovery
        },
        event_plane: resolve_event_plane(&env)?,
        record: resolve_record(cli, &env)?,
        pod_uid: env.get("POD_UID").map(|uid| uid.trim().to_owned()),
        wan_tls: resolve_wan_tls(&cli.wan_tls, environment, bind.is_some())?,
        shutdown_timeout: limits::resolve_shutdown_timeout(&env)?,
    })
}

/// `--record DIR` / `DYN_RELAY_RECORD_DIR` with its limits; a limit without a directory is a
/// conflict (it would silently do nothing).
fn resolve_record(cli: &CliValues, env: &Env<'_>) -> Result<Option<RecordSettings>, ConfigError> {
    let root = cli
        .record
        .clone()
        .or_else(|| env.get("DYN_RELAY_RECORD_DIR").map(|dir| PathBuf::from(dir.trim())));
    let bytes = match (&cli.record_max_bytes, env.get("DYN_RELAY_RECORD_MAX_BYTES")) {
        (Some(value), _) => Some(("--record-max-bytes", value.as_str())),
        (None, Some(value)) => Some(("DYN_RELAY_RECORD_MAX_BYTES", value)),
        (None, None) => None,
    };
    let age = match (&cli.record_max_age, env.get("DYN_RELAY_RECORD_MAX_AGE_SECS")) {
        (Some(value), _) => Some(("--record-max-age", value.as_str())),
        (None, Some(value)) => Some(("DYN_RELAY_RECORD_MAX_AGE_SECS", value)),
        (None, None) => None,
    };
    const CHECKPOINT: [&str; 2] =
        ["DYN_RELAY_RECORD_CHECKPOINT_INPUTS", "DYN_RELAY_RECORD_CHECKPOINT_INTERVAL_MS"];
    let Some(root) = root else {
        let checkpoint = CHECKPOINT.iter().find(|name| env.get(name).is_some()).copied();
        if let Some(setting) = bytes.or(age).map(|(setting, _)| setting).or(checkpoint) {
            return Err(ConfigError::Conflict { first: setting, second: "no --record directory" });
        }
        return Ok(None);
    };
    if root.as_os_str().is_empty() {
        return Err(invalid("--record / DYN_RELAY_RECORD_DIR", "", "expected a directory"));
    }
    let max_total_bytes = match bytes {
        Some((setting, value)) => {
            let parsed = parse_positive(setting, value, u64::MAX)?;
            if parsed < RECORD_MAX_BYTES_MIN {
                return Err(invalid(
                    setting,
                    value,
                    format!("must be at least {RECORD_MAX_BYTES_MIN}"),
                ));
            }
            parsed
        }
        None => RECORD_MAX_BYTES_DEFAULT,
    };
    let max_age_secs = match age {
        Some((setting, value)) => parse_positive(setting, value, TIMER_MS_MAX / 1000)?,
        None => RECORD_MAX_AGE_SECS_DEFAULT,
    };
    Ok(Some(RecordSettings {
        root,
        max_total_bytes,
        max_segment_age: Duration::from_secs(max_age_secs),
        checkpoint_every_inputs: env
            .get(CHECKPOINT[0])
            .map(|v| parse_positive(CHECKPOINT[0], v, u64::MAX))
            .transpose()?
            .unwrap_or(10_000),
        checkpoint_interval: millis(env, CHECKPOINT[1], 10_000)?,
    }))
}

fn millis(env: &Env<'_>, name: &'static str, default_ms: u64) -> Result<Duration, ConfigError> {
    Ok(Duration::from_millis(
        env.get(name)
            .map(|v| parse_positive(name, v, TIMER_MS_MAX))
            .transpose()?
            .unwrap_or(default_ms),
    ))
}

fn resolve_scope(cli: &CliValues, env: &Env<'_>) -> Result<DiscoveryScope, ConfigError> {
    let given: Vec<&'static str> = [
        (cli.sources_file.is_some(), "--sources-file"),
        (cli.watch_all, "--watch-all"),
        (cli.namespaces.is_some(), "--namespaces"),
        (cli.namespace_filter.is_some(), "--namespace-filter"),
    ]
    .into_iter()
    .filter_map(|(set, flag)| set.then_some(flag))
    .collect();
    if let [first, second, ..] = given[..] {
        return Err(ConfigError::Conflict { first, second });
    }
    // Command-line prefixes are taken as given: surrounding whitespace is the scope's error.
    let prefixes = if cli.endpoint_prefixes.is_empty() {
        env.get("DYN_RELAY_ENDPOINT_PREFIXES")
            .map(|v| comma_list("DYN_RELAY_ENDPOINT_PREFIXES", v))
            .transpose()?
            .unwrap_or_default()
    } else {
        cli.endpoint_prefixes.clone()
    };
    if let Some(namespace) = &cli.namespace_filter {
        if namespace.trim().is_empty() || namespace.trim() != namespace {
            return Err(invalid(
                "--namespace-filter",
                namespace,
                "must be non-empty and have no surrounding whitespace",
            ));
        }
        return Ok(DiscoveryScope::new(vec![namespace.clone()], prefixes, false)?);
    }
    // With a sources file the file's namespaces narrow the scope at run time (and replace the
    // environment's namespace settings, as every command-line value does); prefixes still apply.
    if cli.watch_all || cli.sources_file.is_some() {
        return Ok(DiscoveryScope::new(Vec::new(), prefixes, true)?);
    }
    if let Some(namespaces) = &cli.namespaces {
        return Ok(DiscoveryScope::new(comma_list("--namespaces", namespaces)?, prefixes, false)?);
    }
    let namespaces = env
        .get("DYN_RELAY_NAMESPACES")
        .map(|v| comma_list("DYN_RELAY_NAMESPACES", v))
        .transpose()?;
    let watch_all =
        env.get("DYN_RELAY_WATCH_ALL").map(|v| parse_bool("DYN_RELAY_WATCH_ALL", v)).transpose()?;
    match (namespaces, watch_all) {
        (Some(_), Some(true)) => Err(ConfigError::Conflict {
            first: "DYN_RELAY_NAMESPACES",
            second: "DYN_RELAY_WATCH_ALL=true",
        }),
        (None, Some(false)) => Err(ConfigError::Missing {
            setting: "DYN_RELAY_NAMESPACES (DYN_RELAY_WATCH_ALL=false)",
        }),
        (Some(namespaces), _) => Ok(DiscoveryScope::new(namespaces, prefixes, false)?),
        (None, _) => Ok(DiscoveryScope::new(Vec::new(), prefixes, true)?),
    }
}

fn resolve_wan(env: &Env<'_>, listening: bool) -> Result<WanTuning, ConfigError> {
    const WAN: [&str; 17] = [
        "DYN_RELAY_MAX_MESSAGE_BYTES",
        "DYN_RELAY_KEEPALIVE_INTERVAL_MS",
        "DYN_RELAY_KEEPALIVE_TIMEOUT_MS",
        "DYN_RELAY_POOL_HEARTBEAT_INTERVAL_MS",
        "DYN_RELAY_READINESS_HEARTBEAT_INTERVAL_MS",
        "DYN_RELAY_SNAPSHOT_PROGRESS_TIMEOUT_MS",
        "DYN_RELAY_LOAD_WINDOW_MS",
        "DYN_RELAY_LOAD_FANOUT_CAPACITY",
        "DYN_RELAY_PUBLICATION_QUEUE_CAPACITY",
        "DYN_RELAY_PUBLICATION_QUEUE_BYTES",
        "DYN_RELAY_PUBLICATION_ENCODING_CONCURRENCY",
        "DYN_RELAY_MAX_INITIALIZED_POOL_HUBS",
        "DYN_RELAY_MAX_CATALOG_SUBSCRIBERS",
        "DYN_RELAY_MAX_POOL_STREAMS_TOTAL",
        "DYN_RELAY_MAX_SUBSCRIBERS_PER_POOL",
        "DYN_RELAY_MAX_READINESS_SUBSCRIBERS",
        "DYN_RELAY_MAX_LOAD_SUBSCRIBERS",
    ];
    if !listening
        && let Some(name) =
            WAN.iter().chain(&limits::LISTENER_LIMIT_VARIABLES).find(|name| env.get(name).is_some())
    {
        return Err(ConfigError::Conflict { first: name, second: "no --bind listener" });
    }
    let defaults = WanTuning::default();
    let capacity = |name: &'static str, default: usize| -> Result<usize, ConfigError> {
        Ok(env
            .get(name)
            .map(|v| parse_positive(name, v, CAPACITY_MAX))
            .transpose()?
            .map_or(default, |v| v as usize))
    };
    let load_fanout_capacity = env
        .get("DYN_RELAY_LOAD_FANOUT_CAPACITY")
        .map(|v| parse_positive("DYN_RELAY_LOAD_FANOUT_CAPACITY", v, LOAD_FANOUT_CAPACITY_MAX))
        .transpose()?
        .map_or(defaults.load_fanout_capacity, |v| v as usize);
    let max_message_bytes = match env.get("DYN_RELAY_MAX_MESSAGE_BYTES") {
        Some(v) => {
            let bytes = parse_positive("DYN_RELAY_MAX_MESSAGE_BYTES", v, u64::from(u32::MAX))?;
            if bytes < MAX_MESSAGE_BYTES_MIN {
                return Err(invalid(
                    "DYN_RELAY_MAX_MESSAGE_BYTES",
                    v,
                    format!("must be at least {MAX_MESSAGE_BYTES_MIN}"),
                ));
            }
            bytes as usize
        }
        None => defaults.max_message_bytes,
    };
    let publication_queue_bytes = match env.get("DYN_RELAY_PUBLICATION_QUEUE_BYTES") {
        Some(v) => {
            let bytes =
                parse_positive("DYN_RELAY_PUBLICATION_QUEUE_BYTES", v, u64::from(u32::MAX))?;
            if bytes < PUBLICATION_QUEUE_BYTES_MIN {
                return Err(invalid(
                    "DYN_RELAY_PUBLICATION_QUEUE_BYTES",
                    v,
                    format!("must be at least {PUBLICATION_QUEUE_BYTES_MIN}"),
                ));
            }
            bytes as usize
        }
        None => defaults.publication_queue_bytes,
    };
    Ok(WanTuning {
        max_message_bytes,
        keepalive_interval: millis(env, "DYN_RELAY_KEEPALIVE_INTERVAL_MS", 20_000)?,
        keepalive_timeout: millis(env, "DYN_RELAY_KEEPALIVE_TIMEOUT_MS", 10_000)?,
        pool_heartbeat_interval: millis(env, "DYN_RELAY_POOL_HEARTBEAT_INTERVAL_MS", 10_000)?,
        readiness_heartbeat_interval: millis(
            env,
            "DYN_RELAY_READINESS_HEARTBEAT_INTERVAL_MS",
            10_000,
        )?,
        catalog_heartbeat_interval: defaults.catalog_heartbeat_interval,
        snapshot_progress_timeout: millis(env, "DYN_RELAY_SNAPSHOT_PROGRESS_TIMEOUT_MS", 60_000)?,
        load_window: millis(env, "DYN_RELAY_LOAD_WINDOW_MS", 1_000)?,
        load_fanout_capacity,
        publication_queue_frames: capacity(
            "DYN_RELAY_PUBLICATION_QUEUE_CAPACITY",
            defaults.publication_queue_frames,
        )?,
        publication_queue_bytes,
        max_initialized_pool_hubs: capacity(
            "DYN_RELAY_MAX_INITIALIZED_POOL_HUBS",
            defaults.max_initialized_pool_hubs,
        )?,
        max_catalog_subscribers: capacity(
            "DYN_RELAY_MAX_CATALOG_SUBSCRIBERS",
            defaults.max_catalog_subscribers,
        )?,
        max_pool_streams_total: capacity(
            "DYN_RELAY_MAX_POOL_STREAMS_TOTAL",
            defaults.max_pool_streams_total,
        )?,
        max_subscribers_per_pool: capacity(
            "DYN_RELAY_MAX_SUBSCRIBERS_PER_POOL",
            defaults.max_subscribers_per_pool,
        )?,
        max_readiness_subscribers: capacity(
            "DYN_RELAY_MAX_READINESS_SUBSCRIBERS",
            defaults.max_readiness_subscribers,
        )?,
        max_load_subscribers: capacity(
            "DYN_RELAY_MAX_LOAD_SUBSCRIBERS",
            defaults.max_load_subscribers,
        )?,
        publication_encoding_concurrency: capacity(
            "DYN_RELAY_PUBLICATION_ENCODING_CONCURRENCY",
            defaults.publication_encoding_concurrency,
        )?,
        limits: limits::resolve_listener_limits(env)?,
    })
}

/// The discovery transport's own reading of `DYN_DISCOVERY_BACKEND`, `DYN_FILE_KV`,
/// `ETCD_ENDPOINTS` and the Kubernetes settings (`KUBERNETES_SERVICE_HOST`/`_PORT`,
/// `POD_NAMESPACE`, `DYN_KUBE_DISCOVERY_MODE`, `KVRELAY_KUBE_API_URL`/`_TOKEN_FILE`/`_CA_FILE`),
/// with its errors named as settings.
fn resolve_discovery(env: &Env<'_>) -> Result<DiscoveryBackend, ConfigError> {
    DiscoveryBackend::from_lookup(|name| env.get(name).map(str::to_owned)).map_err(|error| {
        match error {
            DiscoveryPlaneError::MissingSetting { variable, .. } => {
                ConfigError::Missing { setting: variable }
            }
            DiscoveryPlaneError::UnsupportedBackend { name } => invalid(
                "DYN_DISCOVERY_BACKEND",
                &name,
                "supported backends are file, etcd and kubernetes",
            ),
            DiscoveryPlaneError::InvalidEtcdEndpoint { endpoint, reason } => {
                invalid("ETCD_ENDPOINTS", &endpoint, reason)
            }
            DiscoveryPlaneError::InvalidEtcdSecurity(error) => {
                invalid(error.variable, "(not shown)", error.reason)
            }
            DiscoveryPlaneError::InvalidKubeApi(reason) => {
                invalid("KVRELAY_KUBE_API_URL", "(see reason)", reason)
            }
            DiscoveryPlaneError::InvalidConfig { field, reason }
                if field.bytes().all(|b| b.is_ascii_uppercase() || b == b'_') =>
            {
                invalid(field, "", reason)
            }
            other => invalid("DYN_DISCOVERY_BACKEND", "", other.to_string()),
        }
    })
}

fn resolve_event_plane(env: &Env<'_>) -> Result<EventPlane, ConfigError> {
    let url = env.get("NATS_SERVER").unwrap_or("nats://localhost:4222").trim().to_owned();
    match env.get("DYN_EVENT_PLANE").map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        None | Some("nats") => {
            let security = NatsSecurity::from_lookup(|name| env.get(name).map(str::to_owned))
                .map_err(nats_security_error)?;
            Ok(EventPlane::Nats { url, security })
        }
        Some("zmq") => Ok(EventPlane::Zmq),
        Some(other) => {
            Err(invalid("DYN_EVENT_PLANE", other, "supported event planes are nats and zmq"))
        }
    }
}

/// A NATS security error as a setting error: the value shown is the path for file errors and
/// never a secret.
fn nats_security_error(error: NatsSecurityError) -> ConfigError {
    let value = match &error {
        NatsSecurityError::File { path, .. } => path.display().to_string(),
        _ => "(not shown)".to_owned(),
    };
    invalid(error.variable(), &value, error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery_plane::{EtcdDiscoveryConfig, FileDiscoveryConfig};

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    fn cli_dc() -> CliValues {
        CliValues { dc_id: Some("dc-a".into()), ..CliValues::default() }
    }

    #[test]
    fn defaults_watch_everything_with_the_reference_sizing() {
        let config = resolve(&cli_dc(), &env(&[])).unwrap();
        assert_eq!(config.dc_id, DcId(0x04f1_10c9_8b1b_fc48));
        assert!(config.scope.includes(&"any/comp/ep".parse().unwrap()));
        assert_eq!(config.ckf_format.bucket_count, 524_288);
        assert_eq!(config.bind, None);
        assert_eq!(config.producer.publication_threshold_events, 16);
        assert_eq!(config.producer.publication_delay, Duration::from_millis(1));
        assert_eq!(config.wan, WanTuning::default());
        assert_eq!(
            config.discovery,
            DiscoveryBackend::Etcd(EtcdDiscoveryConfig::new(vec!["http://localhost:2379".into()]))
        );
        assert_eq!(
            config.event_plane,
            EventPlane::Nats {
                url: "nats://localhost:4222".into(),
                security: NatsSecurity::default()
            }
        );
        assert_eq!(config.record, None);
    }

    #[test]
    fn the_discovery_relist_interval_defaults_to_30_s_and_is_validated() {
        let default = resolve(&cli_dc(), &env(&[])).unwrap();
        assert_eq!(default.discovery.relist_interval(), Duration::from_secs(30));
        for backend in [
            vec![],
            vec![("DYN_DISCOVERY_BACKEND", "file"), ("DYN_FILE_KV", "/tmp/kv")],
            vec![
                ("DYN_DISCOVERY_BACKEND", "kubernetes"),
                ("KVRELAY_KUBE_API_URL", "http://127.0.0.1:8001"),
                ("POD_NAMESPACE", "dynamo"),
            ],
        ] {
            let mut pairs = backend.clone();
            pairs.push((RELIST_INTERVAL_ENV, "2500"));
            let config = resolve(&cli_dc(), &env(&pairs)).unwrap();
            assert_eq!(
                config.discovery.relist_interval(),
                Duration::from_millis(2500),
                "{backend:?}"
            );
        }
        for bad in ["0", "", "soon", "-5"] {
            let error = resolve(&cli_dc(), &env(&[(RELIST_INTERVAL_ENV, bad)])).unwrap_err();
            assert!(
                matches!(&error, ConfigError::Invalid { setting, .. } if *setting == RELIST_INTERVAL_ENV),
                "{bad:?}: {error}"
            );
        }
    }

    #[test]
    fn recording_has_defaults_and_validated_limits_naming_the_setting() {
        let cli = CliValues { record: Some("/var/kvrelay/journal".into()), ..cli_dc() };
        let config = resolve(&cli, &env(&[])).unwrap();
        assert_eq!(
            config.record,
            Some(RecordSettings {
                root: "/var/kvrelay/journal".into(),
                max_total_bytes: 1_073_741_824,
                max_segment_age: Duration::from_secs(3600),
                checkpoint_every_inputs: 10_000,
                checkpoint_interval: Duration::from_secs(10),
            })
        );
        let from_env = env(&[
            ("DYN_RELAY_RECORD_DIR", "/j"),
            ("DYN_RELAY_RECORD_MAX_BYTES", "2097152"),
            ("DYN_RELAY_RECORD_MAX_AGE_SECS", "60"),
            ("DYN_RELAY_RECORD_CHECKPOINT_INPUTS", "100"),
            ("DYN_RELAY_RECORD_CHECKPOINT_INTERVAL_MS", "250"),
        ]);
        let record = resolve(&cli_dc(), &from_env).unwrap().record.unwrap();
        assert_eq!(record.root, PathBuf::from("/j"));
        assert_eq!(record.checkpoint_every_inputs, 100);
        assert_eq!(record.checkpoint_interval, Duration::from_millis(250));
        assert_eq!(record.max_total_bytes, 2_097_152);
        assert_eq!(record.max_segment_age, Duration::from_secs(60));
        let overridden = CliValues {
            record_max_bytes: Some("4194304".into()),
            record_max_age: Some("5".into()),
            ..cli.clone()
        };
        let record = resolve(&overridden, &from_env).unwrap().record.unwrap();
        assert_eq!(record.root, PathBuf::from("/var/kvrelay/journal"), "the flag wins");
        assert_eq!((record.max_total_bytes, record.max_segment_age.as_secs()), (4_194_304, 5));

        let small = CliValues { record_max_bytes: Some("1048575".into()), ..cli.clone() };
        let error = resolve(&small, &env(&[])).unwrap_err();
        assert!(matches!(error, ConfigError::Invalid { setting: "--record-max-bytes", .. }));
        assert!(error.to_string().contains("at least 1048576"), "{error}");
        let zero_age = env(&[("DYN_RELAY_RECORD_MAX_AGE_SECS", "0")]);
        assert!(matches!(
            resolve(&cli, &zero_age).unwrap_err(),
            ConfigError::Invalid { setting: "DYN_RELAY_RECORD_MAX_AGE_SECS", .. }
        ));
        let not_numeric = CliValues { record_max_age: Some("1h".into()), ..cli.clone() };
        assert!(matches!(
            resolve(&not_numeric, &env(&[])).unwrap_err(),
            ConfigError::Invalid { setting: "--record-max-age", .. }
        ));
        let without_dir = CliValues { record_max_bytes: Some("4194304".into()), ..cli_dc() };
        assert_eq!(
            resolve(&without_dir, &env(&[])).unwrap_err(),
            ConfigError::Conflict { first: "--record-max-bytes", second: "no --record directory" }
        );
        assert!(matches!(
            resolve(&cli_dc(), &env(&[("DYN_RELAY_RECORD_MAX_AGE_SECS", "5")])).unwrap_err(),
            ConfigError::Conflict { first: "DYN_RELAY_RECORD_MAX_AGE_SECS", .. }
        ));
        let cadence_only = env(&[("DYN_RELAY_RECORD_CHECKPOINT_INTERVAL_MS", "5")]);
        assert!(matches!(
            resolve(&cli_dc(), &cadence_only).unwrap_err(),
            ConfigError::Conflict { first: "DYN_RELAY_RECORD_CHECKPOINT_INTERVAL_MS", .. }
        ));
        let zero_inputs = env(&[("DYN_RELAY_RECORD_CHECKPOINT_INPUTS", "0")]);
        assert!(matches!(
            resolve(&cli, &zero_inputs).unwrap_err(),
            ConfigError::Invalid { setting: "DYN_RELAY_RECORD_CHECKPOINT_INPUTS", .. }
        ));
    }

    #[test]
    fn dc_id_is_required_and_validated_naming_the_setting() {
        let missing = resolve(&CliValues::default(), &env(&[])).unwrap_err();
        assert!(missing.to_string().contains("DYN_DC_ID"), "{missing}");
        let padded = resolve(&CliValues::default(), &env(&[("DYN_DC_ID", " dc-a")])).unwrap_err();
        assert!(matches!(padded, ConfigError::Invalid { setting: "--dc-id / DYN_DC_ID", .. }));
        let from_env = resolve(&CliValues::default(), &env(&[("DYN_DC_ID", "dc-a")])).unwrap();
        assert_eq!(from_env.dc_name, "dc-a");
    }

    #[test]
    fn command_line_overrides_environment() {
        let cli = CliValues {
            dc_id: Some("dc-b".into()),
            namespaces: Some("prod".into()),
            endpoint_prefixes: vec!["prod.backend".into()],
            expected_unique_blocks: Some("32".into()),
            bind: Some("127.0.0.1:5562".into()),
            ..CliValues::default()
        };
        let environment = env(&[
            ("DYN_DC_ID", "dc-a"),
            ("DYN_RELAY_NAMESPACES", "other"),
            ("DYN_RELAY_ENDPOINT_PREFIXES", "other.x"),
            ("DYN_RELAY_EXPECTED_UNIQUE_BLOCKS", "1024"),
        ]);
        let config = resolve(&cli, &environment).unwrap();
        assert_eq!(config.dc_name, "dc-b");
        assert!(config.scope.includes(&"prod/backend/generate".parse().unwrap()));
        assert!(!config.scope.includes(&"prod/prefill/generate".parse().unwrap()));
        assert!(!config.scope.includes(&"other/x/generate".parse().unwrap()));
        assert_eq!(config.ckf_format.bucket_count, 16);
        assert_eq!(config.bind, Some("127.0.0.1:5562".parse().unwrap()));
    }

    #[test]
    fn scope_conflicts_are_errors() {
        let both = CliValues { watch_all: true, namespaces: Some("a".into()), ..cli_dc() };
        assert_eq!(
            resolve(&both, &env(&[])).unwrap_err(),
            ConfigError::Conflict { first: "--watch-all", second: "--namespaces" }
        );
        let env_conflict = env(&[("DYN_RELAY_NAMESPACES", "a"), ("DYN_RELAY_WATCH_ALL", "yes")]);
        assert!(matches!(
            resolve(&cli_dc(), &env_conflict).unwrap_err(),
            ConfigError::Conflict { .. }
        ));
        let needs_namespaces = env(&[("DYN_RELAY_WATCH_ALL", "off")]);
        assert!(matches!(
            resolve(&cli_dc(), &needs_namespaces).unwrap_err(),
            ConfigError::Missing { .. }
        ));
        let bad_bool = env(&[("DYN_RELAY_WATCH_ALL", "maybe")]);
        assert!(matches!(
            resolve(&cli_dc(), &bad_bool).unwrap_err(),
            ConfigError::Invalid { setting: "DYN_RELAY_WATCH_ALL", .. }
        ));
        let duplicate = env(&[("DYN_RELAY_NAMESPACES", "a, a")]);
        assert!(matches!(resolve(&cli_dc(), &duplicate).unwrap_err(), ConfigError::Invalid { .. }));
    }

    #[test]
    fn sources_file_excludes_cli_scopes_and_replaces_environment_namespaces() {
        let file =
            || CliValues { sources_file: Some("/etc/relay/sources.json".into()), ..cli_dc() };
        let with_watch_all = CliValues { watch_all: true, ..file() };
        assert_eq!(
            resolve(&with_watch_all, &env(&[])).unwrap_err(),
            ConfigError::Conflict { first: "--sources-file", second: "--watch-all" }
        );
        let with_namespaces = CliValues { namespaces: Some("a".into()), ..file() };
        assert_eq!(
            resolve(&with_namespaces, &env(&[])).unwrap_err(),
            ConfigError::Conflict { first: "--sources-file", second: "--namespaces" }
        );
        let environment = env(&[
            ("DYN_RELAY_NAMESPACES", "other"),
            ("DYN_RELAY_ENDPOINT_PREFIXES", "prod.backend"),
            ("DYN_RELAY_CONNECTION_REVISION", "conn-1"),
        ]);
        let config = resolve(&file(), &environment).unwrap();
        assert_eq!(
            config.scope.namespace_selection(),
            &kvrelay_core::discovery::NamespaceSelection::All
        );
        assert!(config.scope.includes(&"prod/backend/generate".parse().unwrap()));
        assert!(!config.scope.includes(&"prod/frontend/generate".parse().unwrap()));
        assert_eq!(config.connection_revision.as_deref(), Some("conn-1"));
        let without_file = resolve(&cli_dc(), &env(&[("DYN_RELAY_CONNECTION_REVISION", "c")]));
        assert_eq!(without_file.unwrap().connection_revision, None, "the guard needs a file");
        let padded = env(&[("DYN_RELAY_CONNECTION_REVISION", "c ")]);
        assert!(matches!(
            resolve(&file(), &padded).unwrap_err(),
            ConfigError::Invalid { setting: "DYN_RELAY_CONNECTION_REVISION", .. }
        ));
    }

    #[test]
    fn ops_listener_is_loopback_by_default_and_can_be_moved_or_disabled() {
        let config = resolve(&cli_dc(), &env(&[])).unwrap();
        assert_eq!(config.ops_bind, Some("127.0.0.1:9090".parse().unwrap()));
        let moved = resolve(&cli_dc(), &env(&[("DYN_RELAY_OPS_BIND", "127.0.0.1:9191")])).unwrap();
        assert_eq!(moved.ops_bind, Some("127.0.0.1:9191".parse().unwrap()));
        let cli = CliValues { ops_bind: Some("off".into()), ..cli_dc() };
        assert_eq!(
            resolve(&cli, &env(&[("DYN_RELAY_OPS_BIND", "0.0.0.0:1")])).unwrap().ops_bind,
            None
        );
        let bad = CliValues { ops_bind: Some("localhost:9090".into()), ..cli_dc() };
        assert!(matches!(
            resolve(&bad, &env(&[])).unwrap_err(),
            ConfigError::Invalid { setting: "--ops-bind / DYN_RELAY_OPS_BIND", .. }
        ));
    }

    #[test]
    fn booleans_accept_the_reference_spellings() {
        for yes in ["1", "true", " YES ", "On"] {
            assert_eq!(parse_bool("X", yes), Ok(true));
        }
        for no in ["0", "false", "no", "OFF"] {
            assert_eq!(parse_bool("X", no), Ok(false));
        }
    }

    #[test]
    fn wan_tuning_requires_a_listener_and_respects_minima() {
        let tuning = env(&[("DYN_RELAY_POOL_HEARTBEAT_INTERVAL_MS", "500")]);
        assert!(matches!(
            resolve(&cli_dc(), &tuning).unwrap_err(),
            ConfigError::Conflict { first: "DYN_RELAY_POOL_HEARTBEAT_INTERVAL_MS", .. }
        ));
        let listening = CliValues { bind: Some("[::1]:5561".into()), ..cli_dc() };
        let config = resolve(&listening, &tuning).unwrap();
        assert_eq!(config.wan.pool_heartbeat_interval, Duration::from_millis(500));
        let small = env(&[("DYN_RELAY_MAX_MESSAGE_BYTES", "4194304")]);
        assert!(matches!(
            resolve(&listening, &small).unwrap_err(),
            ConfigError::Invalid { setting: "DYN_RELAY_MAX_MESSAGE_BYTES", .. }
        ));
        let zero = env(&[("DYN_RELAY_MAX_LOAD_SUBSCRIBERS", "0")]);
        assert!(resolve(&listening, &zero).is_err());
        let not_numeric = CliValues { bind: Some("localhost:5561".into()), ..cli_dc() };
        assert!(matches!(
            resolve(&not_numeric, &env(&[])).unwrap_err(),
            ConfigError::Invalid { .. }
        ));
    }

    #[test]
    fn producer_tuning_and_sizing_are_validated() {
        let tuned = env(&[
            ("DYN_RELAY_PUBLICATION_THRESHOLD", "4"),
            ("DYN_RELAY_PUBLICATION_DELAY_MS", "5"),
        ]);
        let config = resolve(&cli_dc(), &tuned).unwrap();
        assert_eq!(config.producer.publication_threshold_events, 4);
        assert_eq!(config.producer.publication_delay, Duration::from_millis(5));
        assert!(!config.producer.precise_publication_timer, "tokio's timer unless asked");
        let precise = env(&[(PRECISE_TIMER_ENV, "on")]);
        assert!(resolve(&cli_dc(), &precise).unwrap().producer.precise_publication_timer);
        let garbled = env(&[(PRECISE_TIMER_ENV, "sometimes")]);
        assert!(matches!(
            resolve(&cli_dc(), &garbled).unwrap_err(),
            ConfigError::Invalid { setting: PRECISE_TIMER_ENV, .. }
        ));
        let too_big = CliValues { expected_unique_blocks: Some("53687092".into()), ..cli_dc() };
        assert!(matches!(resolve(&too_big, &env(&[])).unwrap_err(), ConfigError::Invalid { .. }));
    }

    #[test]
    fn planes_follow_the_dynamo_runtime_environment() {
        let file = env(&[
            ("DYN_DISCOVERY_BACKEND", "file"),
            ("DYN_FILE_KV", "/tmp/kv"),
            ("DYN_EVENT_PLANE", "zmq"),
        ]);
        let config = resolve(&cli_dc(), &file).unwrap();
        assert_eq!(config.discovery, DiscoveryBackend::File(FileDiscoveryConfig::new("/tmp/kv")));
        assert_eq!(config.event_plane, EventPlane::Zmq);
        let no_dir = env(&[("DYN_DISCOVERY_BACKEND", "file")]);
        assert!(resolve(&cli_dc(), &no_dir).unwrap_err().to_string().contains("DYN_FILE_KV"));
        let mem = env(&[("DYN_DISCOVERY_BACKEND", "mem")]);
        assert!(matches!(
            resolve(&cli_dc(), &mem).unwrap_err(),
            ConfigError::Invalid { setting: "DYN_DISCOVERY_BACKEND", .. }
        ));
        let kube_outside = env(&[("DYN_DISCOVERY_BACKEND", "kubernetes")]);
        assert!(matches!(
            resolve(&cli_dc(), &kube_outside).unwrap_err(),
            ConfigError::Missing { setting: "KUBERNETES_SERVICE_HOST" }
        ));
        let kube = env(&[
            ("DYN_DISCOVERY_BACKEND", "kubernetes"),
            ("KVRELAY_KUBE_API_URL", "http://127.0.0.1:8001"),
            ("POD_NAMESPACE", "dynamo"),
            ("DYN_KUBE_DISCOVERY_MODE", "container"),
        ]);
        let DiscoveryBackend::Kubernetes(kube) = resolve(&cli_dc(), &kube).unwrap().discovery
        else {
            panic!("not kubernetes")
        };
        assert_eq!(kube.mode, crate::discovery_plane::KubeDiscoveryMode::Container);
        let bad_mode = env(&[
            ("DYN_DISCOVERY_BACKEND", "kubernetes"),
            ("KVRELAY_KUBE_API_URL", "http://127.0.0.1:8001"),
            ("DYN_KUBE_DISCOVERY_MODE", "node"),
        ]);
        assert!(matches!(
            resolve(&cli_dc(), &bad_mode).unwrap_err(),
            ConfigError::Invalid { setting: "DYN_KUBE_DISCOVERY_MODE", .. }
        ));
        let etcd = env(&[
            ("ETCD_ENDPOINTS", "http://127.0.0.1:2379,http://127.0.0.1:2380"),
            ("NATS_SERVER", "nats://127.0.0.1:4333"),
        ]);
        let config = resolve(&cli_dc(), &etcd).unwrap();
        assert_eq!(
            config.discovery,
            DiscoveryBackend::Etcd(EtcdDiscoveryConfig::new(vec![
                "http://127.0.0.1:2379".into(),
                "http://127.0.0.1:2380".into()
            ]))
        );
        assert_eq!(
            config.event_plane,
            EventPlane::Nats {
                url: "nats://127.0.0.1:4333".into(),
                security: NatsSecurity::default()
            }
        );
    }

    #[test]
    fn wan_tls_needs_a_pair_a_listener_and_files_that_build() {
        let dir = tempfile::tempdir().unwrap();
        let (cert_path, key_path) = crate::test_pki::write_self_signed(dir.path());
        let listening = CliValues { bind: Some("127.0.0.1:5561".into()), ..cli_dc() };
        assert_eq!(resolve(&listening, &env(&[])).unwrap().wan_tls, None);
        let from_env = env(&[
            ("DYN_RELAY_TLS_CERT", cert_path.to_str().unwrap()),
            ("DYN_RELAY_TLS_KEY", key_path.to_str().unwrap()),
            ("DYN_RELAY_TLS_CLIENT_CA", cert_path.to_str().unwrap()),
            ("DYN_RELAY_TLS_RELOAD_INTERVAL_MS", "250"),
        ]);
        let tls = resolve(&listening, &from_env).unwrap().wan_tls.unwrap();
        assert_eq!(tls.client_ca_path.as_deref(), Some(cert_path.as_path()));
        assert_eq!(tls.reload_interval, Duration::from_millis(250));
        let cert_only = CliValues {
            wan_tls: WanTlsValues { cert: Some(cert_path.clone()), ..WanTlsValues::default() },
            ..listening.clone()
        };
        assert_eq!(
            resolve(&cert_only, &env(&[])).unwrap_err(),
            ConfigError::Missing { setting: "--tls-key" }
        );
        let pair = WanTlsValues {
            cert: Some(cert_path.clone()),
            key: Some(key_path.clone()),
            client_ca: None,
        };
        let without_bind = CliValues { wan_tls: pair.clone(), ..cli_dc() };
        assert!(matches!(
            resolve(&without_bind, &env(&[])).unwrap_err(),
            ConfigError::Conflict { first: "--tls-cert", .. }
        ));
        // The key file given as the certificate and the certificate as the key.
        let swapped = CliValues {
            wan_tls: WanTlsValues {
                cert: pair.key.clone(),
                key: pair.cert.clone(),
                client_ca: None,
            },
            ..listening.clone()
        };
        assert!(matches!(
            resolve(&swapped, &env(&[])).unwrap_err(),
            ConfigError::Invalid { setting: "--tls-cert", .. }
        ));
        let bad_interval = env(&[("DYN_RELAY_TLS_RELOAD_INTERVAL_MS", "0")]);
        let with_pair = CliValues { wan_tls: pair, ..listening };
        assert!(matches!(
            resolve(&with_pair, &bad_interval).unwrap_err(),
            ConfigError::Invalid { setting: "DYN_RELAY_TLS_RELOAD_INTERVAL_MS", .. }
        ));
    }

    #[test]
    fn etcd_security_errors_name_the_variable() {
        let half = env(&[("ETCD_AUTH_USERNAME", "root")]);
        assert!(matches!(
            resolve(&cli_dc(), &half).unwrap_err(),
            ConfigError::Invalid { setting: "ETCD_AUTH_USERNAME", .. }
        ));
        let missing_ca = env(&[("ETCD_AUTH_CA", "/nonexistent/ca.pem")]);
        assert!(matches!(
            resolve(&cli_dc(), &missing_ca).unwrap_err(),
            ConfigError::Invalid { setting: "ETCD_AUTH_CA", .. }
        ));
        let https_without_ca = env(&[("ETCD_ENDPOINTS", "https://127.0.0.1:2379")]);
        assert!(matches!(
            resolve(&cli_dc(), &https_without_ca).unwrap_err(),
            ConfigError::Invalid { setting: "ETCD_ENDPOINTS", .. }
        ));
        let with_password = env(&[("ETCD_AUTH_USERNAME", "root"), ("ETCD_AUTH_PASSWORD", "pw-9")]);
        let config = resolve(&cli_dc(), &with_password).unwrap();
        let DiscoveryBackend::Etcd(etcd) = config.discovery else { panic!("not etcd") };
        assert_eq!(etcd.connect.security.credentials.unwrap().user, "root");
    }

    #[test]
    fn nats_security_comes_from_dynamos_variables_and_bad_values_name_them() {
        let token = env(&[("NATS_AUTH_TOKEN", "t0ken")]);
        let EventPlane::Nats { security, .. } = resolve(&cli_dc(), &token).unwrap().event_plane
        else {
            panic!("not nats")
        };
        assert_eq!(security.auth.method(), "token");
        let both = env(&[
            ("NATS_AUTH_TOKEN", "t0ken"),
            ("NATS_AUTH_USERNAME", "u"),
            ("NATS_AUTH_PASSWORD", "p"),
        ]);
        let error = resolve(&cli_dc(), &both).unwrap_err();
        assert!(matches!(error, ConfigError::Invalid { setting: "NATS_AUTH_TOKEN", .. }));
        assert!(!error.to_string().contains("t0ken"), "{error}");
        let missing = env(&[("NATS_AUTH_CREDENTIALS_FILE", "/nonexistent/relay.creds")]);
        let error = resolve(&cli_dc(), &missing).unwrap_err();
        assert!(
            matches!(&error, ConfigError::Invalid { setting: "NATS_AUTH_CREDENTIALS_FILE", value, .. }
                if value == "/nonexistent/relay.creds"),
            "{error}"
        );
        // With the ZMQ event plane the NATS variables are not read.
        let zmq = env(&[("DYN_EVENT_PLANE", "zmq"), ("NATS_AUTH_USERNAME", "u")]);
        assert_eq!(resolve(&cli_dc(), &zmq).unwrap().event_plane, EventPlane::Zmq);
    }
}
