//! Segment files: naming, rotation by size and age, and retention by total size.
//!
//! Segments are `journal-<n>.kvj` with `n` zero-padded to 8 digits, numbered from 0 in one
//! directory. A segment is closed once appending would pass the size limit or its first record
//! is older than the age limit (by the records' monotonic stamps); the next one starts with a
//! repeat of the header. After a rotation the oldest closed segments are deleted until the
//! directory's total fits the total limit (the open segment is never deleted).
//!
//! This is synchronous file I/O; the recorder runs it through the blocking-executor seam.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::format::{
    JournalHeader, Record, SEGMENT_PREAMBLE_BYTES, Stamp, encode_frame, segment_preamble,
};

/// Bytes buffered before a write reaches the file.
const WRITE_BUFFER_BYTES: usize = 64 * 1024;

/// File name prefix of segments.
pub const SEGMENT_PREFIX: &str = "journal-";
/// File name suffix of segments.
pub const SEGMENT_SUFFIX: &str = ".kvj";

/// The path of segment `index` in `dir`.
#[must_use]
pub fn segment_path(dir: &Path, index: u64) -> PathBuf {
    dir.join(format!("{SEGMENT_PREFIX}{index:08}{SEGMENT_SUFFIX}"))
}

/// The segment number a file name denotes, if it is a segment.
#[must_use]
pub fn segment_index(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(SEGMENT_PREFIX)?.strip_suffix(SEGMENT_SUFFIX)?;
    if digits.is_empty() || !digits.bytes().all(|byte| byte.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The segments in `dir`, in number order.
pub fn list_segments(dir: &Path) -> io::Result<Vec<(u64, PathBuf)>> {
    let mut segments = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if let Some(index) = entry.file_name().to_str().and_then(segment_index) {
            segments.push((index, entry.path()));
        }
    }
    segments.sort();
    Ok(segments)
}

/// Size and age limits of a journal directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentLimits {
    /// A segment is closed before it would pass this many bytes (a single larger record still
    /// gets a segment of its own).
    pub max_segment_bytes: u64,
    /// A segment is closed once its first record is this old.
    pub max_segment_age: Duration,
    /// Closed segments are deleted, oldest first, while the directory holds more than this.
    pub max_total_bytes: u64,
}

/// What the writer has done, for counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteTally {
    /// Records appended.
    pub records: u64,
    /// Bytes appended (frames and preambles).
    pub bytes: u64,
    /// Segments opened.
    pub segments_opened: u64,
    /// Segments deleted by retention.
    pub segments_deleted: u64,
}

#[derive(Debug)]
struct OpenSegment {
    index: u64,
    file: BufWriter<File>,
    bytes: u64,
    first_at: Option<Duration>,
}

/// Appends records to numbered segments in one directory.
#[derive(Debug)]
pub struct SegmentWriter {
    dir: PathBuf,
    header: JournalHeader,
    limits: SegmentLimits,
    open: Option<OpenSegment>,
    closed: VecDeque<(u64, u64)>,
    next_index: u64,
    buffer: Vec<u8>,
    tally: WriteTally,
}

impl SegmentWriter {
    /// A writer for `dir` (created if missing). Refuses a directory that already holds
    /// segments: one directory holds one recording.
    pub fn create(dir: &Path, header: JournalHeader, limits: SegmentLimits) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        if let Some((_, path)) = list_segments(dir)?.first() {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} already holds a journal ({})", dir.display(), path.display()),
            ));
        }
        Ok(SegmentWriter {
            dir: dir.to_path_buf(),
            header,
            limits,
            open: None,
            closed: VecDeque::new(),
            next_index: 0,
            buffer: Vec::new(),
            tally: WriteTally::default(),
        })
    }

    /// The counters so far.
    #[must_use]
    pub fn tally(&self) -> WriteTally {
        self.tally
    }

    /// The directory.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Append `record`, rotating first if a limit says so. A record that cannot be encoded is
    /// an `InvalidData` error and changes nothing; an I/O error abandons the open segment (the
    /// next append starts a new one).
    pub fn append(&mut self, record: &Record) -> io::Result<()> {
        self.buffer.clear();
        let frame = encode_frame(record, &mut self.buffer)
            .map_err(|error| io::Error::new(io::ErrorKind::InvalidData, error))?
            as u64;
        let at = record.stamp().map(|stamp: Stamp| stamp.mono());
        if self.rotation_due(frame, at) {
            self.close_open()?;
        }
        if self.open.is_none() {
            self.open_next()?;
        }
        let result = self.write_open(at);
        if result.is_err() {
            self.open = None;
        }
        result
    }

    fn write_open(&mut self, at: Option<Duration>) -> io::Result<()> {
        let Some(open) = self.open.as_mut() else {
            return Err(io::Error::other("no open segment"));
        };
        open.file.write_all(&self.buffer)?;
        open.bytes += self.buffer.len() as u64;
        if open.first_at.is_none() {
            open.first_at = at;
        }
        self.tally.records += 1;
        self.tally.bytes += self.buffer.len() as u64;
        Ok(())
    }

    fn rotation_due(&self, frame: u64, at: Option<Duration>) -> bool {
        let Some(open) = &self.open else { return false };
        let has_records = open.first_at.is_some();
        let too_big = open.bytes + frame > self.limits.max_segment_bytes;
        let too_old = match (open.first_at, at) {
            (Some(first), Some(at)) => at.saturating_sub(first) >= self.limits.max_segment_age,
            _ => false,
        };
        has_records && (too_big || too_old)
    }

    fn open_next(&mut self) -> io::Result<()> {
        let index = self.next_index;
        self.next_index += 1;
        let path = segment_path(&self.dir, index);
        let file = OpenOptions::new().write(true).create_new(true).open(&path)?;
        let mut file = BufWriter::with_capacity(WRITE_BUFFER_BYTES, file);
        let mut header = self.header.clone();
        header.segment = index;
        let mut bytes = segment_preamble().to_vec();
        encode_frame(&Record::Header(header), &mut bytes)
            .map_err(|error| io::Error::new(io::ErrorKind::InvalidData, error))?;
        file.write_all(&bytes)?;
        self.tally.bytes += bytes.len() as u64;
        self.tally.segments_opened += 1;
        debug_assert!(bytes.len() > SEGMENT_PREAMBLE_BYTES);
        self.open = Some(OpenSegment { index, file, bytes: bytes.len() as u64, first_at: None });
        Ok(())
    }

    fn close_open(&mut self) -> io::Result<()> {
        if let Some(mut open) = self.open.take() {
            open.file.flush()?;
            self.closed.push_back((open.index, open.bytes));
        }
        self.enforce_total()
    }

    fn enforce_total(&mut self) -> io::Result<()> {
        let open_bytes = self.open.as_ref().map_or(0, |open| open.bytes);
        let mut total: u64 = self.closed.iter().map(|(_, bytes)| bytes).sum::<u64>() + open_bytes;
        // Leave room for the segment about to open.
        let budget = self.limits.max_total_bytes.saturating_sub(self.limits.max_segment_bytes);
        while total > budget {
            let Some((index, bytes)) = self.closed.pop_front() else { break };
            match std::fs::remove_file(segment_path(&self.dir, index)) {
                Ok(()) => {}
                Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                Err(error) => {
                    self.closed.push_front((index, bytes));
                    return Err(error);
                }
            }
            self.tally.segments_deleted += 1;
            total -= bytes;
        }
        Ok(())
    }

    /// Push written bytes to the operating system and, with `sync`, to the disk.
    pub fn flush(&mut self, sync: bool) -> io::Result<()> {
        if let Some(open) = self.open.as_mut() {
            open.file.flush()?;
            if sync {
                open.file.get_ref().sync_data()?;
            }
        }
        Ok(())
    }
}
