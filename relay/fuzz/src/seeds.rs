//! Write the seed corpora under `corpus/<target>/` from the relay's own encoders and the
//! Dynamo-shaped samples of its tests. Run from `relay/fuzz`:
//! `cargo run --bin seeds` (the JSON samples come from `scripts/fuzz-seeds.py`).

use std::path::Path;
use std::time::Duration;

use kvrelay_core::filter::cbi1::FrameEncoder;
use kvrelay_core::filter::ckf::BucketImage;
use kvrelay_core::control::ControlConfig;
use kvrelay_core::discovery::DiscoveryScope;
use kvrelay::event_plane::{encode_command, encode_greeting, encode_message_frame, encode_ready};
use kvrelay_core::model::hashing::{ExternalBlockHash, LocalBlockHash};
use kvrelay_core::model::identity::{EndpointPath, RelayIdentity, stable_dc_id};
use kvrelay_core::inputs::{
    DcInput, EventEnvelope, KV_EVENTS_TOPIC, KV_METRICS_TOPIC, KvEventBatch, LoadObservation,
    encode_active_load, encode_event_envelope, encode_kv_events_payload, encode_zmq_event_frame,
};
use kvrelay::journal::format::{encode_frame, segment_preamble};
use kvrelay::journal::{JournalHeader, Record, Stamp};
use kvrelay_core::model::kv_events::{
    KvCacheEvent, KvCacheEventData, RemoveData, RouterEvent, SourceKey, StorageTier, StoreData,
    StoredBlock,
};
use kvrelay::node::NodeConfig;
use kvrelay::pool::PoolConfig;
use kvrelay::publication::HubConfig;
use kvrelay::request_plane::PayloadCodec;
use kvrelay::request_plane::answer::answer_stream;
use kvrelay::request_plane::frame::encode_two_part;
use kvrelay_core::rng::{derive_seed, rng_from_seed};
use kvrelay_core::sources::{RecoveryResponse, TreeDumpScope};
use kvrelay_fuzz::{DC_ID, FORMATS};
use kvrelay_proto::v1 as proto;
use prost::Message;

fn write(target: &str, name: &str, bytes: &[u8]) {
    let dir = Path::new("corpus").join(target);
    std::fs::create_dir_all(&dir).expect("corpus dir");
    std::fs::write(dir.join(name), bytes).expect("seed written");
}

fn with_selector(selector: u8, bytes: &[u8]) -> Vec<u8> {
    let mut out = vec![selector];
    out.extend_from_slice(bytes);
    out
}

fn events() -> Vec<RouterEvent> {
    let event = |event_id, data| RouterEvent {
        worker_id: 13_864_542_646_465_346_627,
        storage_tier: StorageTier::Device,
        residency_domain: None,
        event: KvCacheEvent { event_id, dp_rank: 0, data },
    };
    vec![
        event(
            1,
            KvCacheEventData::Stored(StoreData {
                parent_hash: None,
                start_position: Some(0),
                blocks: vec![StoredBlock {
                    block_hash: ExternalBlockHash(0x48db_ac25_2265_b1f5),
                    tokens_hash: LocalBlockHash(0xea06_fc71_a5ee_6e88),
                }],
            }),
        ),
        event(
            2,
            KvCacheEventData::Removed(RemoveData {
                block_hashes: vec![ExternalBlockHash(0x48db_ac25_2265_b1f5)],
            }),
        ),
        event(3, KvCacheEventData::Cleared),
    ]
}

fn endpoint() -> EndpointPath {
    EndpointPath::new("dynamo", "backend", "generate").expect("valid path")
}

fn cbi1() {
    for (index, format) in FORMATS.iter().enumerate().take(2) {
        let encoder = FrameEncoder::new(*format, DC_ID).expect("valid format");
        let words: Vec<u64> =
            (0..format.bucket_count).map(|bucket| bucket.wrapping_mul(0x9e37_79b9)).collect();
        let chunks = encoder.encode_snapshot(5, &words).expect("snapshot");
        let images = [BucketImage { bucket: 0, word: 3 }, BucketImage { bucket: 1, word: 0 }];
        let delta = encoder.encode_delta(5, 6, &images).expect("delta");
        let selector = 0x80 | index as u8;
        write("cbi1_decode", &format!("chunk-{index}"), &with_selector(selector, &chunks[0]));
        write("cbi1_decode", &format!("delta-{index}"), &with_selector(selector, &delta));
        write("cbi1_replica", &format!("delta-{index}"), &delta);
    }
}

fn envelopes() -> (Vec<u8>, Vec<u8>) {
    let payload = encode_kv_events_payload(&events()).expect("payload");
    let publisher_id = 7_327_664_155_944_878;
    let kv = encode_event_envelope(&EventEnvelope {
        publisher_id,
        sequence: 0,
        published_at_ms: 1_796_040_159_861,
        topic: KV_EVENTS_TOPIC,
        payload: &payload,
    })
    .expect("envelope");
    let observation = LoadObservation {
        source: SourceKey { worker_id: 4, dp_rank: 0 },
        kv_used_blocks: Some(9),
        active_decode_blocks: Some(2),
        active_prefill_tokens: None,
    };
    let load = encode_active_load(&observation).expect("load");
    let metrics = encode_event_envelope(&EventEnvelope {
        publisher_id: publisher_id + 1,
        sequence: 7,
        published_at_ms: 1,
        topic: KV_METRICS_TOPIC,
        payload: &load,
    })
    .expect("envelope");
    write("event_envelope", "kv-events-nats", &with_selector(0, &kv));
    write("event_envelope", "kv-metrics-nats", &with_selector(0, &metrics));
    let frame = encode_zmq_event_frame(&kv).expect("frame");
    write("event_envelope", "kv-events-zmq-frame", &with_selector(1, &frame));
    write("event_envelope", "kv-events-payload", &with_selector(2, &payload));
    let mut message = vec![3, KV_EVENTS_TOPIC.len() as u8, 8, 8];
    message.extend_from_slice(KV_EVENTS_TOPIC.as_bytes());
    message.extend_from_slice(&publisher_id.to_be_bytes());
    message.extend_from_slice(&0u64.to_be_bytes());
    message.extend_from_slice(&frame);
    write("event_envelope", "kv-events-zmq-message", &message);
    (kv, frame)
}

fn zmtp(frame: &[u8]) {
    let mut stream = vec![0];
    stream.extend_from_slice(&encode_greeting());
    stream.extend(encode_ready(b"PUB"));
    stream.extend(encode_command(b"PING", &[0, 10, b'c']));
    for sequence in 0..2u64 {
        stream.extend(encode_message_frame(KV_EVENTS_TOPIC.as_bytes(), true));
        stream.extend(encode_message_frame(&7_327_664_155_944_878u64.to_be_bytes(), true));
        stream.extend(encode_message_frame(&sequence.to_be_bytes(), true));
        stream.extend(encode_message_frame(frame, false));
    }
    write("zmtp", "pub-3.1-two-messages", &stream);
    let mut legacy = stream.clone();
    legacy[1 + 11] = 0;
    legacy[0] = 63;
    write("zmtp", "pub-3.0-chunked", &legacy);
}

fn request_plane() {
    let responses = [
        RecoveryResponse::Events { events: events(), last_event_id: 3 },
        RecoveryResponse::TreeDump {
            events: events()[..1].to_vec(),
            last_event_id: 9,
            reset_scope: TreeDumpScope::Rank,
        },
    ];
    let handshake = br#"{"subject":"kvrelay-recovery-1","stream_type":"response"}"#;
    for (index, response) in responses.iter().enumerate() {
        for (codec, selector) in [(PayloadCodec::MsgPack, 0u8), (PayloadCodec::Json, 1u8)] {
            let mut stream = vec![selector | if index == 0 { 2 } else { 0 }];
            stream.extend(encode_two_part(handshake, b""));
            for message in answer_stream(codec, response).expect("answer") {
                stream.extend(encode_two_part(&message.header, &message.body));
            }
            write("request_plane", &format!("answer-{index}-{selector}"), &stream);
        }
    }
}

fn sources_file() {
    let files: [&[u8]; 3] = [
        br#"{"version":1,"sources":[{"namespace":"dynamo"},{"namespace":"loras"}]}"#,
        br#"{"version":1,"connectionRevision":"rev-1","sources":[]}"#,
        br#"{"version":1,"sources":[{"namespace":"a\u00e9b"}]}"#,
    ];
    for (index, file) in files.iter().enumerate() {
        write("sources_file", &format!("file-{index}"), file);
    }
}

fn wire() {
    let marker = kvrelay_proto::CONTRACT_MARKER;
    let protocol_version = kvrelay_proto::PROTOCOL_VERSION;
    let seeds: Vec<(u8, Vec<u8>)> = vec![
        (0, proto::RelayInfoRequest { contract_marker: marker }.encode_to_vec()),
        (
            1,
            proto::WatchKvPoolCatalogRequest {
                contract_marker: marker,
                subscriber_id: "consumer-1".to_owned(),
            }
            .encode_to_vec(),
        ),
        (
            4,
            proto::SubscribeKvPoolRequest {
                contract_marker: marker,
                subscriber_id: "consumer-1".to_owned(),
                expected_producer: Some(proto::ProducerIdentity::default()),
            }
            .encode_to_vec(),
        ),
        (
            6,
            proto::KvPoolCatalogUpdate {
                contract_marker: marker,
                protocol_version,
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        (
            9,
            proto::FilterUpdate { contract_marker: marker, protocol_version, ..Default::default() }
                .encode_to_vec(),
        ),
    ];
    for (selector, bytes) in seeds {
        write("wire_validate", &format!("message-{selector}"), &with_selector(selector, &bytes));
    }
}

fn journal() {
    let mut rng = rng_from_seed(derive_seed(1, "fuzz-seeds/relay"));
    let relay = RelayIdentity::start(0x0070_0000_0000_0001, &mut rng);
    let scope = DiscoveryScope::new(Vec::new(), Vec::new(), true).expect("watch-all");
    let mut control = ControlConfig::new(relay, stable_dc_id("fuzz-dc").expect("name"), scope);
    control.expected_unique_blocks = 4096;
    let node = NodeConfig {
        control,
        pool: PoolConfig::default(),
        hub: HubConfig::default(),
        max_kicks: kvrelay_core::filter::ckf::MAX_KICKS_DEFAULT,
        rng_seed: 3,
        load_window: Duration::from_secs(1),
        input_queue_capacity: 1024,
        load_fanout_capacity: 16,
        input_queue_bytes_max: kvrelay::node::INPUT_QUEUE_BYTES_MAX_DEFAULT,
    };
    let header = JournalHeader {
        kvrelay_version: "fuzz".to_owned(),
        config: "NodeConfig { .. }".to_owned(),
        node: Box::new(node),
        dc_id: 7,
        relay_incarnation: 9,
        rng_seed: 11,
        wall_origin_us: 1_700_000_000_000_000,
        checkpoint_every_inputs: 4,
        checkpoint_interval_ns: 1_000_000_000,
        segment: 0,
    };
    let at = Stamp { mono_ns: 5_000_000, wall_us: 1_700_000_000_005_000 };
    let records = [
        Record::Header(header),
        Record::Input {
            at,
            input: DcInput::KvEvents(KvEventBatch {
                endpoint: endpoint(),
                publisher_id: 0xabc,
                sequence: 1,
                published_at_ms: 5,
                events: events(),
            }),
        },
        Record::Gap { at, lost: 2 },
    ];
    let mut segment = vec![1];
    segment.extend_from_slice(&segment_preamble());
    for record in &records {
        encode_frame(record, &mut segment).expect("record");
    }
    write("journal_reader", "segment-header-input-gap", &segment);
}

fn main() {
    cbi1();
    let (_, frame) = envelopes();
    zmtp(&frame);
    request_plane();
    sources_file();
    wire();
    journal();
}
