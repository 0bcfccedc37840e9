use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proptest::prelude::*;

use super::format::{FRAME_HEADER_BYTES, SEGMENT_PREAMBLE_BYTES, encode_frame};
use super::segments::{list_segments, segment_path};
use super::*;
use crate::demo::SharedDc;
use crate::node::{CKF_ALLOCATION_CONCURRENCY, NodeConfig, start_node_with_tap};
use crate::pool::PoolConfig;
use crate::publication::HubConfig;
use crate::runtime::{InlineExecutor, ManualWallClock, WallClock};
use kvrelay_core::control::ControlConfig;
use kvrelay_core::discovery::DiscoveryScope;
use kvrelay_core::inputs::{DcInput, KvEventBatch, LoadObservation};
use kvrelay_core::model::hashing::{ExternalBlockHash, LocalBlockHash};
use kvrelay_core::model::identity::{EndpointPath, RelayIdentity, stable_dc_id};
use kvrelay_core::model::kv_events::{
    KvCacheEvent, KvCacheEventData, RemoveData, RouterEvent, StorageTier,
};
use kvrelay_core::model::kv_events::{SourceKey, StoreData, StoredBlock};
use kvrelay_core::rng::{derive_seed, rng_from_seed};
use kvrelay_dc::{Deployment, SimulatedDc, TrafficConfig};

fn endpoint() -> EndpointPath {
    "ns/backend/generate".parse().expect("valid path")
}

fn header() -> JournalHeader {
    JournalHeader {
        kvrelay_version: "test".to_owned(),
        config: "NodeConfig { .. }".to_owned(),
        node: Box::new(node_config()),
        dc_id: 7,
        relay_incarnation: 9,
        rng_seed: 11,
        wall_origin_us: 1_700_000_000_000_000,
        checkpoint_every_inputs: 4,
        checkpoint_interval_ns: 1_000_000_000,
        segment: 0,
    }
}

fn stamp(mono_ms: u64) -> Stamp {
    Stamp { mono_ns: mono_ms * 1_000_000, wall_us: 1_700_000_000_000_000 + mono_ms * 1000 }
}

fn kv_input(sequence: u64, blocks: &[(u64, u64)]) -> DcInput {
    let stored = StoreData {
        parent_hash: None,
        start_position: Some(0),
        blocks: blocks
            .iter()
            .map(|(external, local)| StoredBlock {
                block_hash: ExternalBlockHash(*external),
                tokens_hash: LocalBlockHash(*local),
            })
            .collect(),
    };
    let event = |event_id, data| RouterEvent {
        worker_id: 0x1001,
        storage_tier: StorageTier::Device,
        residency_domain: None,
        event: KvCacheEvent { event_id, dp_rank: 0, data },
    };
    DcInput::KvEvents(KvEventBatch {
        endpoint: endpoint(),
        publisher_id: 0xabc,
        sequence,
        published_at_ms: 5,
        events: vec![
            event(sequence * 2 + 1, KvCacheEventData::Stored(stored)),
            event(
                sequence * 2 + 2,
                KvCacheEventData::Removed(RemoveData {
                    block_hashes: blocks.iter().map(|(e, _)| ExternalBlockHash(*e)).collect(),
                }),
            ),
        ],
    })
}

fn load_input(used: u64) -> DcInput {
    DcInput::Load {
        endpoint: endpoint(),
        observation: LoadObservation {
            source: SourceKey { worker_id: 0x1001, dp_rank: 1 },
            kv_used_blocks: Some(used),
            active_decode_blocks: None,
            active_prefill_tokens: Some(3),
        },
    }
}

fn checkpoint(inputs: u64) -> Checkpoint {
    Checkpoint {
        inputs_handled: inputs,
        catalog_revision: 2,
        catalog: vec!["{\"pool\":1}".to_owned()],
        readiness_revision: 3,
        readiness: vec!["{\"entry\":1}".to_owned()],
        pools: vec![PoolCheckpoint {
            pool: "p".to_owned(),
            layout_generation: 1,
            exact_blocks: inputs,
            canonical_digest: 5,
            filter_digest: 6,
            sequence: 7,
        }],
    }
}

fn generous() -> SegmentLimits {
    SegmentLimits {
        max_segment_bytes: 1 << 30,
        max_segment_age: Duration::from_secs(3600),
        max_total_bytes: 1 << 32,
    }
}

/// A simulated run of `ticks` recorded with nothing lost: its directory, header and records.
async fn recorded_without_loss(ticks: u64) -> (tempfile::TempDir, JournalHeader, Vec<Record>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let stats = record_simulated_run(dir.path(), ticks).await;
    assert_eq!((stats.records_dropped, stats.write_errors), (0, 0));
    let (header, records) = read_ok(dir.path());
    (dir, header, records)
}

/// A journal of `records` under `header`, in a fresh directory (a recording edited by a test).
fn rewritten(
    header: JournalHeader,
    records: impl IntoIterator<Item = Record>,
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut writer = SegmentWriter::create(dir.path(), header, generous()).expect("writer");
    for record in records {
        writer.append(&record).expect("append");
    }
    writer.flush(true).expect("flush");
    dir
}

fn write_all(dir: &Path, records: &[Record], limits: SegmentLimits) -> WriteTallyView {
    let mut writer = SegmentWriter::create(dir, header(), limits).expect("writer");
    for record in records {
        writer.append(record).expect("append");
    }
    writer.flush(true).expect("flush");
    WriteTallyView { deleted: writer.tally().segments_deleted }
}

struct WriteTallyView {
    deleted: u64,
}

fn sample_records() -> Vec<Record> {
    vec![
        Record::Input { at: stamp(1), input: kv_input(0, &[(1, 10), (2, 20)]) },
        Record::Input { at: stamp(2), input: load_input(40) },
        Record::Gap { at: stamp(3), lost: 2 },
        Record::Checkpoint { at: stamp(4), checkpoint: checkpoint(2) },
        Record::Input { at: stamp(5), input: kv_input(1, &[(3, 30)]) },
    ]
}

fn read_ok(dir: &Path) -> (JournalHeader, Vec<Record>) {
    let (header, records, fault) = read_journal(dir).expect("opens");
    assert_eq!(fault, None);
    (header, records)
}

#[test]
fn records_round_trip_through_a_segment() {
    let dir = tempfile::tempdir().expect("tempdir");
    let records = sample_records();
    write_all(dir.path(), &records, generous());
    let (read_header, read) = read_ok(dir.path());
    assert_eq!(read_header, header());
    assert_eq!(read, records);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn any_input_sequence_round_trips(
        batches in proptest::collection::vec(
            (any::<u64>(), proptest::collection::vec((any::<u64>(), any::<u64>()), 0..6), any::<u32>()),
            1..20,
        ),
        segment_bytes in 256u64..4096,
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let records: Vec<Record> = batches
            .iter()
            .enumerate()
            .map(|(index, (sequence, blocks, used))| {
                let input = if index % 3 == 2 {
                    load_input(u64::from(*used))
                } else {
                    kv_input(*sequence / 4, blocks)
                };
                Record::Input { at: stamp(index as u64), input }
            })
            .collect();
        let limits = SegmentLimits { max_segment_bytes: segment_bytes, ..generous() };
        write_all(dir.path(), &records, limits);
        let (_, read) = read_ok(dir.path());
        prop_assert_eq!(read, records);
    }
}

fn big_records(count: u64) -> Vec<Record> {
    (0..count)
        .map(|index| Record::Input {
            at: stamp(index),
            input: kv_input(index, &[(index, index * 3), (index + 1, index * 5)]),
        })
        .collect()
}

#[test]
fn rotation_and_retention_keep_within_their_limits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let records = big_records(400);
    let limits = SegmentLimits {
        max_segment_bytes: 2048,
        max_segment_age: Duration::from_secs(3600),
        max_total_bytes: 8192,
    };
    let tally = write_all(dir.path(), &records, limits);
    let segments = list_segments(dir.path()).expect("list");
    assert!(tally.deleted > 0, "old segments were deleted");
    let sizes: Vec<u64> =
        segments.iter().map(|(_, path)| std::fs::metadata(path).expect("metadata").len()).collect();
    assert!(sizes.iter().all(|size| *size <= limits.max_segment_bytes), "{sizes:?}");
    assert!(sizes.iter().sum::<u64>() <= limits.max_total_bytes, "{sizes:?}");
    assert_eq!(segments.first().map(|(index, _)| *index), Some(tally.deleted));
    // What is left is the newest suffix of what was written, each segment headed.
    let (read_header, read) = read_ok(dir.path());
    assert_eq!(read_header.segment, tally.deleted);
    assert!(!read.is_empty());
    assert_eq!(read.as_slice(), &records[records.len() - read.len()..]);
}

/// Fake earlier recordings under `root`, oldest first: `(start ms, segment sizes)`.
fn fake_recordings(root: &Path, recordings: &[(u64, &[u64])]) -> Vec<PathBuf> {
    let mut segments = Vec::new();
    for (start_ms, sizes) in recordings {
        let dir = recording_dir(root, start_ms * 1000, 0xfeed);
        std::fs::create_dir_all(&dir).expect("recording dir");
        for (index, size) in sizes.iter().enumerate() {
            let path = segment_path(&dir, index as u64);
            std::fs::write(&path, vec![0u8; *size as usize]).expect("fake segment");
            segments.push(path);
        }
    }
    segments
}

/// Bytes of every segment under `root`, in every recording.
fn root_segment_bytes(root: &Path) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir(root).expect("root") {
        let entry = entry.expect("entry");
        let path = entry.path();
        if path.is_dir() && entry.file_name().to_str().is_some_and(is_recording_dir_name) {
            for (_, segment) in list_segments(&path).expect("list") {
                total += std::fs::metadata(segment).expect("metadata").len();
            }
        }
    }
    total
}

#[test]
fn retention_spans_earlier_recordings_and_deletes_the_oldest_first() {
    let root = tempfile::tempdir().expect("tempdir");
    let prior = fake_recordings(
        root.path(),
        &[
            (1_700_000_000_000, &[3000, 3000]),
            (1_700_000_100_000, &[3000, 3000]),
            (1_700_000_200_000, &[3000]),
        ],
    );
    // Not recordings: never counted, never touched.
    std::fs::create_dir_all(root.path().join("notes")).expect("dir");
    std::fs::write(root.path().join("notes").join(segment_path(Path::new(""), 0)), [1u8; 9000])
        .expect("file");
    let newest_prior = prior[4].parent().expect("dir").to_path_buf();
    std::fs::write(newest_prior.join("README"), b"kept").expect("file");

    let limits = SegmentLimits {
        max_segment_bytes: 2048,
        max_segment_age: Duration::from_secs(3600),
        max_total_bytes: 16 * 1024,
    };
    let own = recording_dir(root.path(), 1_700_000_300_000_000, 0xbeef);
    let mut writer = SegmentWriter::create(&own, header(), limits).expect("writer");
    // At start: 15,000 prior bytes leave no room for a 2 KiB segment under 16 KiB, so the
    // oldest recording's first segment goes.
    writer.retain_with_prior_recordings(root.path()).expect("retention");
    assert_eq!(writer.tally().segments_deleted, 1);
    assert!(!prior[0].exists() && prior[1..].iter().all(|path| path.exists()));
    assert_eq!(writer.prior_bytes(), 12_000);

    // While running, rotations delete the rest oldest first, whole recordings before newer ones.
    let records = big_records(400);
    for (written, record) in records.iter().enumerate() {
        writer.append(record).expect("append");
        let kept: Vec<bool> = prior.iter().map(|path| path.exists()).collect();
        // What is left of the earlier recordings is always a newest suffix.
        assert!(kept.windows(2).all(|pair| !pair[0] || pair[1]), "after {written}: {kept:?}");
    }
    writer.flush(true).expect("flush");
    assert!(prior.iter().all(|path| !path.exists()), "every earlier segment was deleted");
    assert!(root_segment_bytes(root.path()) <= limits.max_total_bytes);
    // Emptied recordings are gone; one with another file stays with it; others are untouched.
    assert!(!prior[0].parent().expect("dir").exists());
    assert!(newest_prior.join("README").exists());
    assert!(root.path().join("notes").join(segment_path(Path::new(""), 0)).exists());
    let (_, read) = read_ok(&own);
    assert_eq!(read.as_slice(), &records[records.len() - read.len()..]);
}

#[test]
fn only_recording_directories_share_the_root_budget() {
    let root = Path::new("/records");
    let dir = recording_dir(root, 1_700_000_000_123_456, 0x0123_4567_89ab_cdef);
    assert!(is_recording_dir_name(dir.file_name().and_then(|name| name.to_str()).expect("name")));
    let config = RecorderConfig::new(dir, 1 << 20, Duration::from_secs(60));
    assert_eq!(config.retention_root.as_deref(), Some(root));
    let elsewhere = RecorderConfig::new(root.join("mine"), 1 << 20, Duration::from_secs(60));
    assert_eq!(elsewhere.retention_root, None);
    for name in ["1700000000123-0123456789ABCDEF", "170000000012-0123456789abcdef", "x", ""] {
        assert!(!is_recording_dir_name(name), "{name}");
    }
}

#[test]
fn segments_rotate_by_age_of_their_first_record() {
    let dir = tempfile::tempdir().expect("tempdir");
    let records: Vec<Record> = (0..10)
        .map(|index| Record::Input { at: stamp(index * 400), input: load_input(index) })
        .collect();
    let limits = SegmentLimits { max_segment_age: Duration::from_secs(1), ..generous() };
    write_all(dir.path(), &records, limits);
    // First records at 0, 1200, 2400, 3600 ms: each segment spans less than a second.
    let segments = list_segments(dir.path()).expect("list");
    assert_eq!(segments.len(), 4);
    assert_eq!(read_ok(dir.path()).1, records);
}

#[test]
fn a_directory_holding_a_journal_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_all(dir.path(), &sample_records(), generous());
    let error = SegmentWriter::create(dir.path(), header(), generous()).expect_err("refused");
    assert_eq!(error.kind(), std::io::ErrorKind::AlreadyExists);
}

/// Offsets of every frame of a single-segment journal, header frame first.
fn frame_offsets(records: &[Record]) -> Vec<u64> {
    let mut offsets = vec![SEGMENT_PREAMBLE_BYTES as u64];
    let mut buffer = Vec::new();
    let mut offset = SEGMENT_PREAMBLE_BYTES as u64;
    offset += encode_frame(&Record::Header(header()), &mut buffer).expect("encodes") as u64;
    for record in records {
        offsets.push(offset);
        buffer.clear();
        offset += encode_frame(record, &mut buffer).expect("encodes") as u64;
    }
    offsets.push(offset);
    offsets
}

fn single_segment(dir: &Path) -> std::path::PathBuf {
    let segments = list_segments(dir).expect("list");
    assert_eq!(segments.len(), 1);
    segments[0].1.clone()
}

#[test]
fn a_truncated_journal_names_the_offset_of_the_cut_frame() {
    let dir = tempfile::tempdir().expect("tempdir");
    let records = sample_records();
    write_all(dir.path(), &records, generous());
    let path = single_segment(dir.path());
    let offsets = frame_offsets(&records);
    let end = *offsets.last().expect("end");
    assert_eq!(std::fs::metadata(&path).expect("metadata").len(), end);
    let file = std::fs::OpenOptions::new().write(true).open(&path).expect("open");
    file.set_len(end - 3).expect("truncate");
    let (_, read, fault) = read_journal(dir.path()).expect("opens");
    assert_eq!(read.as_slice(), &records[..records.len() - 1]);
    let fault = fault.expect("fault");
    assert_eq!(fault.file, path);
    assert_eq!(fault.offset, offsets[records.len()]);
    assert!(matches!(fault.kind, JournalErrorKind::Format(FormatErrorAlias::Truncated { .. })));
    assert!(fault.to_string().contains(&format!("byte offset {}", offsets[records.len()])));
}

use super::format::FormatError as FormatErrorAlias;

#[test]
fn a_corrupted_record_stops_the_reader_at_its_offset() {
    let dir = tempfile::tempdir().expect("tempdir");
    let records = sample_records();
    write_all(dir.path(), &records, generous());
    let path = single_segment(dir.path());
    let offsets = frame_offsets(&records);
    let mut bytes = std::fs::read(&path).expect("read");
    // Flip a payload byte of the third record (index 2).
    let target = offsets[3] as usize + FRAME_HEADER_BYTES + 1;
    bytes[target] ^= 0x40;
    std::fs::write(&path, &bytes).expect("write");
    let (_, read, fault) = read_journal(dir.path()).expect("opens");
    assert_eq!(read.as_slice(), &records[..2], "nothing past the corruption");
    let fault = fault.expect("fault");
    assert_eq!((fault.file.clone(), fault.offset), (path, offsets[3]));
    assert!(matches!(fault.kind, JournalErrorKind::Format(FormatErrorAlias::Checksum { .. })));
}

#[test]
fn an_absurd_frame_length_is_refused_before_allocating() {
    let dir = tempfile::tempdir().expect("tempdir");
    let records = sample_records();
    write_all(dir.path(), &records, generous());
    let path = single_segment(dir.path());
    let offsets = frame_offsets(&records);
    let mut bytes = std::fs::read(&path).expect("read");
    let at = offsets[1] as usize;
    bytes[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    std::fs::write(&path, &bytes).expect("write");
    let (_, read, fault) = read_journal(dir.path()).expect("opens");
    assert!(read.is_empty());
    let fault = fault.expect("fault");
    assert_eq!(fault.offset, offsets[1]);
    assert_eq!(
        fault.kind,
        JournalErrorKind::Format(FormatErrorAlias::FrameTooLarge(u64::from(u32::MAX)))
    );
}

#[test]
fn another_format_version_is_refused_at_offset_zero() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_all(dir.path(), &sample_records(), generous());
    let path = single_segment(dir.path());
    let mut bytes = std::fs::read(&path).expect("read");
    bytes[4..6].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
    std::fs::write(&path, &bytes).expect("write");
    let error = JournalReader::open(dir.path()).expect_err("refused");
    assert_eq!((error.file.clone(), error.offset), (path, 0));
    assert_eq!(
        error.kind,
        JournalErrorKind::Format(FormatErrorAlias::Version { found: FORMAT_VERSION + 1 })
    );
}

#[test]
fn publication_points_round_trip() {
    use kvrelay_core::pool::{LeaseRecord, PublicationPoint, PublicationStep, ScriptPosition};
    let dir = tempfile::tempdir().expect("tempdir");
    let position = ScriptPosition { commands: 12, digests: 3, timers: 5 };
    let lease = LeaseRecord(0xabc, 0, 4);
    let steps = [
        PublicationStep::Publish,
        PublicationStep::Barrier(lease),
        PublicationStep::RetireLease(lease),
        PublicationStep::DeliveryFailed(u64::MAX),
    ];
    let mut records = sample_records();
    records.extend(steps.iter().enumerate().map(|(index, step)| Record::Publication {
        at: stamp(6 + index as u64),
        pool: "domain/dc".to_owned(),
        layout_generation: 2,
        point: PublicationPoint { position, step: *step, sequence: index as u64 },
    }));
    write_all(dir.path(), &records, generous());
    let (_, read) = read_ok(dir.path());
    assert_eq!(read, records);
    assert_eq!(read.last().and_then(Record::stamp), Some(stamp(9)));

    // A point of formats 3 to 5 has no timer count: it reads as 0.
    #[derive(serde::Serialize)]
    struct Format5Point {
        position: (u64, u64),
        step: PublicationStep,
        sequence: u64,
    }
    let old =
        Format5Point { position: (12, 3), step: PublicationStep::Barrier(lease), sequence: 7 };
    let decoded: PublicationPoint =
        rmp_serde::from_slice(&rmp_serde::to_vec(&old).expect("encodes")).expect("decodes");
    let position = ScriptPosition { commands: 12, digests: 3, timers: 0 };
    assert_eq!(
        decoded,
        PublicationPoint { position, step: PublicationStep::Barrier(lease), sequence: 7 }
    );
}

#[test]
fn a_version_2_journal_is_refused_with_the_version_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_all(dir.path(), &sample_records(), generous());
    let path = single_segment(dir.path());
    let mut bytes = std::fs::read(&path).expect("read");
    bytes[4..6].copy_from_slice(&2u16.to_le_bytes());
    std::fs::write(&path, &bytes).expect("write");
    let error = JournalReader::open(dir.path()).expect_err("refused");
    assert_eq!(error.offset, 0);
    assert_eq!(error.kind, JournalErrorKind::Format(FormatErrorAlias::Version { found: 2 }));
    let text = error.to_string();
    let expected =
        format!("journal format version 2; this build reads versions 3 to {FORMAT_VERSION}");
    assert!(text.contains(&expected), "{text}");
    let (_, records, fault) = read_journal(dir.path()).map_or_else(
        |error| (None, Vec::new(), Some(error)),
        |(header, records, fault)| (Some(header), records, fault),
    );
    assert!(records.is_empty() && fault.is_some(), "nothing is read past the refusal");
}

#[test]
fn a_missing_middle_segment_is_a_fault() {
    let dir = tempfile::tempdir().expect("tempdir");
    let limits = SegmentLimits { max_segment_bytes: 1024, ..generous() };
    write_all(dir.path(), &big_records(60), limits);
    let segments = list_segments(dir.path()).expect("list");
    assert!(segments.len() >= 3);
    std::fs::remove_file(&segments[1].1).expect("remove");
    let error = JournalReader::open(dir.path()).expect_err("refused");
    assert_eq!(error.kind, JournalErrorKind::MissingSegment { expected: 1 });
}

#[test]
fn checkpoint_schedule_counts_inputs_and_time() {
    let mut schedule = CheckpointSchedule::new(3, Duration::from_secs(1));
    let ms = Duration::from_millis;
    assert!(!schedule.due(ms(10), 1));
    assert!(!schedule.due(ms(20), 2));
    assert!(schedule.due(ms(30), 3), "third input");
    assert!(!schedule.due(ms(2000), 3), "time alone, without an input, is not enough");
    assert!(schedule.due(ms(2000), 4), "interval passed with an input");
    assert!(!schedule.due(ms(2100), 5));
}

#[test]
fn checkpoint_comparison_names_the_differing_entries() {
    let recorded = checkpoint(4);
    let mut replayed = recorded.clone();
    assert_eq!(compare_checkpoints(&recorded, &replayed), None);
    replayed.readiness[0] = "{\"entry\":2}".to_owned();
    replayed.pools[0].filter_digest = 99;
    let diff = compare_checkpoints(&recorded, &replayed).expect("differs");
    let pool = &recorded.pools[0];
    assert_eq!(
        diff.entries,
        [
            "readiness: recorded only {\"entry\":1}".to_owned(),
            "readiness: replayed only {\"entry\":2}".to_owned(),
            format!(
                "pool {} generation {}: filter_digest recorded {} / replayed 99",
                pool.pool, pool.layout_generation, pool.filter_digest
            ),
        ]
    );
}

#[test]
fn a_missing_pool_is_one_entry_not_a_shift_of_the_later_ones() {
    let mut recorded = checkpoint(4);
    recorded.readiness.push("{\"entry\":9}".to_owned());
    let mut second = recorded.pools[0].clone();
    second.pool = "q".to_owned();
    recorded.pools.push(second);
    let mut replayed = recorded.clone();
    let lost_pool = replayed.pools.remove(0);
    let lost_entry = replayed.readiness.remove(0);
    let diff = compare_checkpoints(&recorded, &replayed).expect("differs");
    assert_eq!(
        diff.entries,
        [
            format!("readiness: recorded only {lost_entry}"),
            format!("pools: recorded only {lost_pool:?}")
        ]
    );
}

// ---- recording and replaying a simulated DC --------------------------------------------------

const SEED: u64 = 17;

fn node_config() -> NodeConfig {
    let mut rng = rng_from_seed(derive_seed(SEED, "journal-test/relay"));
    let relay = RelayIdentity::start(0x0070_0000_0000_0001, &mut rng);
    let scope = DiscoveryScope::new(Vec::new(), Vec::new(), true).expect("watch-all is valid");
    let mut control =
        ControlConfig::new(relay, stable_dc_id("journal-dc").expect("valid name"), scope);
    control.expected_unique_blocks = 4096;
    NodeConfig {
        control,
        pool: PoolConfig::default(),
        hub: HubConfig::default(),
        max_kicks: kvrelay_core::filter::ckf::MAX_KICKS_DEFAULT,
        rng_seed: derive_seed(SEED, "journal-test/node"),
        load_window: Duration::from_secs(1),
        input_queue_capacity: 1024,
        load_fanout_capacity: 16,
        input_queue_bytes_max: crate::node::INPUT_QUEUE_BYTES_MAX_DEFAULT,
    }
}

/// Record a simulated DC run: discovery, traffic every 50 ms, a worker restart (fresh
/// incarnations, so recovery queries) and load reports. Returns the recorder's counters.
async fn record_simulated_run(dir: &Path, ticks: u64) -> RecorderStats {
    record_simulated_run_with(dir, ticks, false).await
}

/// A tap that forwards to the recorder's and remembers the pools whose pools started.
#[derive(Debug)]
struct PoolsSeen {
    inner: Arc<dyn NodeTap>,
    pools: Mutex<Vec<kvrelay_core::model::identity::PoolId>>,
}

impl NodeTap for PoolsSeen {
    fn node_started(&self, origin: tokio::time::Instant) {
        self.inner.node_started(origin);
    }

    fn input(&self, at: Duration, input: &DcInput) {
        self.inner.input(at, input);
    }

    fn input_time(&self, inputs_handled: u64) -> Option<Duration> {
        self.inner.input_time(inputs_handled)
    }

    fn timer_plan(&self, inputs_handled: u64) -> crate::journal::TimerPlan {
        self.inner.timer_plan(inputs_handled)
    }

    fn timer_fired(&self, at: Duration, inputs_handled: u64) {
        self.inner.timer_fired(at, inputs_handled);
    }

    fn checkpoint_due(&self, at: Duration, inputs_handled: u64) -> bool {
        self.inner.checkpoint_due(at, inputs_handled)
    }

    fn checkpoint(&self, at: Duration, checkpoint: Checkpoint) {
        self.inner.checkpoint(at, checkpoint);
    }

    fn publication_mode(
        &self,
        pool_id: &kvrelay_core::model::identity::PoolId,
        layout_generation: u64,
    ) -> crate::pool::PublicationMode {
        self.pools.lock().expect("not poisoned").push(*pool_id);
        self.inner.publication_mode(pool_id, layout_generation)
    }

    fn start_timing(
        &self,
        pool_id: &kvrelay_core::model::identity::PoolId,
        layout_generation: u64,
        issued: crate::node::StartPoint,
    ) -> crate::node::StartTiming {
        self.inner.start_timing(pool_id, layout_generation, issued)
    }

    fn pool_started(
        &self,
        at: Duration,
        pool_id: &kvrelay_core::model::identity::PoolId,
        layout_generation: u64,
        point: crate::node::StartPoint,
        started: bool,
    ) {
        self.inner.pool_started(at, pool_id, layout_generation, point, started);
    }
}

/// [`record_simulated_run`], with a WAN subscriber to every pool from tick 3 on when
/// `subscribe` (its lease makes the pools number their publications).
async fn record_simulated_run_with(dir: &Path, ticks: u64, subscribe: bool) -> RecorderStats {
    record_run(dir, ticks, subscribe, None).await
}

/// Holds the node's blocking jobs (here: pool allocations) until the recording run releases
/// them, a few ticks later: each start is applied several inputs after it was issued.
#[derive(Default)]
struct DeferredJobs(Mutex<Vec<Box<dyn FnOnce() + Send + 'static>>>);

impl std::fmt::Debug for DeferredJobs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeferredJobs")
    }
}

impl crate::runtime::BlockingExecutor for DeferredJobs {
    fn spawn(&self, job: Box<dyn FnOnce() + Send + 'static>) {
        self.0.lock().expect("not poisoned").push(job);
    }
}

impl DeferredJobs {
    fn run_all(&self) -> usize {
        let jobs = std::mem::take(&mut *self.0.lock().expect("not poisoned"));
        let count = jobs.len();
        for job in jobs {
            job();
        }
        count
    }
}

/// [`record_simulated_run_with`]; with `deferred`, the node's blocking jobs run only every
/// fourth tick.
async fn record_run(
    dir: &Path,
    ticks: u64,
    subscribe: bool,
    deferred: Option<Arc<DeferredJobs>>,
) -> RecorderStats {
    let clock = Arc::new(ManualWallClock::new(1_700_000_000_000_000));
    let mut recorder_config =
        RecorderConfig::new(dir.to_path_buf(), 64 << 20, Duration::from_secs(60));
    recorder_config.checkpoint_every_inputs = 25;
    recorder_config.checkpoint_interval = Duration::from_millis(500);
    let config = node_config();
    let recorder = start_recorder(
        &recorder_config,
        &config,
        Arc::clone(&clock) as Arc<dyn WallClock>,
        Arc::new(InlineExecutor),
    )
    .expect("recorder starts");
    let mut rng = rng_from_seed(derive_seed(SEED, "journal-test/dc"));
    let dc = SharedDc(Arc::new(Mutex::new(SimulatedDc::start(
        &Deployment::demo(),
        TrafficConfig::default(),
        &mut rng,
    ))));
    let tap = Arc::new(PoolsSeen { inner: recorder.tap(), pools: Mutex::new(Vec::new()) });
    let executor: Arc<dyn crate::runtime::BlockingExecutor> = match &deferred {
        Some(deferred) => Arc::clone(deferred) as _,
        None => Arc::new(InlineExecutor),
    };
    let node = start_node_with_tap(
        config,
        executor,
        Arc::clone(&clock) as Arc<dyn WallClock>,
        recorder.recovery(Arc::new(dc.clone())),
        Some(Arc::clone(&tap) as Arc<dyn NodeTap>),
    )
    .expect("node starts");
    for fact in dc.with(|dc| dc.discovery_facts()) {
        node.inputs.send(fact).await.expect("node runs");
    }
    let mut interval = tokio::time::interval(Duration::from_millis(50));
    let mut subscribers = Vec::new();
    for tick in 1..=ticks {
        interval.tick().await;
        clock.advance_us(50_000);
        if let Some(deferred) = deferred.as_ref().filter(|_| tick % 4 == 0) {
            deferred.run_all();
        }
        if subscribe && tick == 3 {
            let pools = tap.pools.lock().expect("not poisoned").clone();
            for pool in pools {
                let Some(producer) = node.publications.producer(&pool) else { continue };
                let mut stream = node.publications.subscribe(&producer).await.expect("subscribes");
                subscribers.push(crate::runtime::spawn(async move {
                    while stream.next().await.is_ok() {}
                }));
            }
            assert!(!subscribers.is_empty(), "a pool to subscribe to");
        }
        let mut facts = dc.with(|dc| dc.step(6, &mut rng));
        if tick % 10 == 0 {
            facts.extend(dc.with(|dc| dc.load_facts()));
        }
        if tick == ticks / 2 {
            facts.extend(dc.with(|dc| dc.restart_worker(1, &mut rng)));
        }
        for fact in facts {
            node.inputs.send(fact).await.expect("node runs");
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    node.shutdown().await;
    for subscriber in subscribers {
        subscriber.abort();
    }
    recorder.finish().await
}

fn count_records(dir: &Path) -> (usize, usize, usize) {
    let (_, records) = read_ok(dir);
    let inputs = records.iter().filter(|r| matches!(r, Record::Input { .. })).count();
    let recoveries = records.iter().filter(|r| matches!(r, Record::Recovery { .. })).count();
    let checkpoints = records.iter().filter(|r| matches!(r, Record::Checkpoint { .. })).count();
    (inputs, recoveries, checkpoints)
}

#[tokio::test(start_paused = true)]
async fn pool_starts_applied_inputs_after_their_issue_replay_at_their_recorded_points() {
    let dir = tempfile::tempdir().expect("tempdir");
    let stats = record_run(dir.path(), 60, false, Some(Arc::new(DeferredJobs::default()))).await;
    assert_eq!((stats.records_dropped, stats.write_errors), (0, 0));
    let (header, records) = read_ok(dir.path());
    let points: Vec<_> = records
        .iter()
        .filter_map(|record| match record {
            Record::PoolStart { point, started: true, .. } => Some(*point),
            _ => None,
        })
        .collect();
    assert!(points.len() >= 4, "every pool started: {points:?}");
    assert!(
        points.iter().all(|point| point.between_steps),
        "a deferred allocation completes between steps: {points:?}"
    );
    // Replayed with allocations that finish at once, the starts still wait for their points.
    let replay = |dir: PathBuf| async move { replay_whole(&dir).await.expect("replays") };
    let report = replay(dir.path().to_path_buf()).await;
    assert!(report.checkpoints_compared >= 4, "{} compared", report.checkpoints_compared);
    assert_eq!(report.divergence, None);

    // Without its start records the same journal replays the starts nowhere: the replay
    // leaves the recording.
    let kept = records.iter().filter(|record| !matches!(record, Record::PoolStart { .. }));
    let stripped = rewritten(header, kept.cloned());
    let report = replay(stripped.path().to_path_buf()).await;
    assert!(report.divergence.is_some(), "starts never applied change the checkpoints");

    // Marked as format 5 (before timer firings were recorded), the recording is refused with
    // its format named; it is still read.
    let path = single_segment(stripped.path());
    let mut bytes = std::fs::read(&path).expect("read");
    bytes[4..6].copy_from_slice(&5u16.to_le_bytes());
    std::fs::write(&path, &bytes).expect("write");
    let refused = replay_whole(stripped.path()).await.expect_err("refused");
    assert!(matches!(refused, ReplayError::TimersNotRecorded { version: 5 }), "{refused:?}");
    let text = refused.to_string();
    assert!(text.contains("journal format 5") && text.contains("format 6 on"), "{text}");
    let (_, records_read, fault) = read_journal(stripped.path()).expect("a format 5 journal reads");
    let kept = records.iter().filter(|record| !matches!(record, Record::PoolStart { .. }));
    assert_eq!((records_read.len(), fault), (kept.count(), None));
}

/// Replay the whole journal at `path` with the tests' node configuration.
async fn replay_whole(path: &Path) -> Result<ReplayReport, ReplayError> {
    replay_journal(path, node_config(), Arc::new(InlineExecutor), ReplayOptions::default()).await
}

/// `record` with its stamp `by` later (a recording taken off the replay clock's milliseconds).
fn shifted(record: &Record, by: Duration) -> Record {
    let mut record = record.clone();
    if let Some(at) = record.stamp_mut() {
        at.mono_ns += u64::try_from(by.as_nanos()).expect("small");
    }
    record
}

#[tokio::test(start_paused = true)]
async fn a_recording_between_the_replay_clocks_milliseconds_replays_at_its_own_stamps() {
    let (_recording, header, records) = recorded_without_loss(40).await;
    // 0.4 ms later: the replay's paused clock reaches each input only at the next whole
    // millisecond, 0.6 ms after its stamp, and each recorded firing 1.4 ms after it.
    let late =
        rewritten(header, records.iter().map(|record| shifted(record, Duration::from_micros(400))));
    let report = replay_whole(late.path()).await.expect("replays");
    // Every input reaches the core at its recorded stamp, not at the clock's reading (given
    // that instead, the core's time is not the recording's and the first checkpoint differs).
    assert_eq!(report.divergence, None);
    assert!(report.checkpoints_compared >= 2, "{} compared", report.checkpoints_compared);
}

/// A tap that plays timer firings at set input counts (as a replay's does) and notes the input
/// count at each firing the node performs.
#[derive(Debug, Default)]
struct FiringsAt {
    due: Mutex<std::collections::VecDeque<(u64, Duration)>>,
    fired_after: Mutex<Vec<u64>>,
}

impl NodeTap for FiringsAt {
    fn node_started(&self, _origin: tokio::time::Instant) {}

    fn input(&self, _at: Duration, _input: &DcInput) {}

    fn timer_plan(&self, inputs_handled: u64) -> TimerPlan {
        match self.due.lock().expect("not poisoned").front() {
            Some(&(handled, at)) if handled <= inputs_handled => TimerPlan::Recorded(at),
            Some(_) => TimerPlan::AfterInputs,
            None => TimerPlan::OwnFrom(Duration::from_secs(3600)),
        }
    }

    fn timer_fired(&self, _at: Duration, inputs_handled: u64) {
        self.due.lock().expect("not poisoned").pop_front();
        self.fired_after.lock().expect("not poisoned").push(inputs_handled);
    }

    fn checkpoint_due(&self, _at: Duration, _inputs_handled: u64) -> bool {
        false
    }

    fn checkpoint(&self, _at: Duration, _checkpoint: Checkpoint) {}

    fn start_timing(
        &self,
        _pool_id: &kvrelay_core::model::identity::PoolId,
        _layout_generation: u64,
        _issued: crate::node::StartPoint,
    ) -> crate::node::StartTiming {
        crate::node::StartTiming::Free
    }

    fn pool_started(
        &self,
        _at: Duration,
        _pool_id: &kvrelay_core::model::identity::PoolId,
        _layout_generation: u64,
        _point: crate::node::StartPoint,
        _started: bool,
    ) {
    }
}

#[tokio::test(start_paused = true)]
async fn a_played_firing_lands_between_the_same_two_inputs_even_when_they_queue_together() {
    let mut rng = rng_from_seed(derive_seed(SEED, "journal-test/dc"));
    let dc = SimulatedDc::start(&Deployment::demo(), TrafficConfig::default(), &mut rng);
    let facts = dc.discovery_facts();
    assert!(facts.len() >= 4, "{} facts", facts.len());
    let tap = Arc::new(FiringsAt::default());
    tap.due.lock().expect("not poisoned").extend([(1, Duration::ZERO), (2, Duration::ZERO)]);
    let node = start_node_with_tap(
        node_config(),
        Arc::new(InlineExecutor),
        Arc::new(ManualWallClock::new(1_700_000_000_000_000)),
        Arc::new(crate::node::NoRecovery),
        Some(Arc::clone(&tap) as Arc<dyn NodeTap>),
    )
    .expect("node starts");
    // Every fact is queued before the node runs, so it could take them all in one batch.
    let sent = facts.len() as u64;
    for fact in facts {
        node.inputs.send(fact).await.expect("node runs");
    }
    let mut status = node.status.clone();
    let handled = status.wait_for(|status| status.inputs_handled == sent);
    tokio::time::timeout(Duration::from_secs(5), handled).await.expect("handled").expect("runs");
    // Each firing ends the batch after the input it follows, as the recording had it.
    assert_eq!(*tap.fired_after.lock().expect("not poisoned"), [1, 2]);
    node.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn the_node_keeps_taking_inputs_while_pool_filters_allocate() {
    let mut rng = rng_from_seed(derive_seed(SEED, "journal-test/dc"));
    let mut dc = SimulatedDc::start(&Deployment::demo(), TrafficConfig::default(), &mut rng);
    let deferred = Arc::new(DeferredJobs::default());
    let node = crate::node::start_node(
        node_config(),
        Arc::clone(&deferred) as Arc<dyn crate::runtime::BlockingExecutor>,
        Arc::new(ManualWallClock::new(1_700_000_000_000_000)),
        Arc::new(crate::node::NoRecovery),
    )
    .expect("node starts");
    let mut sent = 0u64;
    let mut facts = dc.discovery_facts();
    for _ in 0..5 {
        facts.extend(dc.step(6, &mut rng));
    }
    for fact in facts {
        node.inputs.send(fact).await.expect("node runs");
        sent += 1;
    }
    let mut status = node.status.clone();
    let wait = Duration::from_secs(5);
    let taken = tokio::time::timeout(wait, status.wait_for(|s| s.inputs_handled == sent))
        .await
        .map(|seen| seen.map(|seen| seen.clone()));
    let Ok(Ok(before)) = taken else {
        panic!("every input is handled while the allocations wait");
    };
    assert!(before.pools_starting >= 4, "the pools are starting: {before:?}");
    assert_eq!(before.active_pools, 0, "none is cataloged before its filter exists");

    // At most the concurrency bound allocates at once; each finished job launches the next.
    let mut released = 0;
    while released < before.pools_starting {
        let batch = deferred.run_all();
        assert_eq!(batch, CKF_ALLOCATION_CONCURRENCY.min(before.pools_starting - released));
        released += batch;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let started = tokio::time::timeout(
        wait,
        status.wait_for(|s| s.active_pools == before.pools_starting && s.pools_starting == 0),
    )
    .await
    .is_ok();
    assert!(started, "the finished allocations start their pools: {:?}", status.borrow());
    node.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn the_replay_fires_the_timers_where_the_journal_does_and_not_on_its_own_clock() {
    let (dir, header, records) = recorded_without_loss(40).await;
    let replay = |dir: PathBuf| async move { replay_whole(&dir).await.expect("replays") };
    assert_eq!(replay(dir.path().to_path_buf()).await.divergence, None);
    let is_timer = |record: &&Record| matches!(record, Record::Timer { .. });
    assert!(records.iter().filter(is_timer).count() > 10, "firings recorded");
    // Without its firings the journal still drives the node's time: no timer fires before
    // the window's end, the pools keep their writes unpublished, and the replay leaves the
    // recording at its first checkpoint.
    let stripped = rewritten(header, records.iter().filter(|record| !is_timer(record)).cloned());
    let divergence = replay(stripped.path().to_path_buf()).await.divergence.expect("diverges");
    assert_eq!(divergence.index, 0, "{divergence:?}");
}

#[tokio::test(start_paused = true)]
async fn a_recorded_simulated_run_replays_every_checkpoint_twice_identically() {
    let dir = tempfile::tempdir().expect("tempdir");
    let stats = record_simulated_run(dir.path(), 80).await;
    assert_eq!((stats.records_dropped, stats.write_errors), (0, 0));
    // The default byte budget holds an ordinary run, and every record's bytes came back.
    assert_eq!((stats.records_dropped_queue_bytes, stats.queue_bytes), (0, 0));
    let (inputs, recoveries, checkpoints) = count_records(dir.path());
    assert!(inputs > 100, "{inputs} inputs recorded");
    assert!(recoveries > 0, "recovery answers recorded");
    assert!(checkpoints >= 4, "{checkpoints} checkpoints recorded");
    let (_, records) = read_ok(dir.path());
    let publications = records.iter().filter(|r| matches!(r, Record::Publication { .. })).count();
    let timers = records.iter().filter(|r| matches!(r, Record::Timer { .. })).count();
    assert!(timers > 0, "the node's timer firings are recorded");
    let starts = records.iter().filter(|r| matches!(r, Record::PoolStart { .. })).count();
    assert!(starts >= 4, "every pool start is recorded ({starts})");
    assert_eq!(
        stats.records_written as usize,
        inputs + recoveries + checkpoints + publications + timers + starts
    );

    let first = replay_whole(dir.path()).await.expect("replays");
    assert_eq!(first.divergence, None);
    assert_eq!(first.inputs_replayed as usize, inputs);
    assert_eq!(first.checkpoints_compared, checkpoints);
    assert_eq!(first.checkpoints.len(), checkpoints);
    let last = first.checkpoints.last().expect("checkpoints").1.clone();
    assert!(!last.catalog.is_empty() && !last.readiness.is_empty());
    assert!(last.pools.iter().any(|pool| pool.exact_blocks > 0), "{:?}", last.pools);

    let second = replay_whole(dir.path()).await.expect("replays");
    assert_eq!(second, first);
}

/// With a WAN subscriber in the recording (and none in the replay), the pools' published
/// sequences are reproduced from the recorded publication points.
#[tokio::test(start_paused = true)]
async fn a_recorded_subscriber_s_sequences_replay_without_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let stats = record_simulated_run_with(dir.path(), 40, true).await;
    assert_eq!(stats.records_dropped, 0);
    let (_, records) = read_ok(dir.path());
    let barriers = records
        .iter()
        .filter(|r| {
            matches!(r, Record::Publication { point, .. }
                if matches!(point.step, kvrelay_core::pool::PublicationStep::Barrier(_)))
        })
        .count();
    assert!(barriers > 0, "the subscriber's barriers are recorded");
    let report = replay_whole(dir.path()).await.expect("replays");
    assert_eq!(report.divergence, None);
    assert!(report.checkpoints_compared >= 3);
    let numbered = report
        .checkpoints
        .iter()
        .flat_map(|(_, checkpoint)| &checkpoint.pools)
        .filter(|pool| pool.sequence > 0)
        .count();
    assert!(numbered > 0, "the recorded lease numbered publications: {:?}", report.checkpoints);
}

#[tokio::test(start_paused = true)]
async fn a_replay_missing_an_input_reports_where_it_diverged() {
    let dir = tempfile::tempdir().expect("tempdir");
    record_simulated_run(dir.path(), 40).await;
    let (read_header, records) = read_ok(dir.path());
    // Rewrite the journal without one KV event batch from the middle of the run.
    let victim = records
        .iter()
        .enumerate()
        .filter(|(_, record)| matches!(record, Record::Input { input: DcInput::KvEvents(_), .. }))
        .map(|(index, _)| index)
        .nth(60)
        .expect("enough batches");
    let dropped_at = records[victim].stamp().expect("stamped").mono();
    let kept = records.iter().enumerate().filter(|(index, _)| *index != victim);
    let tampered = rewritten(read_header, kept.map(|(_, record)| record.clone()));
    let report = replay_whole(tampered.path()).await.expect("replays");
    let divergence = report.divergence.expect("diverges");
    let at = divergence.recorded_at.expect("a recorded checkpoint");
    assert!(at >= dropped_at, "diverges at {at:?}, after the dropped input at {dropped_at:?}");
    assert!(!divergence.diff.entries.is_empty());
}

#[tokio::test(start_paused = true)]
async fn replay_until_stops_early_and_dumps_the_state_there() {
    let dir = tempfile::tempdir().expect("tempdir");
    record_simulated_run(dir.path(), 40).await;
    let until = Duration::from_millis(1000);
    let report = replay_journal(
        dir.path(),
        node_config(),
        Arc::new(InlineExecutor),
        ReplayOptions { until: Some(until), own_clock: false },
    )
    .await
    .expect("replays");
    assert_eq!(report.divergence, None);
    assert!(report.checkpoints.iter().all(|(at, _)| *at <= until));
    let (at, state) = report.final_state.expect("final state");
    assert!(at <= until);
    assert_eq!(state.inputs_handled, report.inputs_replayed);
}

#[tokio::test(start_paused = true)]
async fn a_replay_with_another_configuration_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    record_simulated_run(dir.path(), 4).await;
    let mut config = node_config();
    config.rng_seed ^= 1;
    let error =
        replay_journal(dir.path(), config, Arc::new(InlineExecutor), ReplayOptions::default())
            .await
            .expect_err("refused");
    assert!(matches!(error, ReplayError::ConfigMismatch { .. }));
}

#[tokio::test(start_paused = true)]
async fn a_failing_disk_degrades_recording_without_stopping_the_node() {
    let dir = tempfile::tempdir().expect("tempdir");
    let journal = dir.path().join("journal");
    let clock: Arc<dyn WallClock> = Arc::new(ManualWallClock::new(1));
    let config = RecorderConfig::new(journal.clone(), 1 << 20, Duration::from_secs(60));
    let recorder = start_recorder(&config, &node_config(), clock, Arc::new(InlineExecutor))
        .expect("recorder starts");
    let tap = recorder.tap();
    tap.node_started(tokio::time::Instant::now());
    // The directory disappears before the first segment is opened: every write fails.
    std::fs::remove_dir_all(&journal).expect("remove");
    for index in 0..10 {
        tap.input(Duration::from_millis(index), &load_input(index));
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(recorder::BATCH_DELAY * 2).await;
    let degraded = recorder.stats();
    assert!(degraded.write_errors > 0);
    assert_eq!(degraded.records_written, 0);
    assert_eq!(degraded.records_dropped, 10);
    // The disk comes back: recording resumes, the loss recorded as a gap first.
    std::fs::create_dir_all(&journal).expect("recreate");
    tap.input(Duration::from_millis(20), &load_input(20));
    let stats = recorder.finish().await;
    assert_eq!(stats.records_written, 2);
    let (_, records) = read_ok(&journal);
    assert_eq!(records[0], Record::Gap { at: records[1].stamp().expect("stamped"), lost: 10 });
    assert!(matches!(&records[1], Record::Input { input, .. } if *input == load_input(20)));
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_drops_and_counts_instead_of_waiting() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock: Arc<dyn WallClock> = Arc::new(ManualWallClock::new(1));
    let mut config = RecorderConfig::new(dir.path().join("j"), 1 << 20, Duration::from_secs(60));
    config.queue_capacity = 4;
    let recorder = start_recorder(&config, &node_config(), clock, Arc::new(InlineExecutor))
        .expect("recorder starts");
    let tap = recorder.tap();
    // No await between the calls: the writer task cannot run, the queue fills.
    for index in 0..10 {
        tap.input(Duration::from_millis(index), &load_input(index));
    }
    let stats = recorder.finish().await;
    assert_eq!((stats.records_queued, stats.records_dropped), (4, 6));
    let (_, records) = read_ok(&dir.path().join("j"));
    assert_eq!(records.len(), 5);
    assert!(records[..4].iter().all(|record| matches!(record, Record::Input { .. })));
    // The six losses came after the fourth record: the gap says so at the end.
    assert_eq!(records[4], Record::Gap { at: records[3].stamp().expect("stamped"), lost: 6 });
}

#[test]
fn records_are_weighed_by_what_they_hold() {
    assert_eq!(
        RecorderConfig::new(PathBuf::from("j"), 1 << 20, Duration::from_secs(60)).queue_bytes_max,
        QUEUE_BYTES_MAX_DEFAULT
    );
    let light = record_weight_bytes(&Record::Input { at: stamp(0), input: load_input(0) });
    let blocks: Vec<(u64, u64)> = (0..1 << 16).map(|block| (block, block + 1)).collect();
    let heavy = kv_input(1, &blocks);
    let heavy_bytes = record_weight_bytes(&Record::Input { at: stamp(0), input: heavy.clone() });
    // Stored and removed: 2^16 blocks each, 16 and 8 bytes a block.
    assert!(heavy_bytes >= (1 << 16) * 24, "{heavy_bytes}");
    assert_eq!(heavy_bytes - light, heavy.weight_bytes() - load_input(0).weight_bytes());

    let small =
        record_weight_bytes(&Record::Checkpoint { at: stamp(0), checkpoint: checkpoint(1) });
    let mut large = checkpoint(1);
    large.catalog.push("x".repeat(1 << 20));
    let large = record_weight_bytes(&Record::Checkpoint { at: stamp(0), checkpoint: large });
    assert!(large >= small + (1 << 20), "{small} {large}");

    let DcInput::KvEvents(batch) = heavy else { unreachable!("kv_input makes KV events") };
    let dump = Record::Recovery {
        at: stamp(0),
        target: recovery_target(),
        request: recovery_request(),
        outcome: Ok(kvrelay_core::sources::RecoveryResponse::TreeDump {
            events: batch.events,
            last_event_id: 2,
            reset_scope: kvrelay_core::sources::TreeDumpScope::Rank,
        }),
    };
    assert!(record_weight_bytes(&dump) >= (1 << 16) * 24);
}

#[tokio::test(start_paused = true)]
async fn heavy_records_past_the_byte_budget_are_dropped_counted_and_marked_as_a_gap() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock: Arc<dyn WallClock> = Arc::new(ManualWallClock::new(1));
    let blocks: Vec<(u64, u64)> = (0..4096).map(|block| (block, block + 1)).collect();
    let heavy = |sequence| kv_input(sequence, &blocks);
    let weigh = |input: DcInput| record_weight_bytes(&Record::Input { at: stamp(0), input });
    let heavy_bytes = weigh(heavy(0));
    assert!(heavy_bytes > 100 * weigh(load_input(0)), "{heavy_bytes}");
    let mut config = RecorderConfig::new(dir.path().join("j"), 64 << 20, Duration::from_secs(60));
    config.queue_bytes_max = 2 * heavy_bytes;
    let recorder = start_recorder(&config, &node_config(), clock, Arc::new(InlineExecutor))
        .expect("recorder starts");
    let tap = recorder.tap();
    tap.node_started(tokio::time::Instant::now());
    // No await between the calls: the writer task cannot run, the byte budget fills long before
    // the 8192 records of the item bound.
    tap.input(Duration::from_millis(0), &heavy(0));
    tap.input(Duration::from_millis(1), &heavy(1));
    assert_eq!(recorder.stats().queue_bytes, 2 * heavy_bytes as u64);
    tap.input(Duration::from_millis(2), &heavy(2));
    // A full budget has no room for even a light record.
    tap.input(Duration::from_millis(3), &load_input(3));
    let full = recorder.stats();
    assert_eq!(
        (full.records_queued, full.records_dropped, full.records_dropped_queue_bytes),
        (2, 2, 2)
    );
    assert_eq!(full.queue_bytes, 2 * heavy_bytes as u64, "drops hold no bytes");

    // The writer catches up: the written records' bytes are released.
    tokio::time::sleep(recorder::BATCH_DELAY * 2).await;
    let caught_up = recorder.stats();
    assert_eq!((caught_up.records_written, caught_up.queue_bytes), (2, 0));
    // Light and heavy records are accepted again.
    tap.input(Duration::from_millis(4), &load_input(4));
    tap.input(Duration::from_millis(5), &heavy(5));
    let stats = recorder.finish().await;
    assert_eq!(
        (stats.records_queued, stats.records_dropped, stats.records_dropped_queue_bytes),
        (4, 2, 2)
    );
    assert_eq!(stats.queue_bytes, 0);

    let (_, records) = read_ok(&dir.path().join("j"));
    let input_of = |record: &Record| match record {
        Record::Input { input, .. } => Some(input.clone()),
        _ => None,
    };
    assert_eq!(records.len(), 5, "{records:?}");
    assert_eq!(input_of(&records[0]), Some(heavy(0)));
    assert_eq!(input_of(&records[1]), Some(heavy(1)));
    // The two drops came between the second and the third record written: a replay knows.
    assert_eq!(records[2], Record::Gap { at: records[3].stamp().expect("stamped"), lost: 2 });
    assert_eq!(input_of(&records[3]), Some(load_input(4)));
    assert_eq!(input_of(&records[4]), Some(heavy(5)));
}

#[test]
fn each_start_records_into_its_own_directory() {
    let root = Path::new("/var/kvrelay");
    assert_eq!(
        recording_dir(root, 1_700_000_123_456_789, 0xab),
        root.join("1700000123456-00000000000000ab")
    );
}

#[tokio::test(start_paused = true)]
async fn a_journal_whose_start_was_deleted_is_not_replayed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let limits = SegmentLimits {
        max_segment_bytes: 2048,
        max_segment_age: Duration::from_secs(3600),
        max_total_bytes: 8192,
    };
    let tally = write_all(dir.path(), &big_records(200), limits);
    assert!(tally.deleted > 0);
    let error = replay_whole(dir.path()).await.expect_err("refused");
    assert!(
        matches!(error, ReplayError::StartMissing { first_segment } if first_segment == tally.deleted)
    );
}

#[test]
fn a_windows_checkpoints_compare_what_a_fresh_node_can_reproduce() {
    let recorded = checkpoint(12);
    let mut replayed = recorded.clone();
    replayed.catalog_revision += 3;
    replayed.readiness_revision += 5;
    replayed.pools[0].filter_digest ^= 1;
    replayed.pools[0].sequence = 1;
    assert!(compare_checkpoints(&recorded, &replayed).is_some());
    assert_eq!(compare_checkpoints(&recorded.window_view(), &replayed.window_view()), None);
    for change in [
        |c: &mut Checkpoint| c.pools[0].exact_blocks += 1,
        |c: &mut Checkpoint| c.pools[0].canonical_digest ^= 1,
        |c: &mut Checkpoint| c.inputs_handled += 1,
        |c: &mut Checkpoint| c.readiness.push("{}".into()),
    ] {
        let mut wrong = replayed.clone();
        change(&mut wrong);
        assert!(compare_checkpoints(&recorded.window_view(), &wrong.window_view()).is_some());
    }
    let mut window = header();
    assert!(!window.is_window());
    window.checkpoint_every_inputs = NO_CADENCE;
    assert!(!window.is_window(), "both cadence fields mark a window");
    window.checkpoint_interval_ns = NO_CADENCE;
    assert!(window.is_window());
}

/// Segment file operations that fail on cue: write number `n` (from 0) fails when `n` is in
/// `fail_writes` or `fail_every` divides `n + 1`, after writing `torn` bytes of its buffer (a
/// torn frame, as a full disk leaves); cutting a file back fails while `fail_cut`.
#[derive(Debug, Clone, Default)]
struct FailingIo(Arc<Mutex<FailPlan>>);

#[derive(Debug, Default)]
struct FailPlan {
    writes: u64,
    fail_writes: std::collections::BTreeSet<u64>,
    fail_every: u64,
    torn: usize,
    fail_cut: bool,
    failures: u64,
}

impl FailingIo {
    /// Write number `number` fails after writing `torn` bytes of its buffer.
    fn failing_write(number: u64, torn: usize) -> Self {
        let io = FailingIo::default();
        io.plan().fail_writes.insert(number);
        io.plan().torn = torn;
        io
    }

    fn plan(&self) -> std::sync::MutexGuard<'_, FailPlan> {
        self.0.lock().expect("not poisoned")
    }
}

impl segments::SegmentIo for FailingIo {
    fn write_all(&mut self, file: &mut std::fs::File, bytes: &[u8]) -> std::io::Result<()> {
        use std::io::Write;
        let mut plan = self.plan();
        let number = plan.writes;
        plan.writes += 1;
        let fails = plan.fail_writes.contains(&number)
            || (plan.fail_every > 0 && (number + 1).is_multiple_of(plan.fail_every));
        if fails {
            plan.failures += 1;
            file.write_all(&bytes[..plan.torn.min(bytes.len())])?;
            return Err(std::io::Error::other("injected write failure"));
        }
        file.write_all(bytes)
    }

    fn set_len(&mut self, file: &std::fs::File, len: u64) -> std::io::Result<()> {
        if self.plan().fail_cut {
            return Err(std::io::Error::other("injected cut failure"));
        }
        file.set_len(len)
    }
}

/// A writer on `dir` whose write number `number` fails after `torn` bytes, and its plan.
fn failing_writer(dir: &Path, number: u64, torn: usize) -> (FailingIo, SegmentWriter) {
    let io = FailingIo::failing_write(number, torn);
    let writer = SegmentWriter::create_with_io(dir, header(), generous(), Box::new(io.clone()))
        .expect("writer");
    (io, writer)
}

fn segment_sizes(dir: &Path) -> Vec<u64> {
    list_segments(dir)
        .expect("list")
        .iter()
        .map(|(_, path)| std::fs::metadata(path).expect("metadata").len())
        .collect()
}

#[test]
fn a_write_failing_mid_segment_is_cut_back_to_its_last_whole_frame() {
    let dir = tempfile::tempdir().expect("tempdir");
    let records = big_records(6);
    let (_, mut writer) = failing_writer(dir.path(), 1, 37);
    for record in &records[..3] {
        writer.append(record).expect("append");
    }
    writer.flush(false).expect("the first write succeeds");
    let on_disk = writer.tally().bytes;
    for record in &records[3..5] {
        writer.append(record).expect("buffered");
    }
    writer.flush(false).expect_err("the second write fails");
    let tally = writer.tally();
    assert_eq!((tally.records, tally.records_lost, tally.segments_failed), (3, 2, 1));
    // The 37 torn bytes are gone: segment 0 holds exactly what the first write wrote.
    assert_eq!(segment_sizes(dir.path()), vec![on_disk]);
    writer.append(&Record::Gap { at: stamp(5), lost: 2 }).expect("append");
    writer.append(&records[5]).expect("append");
    writer.flush(true).expect("flush");
    assert_eq!(segment_sizes(dir.path()).len(), 2, "the next segment is a new file");
    let (read_header, read) = read_ok(dir.path());
    assert_eq!(read_header.segment, 0);
    let mut expected = records[..3].to_vec();
    expected.push(Record::Gap { at: stamp(5), lost: 2 });
    expected.push(records[5].clone());
    assert_eq!(read, expected);
}

#[test]
fn a_failed_first_write_deletes_the_segment_and_reuses_its_number() {
    let dir = tempfile::tempdir().expect("tempdir");
    let records = big_records(3);
    let (_, mut writer) = failing_writer(dir.path(), 0, 5);
    writer.append(&records[0]).expect("buffered");
    writer.flush(false).expect_err("the first write fails");
    assert_eq!(segment_sizes(dir.path()), Vec::<u64>::new(), "nothing whole was left");
    writer.append(&records[1]).expect("append");
    writer.flush(true).expect("flush");
    assert_eq!(list_segments(dir.path()).expect("list")[0].0, 0);
    assert_eq!(read_ok(dir.path()).1, records[1..2]);
}

#[test]
fn a_torn_tail_that_could_not_be_cut_is_stepped_over_only_before_a_gap() {
    for gap_follows in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        let records = big_records(4);
        let (io, mut writer) = failing_writer(dir.path(), 1, 20);
        io.plan().fail_cut = true;
        writer.append(&records[0]).expect("append");
        writer.flush(false).expect("flush");
        let whole = writer.tally().bytes;
        writer.append(&records[1]).expect("buffered");
        writer.flush(false).expect_err("fails");
        // Kept at its on-disk size, torn frame included.
        assert_eq!(segment_sizes(dir.path()), vec![whole + 20]);
        let gap = Record::Gap { at: stamp(2), lost: 1 };
        if gap_follows {
            writer.append(&gap).expect("append");
        }
        writer.append(&records[2]).expect("append");
        writer.flush(true).expect("flush");
        let (_, read, fault) = read_journal(dir.path()).expect("opens");
        if gap_follows {
            assert_eq!(fault, None);
            assert_eq!(read, vec![records[0].clone(), gap, records[2].clone()]);
        } else {
            let fault = fault.expect("a torn tail not followed by a gap is a fault");
            assert_eq!(fault.offset, whole);
            assert_eq!(fault.file, segments::segment_path(dir.path(), 0));
            assert!(matches!(
                fault.kind,
                JournalErrorKind::Format(format::FormatError::Truncated { .. })
            ));
            assert_eq!(read, records[..1]);
        }
    }
}

fn start_failing_recorder(dir: &Path, max_total_bytes: u64, io: &FailingIo) -> Recorder {
    let clock: Arc<dyn WallClock> = Arc::new(ManualWallClock::new(1_700_000_000_000_000));
    let config = RecorderConfig::new(dir.to_path_buf(), max_total_bytes, Duration::from_secs(60));
    recorder::start_recorder_with_io(
        &config,
        &node_config(),
        clock,
        Arc::new(InlineExecutor),
        Box::new(io.clone()),
    )
    .expect("recorder starts")
}

fn sequence_of(record: &Record) -> Option<u64> {
    match record {
        Record::Input { input: DcInput::KvEvents(batch), .. } => Some(batch.sequence),
        _ => None,
    }
}

#[tokio::test(start_paused = true)]
async fn a_write_failure_mid_segment_leaves_a_replayable_journal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let journal = dir.path().join("journal");
    let io = FailingIo::failing_write(1, 50);
    let recorder = start_failing_recorder(&journal, 1 << 20, &io);
    let tap = recorder.tap();
    tap.node_started(tokio::time::Instant::now());
    // One batch per round: the second round's write fails half-way through its first frame.
    let mut sequence = 0;
    for (round, count) in [5, 4, 3].into_iter().enumerate() {
        for _ in 0..count {
            tap.input(Duration::from_millis(sequence), &kv_input(sequence, &[(sequence, 1)]));
            sequence += 1;
        }
        tokio::time::sleep(recorder::BATCH_DELAY * 2).await;
        let stats = recorder.stats();
        assert_eq!(stats.write_errors, u64::from(round >= 1), "after round {round}");
    }
    let stats = recorder.finish().await;
    assert_eq!(io.plan().failures, 1);
    assert_eq!((stats.write_errors, stats.records_dropped, stats.records_written), (1, 4, 9));
    let (_, records) = read_ok(&journal);
    let sequences: Vec<Option<u64>> = records.iter().map(sequence_of).collect();
    assert_eq!(
        sequences,
        [0, 1, 2, 3, 4]
            .map(Some)
            .into_iter()
            .chain([None])
            .chain([9, 10, 11].map(Some))
            .collect::<Vec<_>>()
    );
    assert_eq!(records[5], Record::Gap { at: records[6].stamp().expect("stamped"), lost: 4 });
    // The gap opens the segment written after the failure.
    let (second_header, second) = read_ok(&segments::segment_path(&journal, 1));
    assert_eq!(second_header.segment, 1);
    assert_eq!(second.first(), Some(&records[5]));
}

#[tokio::test(start_paused = true)]
async fn repeated_write_failures_keep_the_journal_within_bounds_and_readable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let journal = dir.path().join("journal");
    let max_total_bytes = 64 * 1024;
    let io = FailingIo::default();
    io.plan().fail_every = 4;
    io.plan().torn = 100;
    let recorder = start_failing_recorder(&journal, max_total_bytes, &io);
    let tap = recorder.tap();
    tap.node_started(tokio::time::Instant::now());
    let mut sequence = 0;
    for round in 0..60u64 {
        // Every third round the writer cannot cut a torn frame off either.
        io.plan().fail_cut = round % 3 == 2;
        for _ in 0..12 {
            let blocks = [(sequence, sequence * 3), (sequence + 1, sequence * 5)];
            tap.input(Duration::from_millis(sequence), &kv_input(sequence, &blocks));
            sequence += 1;
        }
        tokio::time::sleep(recorder::BATCH_DELAY * 2).await;
        let total: u64 = segment_sizes(&journal).iter().sum();
        assert!(total <= max_total_bytes, "round {round}: {total} bytes on disk");
    }
    let stats = recorder.finish().await;
    let failures = io.plan().failures;
    assert!(failures >= 10, "{failures} injected failures");
    assert_eq!(stats.write_errors, failures);
    assert!(stats.records_dropped > 0 && stats.segments_deleted > 0, "{stats:?}");
    // What is left reads without a fault, and every hole in the sequence is a gap of its size.
    let (_, records) = read_ok(&journal);
    let mut last: Option<u64> = None;
    let mut pending_gap = 0;
    for record in &records {
        match record {
            Record::Gap { lost, .. } => pending_gap += lost,
            record => {
                let sequence = sequence_of(record).expect("an input");
                if let Some(last) = last {
                    assert_eq!(sequence - last - 1, pending_gap, "before sequence {sequence}");
                }
                last = Some(sequence);
                pending_gap = 0;
            }
        }
    }
    assert!(records.iter().any(|record| matches!(record, Record::Gap { .. })));
    let torn = list_segments(&journal)
        .expect("list")
        .iter()
        .filter(|(_, path)| read_journal(path).expect("opens").2.is_some())
        .count();
    assert!(torn > 0, "a torn tail the writer could not cut was read past");
    let written_last = last.expect("inputs survive");
    assert_eq!(written_last + 1 + pending_gap, sequence, "losses at the end are a final gap");
}

fn recovery_target() -> kvrelay_core::inputs::RecoveryTarget {
    kvrelay_core::inputs::RecoveryTarget {
        endpoint: "ns/backend/worker_kv_query_source_1".parse().unwrap(),
        instance_id: 7,
        transport: kvrelay_core::inputs::RequestPlaneTransport::Tcp(
            "127.0.0.1:9/ns/backend/worker_kv_query_source_1".into(),
        ),
    }
}

fn recovery_request() -> kvrelay_core::sources::RecoveryRequest {
    kvrelay_core::sources::RecoveryRequest::tree_dump(SourceKey { worker_id: 1, dp_rank: 0 })
}

#[test]
fn every_recovery_failure_kind_round_trips() {
    use kvrelay_core::sources::RecoveryFailure;
    let failures = [
        RecoveryFailure::NoTransport,
        RecoveryFailure::TimedOut,
        RecoveryFailure::Unreachable("connection refused".into()),
        RecoveryFailure::Refused("Server unavailable: unknown endpoint a/b/c".into()),
        RecoveryFailure::InvalidAnswer("response stream exceeds 8 bytes".into()),
        RecoveryFailure::NotSent("too many pending recovery queries".into()),
    ];
    let records: Vec<Record> = failures
        .into_iter()
        .enumerate()
        .map(|(index, failure)| Record::Recovery {
            at: stamp(index as u64 + 1),
            target: recovery_target(),
            request: recovery_request(),
            outcome: Err(failure),
        })
        .collect();
    let dir = tempfile::tempdir().expect("tempdir");
    write_all(dir.path(), &records, generous());
    assert_eq!(read_ok(dir.path()).1, records);
}

#[test]
fn a_format_3_recovery_failure_text_reads_as_unreachable() {
    /// The record enum as format 3 wrote it, up to its `Recovery` variant.
    #[derive(serde::Serialize)]
    #[allow(dead_code, clippy::large_enum_variant, reason = "only the Recovery variant is written")]
    enum Format3 {
        Header(()),
        Input(()),
        Recovery {
            at: Stamp,
            target: kvrelay_core::inputs::RecoveryTarget,
            request: kvrelay_core::sources::RecoveryRequest,
            outcome: Result<kvrelay_core::sources::RecoveryResponse, String>,
        },
    }
    let written = Format3::Recovery {
        at: stamp(3),
        target: recovery_target(),
        request: recovery_request(),
        outcome: Err("request plane timed out".into()),
    };
    let payload = rmp_serde::to_vec(&written).unwrap();
    let record = super::format::decode_payload(&payload, xxhash_rust::xxh3::xxh3_64(&payload))
        .expect("a format 3 record decodes");
    assert_eq!(
        record,
        Record::Recovery {
            at: stamp(3),
            target: recovery_target(),
            request: recovery_request(),
            outcome: Err(kvrelay_core::sources::RecoveryFailure::Unreachable(
                "request plane timed out".into()
            )),
        }
    );
    let mut preamble = [0u8; SEGMENT_PREAMBLE_BYTES];
    preamble[..4].copy_from_slice(&super::format::SEGMENT_MAGIC);
    for (version, accepted) in
        [(2u16, false), (3, true), (4, true), (FORMAT_VERSION, true), (FORMAT_VERSION + 1, false)]
    {
        preamble[4..6].copy_from_slice(&version.to_le_bytes());
        assert_eq!(super::format::check_preamble(&preamble).is_ok(), accepted, "version {version}");
    }
}
