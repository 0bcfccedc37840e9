//! Renderer tests of the operations surface: fixed snapshots in, exact text and documents out.

use std::net::SocketAddr;

use super::*;
use crate::discovery_plane::DiscoveryStats;
use crate::event_plane::EventPlaneStats;
use crate::node::NodeStatus;
use crate::pool::PoolTotals;
use crate::publication::HubCounts;
use crate::request_plane::RequestPlaneStats;
use crate::serve::SourcesReport;
use crate::wan::{OpenStreams, WanStats, WanTlsStats};
use kvrelay_core::control::{ControlCounters, ControlHealth};
use kvrelay_core::host::HostHealth;
use kvrelay_core::inputs::{InputCounters, InputError};
use kvrelay_core::pool::OwnershipCounters;

fn control(fenced: usize) -> ControlHealth {
    ControlHealth {
        healthy: fenced == 0,
        host: HostHealth {
            healthy: fenced == 0,
            shutting_down: false,
            host_last_error: None,
            endpoint_count: 3,
            active_endpoint_count: 2,
            fenced_endpoint_count: fenced,
            budget_refused_endpoint_count: 1,
            pools_max: 2_048,
        },
        control_last_error: None,
        catalog_revision: 7,
        topology_revision: 5,
        pool_count: 2,
        degraded_load_coverage_pool_count: 1,
        counters: ControlCounters {
            inputs: 40,
            kv_batches_routed: 30,
            ..ControlCounters::default()
        },
    }
}

pub(super) fn snapshot() -> OpsSnapshot {
    let mut records = InputCounters::new();
    records.record::<()>(&Ok(()));
    records.record::<()>(&Err(InputError::Json { what: "card", detail: "eof".into() }));
    let mut decode = InputCounters::new();
    for _ in 0..5 {
        decode.record::<()>(&Ok(()));
    }
    decode.record::<()>(&Err(InputError::MessagePack { what: "envelope", detail: "eof".into() }));
    OpsSnapshot {
        shutting_down: false,
        input_queue: crate::node::InputQueueStats {
            bytes_max: 256 << 20,
            bytes_queued: 4096,
            byte_waits: 3,
            oversized: 1,
        },
        node: NodeStatus {
            healthy: true,
            catalog_revision: 7,
            topology_revision: 5,
            active_pools: 2,
            pools_starting: 1,
            inputs_handled: 40,
            input_batches: 12,
            wakeups: crate::node::WakeupStats {
                longest: std::time::Duration::from_millis(250),
                slow: 3,
            },
            stopped: false,
            control: Some(control(0)),
        },
        wan: Some(WanSnapshot {
            bound_address: "127.0.0.1:5561".parse::<SocketAddr>().unwrap(),
            serving: true,
            last_error: None,
            open_streams: OpenStreams { catalog: 1, pool: 2, readiness: 1, load: 0 },
            stats: WanStats {
                subscriber_lagged: [0, 3, 0, 1],
                subscriber_limit_rejected: [[1, 0, 0], [0, 2, 4], [0, 0, 0], [0, 0, 0]],
                pool_heartbeats: 9,
                load_updates: 11,
                terminal_publication_failures: 1,
                ..WanStats::default()
            },
            tls: Some(WanTlsStats { reloads: 2, reload_failures: 1, handshake_failures: 3 }),
        }),
        catalog_pool_count: 2,
        topology: TopologyCounts { unknown: 0, unavailable: 1, ready: 1 },
        hubs: HubCounts { requested: 1, initialized: 2, ready: 2, idle: 1 },
        pools: PoolTotals {
            pools: 2,
            owned_blocks: 700,
            resident_blocks: 690,
            exact_state_bytes: 48_000,
            exact_state_bytes_max: 128 << 20,
            exact_state_headroom_bytes_min: Some(64 << 20),
            counters: OwnershipCounters {
                events_applied: 1000,
                events_ignored: 3,
                events_rejected: 2,
                capacity_omissions: 10,
                unknown_removals: 4,
                budget_refusals: 1,
            },
        },
        discovery: DiscoveryStats { records, listings: 4, ..DiscoveryStats::default() },
        event_plane: "nats",
        events: EventPlaneStats {
            decode,
            delivered: 5,
            connects: 1,
            subscription_bytes_max: 64 << 20,
            subscription_capacity: 8,
            server_max_payload_bytes: 8 << 20,
            subscriptions: 2,
            client_rebuilds: 1,
            backlog_bytes_peak: 4096,
            ..EventPlaneStats::default()
        },
        recovery: RequestPlaneStats {
            queries: 2,
            answered: 1,
            failed: 1,
            answer_bytes_peak: 3 << 20,
            answer_bytes_max: 256 << 20,
            ..RequestPlaneStats::default()
        },
        sources: None,
        recording: None,
        pod_uid: None,
        discovered_namespaces: 2,
    }
}

#[test]
fn metrics_render_the_relay_names_and_the_existing_counters() {
    let text = render_metrics(&snapshot());
    for line in [
        "# TYPE kv_dc_relay_subscribers gauge",
        "kv_dc_relay_subscribers{stream=\"catalog\"} 1",
        "kv_dc_relay_subscribers{stream=\"pool\"} 2",
        "kv_dc_relay_subscribers{stream=\"load\"} 0",
        "kv_dc_relay_catalog_pool_count 2",
        "kv_dc_relay_initialized_publication_hub_count 2",
        "kv_dc_relay_requested_publication_hub_count 1",
        "kv_dc_relay_ready_publication_hub_count 2",
        "kv_dc_relay_idle_publication_hub_count 1",
        "# TYPE kv_dc_relay_subscriber_lagged_total counter",
        "kv_dc_relay_subscriber_lagged_total{stream=\"pool\"} 3",
        "kv_dc_relay_subscriber_lagged_total{stream=\"load\"} 1",
        "kv_dc_relay_subscriber_limit_rejected_total{stream=\"catalog\",scope=\"total\"} 1",
        "kv_dc_relay_subscriber_limit_rejected_total{stream=\"pool\",scope=\"per_pool\"} 2",
        "kv_dc_relay_subscriber_limit_rejected_total{stream=\"pool\",scope=\"initialized_hub\"} 4",
        "kv_dc_relay_pool_heartbeats_total 9",
        "kv_dc_relay_load_updates_total 11",
        "kv_dc_relay_terminal_publication_failures_total 1",
        "# TYPE kvrelay_pool_capacity_omissions gauge",
        "kvrelay_pool_capacity_omissions 10",
        "kvrelay_pool_owned_blocks 700",
        "kvrelay_pool_resident_blocks 690",
        "kvrelay_pool_events_applied 1000",
        "kvrelay_pool_events_rejected 2",
        "kvrelay_pool_unknown_removals 4",
        "kvrelay_pool_exact_state_bytes 48000",
        "kvrelay_pool_exact_state_bytes_max 134217728",
        "kvrelay_pool_exact_state_headroom_bytes_min 67108864",
        "kvrelay_pool_exact_state_budget_refusals 1",
        "kv_dc_relay_serving_topology_count{state=\"unavailable\"} 1",
        "kv_dc_relay_serving_topology_count{state=\"ready\"} 1",
        "kv_dc_relay_degraded_load_coverage_pool_count 1",
        "kvrelay_healthy 1",
        "kvrelay_fenced_endpoint_count 0",
        "kvrelay_pool_budget_waiting_endpoint_count 1",
        "kvrelay_pools_max 2048",
        "kvrelay_pools_starting 1",
        "kvrelay_dc_inputs_total 40",
        "kvrelay_dc_input_batches_total 12",
        "# TYPE kvrelay_node_wakeup_seconds_max gauge",
        "kvrelay_node_wakeup_seconds_max 0.25",
        "# TYPE kvrelay_node_slow_wakeups_total counter",
        "kvrelay_node_slow_wakeups_total 3",
        "kvrelay_control_inputs_total 40",
        "kvrelay_input_queue_bytes 4096",
        "kvrelay_input_queue_bytes_max 268435456",
        "kvrelay_recovery_answer_bytes_peak 3145728",
        "kvrelay_recovery_answer_bytes_max 268435456",
        "# TYPE kvrelay_input_queue_byte_waits_total counter",
        "kvrelay_input_queue_byte_waits_total 3",
        "kvrelay_input_queue_oversized_total 1",
        "kvrelay_control_kv_batches_routed_total 30",
        "# TYPE kvrelay_control_kv_batches_unrouted_total counter",
        "kvrelay_discovery_records_accepted_total 1",
        "kvrelay_discovery_records_rejected_total{kind=\"json\"} 1",
        "kvrelay_discovery_records_rejected_total{kind=\"message_pack\"} 0",
        "kvrelay_discovery_listings_total 4",
        "kvrelay_event_plane_messages_accepted_total{plane=\"nats\"} 5",
        "kvrelay_event_plane_messages_rejected_total{plane=\"nats\",kind=\"message_pack\"} 1",
        "kvrelay_event_plane_delivered_total{plane=\"nats\"} 5",
        "# TYPE kvrelay_event_plane_subscription_bytes_max gauge",
        "kvrelay_event_plane_subscription_bytes_max{plane=\"nats\"} 67108864",
        "kvrelay_event_plane_subscription_capacity{plane=\"nats\"} 8",
        "kvrelay_event_plane_server_max_payload_bytes{plane=\"nats\"} 8388608",
        "kvrelay_event_plane_subscriptions{plane=\"nats\"} 2",
        "kvrelay_event_plane_backlog_bytes_peak{plane=\"nats\"} 4096",
        "# TYPE kvrelay_event_plane_client_rebuilds_total counter",
        "kvrelay_event_plane_client_rebuilds_total{plane=\"nats\"} 1",
        "kvrelay_recovery_failed_total 1",
    ] {
        assert!(text.lines().any(|candidate| candidate == line), "missing {line:?} in\n{text}");
    }
    assert!(!text.contains("kvrelay_sources_"), "no sources families without a sources file");
    assert!(!text.contains("kvrelay_journal_"), "no journal families without --record");
    // Every sample line is `name[{labels}] value` and belongs to a declared family.
    let mut declared = std::collections::BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            declared.insert(rest.split(' ').next().unwrap().to_owned());
        } else if !line.starts_with('#') {
            let name = line.split(['{', ' ']).next().unwrap();
            assert!(declared.contains(name), "{line}");
            let value = line.rsplit(' ').next().unwrap();
            let whole = value.parse::<u64>().is_ok();
            let seconds =
                name.contains("_seconds") && value.parse::<f64>().is_ok_and(f64::is_finite);
            assert!(whole || seconds, "{line}");
        }
    }
}

#[test]
fn build_info_names_the_version_and_revision() {
    let text = render_metrics(&snapshot());
    let expected = format!(
        "kvrelay_build_info{{version=\"{}\",revision=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION"),
        crate::build_info::REVISION
    );
    assert!(text.lines().any(|line| line == expected), "missing {expected:?} in\n{text}");
    assert!(!crate::build_info::REVISION.is_empty());
    assert!(text.contains("# TYPE kvrelay_build_info gauge"));
}

#[test]
fn label_values_are_escaped() {
    let mut with_odd_plane = snapshot();
    with_odd_plane.event_plane = "a\"b\\c";
    let text = render_metrics(&with_odd_plane);
    assert!(
        text.contains("kvrelay_event_plane_delivered_total{plane=\"a\\\"b\\\\c\"} 5"),
        "{text}"
    );
}

#[test]
fn health_follows_the_node_the_wan_listener_and_shutdown() {
    let healthy = health(&snapshot());
    assert!(healthy.healthy);
    assert_eq!(healthy.status, "healthy");
    assert_eq!(healthy.wan_bound_address.as_deref(), Some("127.0.0.1:5561"));
    assert_eq!((healthy.endpoint_count, healthy.active_endpoint_count), (3, 2));

    let mut fenced = snapshot();
    fenced.node.healthy = false;
    fenced.node.control = Some(control(1));
    let report = health(&fenced);
    assert!(!report.healthy);
    assert_eq!(report.fenced_endpoint_count, 1);

    let mut wan_failed = snapshot();
    if let Some(wan) = wan_failed.wan.as_mut() {
        wan.serving = false;
        wan.last_error = Some("address in use".into());
    }
    assert!(!health(&wan_failed).healthy);

    let mut stopping = snapshot();
    stopping.shutting_down = true;
    assert!(!health(&stopping).healthy);
    assert_eq!(readiness(&stopping).reasons, vec!["shutting down", "unhealthy"]);
}

#[test]
fn readiness_waits_for_discovery_the_event_plane_and_the_sources_file() {
    assert_eq!(readiness(&snapshot()), ReadinessReport { ready: true, reasons: Vec::new() });
    let mut cold = snapshot();
    cold.discovery.listings = 0;
    cold.events.connects = 0;
    cold.sources = Some(SourcesSnapshot {
        report: SourcesReport::default(),
        connection_revision: None,
        reloads: 0,
        refusals: 0,
    });
    assert_eq!(
        readiness(&cold).reasons,
        vec![
            "discovery has not completed a listing",
            "event plane not connected",
            "no valid sources file applied"
        ]
    );
    let mut zmq = cold.clone();
    zmq.event_plane = "zmq";
    assert!(!readiness(&zmq).reasons.contains(&"event plane not connected"));
}

#[test]
fn engine_state_has_dynamos_shape() {
    let discovery_mode = serde_json::to_value(engine_state(&snapshot())).unwrap();
    assert_eq!(
        discovery_mode,
        serde_json::json!({
            "podUID": null,
            "mode": "discovery",
            "connectionRevision": null,
            "ready": true,
            "sources": {"desiredRevision": null, "appliedRevision": null, "count": 2, "lastError": null},
            "softDiscoveryErrors": [],
            "softDiscoveryErrorCount": 0
        })
    );
    let health_json = serde_json::to_value(health(&snapshot())).unwrap();
    assert_eq!(
        health_json["sources"], discovery_mode["sources"],
        "/health carries the same sources"
    );
    let mut file_mode = snapshot();
    file_mode.pod_uid = Some("pod-7".into());
    file_mode.sources = Some(SourcesSnapshot {
        report: SourcesReport {
            desired_revision: None,
            applied_revision: Some("ab".into()),
            count: 2,
            last_error: Some("bad".into()),
        },
        connection_revision: Some("conn-1".into()),
        reloads: 3,
        refusals: 1,
    });
    let state = serde_json::to_value(engine_state(&file_mode)).unwrap();
    assert_eq!(state["mode"], "from-file");
    assert_eq!(state["podUID"], "pod-7");
    assert_eq!(state["connectionRevision"], "conn-1");
    assert_eq!(state["sources"]["count"], 2);
    let health_json = serde_json::to_value(health(&file_mode)).unwrap();
    assert_eq!(health_json["sources"], state["sources"]);
    assert_eq!(health_json["sources"]["desiredRevision"], serde_json::Value::Null);
    assert_eq!(health_json["sources"]["appliedRevision"], "ab");
    let text = render_metrics(&file_mode);
    assert!(text.contains("\nkvrelay_sources_namespace_count 2\n"), "{text}");
    assert!(text.contains("\nkvrelay_sources_refusals_total 1\n"), "{text}");
    assert!(text.contains("\nkvrelay_sources_last_read_refused 1\n"), "{text}");
}

#[test]
fn recording_counters_are_exported_with_record() {
    let mut recording = snapshot();
    recording.recording = Some(RecordingSnapshot {
        active: true,
        stats: crate::journal::RecorderStats {
            records_queued: 120,
            records_dropped: 3,
            records_dropped_queue_bytes: 2,
            queue_bytes: 4096,
            queue_bytes_max: 1 << 20,
            records_written: 118,
            bytes_written: 34_000,
            write_errors: 2,
            segments_deleted: 1,
        },
    });
    let text = render_metrics(&recording);
    for line in [
        "# TYPE kvrelay_journal_recording gauge",
        "kvrelay_journal_recording 1",
        "# TYPE kvrelay_journal_records_written_total counter",
        "kvrelay_journal_records_written_total 118",
        "kvrelay_journal_records_dropped_total 3",
        "kvrelay_journal_records_dropped_queue_bytes_total 2",
        "# TYPE kvrelay_journal_queue_bytes gauge",
        "kvrelay_journal_queue_bytes 4096",
        "# TYPE kvrelay_journal_queue_bytes_max gauge",
        "kvrelay_journal_queue_bytes_max 1048576",
        "kvrelay_journal_write_errors_total 2",
        "kvrelay_journal_bytes_written_total 34000",
        "kvrelay_journal_segments_deleted_total 1",
    ] {
        assert!(text.lines().any(|candidate| candidate == line), "missing {line:?} in\n{text}");
    }
    let mut failed = snapshot();
    failed.recording = Some(RecordingSnapshot { active: false, stats: Default::default() });
    let text = render_metrics(&failed);
    assert!(text.lines().any(|line| line == "kvrelay_journal_recording 0"), "{text}");
    assert!(!text.contains("kvrelay_journal_queue_bytes_max"), "no queue without a recording");
    assert!(text.lines().any(|line| line == "kvrelay_journal_records_written_total 0"), "{text}");
}

#[test]
fn zmtp_violations_are_exported_per_kind() {
    let mut with_violation = snapshot();
    with_violation.events.zmtp_errors.record(&crate::event_plane::ZmtpError::BadSignature);
    let text = render_metrics(&with_violation);
    let line = "kvrelay_event_plane_zmtp_errors_total{plane=\"nats\",kind=\"bad_signature\"} 1";
    assert!(text.lines().any(|sample| sample == line), "missing {line:?} in\n{text}");
    let kinds =
        text.lines().filter(|l| l.starts_with("kvrelay_event_plane_zmtp_errors_total{")).count();
    assert_eq!(kinds, crate::event_plane::ZmtpErrorKind::ALL.len());
}

#[test]
fn wan_tls_counters_are_exported_and_zero_under_plaintext() {
    let has = |text: &str, line: &str| text.lines().any(|candidate| candidate == line);
    let text = render_metrics(&snapshot());
    for line in [
        "# TYPE kvrelay_wan_tls_handshake_failures_total counter",
        "kvrelay_wan_tls_enabled 1",
        "kvrelay_wan_tls_handshake_failures_total 3",
        "kvrelay_wan_tls_reloads_total 2",
        "kvrelay_wan_tls_reload_failures_total 1",
    ] {
        assert!(has(&text, line), "missing {line:?} in\n{text}");
    }
    let mut plaintext = snapshot();
    plaintext.wan.as_mut().expect("a WAN listener").tls = None;
    let text = render_metrics(&plaintext);
    for line in [
        "kvrelay_wan_tls_enabled 0",
        "kvrelay_wan_tls_handshake_failures_total 0",
        "kvrelay_wan_tls_reloads_total 0",
        "kvrelay_wan_tls_reload_failures_total 0",
    ] {
        assert!(has(&text, line), "missing {line:?} in\n{text}");
    }
}

#[test]
fn soft_discovery_errors_are_counted_by_kind_and_listed_in_the_engine_state() {
    use kvrelay_core::discovery::{SoftDiscoveryError, SoftErrorKind};
    let mut with_errors = snapshot();
    let mut log = crate::discovery_plane::SoftErrorLog::default();
    let orphan = SoftDiscoveryError::new(
        SoftErrorKind::OrphanAdapter,
        "ns/backend/generate/1f/ad-1",
        "its worker has no base card on this endpoint",
    );
    let alias = SoftDiscoveryError::new(
        SoftErrorKind::InvalidAlias,
        "ns/backend/generate/1f",
        "alias \" x\" is empty or has surrounding whitespace",
    );
    log.update(vec![orphan.clone(), alias.clone()]);
    log.update(vec![orphan.clone()]);
    with_errors.discovery.soft_errors = log.report().clone();
    let text = render_metrics(&with_errors);
    for line in [
        "kvrelay_discovery_soft_errors_total{kind=\"orphan_adapter\"} 1",
        "kvrelay_discovery_soft_errors_total{kind=\"invalid_alias\"} 1",
        "kvrelay_discovery_soft_errors_total{kind=\"unreadable_key\"} 0",
        "kvrelay_discovery_soft_errors{kind=\"orphan_adapter\"} 1",
        "kvrelay_discovery_soft_errors{kind=\"invalid_alias\"} 0",
        "# TYPE kvrelay_discovery_soft_errors_total counter",
        "# TYPE kvrelay_discovery_soft_errors gauge",
        "# TYPE kvrelay_discovery_watch_streams gauge",
        "kvrelay_discovery_relists_total 0",
        "kvrelay_discovery_rebinds_total 0",
    ] {
        assert!(text.contains(&format!("\n{line}\n")), "{line}\n{text}");
    }
    let state = serde_json::to_value(engine_state(&with_errors)).unwrap();
    assert_eq!(
        state["softDiscoveryErrors"],
        serde_json::json!([{
            "kind": "orphan_adapter",
            "key": "ns/backend/generate/1f/ad-1",
            "reason": "its worker has no base card on this endpoint"
        }])
    );
    assert_eq!(state["softDiscoveryErrorCount"], 1);
}
