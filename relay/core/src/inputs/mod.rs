//! The one boundary through which the relay learns about its data center.
//!
//! Every fact arrives as a typed [`DcInput`] value, whatever transport carried it (file or etcd
//! discovery, NATS or ZMQ event planes, the simulator, a replayed journal). Decoders of the
//! deployment's wire formats turn bytes into these facts; everything downstream consumes only
//! the facts, which is what makes recording and deterministic replay possible.
//!
//! The decoders are pure functions of bytes (no I/O, no clock) shared by every transport:
//!
//! - [`decode_card_json`] and [`normalize_legacy_prefill`]: model deployment cards;
//! - [`decode_discovery_record`] and [`DiscoveryKey`]: discovery values and their keys;
//! - [`decode_event_envelope`], [`decode_kv_event_batch`], [`decode_load_observation`] and the
//!   subject helpers: the event plane;
//! - [`encode_event_envelope`], [`encode_kv_events_payload`], [`encode_active_load`] and
//!   [`encode_zmq_event_frame`]: the inverse, for simulated publishers.
//!
//! Every decoder bounds its input before allocating (see [`limits`]), returns a typed
//! [`InputError`] instead of panicking, and leaves counting of rejections to [`InputCounters`].

mod card;
mod discovery_key;
mod discovery_record;
mod encode;
mod errors;
mod event_plane;
mod facts;
pub mod limits;
mod router_events;
mod subject_cache;
mod weight;
mod wire;

#[cfg(test)]
mod robustness_tests;
#[cfg(test)]
mod test_fixtures;

pub use card::{decode_card_json, normalize_legacy_prefill, parse_model_type, parse_worker_type};
pub use discovery_key::{DiscoveryKey, EventRecordKey};
pub use discovery_record::{
    DiscoveryRecord, EndpointInstanceRecord, EventChannelRecord, EventSourceRecord, EventTransport,
    KV_EVENTS_TOPIC, KV_METRICS_TOPIC, ModelRecord, decode_discovery_record,
};
pub use encode::{
    encode_active_load, encode_event_envelope, encode_kv_events_payload, encode_zmq_event_frame,
    storage_tier_name,
};
pub use errors::{ERROR_ECHO_BYTES_MAX, InputCounters, InputError, InputErrorKind};
pub use event_plane::{
    EventEnvelope, EventSubject, ZMQ_EVENT_FRAME_HEADER_BYTES, ZMQ_EVENT_FRAME_VERSION,
    decode_active_load, decode_event_envelope, decode_kv_event_batch, decode_kv_events_message,
    decode_kv_events_payload, decode_kv_metrics_message, decode_load_observation,
    decode_zmq_event_message, event_subject, event_subject_prefix, parse_event_subject,
    zmq_event_frame_envelope,
};
pub use facts::{
    CardInstanceId, DcInput, EndpointInstances, KvEventBatch, KvEventSourceAdvert, LoadObservation,
    LoraInfo, ModelCard, ModelInput, ModelTypeFlags, RecoveryTarget, RequestPlaneTransport,
    RuntimeConfig, WorkerType,
};
pub use subject_cache::{SUBJECT_CACHE_BYTES_MAX, SubjectCache};
