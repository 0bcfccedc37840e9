//! Real-shaped samples of Dynamo 1.6.1 inputs, typed out from the captures in
//! `reference/dynamo-live.md` §9 and `reference/dynamo-planes-wire.md` §A.2/§B.
//!
//! Placeholders of the captures (`<u64>`, `<instance hex>`) are filled with ids seen elsewhere in
//! the same captures, so the samples agree with each other: the aggregated worker `backend` is
//! instance 13864542646465346627 (0xc068c01457d23c43) with publisher 7327664155944878
//! (0x1a0878c30c67ae); the recoverable worker `small` is instance 15884517127758876217
//! (0xdc71242afcad0e39) with publisher 7808817134260303 (0x1bbe13eb67504f).

/// The aggregated worker's instance id.
pub(crate) const BACKEND_INSTANCE: u64 = 13_864_542_646_465_346_627;
/// The aggregated worker's `kv-events` publisher id.
pub(crate) const BACKEND_PUBLISHER: u64 = 7_327_664_155_944_878;
/// The recoverable worker's instance id.
pub(crate) const SMALL_INSTANCE: u64 = 15_884_517_127_758_876_217;
/// The recoverable worker's `kv-events` publisher id.
pub(crate) const SMALL_PUBLISHER: u64 = 7_808_817_134_260_303;

/// An aggregated base card (`card_json` of a Model record).
pub(crate) const AGGREGATED_CARD_JSON: &str = r#"{"display_name":"tiny-llm","slug":"tiny-llm",
 "source_path":"/tmp/dynlive/models/tiny-llm","kv_cache_block_size":16,"context_length":8192,
 "model_type":"Chat | Completions","model_input":"Tokens","worker_type":"aggregated","needs":[],
 "runtime_config":{"total_kv_blocks":16384,"max_num_seqs":256,"max_num_batched_tokens":8192,
   "data_parallel_start_rank":0,"data_parallel_size":1,"enable_local_indexer":false,
   "kv_event_publishing_enabled":true,"enable_eagle":false},
 "migration_limit":0}"#;

/// A LoRA adapter card on the same worker (dc-inputs §1.4: minimal runtime config, no capacity).
pub(crate) const ADAPTER_CARD_JSON: &str = r#"{"display_name":"ad-1","slug":"ad-1",
 "source_path":"/tmp/dynlive/models/tiny-llm","kv_cache_block_size":16,"context_length":8192,
 "model_type":"Chat | Completions","model_input":"Tokens","worker_type":"aggregated","needs":[],
 "lora":{"name":"ad-1","max_gpu_lora_count":4},
 "runtime_config":{"data_parallel_start_rank":0,"data_parallel_size":1,"context_length":8192,
   "kv_event_publishing_enabled":true},
 "user_data":{"lora_adapter":true,"lora_id":1}}"#;

/// `v1/instances/dynamo%2Fbackend%2Fgenerate%2Fc068c01457d23c43`
pub(crate) const ENDPOINT_RECORD_JSON: &str = r#"{"type":"Endpoint","component":"backend",
 "endpoint":"generate","namespace":"dynamo","instance_id":13864542646465346627,
 "transport":{"tcp":"127.0.0.1:34229/c068c01457d23c43/dynamo/backend/generate"},
 "device_type":"cuda","request_plane_codec":"msgpack"}"#;

/// The file-discovery path of [`ENDPOINT_RECORD_JSON`].
pub(crate) const ENDPOINT_FILE_PATH: &str =
    "v1/instances/dynamo%2Fbackend%2Fgenerate%2Fc068c01457d23c43";

/// The file-discovery path of the adapter Model record.
pub(crate) const ADAPTER_FILE_PATH: &str =
    "v1/mdc/dynamo%2Fbackend%2Fgenerate%2Fc068c01457d23c43%2Fad%2D1";

/// The file-discovery path of [`EVENT_SOURCE_LIVE_ONLY_JSON`].
pub(crate) const EVENT_SOURCE_FILE_PATH: &str = "v1/event_sources/namespace%2Fdynamo%2Fcomponent\
     %2Fbackend%2Fendpoint%2Fgenerate%2Ftopic%2Fkv%2Devents%2F1a0878c30c67ae";

/// A Model record holding `card_json` as an object.
pub(crate) fn model_record_json(card_json: &str, model_suffix: Option<&str>) -> String {
    let suffix = model_suffix.map(|suffix| format!(r#""model_suffix":"{suffix}","#));
    format!(
        r#"{{"type":"Model","namespace":"dynamo","component":"backend","endpoint":"generate",
        "instance_id":13864542646465346627,{}"card_json":{card_json}}}"#,
        suffix.unwrap_or_default()
    )
}

/// An EventSource of a worker without a local indexer (no `recovery_target`).
pub(crate) const EVENT_SOURCE_LIVE_ONLY_JSON: &str = r#"{"type":"EventSource",
 "scope":{"kind":"endpoint","endpoint":{"namespace":"dynamo","component":"backend","name":"generate"}},
 "topic":"kv-events","publisher_id":7327664155944878,
 "metadata":{"kv_state_endpoint":{"namespace":"dynamo","component":"backend","name":"generate"},
   "worker":{"worker_id":13864542646465346627,"dp_rank":0},"publisher_id":7327664155944878}}"#;

/// An EventSource of a worker with a local indexer, its `recovery_target` as captured.
pub(crate) const EVENT_SOURCE_RECOVERABLE_JSON: &str = r#"{"type":"EventSource",
 "scope":{"kind":"endpoint","endpoint":{"namespace":"dynamo","component":"small","name":"generate"}},
 "topic":"kv-events","publisher_id":7808817134260303,
 "metadata":{"kv_state_endpoint":{"namespace":"dynamo","component":"small","name":"generate"},
   "worker":{"worker_id":15884517127758876217,"dp_rank":0},"publisher_id":7808817134260303,
   "recovery_target":{"component":"small","endpoint":"worker_kv_query_source_1bbe13eb67504f",
     "namespace":"dynamo","instance_id":15884517127758876217,
     "transport":{"tcp":"127.0.0.1:39685/dc71242afcad0e39/dynamo/small/worker_kv_query_source_1bbe13eb67504f"},
     "device_type":"cuda","request_plane_codec":"msgpack"}}}"#;

/// The NATS EventChannel of the aggregated worker's `kv-events` publisher.
pub(crate) const EVENT_CHANNEL_NATS_JSON: &str = r#"{"type":"EventChannel",
 "scope":{"kind":"endpoint","endpoint":{"namespace":"dynamo","component":"backend","name":"generate"}},
 "topic":"kv-events","instance_id":7327664155944878,
 "transport":{"kind":"Nats","config":{"subject_prefix":"namespace.dynamo.component.backend.endpoint.generate"}}}"#;

/// The ZMQ EventChannel exactly as captured (dynamo-planes-wire §B.1).
pub(crate) const EVENT_CHANNEL_ZMQ_JSON: &str = r#"{"type":"EventChannel","scope":{"kind":"endpoint","endpoint":{"namespace":"dynamo","component":"backend","name":"generate"}},
 "topic":"kv-events","instance_id":7327664155944878,
 "transport":{"kind":"Zmq","config":{"endpoint":"tcp://127.0.0.1:40311"}}}"#;

/// The first `kv-events` message a SUB socket received in dynamo-planes-wire §B.5, typed out
/// byte for byte: the `[RouterEvent]` payload.
pub(crate) const CAPTURED_PAYLOAD: &[&[u8]] = &[
    b"\x91\x84",
    b"\xa9worker_id\xcf\xc0\x68\xc0\x14\x57\xd2\x3c\x43",
    b"\xacstorage_tier\xa6device",
    b"\xb0residency_domain\xa6worker",
    b"\xa5event\x83",
    b"\xa8event_id\x01",
    b"\xa4data\x81\xa6stored\x83",
    b"\xabparent_hash\xc0",
    b"\xaestart_position\xc0",
    b"\xa6blocks\x91\x83",
    b"\xaablock_hash\xcf\x48\xdb\xac\x25\x22\x65\xb1\xf5",
    b"\xabtokens_hash\xcf\xea\x06\xfc\x71\xa5\xee\x6e\x88",
    b"\xadmm_extra_info\xc0",
    b"\xa7dp_rank\x00",
];

/// The envelope around [`CAPTURED_PAYLOAD`] (199-byte bin8 payload).
pub(crate) const CAPTURED_ENVELOPE_HEAD: &[&[u8]] = &[
    b"\x85",
    b"\xacpublisher_id\xcf\x00\x1a\x08\x78\xc3\x0c\x67\xae",
    b"\xa8sequence\x00",
    b"\xacpublished_at\xcf\x00\x00\x01\xa2\x2c\x55\xf2\x75",
    b"\xa5topic\xa9kv-events",
    b"\xa7payload\xc4\xc7",
];

/// A `kv_metrics` payload as in dynamo-planes-wire §B.5 (90 bytes).
pub(crate) const CAPTURED_LOAD_PAYLOAD: &[&[u8]] = &[
    b"\x85",
    b"\xa9worker_id\xcf\xc0\x68\xc0\x14\x57\xd2\x3c\x43",
    b"\xa7dp_rank\x00",
    b"\xb4active_decode_blocks\x00",
    b"\xb5active_prefill_tokens\xc0",
    b"\xaekv_used_blocks\x03",
];

/// The captured `kv-events` envelope: [`CAPTURED_ENVELOPE_HEAD`] then [`CAPTURED_PAYLOAD`].
pub(crate) fn captured_envelope() -> Vec<u8> {
    [CAPTURED_ENVELOPE_HEAD.concat(), CAPTURED_PAYLOAD.concat()].concat()
}
