//! Reading a journal back: records in order across segments, stopping at the first fault.
//!
//! Every fault is a [`JournalError`] naming the file and the byte offset of the frame (or
//! preamble) that is wrong; the reader returns nothing past it. One exception is not a fault:
//! a last frame cut short by the end of a segment followed by a segment that starts with a
//! [`Record::Gap`], which is what a failed write leaves when cutting the frame off failed too
//! (see [`segments`](super::segments)); the reader goes on with the gap. Frame lengths are checked
//! against [`RECORD_BYTES_MAX`](super::format::RECORD_BYTES_MAX) and the bytes left in the file
//! before anything is allocated.

use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::{Path, PathBuf};

use thiserror::Error;

use super::format::{
    FRAME_HEADER_BYTES, FormatError, JournalHeader, Record, SEGMENT_PREAMBLE_BYTES, check_preamble,
    decode_payload, parse_frame_header,
};
use super::segments::{list_segments, segment_index};

/// What went wrong, where.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{}: byte offset {offset}: {kind}", file.display())]
pub struct JournalError {
    /// The segment file (or the directory, for directory-level faults).
    pub file: PathBuf,
    /// Offset of the faulty preamble or frame in `file`.
    pub offset: u64,
    /// The fault.
    pub kind: JournalErrorKind,
}

/// The kinds of journal faults.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum JournalErrorKind {
    /// The bytes are wrong.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// The file system failed.
    #[error("i/o: {0}")]
    Io(String),
    /// The directory holds no segment.
    #[error("no journal segment found")]
    Empty,
    /// Segment numbers are not consecutive (one is missing in the middle).
    #[error("segment {expected} is missing")]
    MissingSegment {
        /// The number that should have come next.
        expected: u64,
    },
    /// A segment's header disagrees with the first segment's (another recording).
    #[error("header differs from the first segment's (a different recording)")]
    HeaderMismatch,
}

#[derive(Debug)]
struct OpenFile {
    path: PathBuf,
    reader: BufReader<File>,
    offset: u64,
    len: u64,
}

/// Iterates a journal's records (headers excluded) across its segments.
#[derive(Debug)]
pub struct JournalReader {
    segments: std::vec::IntoIter<(u64, PathBuf)>,
    header: JournalHeader,
    format_version: u16,
    current: Option<OpenFile>,
    failed: bool,
}

fn io_error(file: &Path, offset: u64, error: &io::Error) -> JournalError {
    JournalError { file: file.to_path_buf(), offset, kind: JournalErrorKind::Io(error.to_string()) }
}

impl JournalReader {
    /// Open a journal directory, or a single segment file. Reads the first segment's header.
    pub fn open(path: &Path) -> Result<Self, JournalError> {
        let segments = if path.is_dir() {
            list_segments(path).map_err(|error| io_error(path, 0, &error))?
        } else {
            let name = path.file_name().and_then(|name| name.to_str()).unwrap_or_default();
            vec![(segment_index(name).unwrap_or(0), path.to_path_buf())]
        };
        let Some((first_index, first_path)) = segments.first().cloned() else {
            return Err(JournalError {
                file: path.to_path_buf(),
                offset: 0,
                kind: JournalErrorKind::Empty,
            });
        };
        for (position, (index, segment)) in segments.iter().enumerate() {
            let expected = first_index + position as u64;
            if *index != expected {
                return Err(JournalError {
                    file: segment.clone(),
                    offset: 0,
                    kind: JournalErrorKind::MissingSegment { expected },
                });
            }
        }
        let (file, header, format_version) = open_segment(&first_path)?;
        Ok(JournalReader {
            segments: segments.into_iter().skip(1).collect::<Vec<_>>().into_iter(),
            header,
            format_version,
            current: Some(file),
            failed: false,
        })
    }

    /// The first segment's header.
    #[must_use]
    pub fn header(&self) -> &JournalHeader {
        &self.header
    }

    /// The first segment's format version.
    #[must_use]
    pub fn format_version(&self) -> u16 {
        self.format_version
    }

    /// Every record left, up to the first fault, and the fault if there was one.
    #[must_use]
    pub fn read_all(mut self) -> (Vec<Record>, Option<JournalError>) {
        let mut records = Vec::new();
        let mut fault = None;
        for record in self.by_ref() {
            match record {
                Ok(record) => records.push(record),
                Err(error) => fault = Some(error),
            }
        }
        (records, fault)
    }

    fn next_record(&mut self) -> Result<Option<Record>, JournalError> {
        loop {
            if let Some(file) = self.current.as_mut() {
                match read_frame(file) {
                    Ok(Some(record)) => {
                        if matches!(record, Record::Header(_)) {
                            return Err(JournalError {
                                file: file.path.clone(),
                                offset: file.offset,
                                kind: FormatError::Structure("header record after the first frame")
                                    .into(),
                            });
                        }
                        return Ok(Some(record));
                    }
                    Ok(None) => self.current = None,
                    Err(fault) => return self.past_torn_tail(fault).map(Some),
                }
            }
            let Some((_, path)) = self.segments.next() else { return Ok(None) };
            self.current = Some(self.open_next(&path)?);
        }
    }

    /// Open the next segment and check its header against the first one's.
    fn open_next(&self, path: &Path) -> Result<OpenFile, JournalError> {
        let (file, header, _) = open_segment(path)?;
        let mut expected = self.header.clone();
        expected.segment = header.segment;
        if header != expected {
            return Err(JournalError {
                file: path.to_path_buf(),
                offset: SEGMENT_PREAMBLE_BYTES as u64,
                kind: JournalErrorKind::HeaderMismatch,
            });
        }
        Ok(file)
    }

    /// After `fault` in the current segment: a frame cut short by the end of a segment that is
    /// not the last, when the next segment's first record is a gap, is the torn tail a failed
    /// write left (the writer could not cut it off); the reader goes on with that gap.
    /// Anything else is the fault.
    fn past_torn_tail(&mut self, fault: JournalError) -> Result<Record, JournalError> {
        let torn = matches!(fault.kind, JournalErrorKind::Format(FormatError::Truncated { .. }));
        let Some((_, path)) = self.segments.as_slice().first().filter(|_| torn).cloned() else {
            return Err(fault);
        };
        let Ok(mut file) = self.open_next(&path) else { return Err(fault) };
        match read_frame(&mut file) {
            Ok(Some(gap @ Record::Gap { .. })) => {
                self.segments.next();
                self.current = Some(file);
                Ok(gap)
            }
            _ => Err(fault),
        }
    }
}

impl Iterator for JournalReader {
    type Item = Result<Record, JournalError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        match self.next_record() {
            Ok(record) => record.map(Ok),
            Err(error) => {
                self.failed = true;
                Some(Err(error))
            }
        }
    }
}

/// Read every record of the journal at `path`: the header, the records before the first fault,
/// and the fault if there was one.
pub fn read_journal(
    path: &Path,
) -> Result<(JournalHeader, Vec<Record>, Option<JournalError>), JournalError> {
    let reader = JournalReader::open(path)?;
    let header = reader.header().clone();
    let (records, fault) = reader.read_all();
    Ok((header, records, fault))
}

fn open_segment(path: &Path) -> Result<(OpenFile, JournalHeader, u16), JournalError> {
    let file = File::open(path).map_err(|error| io_error(path, 0, &error))?;
    let len = file.metadata().map_err(|error| io_error(path, 0, &error))?.len();
    let mut reader = BufReader::new(file);
    let mut preamble = Vec::with_capacity(SEGMENT_PREAMBLE_BYTES);
    (&mut reader)
        .take(SEGMENT_PREAMBLE_BYTES as u64)
        .read_to_end(&mut preamble)
        .map_err(|error| io_error(path, 0, &error))?;
    let format_version = check_preamble(&preamble).map_err(|kind| JournalError {
        file: path.to_path_buf(),
        offset: 0,
        kind: kind.into(),
    })?;
    let mut file =
        OpenFile { path: path.to_path_buf(), reader, offset: SEGMENT_PREAMBLE_BYTES as u64, len };
    let header = match read_frame(&mut file)? {
        Some(Record::Header(header)) => header,
        _ => {
            return Err(JournalError {
                file: path.to_path_buf(),
                offset: SEGMENT_PREAMBLE_BYTES as u64,
                kind: FormatError::Structure("segment does not start with a header record").into(),
            });
        }
    };
    Ok((file, header, format_version))
}

/// Read one frame; `None` at a clean end of file.
fn read_frame(file: &mut OpenFile) -> Result<Option<Record>, JournalError> {
    let offset = file.offset;
    let fault =
        |kind: FormatError| JournalError { file: file.path.clone(), offset, kind: kind.into() };
    let available = file.len.saturating_sub(offset);
    if available == 0 {
        return Ok(None);
    }
    if available < FRAME_HEADER_BYTES as u64 {
        return Err(fault(FormatError::Truncated { needed: FRAME_HEADER_BYTES as u64, available }));
    }
    let mut header = [0u8; FRAME_HEADER_BYTES];
    file.reader.read_exact(&mut header).map_err(|error| io_error(&file.path, offset, &error))?;
    let (len, checksum) = parse_frame_header(&header).map_err(fault)?;
    let needed = (FRAME_HEADER_BYTES + len) as u64;
    if available < needed {
        return Err(fault(FormatError::Truncated { needed, available }));
    }
    let mut payload = vec![0u8; len];
    file.reader.read_exact(&mut payload).map_err(|error| io_error(&file.path, offset, &error))?;
    let record = decode_payload(&payload, checksum).map_err(fault)?;
    file.offset += needed;
    Ok(Some(record))
}
