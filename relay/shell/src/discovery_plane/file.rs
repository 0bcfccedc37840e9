//! The file discovery backend (`DYN_DISCOVERY_BACKEND=file`, root `DYN_FILE_KV`).
//!
//! Dynamo's file store keeps one JSON file per key at `{root}/v1/{bucket}/{name}`, the name
//! being the rest of the key percent-encoded (dynamo-live §9.1). Each owner touches its files'
//! modification time every ~3.3 s; a file not touched for 10 s belongs to a dead process.
//!
//! One poll reads the four record buckets ([`DISCOVERY_BUCKETS`]) and hands the differ one complete listing:
//!
//! - a file whose modification time is more than the TTL before the injected wall clock is
//!   expired: left out of the listing, hence removed (a time in the future counts as fresh);
//! - a file larger than the record limit is not read; it is listed as rejected (counted once);
//! - a file that vanished between listing and reading is absent; one that cannot be read for
//!   another reason is listed as unreadable, so the record it held stays until the next poll;
//! - names starting with `.` (editor and temporary files) and subdirectories are skipped;
//! - a missing bucket directory is an empty bucket (no process registered that kind of key yet);
//!   a missing root or an unlistable directory fails the whole poll, which changes nothing and
//!   is retried after a backoff. So does a poll that finds more than `files_max` live files (or
//!   more than four times as many directory entries): the differ never sees a truncated
//!   listing, which would read as mass removal.
//!
//! A poll reads a file's bytes only when its size or modification time differs from the last
//! read (an owner's refresh changes the time, so a live file is re-read every ~3.3 s); an
//! unchanged file keeps what the differ holds. Every `relist_interval` (30 s,
//! `DYN_RELAY_DISCOVERY_RELIST_INTERVAL_MS`) and after the namespace selection changed, a poll
//! reads every file: this reconciling relist emits nothing when the store matches what was
//! emitted, and exactly the difference when a file changed without its size or time changing.
//!
//! Problems with single files and failed polls are logged at warn once per distinct problem
//! (while it persists) and at debug on the polls after.
//!
//! The backend only reads; it never deletes expired files (Dynamo's own processes do).

use std::collections::{BTreeMap, BTreeSet};

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use thiserror::Error;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::records::{
    DISCOVERY_BUCKETS, DiscoveryOutput, EntryValue, KeyForm, ListingEntry, ListingMode,
    RecordDiffer,
};
use super::{
    Backoff, DISCOVERY_RECORDS_MAX, Delivery, DiscoveryPlaneError, DiscoverySink, DiscoveryStats,
    sleep_or_cancel,
};
use crate::runtime::{BlockingExecutor, TokioBlockingExecutor, WallClock, run_blocking};
use kvrelay_core::discovery::DiscoveryScope;
use kvrelay_core::inputs::InputError;
use kvrelay_core::inputs::limits::DISCOVERY_RECORD_BYTES_MAX;

/// Configuration of the file backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileDiscoveryConfig {
    /// The store's root directory (`DYN_FILE_KV`); records live under `{root}/v1/`.
    pub root: PathBuf,
    /// Time between the end of one poll and the start of the next (default 1 s).
    pub poll_interval: Duration,
    /// A file not modified for longer than this is expired (default 10 s, Dynamo's TTL).
    pub ttl: Duration,
    /// Largest file read, in bytes (default and maximum: the 4 MiB record limit).
    pub record_bytes_max: usize,
    /// Most files one poll accepts (default [`DISCOVERY_RECORDS_MAX`]); a poll with more fails.
    pub files_max: usize,
    /// First delay after a failed poll (default 100 ms), doubling per failure.
    pub retry_backoff_initial: Duration,
    /// Longest delay after failed polls (default 5 s).
    pub retry_backoff_max: Duration,
    /// Time between polls that read every file, changed or not (default 30 s).
    pub relist_interval: Duration,
}

impl FileDiscoveryConfig {
    /// The defaults for the store at `root`.
    #[must_use]
    pub fn new(root: impl Into<PathBuf>) -> Self {
        FileDiscoveryConfig {
            root: root.into(),
            poll_interval: Duration::from_secs(1),
            ttl: Duration::from_secs(10),
            record_bytes_max: DISCOVERY_RECORD_BYTES_MAX,
            files_max: DISCOVERY_RECORDS_MAX,
            retry_backoff_initial: Duration::from_millis(100),
            retry_backoff_max: Duration::from_secs(5),
            relist_interval: Duration::from_secs(30),
        }
    }

    /// Check the values are usable: positive intervals, limits within the record limits.
    pub fn validate(&self) -> Result<(), DiscoveryPlaneError> {
        let invalid = |field, reason| Err(DiscoveryPlaneError::InvalidConfig { field, reason });
        if self.poll_interval.is_zero() {
            return invalid("poll_interval", "must be positive");
        }
        if self.ttl.is_zero() {
            return invalid("ttl", "must be positive");
        }
        if self.relist_interval.is_zero() {
            return invalid("relist_interval", "must be positive");
        }
        if self.record_bytes_max == 0 || self.record_bytes_max > DISCOVERY_RECORD_BYTES_MAX {
            return invalid("record_bytes_max", "must be within 1..=4 MiB");
        }
        if self.files_max == 0 || self.files_max > DISCOVERY_RECORDS_MAX {
            return invalid("files_max", "must be within 1..=DISCOVERY_RECORDS_MAX");
        }
        if self.retry_backoff_initial.is_zero()
            || self.retry_backoff_max < self.retry_backoff_initial
        {
            return invalid("retry_backoff", "must be positive with initial <= max");
        }
        Ok(())
    }
}

/// Why one poll of the store failed as a whole (nothing was applied).
#[derive(Debug, Error)]
pub enum FileScanError {
    /// The root directory does not exist (yet).
    #[error("file discovery root {} does not exist", path.display())]
    RootMissing {
        /// The configured root.
        path: PathBuf,
    },
    /// A directory could not be listed.
    #[error("cannot list {}: {source}", path.display())]
    ListDirectory {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The store holds more files than one poll accepts.
    #[error("the store holds more than {max} discovery files")]
    TooManyFiles {
        /// The configured bound.
        max: usize,
    },
    /// The blocking job that reads the store died before it answered.
    #[error("the store scan did not complete")]
    ScanDied,
}

/// Whether a file modified at `modified_unix_us` has expired at `now_unix_us`: it is older than
/// `ttl`. A modification time in the future (clock skew) is fresh.
#[must_use]
pub fn is_expired(modified_unix_us: u64, now_unix_us: u64, ttl: Duration) -> bool {
    let ttl_us = u64::try_from(ttl.as_micros()).unwrap_or(u64::MAX);
    now_unix_us.saturating_sub(modified_unix_us) > ttl_us
}

/// What a file looked like when it was last read: a poll that finds the same skips the read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    len: u64,
    modified_unix_us: u64,
}

/// Most distinct problems remembered between polls; beyond it problems are logged at debug.
const PROBLEMS_MAX: usize = 1024;

/// Problems (file errors, failed polls) of the current and the previous poll: each distinct
/// one is logged at warn when it first shows, at debug while it persists from poll to poll.
#[derive(Debug, Default)]
struct Problems {
    previous: BTreeSet<String>,
    current: BTreeSet<String>,
    /// Problems logged at warn so far.
    warned: u64,
}

impl Problems {
    /// Log `problem` (a complete sentence naming what and where).
    fn report(&mut self, problem: String) {
        if self.previous.contains(&problem) || self.current.contains(&problem) {
            debug!(problem, "file discovery problem persists");
        } else if self.current.len() < PROBLEMS_MAX {
            warn!(problem, "file discovery problem");
            self.warned = self.warned.saturating_add(1);
        } else {
            debug!(problem, "file discovery problem (too many to warn about)");
            return;
        }
        self.current.insert(problem);
    }

    /// The poll is over: problems it did not report are forgotten.
    fn end_poll(&mut self) {
        self.previous = std::mem::take(&mut self.current);
    }
}

/// The file backend's state: its configuration, the differ and the stats. [`FileDiscovery::poll_once`]
/// is one step; [`run_file_discovery`] loops it.
#[derive(Debug)]
pub struct FileDiscovery {
    config: FileDiscoveryConfig,
    differ: RecordDiffer,
    clock: Arc<dyn WallClock>,
    stats: DiscoveryStats,
    /// The stamp of every file the last poll read or skipped as unchanged, by key.
    stamps: BTreeMap<String, FileStamp>,
    /// When the next poll reads every file (`None`: the next poll does).
    next_relist: Option<tokio::time::Instant>,
    problems: Problems,
    /// Where a poll's scan runs (tokio's blocking pool unless [`FileDiscovery::with_executor`]).
    executor: Arc<dyn BlockingExecutor>,
}

impl FileDiscovery {
    /// A backend over `config.root` that keeps the records `scope` includes.
    pub fn new(
        config: FileDiscoveryConfig,
        scope: DiscoveryScope,
        clock: Arc<dyn WallClock>,
    ) -> Result<Self, DiscoveryPlaneError> {
        config.validate()?;
        Ok(FileDiscovery {
            config,
            differ: RecordDiffer::new(scope, KeyForm::FilePath),
            clock,
            stats: DiscoveryStats::default(),
            stamps: BTreeMap::new(),
            next_relist: None,
            problems: Problems::default(),
            executor: Arc::new(TokioBlockingExecutor),
        })
    }

    /// The backend with its scans run by `executor`.
    #[must_use]
    pub fn with_executor(mut self, executor: Arc<dyn BlockingExecutor>) -> Self {
        self.executor = executor;
        self
    }

    /// What the backend did so far.
    #[must_use]
    pub fn stats(&self) -> &DiscoveryStats {
        &self.stats
    }

    /// Read the store once and return what changed since the previous poll (the first
    /// successful poll reports everything, as `CardsListed` plus instance sets, adverts and
    /// channels). On error nothing is applied.
    ///
    /// The poll reads every file if a relist is due (the first poll, every `relist_interval` of
    /// tokio time, after a namespace change), else only files whose size or modification time
    /// changed since they were last read.
    pub async fn poll_once(&mut self) -> Result<Vec<DiscoveryOutput>, FileScanError> {
        let now_unix_us = self.clock.now_unix_us();
        let now = tokio::time::Instant::now();
        let relist = self.next_relist.is_none_or(|due| now >= due);
        // The whole scan is one job on the blocking pool: one hand-off per poll, not one per
        // file system call (a store of a thousand files would otherwise cost thousands of
        // thread wake-ups a second).
        let mut scan = Scan {
            config: self.config.clone(),
            last: std::mem::take(&mut self.stamps),
            now_unix_us,
            relist,
            stamps: BTreeMap::new(),
            problems: Vec::new(),
        };
        let job = move || {
            let scanned = scan.store();
            (scanned, scan)
        };
        let (scanned, stamps, problems) = match run_blocking(self.executor.as_ref(), job).await {
            Ok((scanned, scan)) => {
                self.stamps = scan.last;
                (scanned, scan.stamps, scan.problems)
            }
            // The stamps went with the job: the next poll reads every file.
            Err(_) => (Err(FileScanError::ScanDied), BTreeMap::new(), Vec::new()),
        };
        for problem in problems {
            self.problems.report(problem);
        }
        let entries = match scanned {
            Ok(entries) => entries,
            Err(error) => {
                self.stats.transport_errors = self.stats.transport_errors.saturating_add(1);
                self.stats.last_error = Some(error.to_string());
                self.problems.report(format!("poll failed: {error}"));
                self.problems.end_poll();
                return Err(error);
            }
        };
        self.problems.end_poll();
        self.stamps = stamps;
        if relist {
            if self.next_relist.is_some() {
                self.stats.relists = self.stats.relists.saturating_add(1);
            }
            self.next_relist = Some(now + self.config.relist_interval);
        }
        let unreadable =
            entries.iter().filter(|entry| matches!(entry.value, EntryValue::Unreadable)).count();
        self.stats.unreadable_entries =
            self.stats.unreadable_entries.saturating_add(u64::try_from(unreadable).unwrap_or(0));
        let outputs = self.differ.apply_listing(entries, ListingMode::Poll);
        self.stats.listings = self.stats.listings.saturating_add(1);
        self.stats.records = self.differ.counters().clone();
        self.stats.soft_errors = self.differ.soft_errors().clone();
        Ok(outputs)
    }

    /// Make the next poll read every file (the namespace selection changed: files skipped as
    /// out of scope must be read now that they may be in it).
    fn relist_next(&mut self) {
        self.next_relist = None;
    }
}

/// One poll's scan: what it reads by, and what it found (moved to the blocking pool and back).
#[derive(Debug)]
struct Scan {
    config: FileDiscoveryConfig,
    /// The stamps of the previous poll.
    last: BTreeMap<String, FileStamp>,
    now_unix_us: u64,
    /// Read every file, stamped or not.
    relist: bool,
    /// The stamps of the files read or skipped.
    stamps: BTreeMap<String, FileStamp>,
    /// Problems met, in order.
    problems: Vec<String>,
}

impl Scan {
    /// List every bucket into one listing (blocking: runs on the blocking pool).
    fn store(&mut self) -> Result<Vec<ListingEntry>, FileScanError> {
        let root = &self.config.root;
        match std::fs::metadata(root) {
            Ok(metadata) if metadata.is_dir() => {}
            Ok(_) => return Err(FileScanError::RootMissing { path: root.clone() }),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                return Err(FileScanError::RootMissing { path: root.clone() });
            }
            Err(source) => return Err(FileScanError::ListDirectory { path: root.clone(), source }),
        }
        let mut entries = Vec::new();
        let mut seen = 0usize;
        for bucket in DISCOVERY_BUCKETS {
            self.bucket(bucket, &mut entries, &mut seen)?;
        }
        Ok(entries)
    }

    fn bucket(
        &mut self,
        bucket: &str,
        entries: &mut Vec<ListingEntry>,
        seen: &mut usize,
    ) -> Result<(), FileScanError> {
        let directory = self.config.root.join("v1").join(bucket);
        let list_error = |source| FileScanError::ListDirectory { path: directory.clone(), source };
        let listing = match std::fs::read_dir(&directory) {
            Ok(listing) => listing,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(error) => return Err(list_error(error)),
        };
        // Directory entries looked at (expired and skipped ones too) are bounded as well, so a
        // directory that nobody cleans cannot make a poll unbounded.
        let seen_max = self.config.files_max.saturating_mul(4);
        for entry in listing {
            let entry = entry.map_err(list_error)?;
            *seen += 1;
            if *seen > seen_max {
                return Err(FileScanError::TooManyFiles { max: self.config.files_max });
            }
            let file_name = entry.file_name();
            let name = file_name.to_string_lossy();
            if name.starts_with('.') {
                continue;
            }
            let key = format!("v1/{bucket}/{name}");
            let value = if file_name.to_str().is_none() {
                EntryValue::Rejected(InputError::MalformedKey {
                    key: name.chars().take(64).collect(),
                    reason: "file name is not UTF-8",
                })
            } else {
                match self.entry(&key, &entry.path()) {
                    Some(value) => value,
                    None => continue,
                }
            };
            if entries.len() >= self.config.files_max {
                return Err(FileScanError::TooManyFiles { max: self.config.files_max });
            }
            entries.push(ListingEntry { key, value });
        }
        Ok(())
    }

    /// The value of one file, or `None` if it is not a live record file (gone, expired, a
    /// directory); [`EntryValue::Unchanged`] if it is stamped as last read (and no relist is
    /// due).
    fn entry(&mut self, key: &str, path: &Path) -> Option<EntryValue> {
        let metadata = match std::fs::metadata(path) {
            Ok(metadata) => metadata,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return None,
            Err(error) => {
                self.problems.push(format!("cannot stat {}: {error}", path.display()));
                return Some(EntryValue::Unreadable);
            }
        };
        if !metadata.is_file() {
            return None;
        }
        let modified_unix_us = match metadata.modified() {
            Ok(modified) => modified
                .duration_since(UNIX_EPOCH)
                .map_or(0, |since| u64::try_from(since.as_micros()).unwrap_or(u64::MAX)),
            Err(error) => {
                self.problems.push(format!("{} has no modification time: {error}", path.display()));
                return Some(EntryValue::Unreadable);
            }
        };
        if is_expired(modified_unix_us, self.now_unix_us, self.config.ttl) {
            debug!(path = %path.display(), "discovery file expired");
            return None;
        }
        let stamp = FileStamp { len: metadata.len(), modified_unix_us };
        if !self.relist && self.last.get(key) == Some(&stamp) {
            self.stamps.insert(key.to_owned(), stamp);
            return Some(EntryValue::Unchanged);
        }
        let max = self.config.record_bytes_max;
        let too_large = |bytes: usize| {
            EntryValue::Rejected(InputError::TooLarge { what: "discovery record", bytes, max })
        };
        if metadata.len() > max as u64 {
            self.stamps.insert(key.to_owned(), stamp);
            return Some(too_large(usize::try_from(metadata.len()).unwrap_or(usize::MAX)));
        }
        let file = match std::fs::File::open(path) {
            Ok(file) => file,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return None,
            Err(error) => {
                self.problems.push(format!("cannot open {}: {error}", path.display()));
                return Some(EntryValue::Unreadable);
            }
        };
        // The file may have grown since the stat: read at most one byte past the limit.
        let mut bytes = Vec::with_capacity(usize::try_from(metadata.len()).unwrap_or(0));
        let limit = u64::try_from(max).unwrap_or(u64::MAX).saturating_add(1);
        let value = match file.take(limit).read_to_end(&mut bytes) {
            Ok(_) if bytes.len() > max => too_large(bytes.len()),
            Ok(_) => EntryValue::Bytes(bytes),
            Err(error) => {
                self.problems.push(format!("cannot read {}: {error}", path.display()));
                return Some(EntryValue::Unreadable);
            }
        };
        // A file that changed while it was read has a newer stamp than `stamp`: the next poll
        // reads it again.
        self.stamps.insert(key.to_owned(), stamp);
        Some(value)
    }
}

/// Run the file backend until `cancel` fires (`Ok(())`) or the sink closes
/// ([`DiscoveryPlaneError::SinkClosed`]). Fails at once only on an invalid configuration.
///
/// Polls every `poll_interval`; after a failed poll it waits the backoff (100 ms doubling to
/// 5 s) instead, and a successful poll resets it.
pub async fn run_file_discovery(
    config: FileDiscoveryConfig,
    scope: DiscoveryScope,
    sink: DiscoverySink,
    clock: Arc<dyn WallClock>,
    cancel: CancellationToken,
) -> Result<(), DiscoveryPlaneError> {
    let poll_interval = config.poll_interval;
    let mut backoff = Backoff::new(config.retry_backoff_initial, config.retry_backoff_max);
    let root = config.root.clone();
    let mut backend = FileDiscovery::new(config, scope, clock)?;
    info!(root = %root.display(), "file discovery started");
    loop {
        if let Some(limit) = sink.namespace_limit_change(backend.differ.namespace_limit()) {
            info!(namespaces = ?limit, "file discovery scope narrowed");
            backend.differ.set_namespace_limit(limit);
            backend.relist_next();
        }
        let delay = match backend.poll_once().await {
            Ok(outputs) => {
                backoff.reset();
                let delivered = sink.deliver(outputs, &cancel).await?;
                sink.publish_stats(backend.stats());
                if delivered == Delivery::Cancelled {
                    return Ok(());
                }
                poll_interval
            }
            Err(error) => {
                // `poll_once` logged the failure (at warn the first time).
                debug!(%error, "file discovery poll failed; retrying");
                sink.publish_stats(backend.stats());
                backoff.next_delay()
            }
        };
        if sleep_or_cancel(delay, &cancel).await {
            info!(root = %root.display(), "file discovery stopped");
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_expire_strictly_after_the_ttl_and_future_times_are_fresh() {
        let ttl = Duration::from_secs(10);
        let now = 1_800_000_000_000_000;
        assert!(!is_expired(now, now, ttl));
        assert!(!is_expired(now - 10_000_000, now, ttl));
        assert!(is_expired(now - 10_000_001, now, ttl));
        assert!(!is_expired(now + 60_000_000, now, ttl));
        assert!(is_expired(0, now, ttl));
    }

    #[test]
    fn a_problem_warns_once_while_it_persists_and_again_after_it_cleared() {
        let mut problems = Problems::default();
        for _ in 0..3 {
            problems.report("cannot open v1/mdc/x: permission denied".into());
            problems.report("cannot open v1/mdc/x: permission denied".into());
            problems.end_poll();
        }
        assert_eq!(problems.warned, 1);
        problems.report("cannot open v1/mdc/y: permission denied".into());
        problems.end_poll();
        assert_eq!(problems.warned, 2);
        // x was not reported by the last poll: it is forgotten, so it warns again.
        problems.report("cannot open v1/mdc/x: permission denied".into());
        assert_eq!(problems.warned, 3);
    }

    #[tokio::test]
    async fn a_failed_poll_warns_once_per_distinct_failure() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("missing");
        let clock: Arc<dyn WallClock> = Arc::new(crate::runtime::ManualWallClock::new(0));
        let mut backend = FileDiscovery::new(
            FileDiscoveryConfig::new(&root),
            DiscoveryScope::watch_all(Vec::new()).unwrap(),
            clock,
        )
        .unwrap();
        for _ in 0..4 {
            assert!(backend.poll_once().await.is_err());
        }
        assert_eq!(backend.problems.warned, 1);
        assert_eq!(backend.stats().transport_errors, 4);
        std::fs::create_dir_all(&root).unwrap();
        assert!(backend.poll_once().await.is_ok());
        std::fs::remove_dir(&root).unwrap();
        assert!(backend.poll_once().await.is_err());
        assert_eq!(backend.problems.warned, 2);
    }

    /// Runs nothing: every job dies unrun, as one that panicked on a pool thread does.
    #[derive(Debug)]
    struct DyingExecutor;

    impl BlockingExecutor for DyingExecutor {
        fn spawn(&self, job: Box<dyn FnOnce() + Send + 'static>) {
            drop(job);
        }
    }

    /// A scan that dies fails its poll with `ScanDied` (counted and reported, nothing applied)
    /// and the next poll reads the store again.
    #[tokio::test]
    async fn a_scan_that_dies_fails_its_poll_and_the_next_poll_recovers() {
        let dir = tempfile::tempdir().unwrap();
        let clock: Arc<dyn WallClock> = Arc::new(crate::runtime::ManualWallClock::new(0));
        let mut backend = FileDiscovery::new(
            FileDiscoveryConfig::new(dir.path()),
            DiscoveryScope::watch_all(Vec::new()).unwrap(),
            clock,
        )
        .unwrap()
        .with_executor(Arc::new(DyingExecutor));
        assert!(matches!(backend.poll_once().await, Err(FileScanError::ScanDied)));
        assert_eq!(backend.stats().transport_errors, 1);
        assert_eq!(backend.problems.warned, 1);
        backend.executor = Arc::new(crate::runtime::InlineExecutor);
        assert!(backend.poll_once().await.is_ok());
        assert_eq!(backend.stats().transport_errors, 1);
    }

    #[test]
    fn configuration_limits_are_checked() {
        let valid = FileDiscoveryConfig::new("/tmp/x");
        assert!(valid.validate().is_ok());
        for (config, field) in [
            (
                FileDiscoveryConfig { poll_interval: Duration::ZERO, ..valid.clone() },
                "poll_interval",
            ),
            (FileDiscoveryConfig { ttl: Duration::ZERO, ..valid.clone() }, "ttl"),
            (
                FileDiscoveryConfig { relist_interval: Duration::ZERO, ..valid.clone() },
                "relist_interval",
            ),
            (
                FileDiscoveryConfig {
                    record_bytes_max: DISCOVERY_RECORD_BYTES_MAX + 1,
                    ..valid.clone()
                },
                "record_bytes_max",
            ),
            (FileDiscoveryConfig { files_max: 0, ..valid.clone() }, "files_max"),
            (
                FileDiscoveryConfig {
                    retry_backoff_max: Duration::from_millis(1),
                    ..valid.clone()
                },
                "retry_backoff",
            ),
        ] {
            assert!(
                matches!(config.validate(), Err(DiscoveryPlaneError::InvalidConfig { field: f, .. }) if f == field),
                "{field}"
            );
        }
    }
}
