//! Discovery records (dc-inputs §1.3, §3.1; dynamo-live §9.1; dynamo-planes-wire §A.2, §B.1):
//! the JSON values of Dynamo's key-value discovery, tagged by `"type"`.
//!
//! | `type` | decoded into |
//! | --- | --- |
//! | `Endpoint` | [`EndpointInstanceRecord`]: one live worker instance of an endpoint |
//! | `Model` | [`ModelRecord`]: a [`CardInstanceId`] and its [`ModelCard`] |
//! | `EventSource` | [`EventSourceRecord`]: for topic `kv-events`, a [`KvEventSourceAdvert`] |
//! | `EventChannel` | [`EventChannelRecord`]: where a publisher's events can be received |
//!
//! The decoder reads the tag first, then decodes the whole record as the tagged shape; unknown
//! fields are ignored everywhere. Consistency rules enforced here, because a record that breaks
//! them cannot be turned into one fact:
//!
//! - an EventSource's metadata must name the record's `publisher_id`, and its `kv_state_endpoint`
//!   must be the record's scope;
//! - a recovery target must use a request-plane transport this relay speaks (`tcp`, `nats_tcp`);
//! - event records must be endpoint-scoped (the only scope of `kv-events` and `kv_metrics`).
//!
//! Rules left to the discovery projection, because Dynamo treats a violation as a conflict of
//! one binding rather than an unreadable record: `model_suffix` present iff the card has `lora`,
//! a non-empty display name, a non-zero block size.

use serde::Deserialize;
use serde::de::IgnoredAny;

use super::card::WireCard;
use super::discovery_key::{DiscoveryKey, EventRecordKey};
use super::errors::{InputError, echo};
use super::facts::{
    CardInstanceId, KvEventSourceAdvert, ModelCard, RecoveryTarget, RequestPlaneTransport,
};
use super::limits::DISCOVERY_RECORD_BYTES_MAX;
use super::wire::{
    Embedded, WireEndpoint, check_segment, check_size, check_text, endpoint_path, json,
};
use crate::model::identity::EndpointPath;
use crate::model::kv_events::SourceKey;

/// The event-plane topic of KV cache events.
pub const KV_EVENTS_TOPIC: &str = "kv-events";
/// The event-plane topic of worker load (`ActiveLoad`) reports.
pub const KV_METRICS_TOPIC: &str = "kv_metrics";

/// One decoded discovery record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoveryRecord {
    /// A live instance of an endpoint.
    Endpoint(EndpointInstanceRecord),
    /// A model card registration.
    Model(ModelRecord),
    /// An event source advertisement.
    EventSource(EventSourceRecord),
    /// An event channel of one publisher.
    EventChannel(EventChannelRecord),
}

impl DiscoveryRecord {
    /// The discovery key this record is stored under.
    #[must_use]
    pub fn key(&self) -> DiscoveryKey {
        match self {
            DiscoveryRecord::Endpoint(record) => DiscoveryKey::Instance {
                endpoint: record.endpoint.clone(),
                instance_id: record.instance_id,
            },
            DiscoveryRecord::Model(record) => DiscoveryKey::Model(record.id.clone()),
            DiscoveryRecord::EventSource(record) => DiscoveryKey::EventSource(EventRecordKey {
                scope: record.scope.clone(),
                topic: record.topic.clone(),
                publisher_id: record.publisher_id,
            }),
            DiscoveryRecord::EventChannel(record) => DiscoveryKey::EventChannel(EventRecordKey {
                scope: record.scope.clone(),
                topic: record.topic.clone(),
                publisher_id: record.publisher_id,
            }),
        }
    }
}

/// A live worker instance of an endpoint (`v1/instances/...`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointInstanceRecord {
    /// The served endpoint.
    pub endpoint: EndpointPath,
    /// The worker's instance id (its `worker_id` in KV events).
    pub instance_id: u64,
    /// The request-plane transport; `None` when the record names one this relay does not speak.
    /// The instance still counts for availability, which needs only its id.
    pub transport: Option<RequestPlaneTransport>,
    /// The body codec its request plane expects (`"msgpack"` in Dynamo 1.6.1), if advertised.
    pub request_plane_codec: Option<String>,
}

/// A model card registration (`v1/mdc/...`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelRecord {
    /// Where the card is registered.
    pub id: CardInstanceId,
    /// The card, as written (not legacy-normalized).
    pub card: ModelCard,
}

/// An event source advertisement (`v1/event_sources/...`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventSourceRecord {
    /// The endpoint the events are scoped to.
    pub scope: EndpointPath,
    /// The event-plane topic.
    pub topic: String,
    /// The publisher incarnation.
    pub publisher_id: u64,
    /// The KV event source it advertises; present exactly when the topic is `kv-events`.
    pub advert: Option<KvEventSourceAdvert>,
    /// The body codec of the recovery target's request plane, if it has one and advertises it.
    pub recovery_request_plane_codec: Option<String>,
}

/// How to receive one publisher's events.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EventTransport {
    /// NATS: subscribe to `{subject_prefix}.{topic}`.
    Nats {
        /// Subject prefix, e.g. `namespace.dynamo.component.backend.endpoint.generate`.
        subject_prefix: String,
    },
    /// ZMQ direct mode: connect a SUB socket to the publisher's PUB socket.
    Zmq {
        /// The advertised endpoint, e.g. `tcp://127.0.0.1:40311`.
        endpoint: String,
    },
}

/// An event channel of one publisher (`v1/event_channels/...`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventChannelRecord {
    /// The endpoint the events are scoped to.
    pub scope: EndpointPath,
    /// The event-plane topic.
    pub topic: String,
    /// The publisher incarnation (the record's `instance_id`; equals the envelopes'
    /// `publisher_id`).
    pub publisher_id: u64,
    /// Where to receive the events.
    pub transport: EventTransport,
}

/// Decode one discovery record (a file-discovery file or an etcd value).
///
/// Rejects input over [`DISCOVERY_RECORD_BYTES_MAX`] before parsing.
pub fn decode_discovery_record(bytes: &[u8]) -> Result<DiscoveryRecord, InputError> {
    check_size(bytes.len(), DISCOVERY_RECORD_BYTES_MAX, "discovery record")?;
    let tag: WireTag = json(bytes, "discovery record")?;
    match tag.record_type.as_str() {
        "Endpoint" => {
            let wire: WireInstance = json(bytes, "Endpoint record")?;
            wire.into_endpoint_record().map(DiscoveryRecord::Endpoint)
        }
        "Model" => {
            let wire: WireModelRecord = json(bytes, "Model record")?;
            wire.into_model_record().map(DiscoveryRecord::Model)
        }
        "EventSource" => decode_event_source(bytes).map(DiscoveryRecord::EventSource),
        "EventChannel" => {
            let wire: WireEventChannel = json(bytes, "EventChannel record")?;
            wire.into_event_channel_record().map(DiscoveryRecord::EventChannel)
        }
        other => Err(InputError::UnknownRecordType { record_type: echo(other) }),
    }
}

#[derive(Deserialize)]
struct WireTag {
    #[serde(rename = "type")]
    record_type: String,
}

/// An endpoint instance: the body of an Endpoint record and of a recovery target.
#[derive(Deserialize)]
struct WireInstance {
    namespace: String,
    component: String,
    endpoint: String,
    instance_id: u64,
    transport: serde_json::Value,
    #[serde(default)]
    request_plane_codec: Option<String>,
}

impl WireInstance {
    fn endpoint(&mut self, field: &'static str) -> Result<EndpointPath, InputError> {
        endpoint_path(
            std::mem::take(&mut self.namespace),
            std::mem::take(&mut self.component),
            std::mem::take(&mut self.endpoint),
            field,
        )
    }

    fn codec(&mut self, field: &'static str) -> Result<Option<String>, InputError> {
        if let Some(codec) = &self.request_plane_codec {
            check_segment(codec, field)?;
        }
        Ok(self.request_plane_codec.take())
    }

    fn into_endpoint_record(mut self) -> Result<EndpointInstanceRecord, InputError> {
        let endpoint = self.endpoint("Endpoint record")?;
        let request_plane_codec = self.codec("request_plane_codec")?;
        // An unknown transport kind still leaves a usable instance (availability needs the id).
        let transport = request_plane_transport(self.transport, "transport")?.ok();
        Ok(EndpointInstanceRecord {
            endpoint,
            instance_id: self.instance_id,
            transport,
            request_plane_codec,
        })
    }
}

/// A request-plane transport `{"tcp": address}` or `{"nats_tcp": subject}`: `Ok(Ok(_))` when
/// understood, `Ok(Err(kind))` for a well-formed transport of another kind.
fn request_plane_transport(
    value: serde_json::Value,
    field: &'static str,
) -> Result<Result<RequestPlaneTransport, String>, InputError> {
    let invalid = InputError::InvalidField { field, reason: "expected an object with one key" };
    let (kind, address) = match value {
        serde_json::Value::Object(map) if map.len() == 1 => {
            map.into_iter().next().ok_or(invalid)?
        }
        serde_json::Value::String(kind) => return Ok(Err(kind)),
        _ => return Err(invalid),
    };
    let address = match (kind.as_str(), address) {
        ("tcp" | "nats_tcp", serde_json::Value::String(address)) => address,
        ("tcp" | "nats_tcp", _) => {
            return Err(InputError::InvalidField { field, reason: "address is not a string" });
        }
        _ => return Ok(Err(kind)),
    };
    check_text(&address, field)?;
    Ok(Ok(if kind == "tcp" {
        RequestPlaneTransport::Tcp(address)
    } else {
        RequestPlaneTransport::NatsTcp(address)
    }))
}

#[derive(Deserialize)]
struct WireModelRecord {
    namespace: String,
    component: String,
    endpoint: String,
    instance_id: u64,
    card_json: Embedded<WireCard>,
    #[serde(default)]
    model_suffix: Option<String>,
}

impl WireModelRecord {
    fn into_model_record(self) -> Result<ModelRecord, InputError> {
        let endpoint =
            endpoint_path(self.namespace, self.component, self.endpoint, "Model record")?;
        if let Some(suffix) = &self.model_suffix {
            check_segment(suffix, "model_suffix")?;
            if suffix.is_empty() || suffix.contains('/') {
                return Err(InputError::InvalidField {
                    field: "model_suffix",
                    reason: "must be a non-empty key segment without '/'",
                });
            }
        }
        let card = self.card_json.0.into_card()?;
        Ok(ModelRecord {
            id: CardInstanceId {
                endpoint,
                instance_id: self.instance_id,
                model_suffix: self.model_suffix,
            },
            card,
        })
    }
}

/// `{"kind":"endpoint","endpoint":{namespace,component,name}}`; other kinds are not consumed.
#[derive(Deserialize)]
struct WireScope {
    kind: String,
    #[serde(default)]
    endpoint: Option<WireEndpoint>,
}

impl WireScope {
    fn into_endpoint(self) -> Result<EndpointPath, InputError> {
        if self.kind != "endpoint" {
            return Err(InputError::UnsupportedEventScope { kind: echo(&self.kind) });
        }
        self.endpoint
            .ok_or(InputError::InvalidField { field: "scope.endpoint", reason: "missing" })?
            .into_path("scope.endpoint")
    }
}

/// The fields every EventSource record has; the metadata is decoded per topic.
#[derive(Deserialize)]
struct WireEventSourceHeader {
    scope: WireScope,
    topic: String,
    publisher_id: u64,
}

/// An EventSource record whose metadata is a `KvEventSource`.
#[derive(Deserialize)]
struct WireKvEventSourceRecord {
    #[serde(default)]
    metadata: Option<Embedded<WireKvEventSource>>,
}

#[derive(Deserialize)]
struct WireKvEventSource {
    kv_state_endpoint: WireEndpoint,
    worker: WireWorker,
    publisher_id: u64,
    #[serde(default)]
    recovery_target: Option<WireInstance>,
}

#[derive(Deserialize)]
struct WireWorker {
    worker_id: u64,
    #[serde(default)]
    dp_rank: Option<u32>,
}

fn decode_event_source(bytes: &[u8]) -> Result<EventSourceRecord, InputError> {
    let header: WireEventSourceHeader = json(bytes, "EventSource record")?;
    let scope = header.scope.into_endpoint()?;
    let topic = event_topic(header.topic)?;
    if topic != KV_EVENTS_TOPIC {
        return Ok(EventSourceRecord {
            scope,
            topic,
            publisher_id: header.publisher_id,
            advert: None,
            recovery_request_plane_codec: None,
        });
    }
    let record: WireKvEventSourceRecord = json(bytes, "EventSource record")?;
    let metadata =
        record.metadata.ok_or(InputError::InvalidField { field: "metadata", reason: "missing" })?.0;
    if metadata.publisher_id != header.publisher_id {
        return Err(InputError::PublisherIdMismatch {
            record: header.publisher_id,
            metadata: metadata.publisher_id,
        });
    }
    let kv_state_endpoint = metadata.kv_state_endpoint.into_path("metadata.kv_state_endpoint")?;
    if kv_state_endpoint != scope {
        return Err(InputError::KvStateEndpointMismatch {
            scope: echo(&scope.to_string()),
            metadata: echo(&kv_state_endpoint.to_string()),
        });
    }
    let (recovery_target, recovery_request_plane_codec) = match metadata.recovery_target {
        Some(mut target) => {
            let endpoint = target.endpoint("metadata.recovery_target")?;
            let codec = target.codec("metadata.recovery_target.request_plane_codec")?;
            let field = "metadata.recovery_target.transport";
            let transport = request_plane_transport(target.transport, field)?
                .map_err(|kind| InputError::UnsupportedTransport { field, kind: echo(&kind) })?;
            (Some(RecoveryTarget { endpoint, instance_id: target.instance_id, transport }), codec)
        }
        None => (None, None),
    };
    Ok(EventSourceRecord {
        advert: Some(KvEventSourceAdvert {
            kv_state_endpoint,
            source: SourceKey {
                worker_id: metadata.worker.worker_id,
                dp_rank: metadata.worker.dp_rank.unwrap_or(0),
            },
            publisher_id: header.publisher_id,
            recovery_target,
        }),
        scope,
        topic,
        publisher_id: header.publisher_id,
        recovery_request_plane_codec,
    })
}

/// A topic must be a non-empty segment.
fn event_topic(topic: String) -> Result<String, InputError> {
    check_segment(&topic, "topic")?;
    if topic.is_empty() {
        return Err(InputError::InvalidField { field: "topic", reason: "empty" });
    }
    Ok(topic)
}

#[derive(Deserialize)]
struct WireEventChannel {
    scope: WireScope,
    topic: String,
    /// The publisher id (named `instance_id` on the wire).
    instance_id: u64,
    transport: WireEventTransport,
}

/// `{"kind":"Nats","config":{"subject_prefix":..}}` or `{"kind":"Zmq","config":{"endpoint":..}}`.
#[derive(Deserialize)]
struct WireEventTransport {
    kind: String,
    #[serde(default)]
    config: Option<WireEventTransportConfig>,
}

#[derive(Deserialize)]
struct WireEventTransportConfig {
    #[serde(default)]
    subject_prefix: Option<String>,
    #[serde(default)]
    endpoint: Option<String>,
    /// Present in ZMQ broker mode, which this relay does not speak.
    #[serde(default)]
    xsub_endpoints: Option<IgnoredAny>,
}

impl WireEventChannel {
    fn into_event_channel_record(self) -> Result<EventChannelRecord, InputError> {
        let scope = self.scope.into_endpoint()?;
        let topic = event_topic(self.topic)?;
        let field = "transport";
        let config = self
            .transport
            .config
            .ok_or(InputError::InvalidField { field: "transport.config", reason: "missing" })?;
        let transport = match self.transport.kind.as_str() {
            "Nats" => EventTransport::Nats {
                subject_prefix: config.subject_prefix.ok_or(InputError::InvalidField {
                    field: "transport.config.subject_prefix",
                    reason: "missing",
                })?,
            },
            "Zmq" if config.endpoint.is_none() && config.xsub_endpoints.is_some() => {
                return Err(InputError::UnsupportedTransport { field, kind: "Zmq broker".into() });
            }
            "Zmq" => EventTransport::Zmq {
                endpoint: config.endpoint.ok_or(InputError::InvalidField {
                    field: "transport.config.endpoint",
                    reason: "missing",
                })?,
            },
            other => return Err(InputError::UnsupportedTransport { field, kind: echo(other) }),
        };
        match &transport {
            EventTransport::Nats { subject_prefix: text }
            | EventTransport::Zmq { endpoint: text } => {
                check_text(text, "transport.config")?;
            }
        }
        Ok(EventChannelRecord { scope, topic, publisher_id: self.instance_id, transport })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inputs::card::decode_card_json;
    use crate::inputs::test_fixtures::*;

    fn decode(json: &str) -> Result<DiscoveryRecord, InputError> {
        decode_discovery_record(json.as_bytes())
    }

    fn backend() -> EndpointPath {
        EndpointPath::new("dynamo", "backend", "generate").unwrap()
    }

    fn small() -> EndpointPath {
        EndpointPath::new("dynamo", "small", "generate").unwrap()
    }

    #[test]
    fn endpoint_instance_sample_decodes_to_endpoint_id_and_transport() {
        let record = decode(ENDPOINT_RECORD_JSON).unwrap();
        assert_eq!(
            record,
            DiscoveryRecord::Endpoint(EndpointInstanceRecord {
                endpoint: backend(),
                instance_id: BACKEND_INSTANCE,
                transport: Some(RequestPlaneTransport::Tcp(
                    "127.0.0.1:34229/c068c01457d23c43/dynamo/backend/generate".into()
                )),
                request_plane_codec: Some("msgpack".into()),
            })
        );
        assert_eq!(record.key().file_path(), ENDPOINT_FILE_PATH);
    }

    #[test]
    fn endpoint_instance_with_an_unknown_transport_still_counts_as_an_instance() {
        let record = decode(
            r#"{"type":"Endpoint","namespace":"dynamo","component":"backend","endpoint":"generate",
                "instance_id":7,"transport":{"quic":"127.0.0.1:1"}}"#,
        )
        .unwrap();
        let DiscoveryRecord::Endpoint(record) = record else { panic!("not an endpoint") };
        assert_eq!(record.instance_id, 7);
        assert_eq!(record.transport, None);
        assert_eq!(record.request_plane_codec, None);
        let nats = decode(
            r#"{"type":"Endpoint","namespace":"dynamo","component":"backend","endpoint":"generate",
                "instance_id":7,"transport":{"nats_tcp":"subject.x"}}"#,
        )
        .unwrap();
        let DiscoveryRecord::Endpoint(nats) = nats else { panic!("not an endpoint") };
        assert_eq!(nats.transport, Some(RequestPlaneTransport::NatsTcp("subject.x".into())));
    }

    #[test]
    fn model_sample_decodes_to_card_instance_id_and_card() {
        let record = decode(&model_record_json(AGGREGATED_CARD_JSON, None)).unwrap();
        let DiscoveryRecord::Model(model) = &record else { panic!("not a model") };
        assert_eq!(
            model.id,
            CardInstanceId {
                endpoint: backend(),
                instance_id: BACKEND_INSTANCE,
                model_suffix: None
            }
        );
        assert_eq!(model.card, decode_card_json(AGGREGATED_CARD_JSON.as_bytes()).unwrap());
        assert_eq!(record.key().key_path(), "v1/mdc/dynamo/backend/generate/c068c01457d23c43");
    }

    #[test]
    fn adapter_model_sample_carries_its_suffix_and_lora() {
        let record = decode(&model_record_json(ADAPTER_CARD_JSON, Some("ad-1"))).unwrap();
        assert_eq!(record.key().file_path(), ADAPTER_FILE_PATH);
        let DiscoveryRecord::Model(model) = record else { panic!("not a model") };
        assert_eq!(model.id.model_suffix.as_deref(), Some("ad-1"));
        assert_eq!(model.card.lora.as_ref().map(|lora| lora.name.as_str()), Some("ad-1"));
    }

    #[test]
    fn card_json_given_as_a_string_decodes_like_the_object() {
        let quoted = serde_json::to_string(AGGREGATED_CARD_JSON).unwrap();
        let as_string = decode(&model_record_json(&quoted, None)).unwrap();
        let as_object = decode(&model_record_json(AGGREGATED_CARD_JSON, None)).unwrap();
        assert_eq!(as_string, as_object);
    }

    #[test]
    fn model_records_with_invalid_cards_or_suffixes_are_rejected() {
        let bad_card = model_record_json(r#"{"display_name":"m","worker_type":"boss"}"#, None);
        assert_eq!(
            decode(&bad_card),
            Err(InputError::UnknownWorkerType { field: "worker_type", value: "boss".into() })
        );
        for suffix in ["", "a/b"] {
            assert_eq!(
                decode(&model_record_json(ADAPTER_CARD_JSON, Some(suffix))),
                Err(InputError::InvalidField {
                    field: "model_suffix",
                    reason: "must be a non-empty key segment without '/'",
                })
            );
        }
        let not_object = model_record_json("17", None);
        assert!(matches!(decode(&not_object), Err(InputError::Json { what: "Model record", .. })));
    }

    #[test]
    fn live_only_event_source_sample_advertises_without_recovery_target() {
        let record = decode(EVENT_SOURCE_LIVE_ONLY_JSON).unwrap();
        assert_eq!(record.key().file_path(), EVENT_SOURCE_FILE_PATH);
        assert_eq!(
            record,
            DiscoveryRecord::EventSource(EventSourceRecord {
                scope: backend(),
                topic: "kv-events".into(),
                publisher_id: BACKEND_PUBLISHER,
                advert: Some(KvEventSourceAdvert {
                    kv_state_endpoint: backend(),
                    source: SourceKey { worker_id: BACKEND_INSTANCE, dp_rank: 0 },
                    publisher_id: BACKEND_PUBLISHER,
                    recovery_target: None,
                }),
                recovery_request_plane_codec: None,
            })
        );
    }

    #[test]
    fn recoverable_event_source_sample_carries_its_recovery_target() {
        let DiscoveryRecord::EventSource(record) = decode(EVENT_SOURCE_RECOVERABLE_JSON).unwrap()
        else {
            panic!("not an event source")
        };
        let advert = record.advert.unwrap();
        assert_eq!(advert.kv_state_endpoint, small());
        assert_eq!(advert.source, SourceKey { worker_id: SMALL_INSTANCE, dp_rank: 0 });
        assert_eq!(advert.publisher_id, SMALL_PUBLISHER);
        assert_eq!(
            advert.recovery_target,
            Some(RecoveryTarget {
                endpoint: EndpointPath::new(
                    "dynamo",
                    "small",
                    "worker_kv_query_source_1bbe13eb67504f"
                )
                .unwrap(),
                instance_id: SMALL_INSTANCE,
                transport: RequestPlaneTransport::Tcp(
                    "127.0.0.1:39685/dc71242afcad0e39/dynamo/small/\
                     worker_kv_query_source_1bbe13eb67504f"
                        .into()
                ),
            })
        );
        assert_eq!(record.recovery_request_plane_codec.as_deref(), Some("msgpack"));
        // The recovery endpoint is named after the publisher in unpadded lowercase hex.
        assert_eq!(format!("{:x}", SMALL_PUBLISHER), "1bbe13eb67504f");
    }

    #[test]
    fn event_source_metadata_may_be_a_json_string_and_dp_rank_defaults_to_zero() {
        let metadata = r#"{"kv_state_endpoint":{"namespace":"dynamo","component":"backend","name":"generate"},
            "worker":{"worker_id":5},"publisher_id":9}"#;
        let record = format!(
            r#"{{"type":"EventSource","scope":{{"kind":"endpoint","endpoint":{{"namespace":"dynamo",
            "component":"backend","name":"generate"}}}},"topic":"kv-events","publisher_id":9,
            "metadata":{}}}"#,
            serde_json::to_string(metadata).unwrap()
        );
        let DiscoveryRecord::EventSource(record) = decode(&record).unwrap() else {
            panic!("not an event source")
        };
        assert_eq!(record.advert.unwrap().source, SourceKey { worker_id: 5, dp_rank: 0 });
    }

    #[test]
    fn event_sources_of_other_topics_carry_no_advert() {
        let record = r#"{"type":"EventSource","scope":{"kind":"endpoint","endpoint":{"namespace":"dynamo",
            "component":"backend","name":"generate"}},"topic":"kv_metrics","publisher_id":9,
            "metadata":{"anything":["goes"]}}"#;
        let DiscoveryRecord::EventSource(record) = decode(record).unwrap() else {
            panic!("not an event source")
        };
        assert_eq!(record.topic, KV_METRICS_TOPIC);
        assert_eq!(record.advert, None);
    }

    #[test]
    fn event_source_metadata_naming_another_publisher_is_rejected() {
        let record = EVENT_SOURCE_LIVE_ONLY_JSON.replacen(
            r#""publisher_id":7327664155944878}"#,
            r#""publisher_id":1}"#,
            1,
        );
        assert_eq!(
            decode(&record),
            Err(InputError::PublisherIdMismatch { record: BACKEND_PUBLISHER, metadata: 1 })
        );
    }

    #[test]
    fn event_source_metadata_naming_another_kv_state_endpoint_is_rejected() {
        let record = EVENT_SOURCE_LIVE_ONLY_JSON.replacen(
            r#""kv_state_endpoint":{"namespace":"dynamo","component":"backend""#,
            r#""kv_state_endpoint":{"namespace":"dynamo","component":"other""#,
            1,
        );
        assert_eq!(
            decode(&record),
            Err(InputError::KvStateEndpointMismatch {
                scope: "dynamo/backend/generate".into(),
                metadata: "dynamo/other/generate".into(),
            })
        );
    }

    #[test]
    fn kv_event_source_without_metadata_is_rejected() {
        let record = r#"{"type":"EventSource","scope":{"kind":"endpoint","endpoint":{"namespace":"dynamo",
            "component":"backend","name":"generate"}},"topic":"kv-events","publisher_id":9}"#;
        assert_eq!(
            decode(record),
            Err(InputError::InvalidField { field: "metadata", reason: "missing" })
        );
    }

    #[test]
    fn recovery_target_with_an_unknown_transport_is_rejected() {
        let record = EVENT_SOURCE_RECOVERABLE_JSON.replacen(r#"{"tcp":"#, r#"{"quic":"#, 1);
        assert_eq!(
            decode(&record),
            Err(InputError::UnsupportedTransport {
                field: "metadata.recovery_target.transport",
                kind: "quic".into(),
            })
        );
        let not_a_string = EVENT_SOURCE_RECOVERABLE_JSON.replacen(
            r#"{"tcp":"127.0.0.1:39685/dc71242afcad0e39/dynamo/small/worker_kv_query_source_1bbe13eb67504f"}"#,
            r#"{"tcp":5}"#,
            1,
        );
        assert_eq!(
            decode(&not_a_string),
            Err(InputError::InvalidField {
                field: "metadata.recovery_target.transport",
                reason: "address is not a string",
            })
        );
        let two_keys = EVENT_SOURCE_RECOVERABLE_JSON.replacen(r#"{"tcp":"#, r#"{"a":1,"tcp":"#, 1);
        assert_eq!(
            decode(&two_keys),
            Err(InputError::InvalidField {
                field: "metadata.recovery_target.transport",
                reason: "expected an object with one key",
            })
        );
    }

    #[test]
    fn nats_event_channel_sample_decodes_with_its_subject_prefix() {
        let record = decode(EVENT_CHANNEL_NATS_JSON).unwrap();
        assert_eq!(
            record,
            DiscoveryRecord::EventChannel(EventChannelRecord {
                scope: backend(),
                topic: "kv-events".into(),
                publisher_id: BACKEND_PUBLISHER,
                transport: EventTransport::Nats {
                    subject_prefix: "namespace.dynamo.component.backend.endpoint.generate".into()
                },
            })
        );
        assert_eq!(
            record.key().key_path(),
            "v1/event_channels/namespace/dynamo/component/backend/endpoint/generate/topic/kv-events/1a0878c30c67ae"
        );
    }

    #[test]
    fn zmq_event_channel_sample_decodes_with_its_endpoint() {
        let DiscoveryRecord::EventChannel(record) = decode(EVENT_CHANNEL_ZMQ_JSON).unwrap() else {
            panic!("not an event channel")
        };
        assert_eq!(
            record.transport,
            EventTransport::Zmq { endpoint: "tcp://127.0.0.1:40311".into() }
        );
        assert_eq!(record.publisher_id, BACKEND_PUBLISHER);
    }

    #[test]
    fn event_channels_with_unsupported_or_incomplete_transports_are_rejected() {
        let broker = EVENT_CHANNEL_ZMQ_JSON.replacen(
            r#""endpoint":"tcp://127.0.0.1:40311""#,
            r#""xsub_endpoints":["tcp://b:1"]"#,
            1,
        );
        assert_eq!(
            decode(&broker),
            Err(InputError::UnsupportedTransport { field: "transport", kind: "Zmq broker".into() })
        );
        let other = EVENT_CHANNEL_NATS_JSON.replacen(r#""kind":"Nats""#, r#""kind":"Kafka""#, 1);
        assert_eq!(
            decode(&other),
            Err(InputError::UnsupportedTransport { field: "transport", kind: "Kafka".into() })
        );
        let no_prefix = EVENT_CHANNEL_NATS_JSON.replacen("subject_prefix", "prefix", 1);
        assert_eq!(
            decode(&no_prefix),
            Err(InputError::InvalidField {
                field: "transport.config.subject_prefix",
                reason: "missing"
            })
        );
        let no_endpoint =
            EVENT_CHANNEL_ZMQ_JSON.replacen(r#""endpoint":"tcp"#, r#""address":"tcp"#, 1);
        assert_eq!(
            decode(&no_endpoint),
            Err(InputError::InvalidField { field: "transport.config.endpoint", reason: "missing" })
        );
        let no_config = r#"{"type":"EventChannel","scope":{"kind":"endpoint","endpoint":{"namespace":"a",
            "component":"b","name":"c"}},"topic":"kv-events","instance_id":1,"transport":{"kind":"Nats"}}"#;
        assert_eq!(
            decode(no_config),
            Err(InputError::InvalidField { field: "transport.config", reason: "missing" })
        );
    }

    #[test]
    fn event_records_that_are_not_endpoint_scoped_are_unsupported() {
        let component = r#"{"type":"EventChannel","scope":{"kind":"component","component":{"namespace":"a",
            "name":"b"}},"topic":"kv-events","instance_id":1,"transport":{"kind":"Nats","config":{}}}"#;
        assert_eq!(
            decode(component),
            Err(InputError::UnsupportedEventScope { kind: "component".into() })
        );
        let missing = r#"{"type":"EventSource","scope":{"kind":"endpoint"},"topic":"kv-events",
            "publisher_id":1}"#;
        assert_eq!(
            decode(missing),
            Err(InputError::InvalidField { field: "scope.endpoint", reason: "missing" })
        );
    }

    #[test]
    fn records_with_unknown_types_or_bad_shapes_are_rejected() {
        assert_eq!(
            decode(r#"{"type":"Gateway"}"#),
            Err(InputError::UnknownRecordType { record_type: "Gateway".into() })
        );
        for text in
            ["", "{}", "[]", r#"{"type":1}"#, r#"{"type":"Endpoint"}"#, "{\"type\":\"Endpoint\"} x"]
        {
            assert!(matches!(decode(text), Err(InputError::Json { .. })), "{text}");
        }
        let empty_topic =
            EVENT_CHANNEL_NATS_JSON.replacen(r#""topic":"kv-events""#, r#""topic":"""#, 1);
        assert_eq!(
            decode(&empty_topic),
            Err(InputError::InvalidField { field: "topic", reason: "empty" })
        );
        let bad_endpoint =
            ENDPOINT_RECORD_JSON.replacen(r#""component":"backend""#, r#""component":"a/b""#, 1);
        assert!(matches!(decode(&bad_endpoint), Err(InputError::InvalidEndpoint { .. })));
        let oversized = vec![b' '; DISCOVERY_RECORD_BYTES_MAX + 1];
        assert!(matches!(
            decode_discovery_record(&oversized),
            Err(InputError::TooLarge { what: "discovery record", .. })
        ));
    }
}
