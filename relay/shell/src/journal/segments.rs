//! Segment files: naming, rotation by size and age, retention by total size, and what a write
//! failure leaves.
//!
//! Segments are `journal-<n>.kvj` with `n` zero-padded to 8 digits, numbered from 0 in one
//! directory. A segment is closed once appending would pass the size limit or its first record
//! is older than the age limit (by the records' monotonic stamps); the next one starts with a
//! repeat of the header. After a rotation the oldest closed segments are deleted until the
//! directory's total fits the total limit (the open segment is never deleted).
//!
//! Frames gather in a buffer and reach the file in whole-buffer writes, so the bytes a segment
//! holds after every successful write are whole frames. A failed write (or sync) closes the
//! segment at once: the file is cut back to its last whole frame and counted by retention like
//! any closed segment; a segment that never had a successful write is deleted and its number
//! reused, so numbers stay consecutive. If the cut fails too, the segment is kept at its
//! on-disk size with a torn last frame; the reader steps over such a tail only when the next
//! segment starts with a [`Record::Gap`] (docs/journal.md, "Write failures").
//!
//! Retention can also span a whole record root ([`SegmentWriter::retain_with_prior_recordings`]):
//! the segments of earlier recordings in sibling directories (named like
//! [`recording_dir`](super::recording_dir) names them) count against the same total, and are
//! deleted before any of this recording's, oldest recording first, at start and at every
//! rotation; a recording directory left empty is removed. Nothing else under the root is
//! touched.
//!
//! This is synchronous file I/O; the recorder runs it through the blocking-executor seam. The
//! file operations go through [`SegmentIo`], so a test can make them fail.

use std::collections::VecDeque;
use std::fmt::Debug;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::format::{
    JournalHeader, Record, SEGMENT_PREAMBLE_BYTES, Stamp, encode_frame, segment_preamble,
};

/// Bytes buffered before a write reaches the file.
pub const WRITE_BUFFER_BYTES: usize = 64 * 1024;

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
    /// Records written to a segment file.
    pub records: u64,
    /// Bytes written to segment files (frames and preambles; a failed write's part is not
    /// counted, it is cut off again).
    pub bytes: u64,
    /// Records [`SegmentWriter::append`] accepted that a failed write then lost, gap markers
    /// left out.
    pub records_lost: u64,
    /// The losses that lost gap markers reported (the sum of their `lost`).
    pub gap_losses_lost: u64,
    /// Segments opened.
    pub segments_opened: u64,
    /// Segments closed early by a failed write or sync.
    pub segments_failed: u64,
    /// Segments deleted by retention.
    pub segments_deleted: u64,
}

/// The file operations of a [`SegmentWriter`]. The provided methods are the file system's
/// ([`FileSystem`]); a test overrides some to fail on cue.
pub trait SegmentIo: Send + Debug + 'static {
    /// Create `path` empty for writing (the writer owns its directory: a leftover file of its
    /// own under that name is replaced).
    fn create(&mut self, path: &Path) -> io::Result<File> {
        OpenOptions::new().write(true).create(true).truncate(true).open(path)
    }

    /// Write all of `bytes` at the end of `file`.
    fn write_all(&mut self, file: &mut File, bytes: &[u8]) -> io::Result<()> {
        file.write_all(bytes)
    }

    /// Cut `file` to `len` bytes.
    fn set_len(&mut self, file: &File, len: u64) -> io::Result<()> {
        file.set_len(len)
    }

    /// Push `file`'s data to the disk.
    fn sync(&mut self, file: &File) -> io::Result<()> {
        file.sync_data()
    }

    /// Delete `path`.
    fn remove(&mut self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
}

/// The file system, as it is.
#[derive(Debug, Clone, Copy, Default)]
pub struct FileSystem;

impl SegmentIo for FileSystem {}

#[derive(Debug)]
struct OpenSegment {
    index: u64,
    file: File,
    /// Bytes in the file: whole frames, every write so far having succeeded.
    written: u64,
    /// Frames (and, before the first write, the preamble and header) not written yet.
    pending: Vec<u8>,
    /// Records in `pending`, gap markers included.
    pending_records: u64,
    /// Gap markers in `pending`.
    pending_gaps: u64,
    /// The sum of those gap markers' `lost`.
    pending_gap_losses: u64,
    first_at: Option<Duration>,
}

impl OpenSegment {
    fn bytes(&self) -> u64 {
        self.written + self.pending.len() as u64
    }
}

/// A segment of an earlier recording, counted by retention.
#[derive(Debug)]
struct PriorSegment {
    path: PathBuf,
    bytes: u64,
    last_of_recording: bool,
}

/// Appends records to numbered segments in one directory.
#[derive(Debug)]
pub struct SegmentWriter {
    dir: PathBuf,
    header: JournalHeader,
    limits: SegmentLimits,
    io: Box<dyn SegmentIo>,
    open: Option<OpenSegment>,
    closed: VecDeque<(u64, u64)>,
    /// Segments of earlier recordings under the same root, oldest recording first, each with
    /// its size and whether it is its recording's last segment here.
    prior: VecDeque<PriorSegment>,
    next_index: u64,
    buffer: Vec<u8>,
    tally: WriteTally,
}

impl SegmentWriter {
    /// A writer for `dir` (created if missing). Refuses a directory that already holds
    /// segments: one directory holds one recording.
    pub fn create(dir: &Path, header: JournalHeader, limits: SegmentLimits) -> io::Result<Self> {
        SegmentWriter::create_with_io(dir, header, limits, Box::new(FileSystem))
    }

    /// [`SegmentWriter::create`], with the file operations of `io`.
    pub fn create_with_io(
        dir: &Path,
        header: JournalHeader,
        limits: SegmentLimits,
        io: Box<dyn SegmentIo>,
    ) -> io::Result<Self> {
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
            io,
            open: None,
            closed: VecDeque::new(),
            prior: VecDeque::new(),
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

    /// Append `record`, rotating first if a limit says so; it reaches the file with the next
    /// full buffer, rotation or [`SegmentWriter::flush`]. A record that cannot be encoded is an
    /// `InvalidData` error and changes nothing. On an I/O error the record is not taken, the
    /// open segment is closed as the module doc says (the records it still buffered are counted
    /// in [`WriteTally::records_lost`]), and the next append starts a new segment.
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
        let buffered = self.open.as_ref().map_or(0, |open| open.pending.len() as u64);
        if buffered + frame > WRITE_BUFFER_BYTES as u64 {
            self.write_pending()?;
        }
        let Some(open) = self.open.as_mut() else {
            return Err(io::Error::other("no open segment"));
        };
        open.pending.extend_from_slice(&self.buffer);
        open.pending_records += 1;
        if let Record::Gap { lost, .. } = record {
            open.pending_gaps += 1;
            open.pending_gap_losses += lost;
        }
        if open.first_at.is_none() {
            open.first_at = at;
        }
        Ok(())
    }

    fn rotation_due(&self, frame: u64, at: Option<Duration>) -> bool {
        let Some(open) = &self.open else { return false };
        let has_records = open.first_at.is_some();
        let too_big = open.bytes() + frame > self.limits.max_segment_bytes;
        let too_old = match (open.first_at, at) {
            (Some(first), Some(at)) => at.saturating_sub(first) >= self.limits.max_segment_age,
            _ => false,
        };
        has_records && (too_big || too_old)
    }

    /// Open the next segment, its preamble and header buffered. The number is taken only once
    /// the file exists.
    fn open_next(&mut self) -> io::Result<()> {
        let index = self.next_index;
        let mut header = self.header.clone();
        header.segment = index;
        let mut pending = segment_preamble().to_vec();
        encode_frame(&Record::Header(header), &mut pending)
            .map_err(|error| io::Error::new(io::ErrorKind::InvalidData, error))?;
        debug_assert!(pending.len() > SEGMENT_PREAMBLE_BYTES);
        let file = self.io.create(&segment_path(&self.dir, index))?;
        self.next_index += 1;
        self.tally.segments_opened += 1;
        self.open = Some(OpenSegment {
            index,
            file,
            written: 0,
            pending,
            pending_records: 0,
            pending_gaps: 0,
            pending_gap_losses: 0,
            first_at: None,
        });
        Ok(())
    }

    /// Write the open segment's buffer; on failure close the segment as failed.
    fn write_pending(&mut self) -> io::Result<()> {
        let Some(open) = self.open.as_mut() else { return Ok(()) };
        if open.pending.is_empty() {
            return Ok(());
        }
        if let Err(error) = self.io.write_all(&mut open.file, &open.pending) {
            self.fail_open();
            return Err(error);
        }
        let bytes = open.pending.len() as u64;
        open.written += bytes;
        open.pending.clear();
        // A record larger than the buffer does not keep its size allocated.
        open.pending.shrink_to(WRITE_BUFFER_BYTES);
        self.tally.records += open.pending_records;
        self.tally.bytes += bytes;
        open.pending_records = 0;
        open.pending_gaps = 0;
        open.pending_gap_losses = 0;
        Ok(())
    }

    /// Close the open segment after a failed write or sync: its buffer is lost, the file cut
    /// back to its whole frames and kept as a closed segment, or deleted (its number reused)
    /// when it holds none. Retention runs; its own failure waits for the next rotation.
    fn fail_open(&mut self) {
        let Some(open) = self.open.take() else { return };
        self.tally.segments_failed += 1;
        self.tally.records_lost += open.pending_records - open.pending_gaps;
        self.tally.gap_losses_lost += open.pending_gap_losses;
        let path = segment_path(&self.dir, open.index);
        if open.written == 0 {
            drop(open.file);
            // A leftover is replaced when the number is used again.
            let _ = self.io.remove(&path);
            self.next_index = open.index;
        } else {
            let size = match self.io.set_len(&open.file, open.written) {
                Ok(()) => open.written,
                Err(_) => open.file.metadata().map_or(open.bytes(), |metadata| metadata.len()),
            };
            self.closed.push_back((open.index, size));
        }
        let _ = self.enforce_total();
    }

    fn close_open(&mut self) -> io::Result<()> {
        self.write_pending()?;
        if let Some(open) = self.open.take() {
            self.closed.push_back((open.index, open.written));
        }
        self.enforce_total()
    }

    fn enforce_total(&mut self) -> io::Result<()> {
        let open_bytes = self.open.as_ref().map_or(0, OpenSegment::bytes);
        let prior_bytes = self.prior.iter().map(|segment| segment.bytes).sum::<u64>();
        let mut total: u64 =
            self.closed.iter().map(|(_, bytes)| bytes).sum::<u64>() + open_bytes + prior_bytes;
        // Leave room for the segment about to open.
        let budget = self.limits.max_total_bytes.saturating_sub(self.limits.max_segment_bytes);
        while total > budget {
            let Some(segment) = self.prior.pop_front() else { break };
            match self.io.remove(&segment.path) {
                Ok(()) => {}
                Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                Err(error) => {
                    self.prior.push_front(segment);
                    return Err(error);
                }
            }
            self.tally.segments_deleted += 1;
            total -= segment.bytes;
            if segment.last_of_recording
                && let Some(dir) = segment.path.parent()
            {
                // Only an empty directory goes (anything else in it stays, and so does it).
                let _ = std::fs::remove_dir(dir);
            }
        }
        while total > budget {
            let Some((index, bytes)) = self.closed.pop_front() else { break };
            match self.io.remove(&segment_path(&self.dir, index)) {
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

    /// Count the segments of the earlier recordings under `root` (every other subdirectory named
    /// like a recording, in name order, which is start-time order) against this writer's total,
    /// and delete the oldest of them at once until the total fits (see the module doc). Call it
    /// before the first append; this writer's own directory is skipped.
    pub fn retain_with_prior_recordings(&mut self, root: &Path) -> io::Result<()> {
        let mut recordings = Vec::new();
        for entry in std::fs::read_dir(root)? {
            let entry = entry?;
            let path = entry.path();
            let is_recording =
                entry.file_name().to_str().is_some_and(super::recorder::is_recording_dir_name);
            if is_recording && entry.file_type()?.is_dir() && path != self.dir {
                recordings.push(path);
            }
        }
        recordings.sort();
        let mut prior = VecDeque::new();
        for recording in recordings {
            let segments = list_segments(&recording)?;
            let count = segments.len();
            for (position, (_, path)) in segments.into_iter().enumerate() {
                let bytes = std::fs::metadata(&path)?.len();
                prior.push_back(PriorSegment {
                    path,
                    bytes,
                    last_of_recording: position + 1 == count,
                });
            }
        }
        self.prior = prior;
        self.enforce_total()
    }

    /// Bytes of earlier recordings still counted against the total.
    #[must_use]
    pub fn prior_bytes(&self) -> u64 {
        self.prior.iter().map(|segment| segment.bytes).sum()
    }

    /// Write the buffered frames and, with `sync`, push them to the disk. A failure closes
    /// the segment as [`SegmentWriter::append`]'s does.
    pub fn flush(&mut self, sync: bool) -> io::Result<()> {
        self.write_pending()?;
        if sync
            && let Some(open) = self.open.as_ref()
            && let Err(error) = self.io.sync(&open.file)
        {
            self.fail_open();
            return Err(error);
        }
        Ok(())
    }
}

impl Drop for SegmentWriter {
    /// Buffered frames are written (errors ignored: flush first to see them).
    fn drop(&mut self) {
        let _ = self.write_pending();
    }
}
