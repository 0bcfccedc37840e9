//! The resolved configuration as JSON (`kvrelay serve --check-config`): every setting the relay
//! would run with, defaults filled in, durations in milliseconds, field names in camelCase.
//!
//! Secrets never appear: URLs are printed without their user-info part (`user:pass@`), and
//! only the backend kind and addresses of the discovery and event planes are shown.

use serde_json::{Value, json};

use super::{EventPlane, RelayConfig};
use crate::discovery_plane::DiscoveryBackend;
use kvrelay_core::discovery::NamespaceSelection;

/// `url` without the `user:pass@` part of its authority.
fn without_userinfo(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, url),
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let rest = match rest[..authority_end].rfind('@') {
        Some(at) => &rest[at + 1..],
        None => rest,
    };
    match scheme {
        Some(scheme) => format!("{scheme}://{rest}"),
        None => rest.to_owned(),
    }
}

fn millis(duration: std::time::Duration) -> u128 {
    duration.as_millis()
}

/// The configuration as the JSON document `--check-config` prints.
#[must_use]
pub fn describe(config: &RelayConfig) -> Value {
    let namespaces = match config.scope.namespace_selection() {
        NamespaceSelection::All => Value::Null,
        NamespaceSelection::Namespaces(names) => json!(names),
    };
    #[allow(unreachable_patterns, reason = "backends added later print their kind only")]
    let mut discovery = match &config.discovery {
        DiscoveryBackend::File(file) => json!({"backend": "file", "root": file.root}),
        DiscoveryBackend::Etcd(etcd) => json!({
            "backend": "etcd",
            "endpoints": etcd.endpoints.iter().map(|e| without_userinfo(e)).collect::<Vec<_>>(),
        }),
        DiscoveryBackend::Kubernetes(kube) => json!({
            "backend": "kubernetes",
            "apiUrl": kube.api.api_url,
            "namespace": kube.namespace,
            "mode": format!("{:?}", kube.mode).to_ascii_lowercase(),
        }),
        _ => json!({"backend": "other"}),
    };
    if let Value::Object(fields) = &mut discovery {
        fields.insert(
            "relistIntervalMs".to_owned(),
            json!(millis(config.discovery.relist_interval())),
        );
    }
    let event_plane = match &config.event_plane {
        EventPlane::Nats { url, .. } => json!({"plane": "nats", "url": without_userinfo(url)}),
        EventPlane::Zmq => json!({"plane": "zmq"}),
    };
    let wan = &config.wan;
    json!({
        "dcId": config.dc_name,
        "dcIdHex": config.dc_id.to_string(),
        "scope": {
            "watchAll": matches!(config.scope.namespace_selection(), NamespaceSelection::All),
            "namespaces": namespaces,
            "endpointPrefixes": config.scope.endpoint_prefixes(),
            "sourcesFile": config.sources_file,
            "connectionRevision": config.connection_revision,
        },
        "expectedUniqueBlocks": config.expected_unique_blocks,
        "ckf": {
            "formatVersion": config.ckf_format.format_version,
            "seed": format!("{:#018x}", config.ckf_format.seed),
            "bucketCount": config.ckf_format.bucket_count,
            "fingerprintBits": config.ckf_format.fingerprint_bits,
            "slotsPerBucket": config.ckf_format.slots_per_bucket,
            "filterBytes": config.ckf_format.filter_bytes(),
        },
        "poolFilterBytesMax": config.pool_filter_bytes_max,
        "memory": {
            "poolExactStateBytesMax": config.memory.pool_exact_state_bytes_max,
            "inputQueueBytesMax": config.memory.input_queue_bytes_max,
            "natsBacklogBytesMax": config.memory.nats_backlog_bytes_max,
            "recoveryResponseBytesMax": config.memory.recovery_response_bytes_max,
            "recoveryAnswersBytesMax": config.memory.recovery_answers_bytes_max,
            "journalQueueBytesMax": config.memory.journal_queue_bytes_max,
        },
        "bind": config.bind.map(|address| address.to_string()),
        "opsBind": config.ops_bind.map(|address| address.to_string()),
        "producer": {
            "publicationThreshold": config.producer.publication_threshold_events,
            "publicationDelayMs": millis(config.producer.publication_delay),
            "precisePublicationTimer": config.producer.precise_publication_timer,
            "recoveryAttemptTimeoutMs": millis(config.producer.recovery_attempt_timeout),
        },
        "wan": {
            "maxMessageBytes": wan.max_message_bytes,
            "keepaliveIntervalMs": millis(wan.keepalive_interval),
            "keepaliveTimeoutMs": millis(wan.keepalive_timeout),
            "poolHeartbeatIntervalMs": millis(wan.pool_heartbeat_interval),
            "readinessHeartbeatIntervalMs": millis(wan.readiness_heartbeat_interval),
            "catalogHeartbeatIntervalMs": millis(wan.catalog_heartbeat_interval),
            "snapshotProgressTimeoutMs": millis(wan.snapshot_progress_timeout),
            "loadWindowMs": millis(wan.load_window),
            "loadFanoutCapacity": wan.load_fanout_capacity,
            "publicationQueueCapacity": wan.publication_queue_frames,
            "publicationQueueBytes": wan.publication_queue_bytes,
            "publicationEncodingConcurrency": wan.publication_encoding_concurrency,
            "maxInitializedPoolHubs": wan.max_initialized_pool_hubs,
            "maxCatalogSubscribers": wan.max_catalog_subscribers,
            "maxPoolStreamsTotal": wan.max_pool_streams_total,
            "maxSubscribersPerPool": wan.max_subscribers_per_pool,
            "maxReadinessSubscribers": wan.max_readiness_subscribers,
            "maxLoadSubscribers": wan.max_load_subscribers,
            "limits": {
                "maxConnections": wan.limits.max_connections,
                "maxStreamsPerConnection": wan.limits.max_streams_per_connection,
                "maxHeaderListBytes": wan.limits.max_header_list_bytes,
                "maxRequestBytes": wan.limits.max_request_bytes,
                "handshakeTimeoutMs": millis(wan.limits.handshake_timeout),
                "acceptErrorBackoffMs": millis(wan.limits.accept_error_backoff),
                "subscriberSendTimeoutMs": millis(wan.limits.subscriber_send_timeout),
                "maxHealthWatchStreams": wan.limits.max_health_watch_streams,
                "maxReflectionStreams": wan.limits.max_reflection_streams,
                "drainTimeoutMs": millis(wan.limits.drain_timeout),
            },
        },
        "shutdownTimeoutMs": millis(config.shutdown_timeout),
        "discovery": discovery,
        "eventPlane": event_plane,
        "record": config.record.as_ref().map(|record| json!({
            "root": record.root,
            "maxTotalBytes": record.max_total_bytes,
            "maxSegmentAgeSecs": record.max_segment_age.as_secs(),
            "checkpointEveryInputs": record.checkpoint_every_inputs,
            "checkpointIntervalMs": millis(record.checkpoint_interval),
        })),
        "podUid": config.pod_uid,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::config::{CliValues, resolve};

    #[test]
    fn user_info_is_removed_from_urls() {
        assert_eq!(without_userinfo("nats://u:secret@10.0.0.1:4222"), "nats://10.0.0.1:4222");
        assert_eq!(without_userinfo("http://h:2379/p@x"), "http://h:2379/p@x");
        assert_eq!(without_userinfo("tok@host:1"), "host:1");
        assert_eq!(without_userinfo("nats://localhost:4222"), "nats://localhost:4222");
    }

    #[test]
    fn the_document_holds_the_resolved_values_and_no_secret() {
        let cli = CliValues {
            dc_id: Some("dc-a".into()),
            namespace_filter: Some("prod".into()),
            bind: Some("127.0.0.1:5561".into()),
            ..CliValues::default()
        };
        let environment: BTreeMap<String, String> = [
            ("NATS_SERVER", "nats://relay:hunter2@127.0.0.1:4222"),
            ("DYN_RELAY_PUBLICATION_ENCODING_CONCURRENCY", "3"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let document = describe(&resolve(&cli, &environment).unwrap());
        assert_eq!(document["dcIdHex"], "04f110c98b1bfc48");
        assert_eq!(document["scope"]["namespaces"], json!(["prod"]));
        assert_eq!(document["scope"]["watchAll"], false);
        assert_eq!(document["bind"], "127.0.0.1:5561");
        assert_eq!(document["wan"]["publicationEncodingConcurrency"], 3);
        assert_eq!(document["wan"]["keepaliveIntervalMs"], 20_000);
        assert_eq!(document["wan"]["limits"]["maxRequestBytes"], 65_536);
        assert_eq!(document["shutdownTimeoutMs"], 10_000);
        assert_eq!(document["ckf"]["bucketCount"], 524_288);
        assert_eq!(document["ckf"]["filterBytes"], 4 << 20);
        assert_eq!(document["poolFilterBytesMax"], 8u64 << 30);
        assert_eq!(document["eventPlane"]["url"], "nats://127.0.0.1:4222");
        assert_eq!(document["discovery"]["relistIntervalMs"], 30_000);
        assert!(!document.to_string().contains("hunter2"));
    }
}
