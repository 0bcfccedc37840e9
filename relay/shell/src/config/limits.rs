//! Limits of the WAN listener against hostile or stalled clients, and the shutdown bound.
//!
//! Every value has a default sized for the contract: requests are a few hundred bytes, a
//! consumer opens one catalog, readiness and load stream plus one stream per pool on one
//! connection, and a subscriber that cannot take a frame within the send timeout is a slow
//! consumer (ended as SUBSCRIBER_LAGGED).

use std::time::Duration;

use kvrelay_core::filter::ckf::CkfFormat;
use kvrelay_core::host::POOL_FILTER_BYTES_MAX_DEFAULT;

use super::{ConfigError, Env, invalid, millis, parse_positive};

/// Largest accepted `DYN_RELAY_MAX_HEADER_LIST_BYTES` / `DYN_RELAY_MAX_REQUEST_BYTES`: 16 MiB.
pub const LISTENER_BYTES_MAX: u64 = 16 << 20;
/// Smallest accepted request size limit: the largest valid request (a pool subscription with
/// its identity fields) fits with room to spare.
pub const MAX_REQUEST_BYTES_MIN: u64 = 1024;
/// Smallest accepted header list limit (a gRPC request's headers fit).
pub const MAX_HEADER_LIST_BYTES_MIN: u64 = 1024;

/// How the WAN listener defends itself (`DYN_RELAY_MAX_CONNECTIONS` ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenerLimits {
    /// Open connections at once; a connection past it is accepted and closed at once, counted.
    pub max_connections: usize,
    /// HTTP/2 `SETTINGS_MAX_CONCURRENT_STREAMS` per connection (h2 refuses streams past it
    /// with `REFUSED_STREAM`).
    pub max_streams_per_connection: u32,
    /// HTTP/2 `SETTINGS_MAX_HEADER_LIST_SIZE`: bigger request headers are refused.
    pub max_header_list_bytes: u32,
    /// Largest decoded request message (responses keep `max_message_bytes`).
    pub max_request_bytes: usize,
    /// A connection must send the 24-byte HTTP/2 preface within this or it is closed.
    pub handshake_timeout: Duration,
    /// Pause after a failed `accept` before the next one.
    pub accept_error_backoff: Duration,
    /// A subscriber that does not take a frame within this is ended as SUBSCRIBER_LAGGED
    /// (during a pool snapshot the snapshot progress timeout applies instead).
    pub subscriber_send_timeout: Duration,
    /// Open `grpc.health.v1.Health/Watch` streams.
    pub max_health_watch_streams: usize,
    /// Open reflection streams.
    pub max_reflection_streams: usize,
    /// After shutdown begins, connections still open this much later are closed.
    pub drain_timeout: Duration,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        ListenerLimits {
            max_connections: 256,
            max_streams_per_connection: 128,
            max_header_list_bytes: 16_384,
            max_request_bytes: 65_536,
            handshake_timeout: Duration::from_secs(10),
            accept_error_backoff: Duration::from_millis(100),
            subscriber_send_timeout: Duration::from_secs(30),
            max_health_watch_streams: 64,
            max_reflection_streams: 8,
            drain_timeout: Duration::from_secs(3),
        }
    }
}

/// The variables [`resolve_listener_limits`] reads (they need a `--bind` listener).
pub(super) const LISTENER_LIMIT_VARIABLES: [&str; 10] = [
    "DYN_RELAY_MAX_CONNECTIONS",
    "DYN_RELAY_MAX_STREAMS_PER_CONNECTION",
    "DYN_RELAY_MAX_HEADER_LIST_BYTES",
    "DYN_RELAY_MAX_REQUEST_BYTES",
    "DYN_RELAY_HANDSHAKE_TIMEOUT_MS",
    "DYN_RELAY_ACCEPT_ERROR_BACKOFF_MS",
    "DYN_RELAY_SUBSCRIBER_SEND_TIMEOUT_MS",
    "DYN_RELAY_MAX_HEALTH_WATCH_STREAMS",
    "DYN_RELAY_MAX_REFLECTION_STREAMS",
    "DYN_RELAY_DRAIN_TIMEOUT_MS",
];

/// `DYN_RELAY_SHUTDOWN_TIMEOUT_MS`: the bound on a shutdown (default 10 s).
pub const SHUTDOWN_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);

fn bytes(env: &Env<'_>, name: &'static str, min: u64, default: u64) -> Result<u64, ConfigError> {
    let Some(value) = env.get(name) else {
        return Ok(default);
    };
    let parsed = parse_positive(name, value, LISTENER_BYTES_MAX)?;
    if parsed < min {
        return Err(invalid(name, value, format!("must be at least {min}")));
    }
    Ok(parsed)
}

fn count(
    env: &Env<'_>,
    name: &'static str,
    max: u64,
    default: usize,
) -> Result<usize, ConfigError> {
    Ok(env
        .get(name)
        .map(|v| parse_positive(name, v, max))
        .transpose()?
        .map_or(default, |v| v as usize))
}

/// The listener limits from the environment, defaults for what is not set.
pub(super) fn resolve_listener_limits(env: &Env<'_>) -> Result<ListenerLimits, ConfigError> {
    let d = ListenerLimits::default();
    let ms = |duration: Duration| duration.as_millis() as u64;
    let permits = super::CAPACITY_MAX;
    Ok(ListenerLimits {
        max_connections: count(env, "DYN_RELAY_MAX_CONNECTIONS", permits, d.max_connections)?,
        max_streams_per_connection: count(
            env,
            "DYN_RELAY_MAX_STREAMS_PER_CONNECTION",
            u64::from(u32::MAX),
            d.max_streams_per_connection as usize,
        )? as u32,
        max_header_list_bytes: bytes(
            env,
            "DYN_RELAY_MAX_HEADER_LIST_BYTES",
            MAX_HEADER_LIST_BYTES_MIN,
            u64::from(d.max_header_list_bytes),
        )? as u32,
        max_request_bytes: bytes(
            env,
            "DYN_RELAY_MAX_REQUEST_BYTES",
            MAX_REQUEST_BYTES_MIN,
            d.max_request_bytes as u64,
        )? as usize,
        handshake_timeout: millis(env, "DYN_RELAY_HANDSHAKE_TIMEOUT_MS", ms(d.handshake_timeout))?,
        accept_error_backoff: millis(
            env,
            "DYN_RELAY_ACCEPT_ERROR_BACKOFF_MS",
            ms(d.accept_error_backoff),
        )?,
        subscriber_send_timeout: millis(
            env,
            "DYN_RELAY_SUBSCRIBER_SEND_TIMEOUT_MS",
            ms(d.subscriber_send_timeout),
        )?,
        max_health_watch_streams: count(
            env,
            "DYN_RELAY_MAX_HEALTH_WATCH_STREAMS",
            permits,
            d.max_health_watch_streams,
        )?,
        max_reflection_streams: count(
            env,
            "DYN_RELAY_MAX_REFLECTION_STREAMS",
            permits,
            d.max_reflection_streams,
        )?,
        drain_timeout: millis(env, "DYN_RELAY_DRAIN_TIMEOUT_MS", ms(d.drain_timeout))?,
    })
}

/// `DYN_RELAY_SHUTDOWN_TIMEOUT_MS` (valid with or without a listener).
pub(super) fn resolve_shutdown_timeout(env: &Env<'_>) -> Result<Duration, ConfigError> {
    millis(env, "DYN_RELAY_SHUTDOWN_TIMEOUT_MS", SHUTDOWN_TIMEOUT_DEFAULT.as_millis() as u64)
}

/// `DYN_RELAY_POOL_FILTER_BYTES_MAX`: the bytes the filters of all pools may take together
/// (default [`POOL_FILTER_BYTES_MAX_DEFAULT`]); at least one pool's filter of `ckf_format`,
/// since a smaller budget could never start a pool.
pub(super) fn resolve_pool_filter_bytes_max(
    env: &Env<'_>,
    ckf_format: &CkfFormat,
) -> Result<u64, ConfigError> {
    const SETTING: &str = "DYN_RELAY_POOL_FILTER_BYTES_MAX";
    let Some(value) = env.get(SETTING) else {
        return Ok(POOL_FILTER_BYTES_MAX_DEFAULT);
    };
    let budget = parse_positive(SETTING, value, u64::MAX)?;
    if budget < ckf_format.filter_bytes() {
        let reason = format!(
            "must hold at least one pool's filter ({} bytes at the configured expected unique \
             blocks)",
            ckf_format.filter_bytes()
        );
        return Err(invalid(SETTING, value, reason));
    }
    Ok(budget)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn defaults_hold_and_each_variable_is_read_and_validated() {
        let empty = env(&[]);
        assert_eq!(resolve_listener_limits(&Env(&empty)).unwrap(), ListenerLimits::default());
        assert_eq!(resolve_shutdown_timeout(&Env(&empty)).unwrap(), SHUTDOWN_TIMEOUT_DEFAULT);
        let set = env(&[
            ("DYN_RELAY_MAX_CONNECTIONS", "3"),
            ("DYN_RELAY_MAX_STREAMS_PER_CONNECTION", "4"),
            ("DYN_RELAY_MAX_HEADER_LIST_BYTES", "2048"),
            ("DYN_RELAY_MAX_REQUEST_BYTES", "4096"),
            ("DYN_RELAY_HANDSHAKE_TIMEOUT_MS", "5"),
            ("DYN_RELAY_ACCEPT_ERROR_BACKOFF_MS", "6"),
            ("DYN_RELAY_SUBSCRIBER_SEND_TIMEOUT_MS", "7"),
            ("DYN_RELAY_MAX_HEALTH_WATCH_STREAMS", "8"),
            ("DYN_RELAY_MAX_REFLECTION_STREAMS", "9"),
            ("DYN_RELAY_DRAIN_TIMEOUT_MS", "10"),
            ("DYN_RELAY_SHUTDOWN_TIMEOUT_MS", "1500"),
        ]);
        let limits = resolve_listener_limits(&Env(&set)).unwrap();
        assert_eq!(
            limits,
            ListenerLimits {
                max_connections: 3,
                max_streams_per_connection: 4,
                max_header_list_bytes: 2048,
                max_request_bytes: 4096,
                handshake_timeout: Duration::from_millis(5),
                accept_error_backoff: Duration::from_millis(6),
                subscriber_send_timeout: Duration::from_millis(7),
                max_health_watch_streams: 8,
                max_reflection_streams: 9,
                drain_timeout: Duration::from_millis(10),
            }
        );
        assert_eq!(resolve_shutdown_timeout(&Env(&set)).unwrap(), Duration::from_millis(1500));
        for (name, bad) in [
            ("DYN_RELAY_MAX_CONNECTIONS", "0"),
            ("DYN_RELAY_MAX_REQUEST_BYTES", "1023"),
            ("DYN_RELAY_MAX_REQUEST_BYTES", "16777217"),
            ("DYN_RELAY_MAX_HEADER_LIST_BYTES", "x"),
            ("DYN_RELAY_SUBSCRIBER_SEND_TIMEOUT_MS", "0"),
        ] {
            let error = resolve_listener_limits(&Env(&env(&[(name, bad)]))).unwrap_err();
            assert!(error.to_string().contains(name), "{name}={bad}: {error}");
        }
        let error = resolve_shutdown_timeout(&Env(&env(&[("DYN_RELAY_SHUTDOWN_TIMEOUT_MS", "0")])));
        assert!(error.is_err());
    }

    #[test]
    fn the_pool_budget_holds_at_least_one_filter() {
        const SETTING: &str = "DYN_RELAY_POOL_FILTER_BYTES_MAX";
        let format = CkfFormat::for_expected_blocks(1 << 20).unwrap();
        let resolve = |value: Option<&str>| {
            let pairs: Vec<(&str, &str)> =
                value.map(|value| (SETTING, value)).into_iter().collect();
            resolve_pool_filter_bytes_max(&Env(&env(&pairs)), &format)
        };
        assert_eq!(resolve(None).unwrap(), POOL_FILTER_BYTES_MAX_DEFAULT);
        assert_eq!(resolve(Some("4194304")).unwrap(), 4 << 20);
        for bad in ["4194303", "0", "-1", "lots"] {
            let error = resolve(Some(bad)).unwrap_err().to_string();
            assert!(error.contains(SETTING), "{bad}: {error}");
        }
        assert!(resolve(Some("1")).unwrap_err().to_string().contains("4194304 bytes"));
    }
}
