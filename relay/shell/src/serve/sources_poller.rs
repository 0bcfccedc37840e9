//! The async shell of `--sources-file`: read the file every [`SOURCES_POLL_INTERVAL`], each read
//! bounded by [`SOURCES_READ_TIMEOUT`] and [`SOURCES_FILE_BYTES_MAX`] (+1 byte, to tell a
//! too-large file), hand the outcome to [`SourcesState`], and publish every new selection as the
//! discovery transport's namespace limit.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::sources_file::{
    SOURCES_FILE_BYTES_MAX, SOURCES_POLL_INTERVAL, SOURCES_READ_TIMEOUT, SourceList,
    SourcesFileError, SourcesState, parse_sources_file,
};
use crate::discovery_plane::NamespaceLimit;

/// Where the poller reads and how often.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourcesPollerConfig {
    /// The file.
    pub path: PathBuf,
    /// `DYN_RELAY_CONNECTION_REVISION`, if set.
    pub guard: Option<String>,
    /// Time between reads.
    pub poll_interval: Duration,
    /// Longest time one read may take.
    pub read_timeout: Duration,
}

impl SourcesPollerConfig {
    /// The reference cadence for `path`.
    #[must_use]
    pub fn new(path: PathBuf, guard: Option<String>) -> Self {
        SourcesPollerConfig {
            path,
            guard,
            poll_interval: SOURCES_POLL_INTERVAL,
            read_timeout: SOURCES_READ_TIMEOUT,
        }
    }
}

/// Read and validate the file once.
pub async fn read_sources_file(
    config: &SourcesPollerConfig,
) -> Result<SourceList, SourcesFileError> {
    let bytes = tokio::time::timeout(config.read_timeout, read_bounded(&config.path))
        .await
        .map_err(|_| SourcesFileError::ReadTimeout)?
        .map_err(|error| match error.kind() {
            std::io::ErrorKind::NotFound => SourcesFileError::Missing,
            _ => SourcesFileError::Read { reason: error.to_string() },
        })?;
    parse_sources_file(&bytes, config.guard.as_deref())
}

async fn read_bounded(path: &Path) -> std::io::Result<Vec<u8>> {
    let file = tokio::fs::File::open(path).await?;
    let mut bytes = Vec::new();
    let limit = u64::try_from(SOURCES_FILE_BYTES_MAX).unwrap_or(u64::MAX).saturating_add(1);
    file.take(limit).read_to_end(&mut bytes).await?;
    Ok(bytes)
}

/// Poll until `cancel` fires. `state` starts with the first read already applied (see
/// [`super::start`]); every change of selection is sent to `limit`, every step to `report`.
pub async fn run_sources_poller(
    config: SourcesPollerConfig,
    mut state: SourcesState,
    limit: watch::Sender<NamespaceLimit>,
    report: watch::Sender<SourcesState>,
    cancel: CancellationToken,
) {
    loop {
        tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(config.poll_interval) => {}
        }
        let outcome = tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            outcome = read_sources_file(&config) => outcome,
        };
        if let Err(error) = &outcome
            && state.last_error() != Some(error)
        {
            warn!(path = %config.path.display(), %error, "sources file refused; keeping the last good selection");
        }
        if let Some(namespaces) = state.apply(outcome) {
            info!(path = %config.path.display(), ?namespaces, "sources file selection changed");
            limit.send_replace(Some(namespaces));
        }
        report.send_if_modified(|current| {
            let changed = *current != state;
            if changed {
                current.clone_from(&state);
            }
            changed
        });
    }
}
