//! The Prometheus text exposition (format 0.0.4) of an [`OpsSnapshot`]. Pure: the same snapshot
//! always renders the same text.
//!
//! Names: the relay metrics of relay-facts §13 keep Dynamo's `kv_dc_relay_` names (subscribers,
//! lagged and limit-rejected subscribers, pool heartbeats, load updates, catalog pools,
//! publication hubs by state, terminal publication failures, serving topology by state,
//! degraded load coverage); the input, fence and transport counters the
//! crate keeps are exported under `kvrelay_`, the input journal's (with `--record`) under
//! `kvrelay_journal_`; `kvrelay_build_info{version,revision}` is 1 and names the build.
//! Counters end in `_total`. Every family is written
//! even at zero, so a dashboard sees the series from the first scrape.

use std::fmt::Write as _;

use super::snapshot::OpsSnapshot;
use crate::event_plane::ZmtpErrorKind;
use crate::wan::{LimitScope, StreamType};
use kvrelay_core::discovery::SoftErrorKind;
use kvrelay_core::inputs::{InputCounters, InputErrorKind};

/// The `Content-Type` of the exposition.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[derive(Clone, Copy)]
enum Kind {
    Counter,
    Gauge,
}

/// A text exposition under construction.
#[derive(Default)]
struct Exposition {
    text: String,
}

impl Exposition {
    fn family(&mut self, name: &str, kind: Kind, help: &str) {
        let kind = match kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
        };
        let _ = writeln!(self.text, "# HELP {name} {help}");
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: u64) {
        self.text.push_str(name);
        if !labels.is_empty() {
            self.text.push('{');
            for (index, (label, value)) in labels.iter().enumerate() {
                if index > 0 {
                    self.text.push(',');
                }
                let _ = write!(self.text, "{label}=\"{}\"", escape_label(value));
            }
            self.text.push('}');
        }
        let _ = writeln!(self.text, " {value}");
    }

    /// A family with one unlabelled sample.
    fn single(&mut self, name: &str, kind: Kind, help: &str, value: u64) {
        self.family(name, kind, help);
        self.sample(name, &[], value);
    }

    /// One unlabelled gauge in seconds (`f64`'s shortest exact decimal).
    fn seconds(&mut self, name: &str, help: &str, value: std::time::Duration) {
        self.family(name, Kind::Gauge, help);
        let _ = writeln!(self.text, "{name} {}", value.as_secs_f64());
    }

    /// Accepted and rejected-per-kind counters of one decoder, under `labels`.
    fn input_counters(
        &mut self,
        prefix: &str,
        what: &str,
        labels: &[(&str, &str)],
        counters: &InputCounters,
    ) {
        let accepted = format!("{prefix}_accepted_total");
        self.family(&accepted, Kind::Counter, &format!("{what} decoded and accepted."));
        self.sample(&accepted, labels, counters.accepted());
        self.counter_by_kind(
            &format!("{prefix}_rejected_total"),
            &format!("{what} rejected as malformed, by error kind."),
            labels,
            InputErrorKind::ALL.map(|kind| (kind.name(), counters.rejected(kind))),
        );
    }

    /// A counter family with one sample per kind, each under `labels` plus `kind`.
    fn counter_by_kind(
        &mut self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
        samples: impl IntoIterator<Item = (&'static str, u64)>,
    ) {
        self.family(name, Kind::Counter, help);
        for (kind, value) in samples {
            let mut with_kind = labels.to_vec();
            with_kind.push(("kind", kind));
            self.sample(name, &with_kind, value);
        }
    }
}

fn escape_label(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn count(value: usize) -> u64 {
    u64::try_from(value).unwrap_or(u64::MAX)
}

/// Render `snapshot` as Prometheus text.
#[must_use]
pub fn render_metrics(snapshot: &OpsSnapshot) -> String {
    let mut out = Exposition::default();
    relay_families(&mut out, snapshot);
    listener_families(&mut out, snapshot);
    host_families(&mut out, snapshot);
    input_families(&mut out, snapshot);
    journal_families(&mut out, snapshot);
    build_family(&mut out);
    out.text
}

/// `kvrelay_build_info{version,revision} 1`: which build is running.
fn build_family(out: &mut Exposition) {
    let name = "kvrelay_build_info";
    out.family(name, Kind::Gauge, "The running build: package version and source revision.");
    let labels =
        [("version", crate::build_info::VERSION), ("revision", crate::build_info::REVISION)];
    out.sample(name, &labels, 1);
}

/// The WAN listener's own defences: connections, slow consumers, health and reflection streams.
fn listener_families(out: &mut Exposition, snapshot: &OpsSnapshot) {
    let stats = snapshot.wan.as_ref().map(|wan| wan.stats).unwrap_or_default();
    let name = "kvrelay_wan_slow_consumer_ended_total";
    out.family(
        name,
        Kind::Counter,
        "Streams ended because the client took no frame within the send deadline.",
    );
    for stream in StreamType::ALL {
        out.sample(name, &[("stream", stream.label())], stats.slow_consumer_ended[stream as usize]);
    }
    let l = stats.listener;
    for (name, kind, help, value) in [
        (
            "kvrelay_wan_slow_consumer_connections_closed_total",
            Kind::Counter,
            "Connections closed because a slow consumer's final status could not be delivered.",
            stats.slow_consumer_connections_closed,
        ),
        ("kvrelay_wan_connections", Kind::Gauge, "Open WAN connections.", l.connections_open),
        (
            "kvrelay_wan_connections_refused_total",
            Kind::Counter,
            "WAN connections closed at once because the connection limit was reached.",
            l.connections_refused,
        ),
        (
            "kvrelay_wan_accept_errors_total",
            Kind::Counter,
            "Failed accepts on the WAN listener (each followed by the back-off).",
            l.accept_errors,
        ),
        (
            "kvrelay_wan_handshake_timeouts_total",
            Kind::Counter,
            "WAN connections closed for not sending the HTTP/2 preface in time.",
            l.handshake_timeouts,
        ),
        (
            "kvrelay_wan_connections_aborted_at_shutdown_total",
            Kind::Counter,
            "WAN connections still open at the shutdown drain deadline, closed.",
            l.connections_aborted_at_shutdown,
        ),
        (
            "kvrelay_wan_health_watch_streams",
            Kind::Gauge,
            "Open health Watch streams.",
            l.health_watch_open,
        ),
        (
            "kvrelay_wan_health_watch_rejected_total",
            Kind::Counter,
            "Health Watch streams refused at their limit.",
            l.health_watch_rejected,
        ),
        (
            "kvrelay_wan_reflection_streams",
            Kind::Gauge,
            "Open reflection streams.",
            l.reflection_open,
        ),
        (
            "kvrelay_wan_reflection_rejected_total",
            Kind::Counter,
            "Reflection streams refused at their limit.",
            l.reflection_rejected,
        ),
    ] {
        out.single(name, kind, help, value);
    }
}

/// relay-facts §13 names.
fn relay_families(out: &mut Exposition, snapshot: &OpsSnapshot) {
    let streams = snapshot.wan.as_ref().map(|wan| wan.open_streams).unwrap_or_default();
    out.family("kv_dc_relay_subscribers", Kind::Gauge, "Open WAN streams by stream type.");
    for (stream, open) in [
        ("catalog", streams.catalog),
        ("pool", streams.pool),
        ("readiness", streams.readiness),
        ("load", streams.load),
    ] {
        out.sample("kv_dc_relay_subscribers", &[("stream", stream)], count(open));
    }
    out.single(
        "kv_dc_relay_catalog_pool_count",
        Kind::Gauge,
        "Pools in the published catalog.",
        count(snapshot.catalog_pool_count),
    );
    let stats = snapshot.wan.as_ref().map(|wan| wan.stats).unwrap_or_default();
    out.family(
        "kv_dc_relay_subscriber_lagged_total",
        Kind::Counter,
        "Streams ended as SUBSCRIBER_LAGGED.",
    );
    for stream in StreamType::ALL {
        let lagged = stats.subscriber_lagged[stream as usize];
        out.sample("kv_dc_relay_subscriber_lagged_total", &[("stream", stream.label())], lagged);
    }
    out.family(
        "kv_dc_relay_subscriber_limit_rejected_total",
        Kind::Counter,
        "Streams refused as RESOURCE_LIMIT, by stream type and the limit that refused them.",
    );
    for stream in StreamType::ALL {
        for scope in LimitScope::ALL {
            out.sample(
                "kv_dc_relay_subscriber_limit_rejected_total",
                &[("stream", stream.label()), ("scope", scope.label())],
                stats.subscriber_limit_rejected[stream as usize][scope as usize],
            );
        }
    }
    out.single(
        "kv_dc_relay_pool_heartbeats_total",
        Kind::Counter,
        "Heartbeats sent on pool streams.",
        stats.pool_heartbeats,
    );
    out.single(
        "kv_dc_relay_load_updates_total",
        Kind::Counter,
        "Load windows sent to subscribers.",
        stats.load_updates,
    );
    out.single(
        "kv_dc_relay_terminal_publication_failures_total",
        Kind::Counter,
        "Pool streams ended by a terminal publication failure (not lag, not shutdown).",
        stats.terminal_publication_failures,
    );
    for (name, help, value) in [
        (
            "kv_dc_relay_requested_publication_hub_count",
            "Pools whose publication hub a subscription is building or attaching to.",
            snapshot.hubs.requested,
        ),
        (
            "kv_dc_relay_initialized_publication_hub_count",
            "Publication hubs holding an initialized snapshot.",
            snapshot.hubs.initialized,
        ),
        (
            "kv_dc_relay_ready_publication_hub_count",
            "Running publication hubs accepting subscribers.",
            snapshot.hubs.ready,
        ),
        (
            "kv_dc_relay_idle_publication_hub_count",
            "Ready publication hubs without a subscriber (evictable).",
            snapshot.hubs.idle,
        ),
    ] {
        out.single(name, Kind::Gauge, help, count(value));
    }
    out.family(
        "kv_dc_relay_serving_topology_count",
        Kind::Gauge,
        "Serving topology entries by readiness state.",
    );
    for (state, entries) in [
        ("unknown", snapshot.topology.unknown),
        ("unavailable", snapshot.topology.unavailable),
        ("ready", snapshot.topology.ready),
    ] {
        out.sample("kv_dc_relay_serving_topology_count", &[("state", state)], count(entries));
    }
    let pools = &snapshot.pools;
    for (name, help, value) in [
        ("kvrelay_pool_count", "Active pools that reported their counters.", pools.pools),
        ("kvrelay_pool_owned_blocks", "Distinct canonical blocks owned.", pools.owned_blocks),
        ("kvrelay_pool_resident_blocks", "Occupied filter slots.", pools.resident_blocks),
        (
            "kvrelay_pool_events_applied",
            "KV events applied by the active pool generations.",
            pools.counters.events_applied,
        ),
        (
            "kvrelay_pool_events_ignored",
            "Valid KV events ignored (not for the primary residency).",
            pools.counters.events_ignored,
        ),
        (
            "kvrelay_pool_events_rejected",
            "KV events rejected with an error.",
            pools.counters.events_rejected,
        ),
        (
            "kvrelay_pool_capacity_omissions",
            "Blocks owned without filter residency because the filter had no room.",
            pools.counters.capacity_omissions,
        ),
        (
            "kvrelay_pool_unknown_removals",
            "Removals of blocks the source never stored.",
            pools.counters.unknown_removals,
        ),
        (
            "kvrelay_pool_exact_state_bytes",
            "Bytes the exact ownership state of the active pools allocates.",
            pools.exact_state_bytes,
        ),
        (
            "kvrelay_pool_exact_state_bytes_max",
            "Exact-state byte budgets of the active pools, summed.",
            pools.exact_state_bytes_max,
        ),
        (
            "kvrelay_pool_exact_state_budget_refusals",
            "KV events, rank dumps and rank replacements refused at a pool's exact-state byte budget.",
            pools.counters.budget_refusals,
        ),
    ] {
        // Gauges: a retired pool generation takes its counts with it.
        out.single(name, Kind::Gauge, help, value);
    }
    if let Some(headroom) = pools.exact_state_headroom_bytes_min {
        out.single(
            "kvrelay_pool_exact_state_headroom_bytes_min",
            Kind::Gauge,
            "Least room left under its exact-state byte budget of any active pool (0: refusing growth).",
            headroom,
        );
    }
    let control = snapshot.node.control.as_ref();
    out.single(
        "kv_dc_relay_degraded_load_coverage_pool_count",
        Kind::Gauge,
        "Active pools whose load coverage is degraded.",
        count(control.map_or(0, |health| health.degraded_load_coverage_pool_count)),
    );
}

/// Health, revisions, endpoints and fences.
fn host_families(out: &mut Exposition, snapshot: &OpsSnapshot) {
    let node = &snapshot.node;
    let host = node.control.as_ref().map(|health| &health.host);
    out.single(
        "kvrelay_healthy",
        Kind::Gauge,
        "1 if the relay is healthy.",
        u64::from(node.healthy),
    );
    out.single(
        "kvrelay_shutting_down",
        Kind::Gauge,
        "1 once shutdown has begun.",
        u64::from(snapshot.shutting_down),
    );
    out.single(
        "kvrelay_wan_serving",
        Kind::Gauge,
        "1 if the WAN listener is serving.",
        u64::from(snapshot.wan.as_ref().is_some_and(|wan| wan.serving)),
    );
    let tls = snapshot.wan.as_ref().and_then(|wan| wan.tls);
    out.single(
        "kvrelay_wan_tls_enabled",
        Kind::Gauge,
        "1 if the WAN listener serves TLS.",
        u64::from(tls.is_some()),
    );
    let tls = tls.unwrap_or_default();
    for (name, help, value) in [
        (
            "kvrelay_wan_tls_handshake_failures_total",
            "WAN TLS handshakes that failed or timed out.",
            tls.handshake_failures,
        ),
        (
            "kvrelay_wan_tls_reloads_total",
            "WAN TLS configurations swapped in after a certificate file change.",
            tls.reloads,
        ),
        (
            "kvrelay_wan_tls_reload_failures_total",
            "WAN certificate file changes that did not load (the previous configuration stays).",
            tls.reload_failures,
        ),
    ] {
        out.single(name, Kind::Counter, help, value);
    }
    out.single(
        "kvrelay_catalog_revision",
        Kind::Gauge,
        "Revision of the published catalog.",
        node.catalog_revision,
    );
    out.single(
        "kvrelay_topology_revision",
        Kind::Gauge,
        "Revision of the published serving readiness.",
        node.topology_revision,
    );
    out.single(
        "kvrelay_endpoint_count",
        Kind::Gauge,
        "Endpoint slots held by the host.",
        count(host.map_or(0, |host| host.endpoint_count)),
    );
    out.single(
        "kvrelay_active_endpoint_count",
        Kind::Gauge,
        "Endpoint slots with a published generation.",
        count(host.map_or(0, |host| host.active_endpoint_count)),
    );
    out.single(
        "kvrelay_fenced_endpoint_count",
        Kind::Gauge,
        "Endpoint slots fenced after an invariant failure.",
        count(host.map_or(0, |host| host.fenced_endpoint_count)),
    );
    out.single(
        "kvrelay_pool_budget_waiting_endpoint_count",
        Kind::Gauge,
        "Endpoint slots that want a pool but wait for the pool filter budget.",
        count(host.map_or(0, |host| host.budget_refused_endpoint_count)),
    );
    out.single(
        "kvrelay_pools_max",
        Kind::Gauge,
        "Pools the filter budget (DYN_RELAY_POOL_FILTER_BYTES_MAX) admits at once.",
        host.map_or(0, |host| host.pools_max),
    );
    out.single(
        "kvrelay_pools_starting",
        Kind::Gauge,
        "Pool starts whose filter is being allocated (off the node's loop) or awaits being applied.",
        count(node.pools_starting),
    );
    out.single(
        "kvrelay_dc_inputs_total",
        Kind::Counter,
        "DC inputs handled by the node.",
        node.inputs_handled,
    );
    out.single(
        "kvrelay_dc_input_batches_total",
        Kind::Counter,
        "Batches the node took its DC inputs in (inputs per batch = inputs / batches).",
        node.input_batches,
    );
    out.seconds(
        "kvrelay_node_wakeup_seconds_max",
        "The longest any one wake-up kept the node's loop (from waking until its work was done), since start.",
        node.wakeups.longest,
    );
    out.single(
        "kvrelay_node_slow_wakeups_total",
        Kind::Counter,
        "Wake-ups that kept the node's loop longer than 100 ms: the transports' readers waited meanwhile.",
        node.wakeups.slow,
    );
    let queue = &snapshot.input_queue;
    out.single(
        "kvrelay_input_queue_bytes",
        Kind::Gauge,
        "Bytes of DC inputs queued for the node or in their step.",
        queue.bytes_queued,
    );
    out.single(
        "kvrelay_input_queue_bytes_max",
        Kind::Gauge,
        "The node input queue's byte budget; senders wait past it.",
        queue.bytes_max,
    );
    out.single(
        "kvrelay_input_queue_byte_waits_total",
        Kind::Counter,
        "Inputs whose sender waited for the input queue's byte budget.",
        queue.byte_waits,
    );
    out.single(
        "kvrelay_input_queue_oversized_total",
        Kind::Counter,
        "Inputs heavier than the whole input queue budget (each waited for an empty queue).",
        queue.oversized,
    );
    let counters = node.control.as_ref().map(|health| health.counters).unwrap_or_default();
    if let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(counters) {
        for (field, value) in fields {
            let name = format!("kvrelay_control_{field}_total");
            out.single(
                &name,
                Kind::Counter,
                &format!("Control plane input counter `{field}`."),
                value.as_u64().unwrap_or(0),
            );
        }
    }
}

/// Discovery, event plane, recovery and sources-file counters.
fn input_families(out: &mut Exposition, snapshot: &OpsSnapshot) {
    let discovery = &snapshot.discovery;
    out.input_counters("kvrelay_discovery_records", "Discovery records", &[], &discovery.records);
    for (name, help, value) in [
        (
            "kvrelay_discovery_listings_total",
            "Complete discovery listings applied.",
            discovery.listings,
        ),
        (
            "kvrelay_discovery_watch_events_total",
            "etcd watch events applied.",
            discovery.watch_events,
        ),
        (
            "kvrelay_discovery_transport_errors_total",
            "Failed discovery polls, connections or calls.",
            discovery.transport_errors,
        ),
        (
            "kvrelay_discovery_unreadable_entries_total",
            "Listed discovery entries that could not be read.",
            discovery.unreadable_entries,
        ),
        (
            "kvrelay_discovery_reconnects_total",
            "etcd sessions begun after the first.",
            discovery.reconnects,
        ),
        (
            "kvrelay_discovery_compactions_total",
            "Relists forced by an etcd compaction or a Kubernetes 410 Gone.",
            discovery.compactions,
        ),
        (
            "kvrelay_discovery_rejected_objects_total",
            "Kubernetes discovery objects skipped as malformed or oversized.",
            discovery.rejected_objects,
        ),
        (
            "kvrelay_discovery_relists_total",
            "Periodic reconciling discovery relists (file backend: full re-reads).",
            discovery.relists,
        ),
        (
            "kvrelay_discovery_rebinds_total",
            "etcd namespace query sets rebound because one of their streams ended.",
            discovery.rebinds,
        ),
    ] {
        out.single(name, Kind::Counter, help, value);
    }
    out.single(
        "kvrelay_discovery_revision",
        Kind::Gauge,
        "etcd revision applied (0 for the file backend).",
        u64::try_from(discovery.revision).unwrap_or(0),
    );
    out.single(
        "kvrelay_discovery_watch_streams",
        Kind::Gauge,
        "etcd watch streams open (one for the whole store, or one per queried namespace).",
        discovery.watch_streams,
    );
    let soft = &discovery.soft_errors;
    out.counter_by_kind(
        "kvrelay_discovery_soft_errors_total",
        "Soft discovery errors (records left out while the rest stands) that appeared, by kind.",
        &[],
        SoftErrorKind::ALL
            .map(|kind| (kind.as_str(), soft.appeared.get(&kind).copied().unwrap_or(0))),
    );
    let name = "kvrelay_discovery_soft_errors";
    out.family(name, Kind::Gauge, "Soft discovery errors holding now, by kind.");
    for kind in SoftErrorKind::ALL {
        let value = soft.current.get(&kind).copied().unwrap_or(0);
        out.sample(name, &[("kind", kind.as_str())], value);
    }

    let plane = [("plane", snapshot.event_plane)];
    let events = &snapshot.events;
    out.input_counters(
        "kvrelay_event_plane_messages",
        "Event plane messages",
        &plane,
        &events.decode,
    );
    for (name, help, value) in [
        (
            "kvrelay_event_plane_delivered_total",
            "Event plane facts handed to the node.",
            events.delivered,
        ),
        (
            "kvrelay_event_plane_publisher_mismatches_total",
            "ZMQ messages naming another publisher than their channel.",
            events.publisher_mismatches,
        ),
        (
            "kvrelay_event_plane_connects_total",
            "Event plane connections established.",
            events.connects,
        ),
        (
            "kvrelay_event_plane_disconnects_total",
            "Event plane connection losses.",
            events.disconnects,
        ),
        (
            "kvrelay_event_plane_connect_failures_total",
            "Event plane connection attempts that failed.",
            events.connect_failures,
        ),
        (
            "kvrelay_event_plane_receive_errors_total",
            "Errors reading an event plane connection.",
            events.receive_errors,
        ),
        (
            "kvrelay_event_plane_channels_ignored_total",
            "Event channel records ignored.",
            events.channels_ignored,
        ),
        (
            "kvrelay_event_plane_channels_refused_total",
            "Event channel records refused at the table limit.",
            events.channels_refused,
        ),
        (
            "kvrelay_event_plane_client_drops_total",
            "Messages the event plane client dropped (slow consumer).",
            events.client_drops,
        ),
        (
            "kvrelay_event_plane_backlog_drops_total",
            "Messages dropped because the event plane's backlog held its byte budget.",
            events.backlog_drops,
        ),
    ] {
        out.family(name, Kind::Counter, help);
        out.sample(name, &plane, value);
    }
    if snapshot.event_plane == "nats" {
        for (name, kind, help, value) in [
            (
                "kvrelay_event_plane_subscription_bytes_max",
                Kind::Gauge,
                "Byte budget of the NATS plane's backlog (what a subscription queue is sized for).",
                events.subscription_bytes_max,
            ),
            (
                "kvrelay_event_plane_subscription_capacity",
                Kind::Gauge,
                "Messages one NATS subscription's queue holds (byte budget over max_payload, at least 16384).",
                events.subscription_capacity,
            ),
            (
                "kvrelay_event_plane_server_max_payload_bytes",
                Kind::Gauge,
                "The NATS server's max_payload the subscription capacity is derived from.",
                events.server_max_payload_bytes,
            ),
            (
                "kvrelay_event_plane_subscriptions",
                Kind::Gauge,
                "NATS subscriptions, each with its own queue.",
                events.subscriptions,
            ),
            (
                "kvrelay_event_plane_backlog_bytes_peak",
                Kind::Gauge,
                "Most bytes of decoded NATS messages held while the node's queue was full.",
                events.backlog_bytes_peak,
            ),
            (
                "kvrelay_event_plane_client_rebuilds_total",
                Kind::Counter,
                "NATS clients rebuilt for the server's max_payload.",
                events.client_rebuilds,
            ),
        ] {
            out.family(name, kind, help);
            out.sample(name, &plane, value);
        }
    }
    out.counter_by_kind(
        "kvrelay_event_plane_zmtp_errors_total",
        "ZMTP protocol violations that ended a session, by kind.",
        &plane,
        ZmtpErrorKind::ALL.map(|kind| (kind.name(), events.zmtp_errors.get(kind))),
    );

    let recovery = &snapshot.recovery;
    for (name, help, value) in [
        ("kvrelay_recovery_queries_total", "Recovery queries started.", recovery.queries),
        ("kvrelay_recovery_answered_total", "Recovery queries answered.", recovery.answered),
        (
            "kvrelay_recovery_failed_total",
            "Recovery queries failed (timeouts included).",
            recovery.failed,
        ),
        ("kvrelay_recovery_timeouts_total", "Recovery queries timed out.", recovery.timeouts),
        (
            "kvrelay_recovery_connections_opened_total",
            "Request plane connections opened.",
            recovery.connections_opened,
        ),
        (
            "kvrelay_recovery_call_homes_malformed_total",
            "Call-home connections with an unreadable or late handshake.",
            recovery.call_homes_malformed,
        ),
        (
            "kvrelay_recovery_answer_bytes_waits_total",
            "Times a recovery answer's read waited for the answers' shared byte budget.",
            recovery.answer_bytes_waits,
        ),
    ] {
        out.single(name, Kind::Counter, help, value);
    }
    out.single(
        "kvrelay_recovery_answer_bytes",
        Kind::Gauge,
        "Bytes of recovery answers being read (bounded by the answers' shared byte budget).",
        recovery.answer_bytes_in_use,
    );
    out.single(
        "kvrelay_recovery_answer_bytes_peak",
        Kind::Gauge,
        "Most bytes of recovery answers read at once since the relay started.",
        recovery.answer_bytes_peak,
    );
    out.single(
        "kvrelay_recovery_answer_bytes_max",
        Kind::Gauge,
        "The recovery answers' shared byte budget (DYN_RELAY_RECOVERY_ANSWERS_BYTES_MAX).",
        recovery.answer_bytes_max,
    );

    if let Some(sources) = &snapshot.sources {
        out.single(
            "kvrelay_sources_namespace_count",
            Kind::Gauge,
            "Namespaces selected by the sources file.",
            count(sources.report.count),
        );
        out.single(
            "kvrelay_sources_reloads_total",
            Kind::Counter,
            "Sources file selections applied.",
            sources.reloads,
        );
        out.single(
            "kvrelay_sources_refusals_total",
            Kind::Counter,
            "Sources file reads refused (the last good selection was kept).",
            sources.refusals,
        );
        out.single(
            "kvrelay_sources_last_read_refused",
            Kind::Gauge,
            "1 if the latest sources file read was refused.",
            u64::from(sources.report.last_error.is_some()),
        );
    }
}

/// The input journal's counters, with `--record`.
fn journal_families(out: &mut Exposition, snapshot: &OpsSnapshot) {
    let Some(recording) = &snapshot.recording else {
        return;
    };
    out.single(
        "kvrelay_journal_recording",
        Kind::Gauge,
        "1 if the input journal is recording (0: it could not start).",
        u64::from(recording.active),
    );
    let stats = &recording.stats;
    out.single(
        "kvrelay_journal_queue_bytes",
        Kind::Gauge,
        "Bytes of journal records queued for the writer (at most the queue's byte budget).",
        stats.queue_bytes,
    );
    if recording.active {
        out.single(
            "kvrelay_journal_queue_bytes_max",
            Kind::Gauge,
            "The journal queue's byte budget (DYN_RELAY_JOURNAL_QUEUE_BYTES_MAX).",
            stats.queue_bytes_max,
        );
    }
    for (name, help, value) in [
        (
            "kvrelay_journal_records_written_total",
            "Journal records on disk (gap markers included).",
            stats.records_written,
        ),
        (
            "kvrelay_journal_records_dropped_total",
            "Journal records lost (queue full, write failure, unencodable).",
            stats.records_dropped,
        ),
        (
            "kvrelay_journal_records_dropped_queue_bytes_total",
            "Journal records dropped at the queue's byte budget (also in records_dropped).",
            stats.records_dropped_queue_bytes,
        ),
        ("kvrelay_journal_write_errors_total", "Journal write errors.", stats.write_errors),
        ("kvrelay_journal_bytes_written_total", "Journal bytes written.", stats.bytes_written),
        (
            "kvrelay_journal_segments_deleted_total",
            "Journal segments deleted by retention.",
            stats.segments_deleted,
        ),
    ] {
        out.single(name, Kind::Counter, help, value);
    }
}
