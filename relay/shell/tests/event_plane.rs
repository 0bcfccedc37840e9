//! The production event planes against real peers on loopback:
//!
//! - NATS: a real `nats-server` child process (Debian's package; `.ci/run` installs it), Dynamo-
//!   shaped envelopes published with the repository's encoders and the hand-typed capture of
//!   `reference/dynamo-planes-wire.md` §B.5, and a server restart to check re-subscription;
//! - ZMQ: in-process `zeromq` PUB sockets sending the exact captured frames of §B.5, a publisher
//!   that comes up late, and channel removal.
//!
//! Every test is bounded in time; the NATS server is killed by PID when its guard drops, also
//! when a test fails.

mod servers;

use std::time::Duration;

use bytes::Bytes;
use kvrelay::event_plane::{
    BACKLOG_ENTRY_BYTES, ChannelChange, EventPlaneCounters, EventPlaneError,
    NATS_SUBSCRIPTION_CAPACITY_MIN, NatsEventPlaneConfig, NatsNamespaces, ZmqEventPlaneConfig,
    run_nats_event_plane, run_zmq_event_plane,
};
use kvrelay_core::inputs::{
    DcInput, EventChannelRecord, EventEnvelope, EventRecordKey, EventTransport, InputErrorKind,
    KV_EVENTS_TOPIC, KV_METRICS_TOPIC, LoadObservation, encode_active_load, encode_event_envelope,
    encode_kv_events_payload, encode_zmq_event_frame,
};
use kvrelay_core::model::hashing::{ExternalBlockHash, LocalBlockHash};
use kvrelay_core::model::identity::EndpointPath;
use kvrelay_core::model::kv_events::{
    KvCacheEvent, KvCacheEventData, ResidencyDomain, RouterEvent, SourceKey, StorageTier,
    StoreData, StoredBlock,
};
use servers::{NatsServer, free_port};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

/// Bound of every test.
const TEST_TIMEOUT: Duration = Duration::from_secs(90);
/// The captured aggregated worker (`backend`) and its `kv-events` publisher.
const BACKEND_INSTANCE: u64 = 13_864_542_646_465_346_627;
const BACKEND_PUBLISHER: u64 = 7_327_664_155_944_878;
/// The worker id of probe messages, which only show that a subscription is live.
const PROBE_WORKER: u64 = 4_242;

/// The first `kv-events` envelope of §B.5, typed out byte for byte (280 bytes, 199-byte payload).
fn captured_envelope() -> Vec<u8> {
    let parts: &[&[u8]] = &[
        b"\x85",
        b"\xacpublisher_id\xcf\x00\x1a\x08\x78\xc3\x0c\x67\xae",
        b"\xa8sequence\x00",
        b"\xacpublished_at\xcf\x00\x00\x01\xa2\x2c\x55\xf2\x75",
        b"\xa5topic\xa9kv-events",
        b"\xa7payload\xc4\xc7",
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
    let envelope = parts.concat();
    assert_eq!(envelope.len(), 0x118);
    envelope
}

/// The events of [`captured_envelope`].
fn captured_events() -> Vec<RouterEvent> {
    vec![RouterEvent {
        worker_id: BACKEND_INSTANCE,
        storage_tier: StorageTier::Device,
        residency_domain: Some(ResidencyDomain::Worker),
        event: KvCacheEvent {
            event_id: 1,
            dp_rank: 0,
            data: KvCacheEventData::Stored(StoreData {
                parent_hash: None,
                start_position: None,
                blocks: vec![StoredBlock {
                    block_hash: ExternalBlockHash(0x48db_ac25_2265_b1f5),
                    tokens_hash: LocalBlockHash(0xea06_fc71_a5ee_6e88),
                }],
            }),
        },
    }]
}

/// A `kv_metrics` envelope made with the repository's encoders.
fn load_envelope(publisher_id: u64, sequence: u64, worker_id: u64, kv_used_blocks: u64) -> Vec<u8> {
    let payload = encode_active_load(&LoadObservation {
        source: SourceKey { worker_id, dp_rank: 0 },
        kv_used_blocks: Some(kv_used_blocks),
        active_decode_blocks: Some(0),
        active_prefill_tokens: None,
    })
    .unwrap();
    encode_event_envelope(&EventEnvelope {
        publisher_id,
        sequence,
        published_at_ms: 1_796_040_159_861,
        topic: KV_METRICS_TOPIC,
        payload: &payload,
    })
    .unwrap()
}

fn endpoint(namespace: &str, component: &str, name: &str) -> EndpointPath {
    EndpointPath::new(namespace, component, name).unwrap()
}

async fn bounded<F: std::future::Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, test).await.expect("test exceeded its time bound")
}

/// Receive the next input that is not a probe, failing after `wait`.
/// Waits until redundant sends have surely landed, then discards every pending input.
async fn settle_and_drain(inputs: &mut kvrelay::node::InputReceiver) {
    tokio::time::sleep(Duration::from_secs(1)).await;
    while inputs.try_recv_input().is_ok() {}
}

async fn next_input(inputs: &mut kvrelay::node::InputReceiver, wait: Duration) -> DcInput {
    tokio::time::timeout(wait, async {
        loop {
            let input = inputs.recv_input().await.expect("sink closed");
            if !is_probe(&input) {
                return input;
            }
        }
    })
    .await
    .expect("no input in time")
}

fn is_probe(input: &DcInput) -> bool {
    matches!(input, DcInput::Load { observation, .. } if observation.source.worker_id == PROBE_WORKER)
}

/// Publish a probe on `subject` every 100 ms until one comes through `inputs` (a live
/// subscription), failing after `wait`.
async fn probe_until_live(
    publisher: &async_nats::Client,
    subject: &str,
    inputs: &mut kvrelay::node::InputReceiver,
    wait: Duration,
) {
    let probe = Bytes::from(load_envelope(1, 0, PROBE_WORKER, 1));
    tokio::time::timeout(wait, async {
        loop {
            let _ = publisher.publish(subject.to_owned(), probe.clone()).await;
            let _ = publisher.flush().await;
            if let Ok(Some(input)) =
                tokio::time::timeout(Duration::from_millis(100), inputs.recv_input()).await
                && is_probe(&input)
            {
                return;
            }
        }
    })
    .await
    .expect("the subscription did not come (back) up in time");
}

/// A NATS plane started on `config` with a node queue of `queue_items` inputs: its task, the
/// node's end of the queue, its counters and its cancellation.
struct NatsPlane {
    task: JoinHandle<Result<(), EventPlaneError>>,
    inputs: kvrelay::node::InputReceiver,
    counters: EventPlaneCounters,
    cancel: CancellationToken,
}

fn start_nats_plane(config: NatsEventPlaneConfig, queue_items: usize) -> NatsPlane {
    let (sink, inputs) =
        kvrelay::node::input_queue(queue_items, kvrelay::node::INPUT_QUEUE_BYTES_MAX_DEFAULT);
    let counters = EventPlaneCounters::new();
    let cancel = CancellationToken::new();
    let task = kvrelay::runtime::spawn(run_nats_event_plane(
        config,
        sink,
        counters.clone(),
        cancel.clone(),
    ));
    NatsPlane { task, inputs, counters, cancel }
}

/// Publish `count` load reports of `worker` (their `kv_used_blocks` = their sequence) at once.
async fn publish_load_burst(
    publisher: &async_nats::Client,
    subject: &str,
    worker: u64,
    count: u64,
) {
    for sequence in 0..count {
        let body = Bytes::from(load_envelope(worker, sequence, worker, sequence));
        publisher.publish(subject.to_owned(), body).await.unwrap();
    }
    publisher.flush().await.unwrap();
}

/// Every load report that arrives until the queue stays empty for 500 ms: its `kv_used_blocks`
/// and the input's weight.
async fn receive_loads(inputs: &mut kvrelay::node::InputReceiver) -> Vec<(Option<u64>, usize)> {
    let mut received = Vec::new();
    while let Ok(Some(input)) =
        tokio::time::timeout(Duration::from_millis(500), inputs.recv_input()).await
    {
        let DcInput::Load { observation, .. } = &input else { panic!("{input:?}") };
        received.push((observation.kv_used_blocks, input.weight_bytes()));
    }
    received
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_plane_delivers_dynamo_envelopes_and_survives_a_server_restart() {
    bounded(async {
        let port = free_port();
        let server = NatsServer::start_on(port).await;
        let url = server.url();
        let namespaces = NatsNamespaces::Only(["dynamo".to_owned(), "team.a".to_owned()].into());
        let config = NatsEventPlaneConfig::new(url.clone(), namespaces);
        let NatsPlane { task: plane, mut inputs, counters, cancel } = start_nats_plane(config, 16);
        let publisher = async_nats::connect(url.as_str()).await.unwrap();

        let events_subject = "namespace.dynamo.component.backend.endpoint.generate.kv-events";
        let metrics_subject = "namespace.dynamo.component.backend.endpoint.generate.kv_metrics";
        probe_until_live(&publisher, metrics_subject, &mut inputs, Duration::from_secs(20)).await;

        // The captured envelope is also a NATS body: the endpoint comes from the subject.
        publisher.publish(events_subject, Bytes::from(captured_envelope())).await.unwrap();
        publisher.flush().await.unwrap();
        let DcInput::KvEvents(batch) = next_input(&mut inputs, Duration::from_secs(5)).await else {
            panic!("expected a KV event batch");
        };
        assert_eq!(batch.endpoint, endpoint("dynamo", "backend", "generate"));
        assert_eq!((batch.publisher_id, batch.sequence), (BACKEND_PUBLISHER, 0));
        assert_eq!(batch.published_at_ms, 1_796_040_159_861);
        assert_eq!(batch.events, captured_events());

        // A namespace with a '.' is watched under its escaped subject segment.
        let escaped = "namespace.team%2Ea.component.prefill.endpoint.generate.kv_metrics";
        publisher.publish(escaped, Bytes::from(load_envelope(9, 3, 77, 12))).await.unwrap();
        publisher.flush().await.unwrap();
        let DcInput::Load { endpoint: load_endpoint, observation } =
            next_input(&mut inputs, Duration::from_secs(5)).await
        else {
            panic!("expected a load report");
        };
        assert_eq!(load_endpoint, endpoint("team.a", "prefill", "generate"));
        assert_eq!(observation.source, SourceKey { worker_id: 77, dp_rank: 0 });
        assert_eq!(observation.kv_used_blocks, Some(12));

        // Malformed bodies are counted and dropped; unwatched namespaces never arrive. The
        // valid batch behind them on the same subject shows they were processed.
        let before = counters.snapshot();
        publisher.publish(events_subject, Bytes::from_static(b"\xc1 not msgpack")).await.unwrap();
        publisher
            .publish(
                "namespace.other.component.backend.endpoint.generate.kv-events",
                Bytes::from(captured_envelope()),
            )
            .await
            .unwrap();
        publisher.publish(events_subject, Bytes::from(captured_envelope())).await.unwrap();
        publisher.flush().await.unwrap();
        let DcInput::KvEvents(batch) = next_input(&mut inputs, Duration::from_secs(5)).await else {
            panic!("expected a KV event batch");
        };
        assert_eq!(batch.endpoint, endpoint("dynamo", "backend", "generate"));
        let after = counters.snapshot();
        assert_eq!(after.decode.rejected_total(), before.decode.rejected_total() + 1);
        assert_eq!(
            after.decode.rejected(InputErrorKind::MessagePack),
            before.decode.rejected(InputErrorKind::MessagePack) + 1
        );

        // Restart the server on the same port: the client reconnects and re-subscribes.
        drop(server);
        let server = NatsServer::start_on(port).await;
        probe_until_live(&publisher, metrics_subject, &mut inputs, Duration::from_secs(40)).await;
        publisher.publish(events_subject, Bytes::from(captured_envelope())).await.unwrap();
        publisher.flush().await.unwrap();
        let DcInput::KvEvents(batch) = next_input(&mut inputs, Duration::from_secs(5)).await else {
            panic!("expected a KV event batch after the restart");
        };
        assert_eq!(batch.events, captured_events());
        let stats = counters.snapshot();
        assert!(stats.connects >= 2, "{stats:?}");
        assert!(stats.disconnects >= 1, "{stats:?}");
        // NATS's default max_payload: the default budget holds 64 messages per subscription,
        // raised to the floor, and the first client needed no rebuild.
        assert_eq!(
            (stats.server_max_payload_bytes, stats.subscription_capacity),
            (1 << 20, NATS_SUBSCRIPTION_CAPACITY_MIN as u64)
        );
        assert_eq!((stats.subscriptions, stats.client_rebuilds), (4, 0));

        cancel.cancel();
        assert!(matches!(plane.await.unwrap(), Ok(())));
        drop(server);
    })
    .await;
}

/// Each subscription's queue inside the NATS client is sized from the server's `max_payload`:
/// under a 1 GiB budget a server configured for 16 KiB messages gets 65,536 messages per
/// subscription (the client first built for NATS's default 1 MiB, 16,384 messages, is replaced
/// before it subscribes). A burst while the node takes nothing is held in the plane's backlog,
/// not dropped. A restart with 32 KiB makes the plane rebuild its client for 32,768 messages; a
/// restart with 16 KiB again keeps it (a smaller `max_payload` never rebuilds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_subscription_queues_hold_the_byte_budget_of_the_servers_max_payload() {
    bounded(async {
        const MIB: usize = 1 << 20;
        let port = free_port();
        const KIB: usize = 1 << 10;
        let server = NatsServer::start_with_max_payload(port, 16 * KIB).await;
        let url = server.url();
        let namespaces = NatsNamespaces::Only(["dynamo".to_owned()].into());
        let config = NatsEventPlaneConfig {
            subscription_bytes_max: 1024 * MIB,
            ..NatsEventPlaneConfig::new(url.clone(), namespaces)
        };
        // The node's queue holds one input: the plane blocks on the second one it takes.
        let NatsPlane { task: plane, mut inputs, counters, cancel } = start_nats_plane(config, 1);
        let publisher = async_nats::connect(url.as_str()).await.unwrap();
        assert_eq!(publisher.server_info().max_payload, 16 * KIB);
        let subject = "namespace.dynamo.component.backend.endpoint.generate.kv_metrics";
        probe_until_live(&publisher, subject, &mut inputs, Duration::from_secs(20)).await;
        let stats = counters.snapshot();
        assert_eq!(
            (stats.server_max_payload_bytes, stats.subscription_capacity, stats.subscriptions),
            (16 * KIB as u64, 65_536, 2),
            "{stats:?}"
        );
        assert_eq!(stats.client_rebuilds, 1, "{stats:?}");
        assert_eq!(stats.client_drops, 0, "{stats:?}");

        // A burst of 100 messages while nothing reads the node's queue: the plane keeps taking
        // them into its backlog.
        settle_and_drain(&mut inputs).await;
        const BURST: u64 = 100;
        publish_load_burst(&publisher, subject, 5, BURST).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let received: Vec<Option<u64>> =
            receive_loads(&mut inputs).await.into_iter().map(|(used, _)| used).collect();
        let stats = counters.snapshot();
        assert_eq!(received, (0..BURST).map(Some).collect::<Vec<_>>(), "every message, in order");
        assert_eq!(stats.client_drops, 0, "{stats:?}");
        assert!(stats.backlog_bytes_peak > 0, "{stats:?}");

        // The server comes back allowing 32 KiB messages: the plane's client reconnects, finds
        // the larger max_payload, and is replaced by one holding 32,768 messages per
        // subscription.
        drop(server);
        let server = NatsServer::start_with_max_payload(port, 32 * KIB).await;
        probe_until_live(&publisher, subject, &mut inputs, Duration::from_secs(40)).await;
        let stats = counters.snapshot();
        assert_eq!(
            (stats.server_max_payload_bytes, stats.subscription_capacity, stats.client_rebuilds),
            (32 * KIB as u64, 32_768, 2),
            "{stats:?}"
        );

        // Back to 16 KiB: a smaller max_payload keeps the client built for 32 KiB.
        drop(server);
        let server = NatsServer::start_with_max_payload(port, 16 * KIB).await;
        probe_until_live(&publisher, subject, &mut inputs, Duration::from_secs(40)).await;
        let stats = counters.snapshot();
        assert_eq!((stats.subscription_capacity, stats.client_rebuilds), (32_768, 2), "{stats:?}");

        cancel.cancel();
        assert!(matches!(plane.await.unwrap(), Ok(())));
        drop(server);
    })
    .await;
}

/// The plane's backlog holds its byte budget and no more: with the smallest budget (1 MiB) and a
/// node that takes nothing, a burst far larger than the budget is held up to it, the rest is
/// dropped and counted, and what was held arrives in order once the node reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_backlog_holds_its_byte_budget_and_drops_and_counts_beyond_it() {
    bounded(async {
        const MIB: usize = 1 << 20;
        let server = NatsServer::start().await;
        let url = server.url();
        let namespaces = NatsNamespaces::Only(["dynamo".to_owned()].into());
        let config = NatsEventPlaneConfig {
            subscription_bytes_max: MIB,
            ..NatsEventPlaneConfig::new(url.clone(), namespaces)
        };
        let NatsPlane { task: plane, mut inputs, counters, cancel } = start_nats_plane(config, 1);
        let publisher = async_nats::connect(url.as_str()).await.unwrap();
        let subject = "namespace.dynamo.component.backend.endpoint.generate.kv_metrics";
        probe_until_live(&publisher, subject, &mut inputs, Duration::from_secs(20)).await;
        assert_eq!(
            counters.snapshot().subscription_capacity,
            NATS_SUBSCRIPTION_CAPACITY_MIN as u64
        );
        settle_and_drain(&mut inputs).await;

        const BURST: u64 = 20_000;
        publish_load_burst(&publisher, subject, 6, BURST).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let received = receive_loads(&mut inputs).await;
        let stats = counters.snapshot();
        let weight = received.first().map_or(0, |&(_, weight)| weight);
        assert!(weight > 0 && received.iter().all(|&(_, w)| w == weight), "equal weights");
        // Held: the backlog's budget (each input weighs its own bytes and its place in the
        // queue) plus the one input that passes it; beside it one input in the node's queue
        // and one reserved in flight.
        let held_weight = weight + BACKLOG_ENTRY_BYTES;
        let held_max = MIB / held_weight + 1 + 2;
        assert!(
            received.len() >= MIB / held_weight && received.len() <= held_max,
            "{} received, between {} and {held_max} expected",
            received.len(),
            MIB / held_weight
        );
        assert!(received.windows(2).all(|pair| pair[0].0 < pair[1].0), "in order");
        assert!(stats.backlog_drops > 0, "the backlog dropped past its budget: {stats:?}");
        // Every message is delivered or counted (the client's own drop notices can be
        // under-counted, so the sum is exact only when it dropped none).
        let accounted = received.len() as u64 + stats.backlog_drops;
        if stats.client_drops == 0 {
            assert_eq!(accounted, BURST, "{stats:?}");
        } else {
            assert!(accounted + stats.client_drops <= BURST, "{stats:?}");
        }
        let peak = stats.backlog_bytes_peak as usize;
        assert!(peak >= MIB && peak < MIB + held_weight, "backlog peak {peak}");

        cancel.cancel();
        assert!(matches!(plane.await.unwrap(), Ok(())));
        drop(server);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_plane_fails_clearly_without_namespaces() {
    let config = NatsEventPlaneConfig::new("nats://127.0.0.1:1", NatsNamespaces::Only([].into()));
    let (sink, _inputs) =
        kvrelay::node::input_queue(1, kvrelay::node::INPUT_QUEUE_BYTES_MAX_DEFAULT);
    let result =
        run_nats_event_plane(config, sink, EventPlaneCounters::new(), CancellationToken::new())
            .await;
    assert!(matches!(result, Err(EventPlaneError::InvalidConfig(_))));
}

/// A ZMQ PUB socket bound on 127.0.0.1.
async fn bind_publisher(port: u16) -> (PubSocket, String) {
    let mut socket = PubSocket::new();
    let bound = socket.bind(&format!("tcp://127.0.0.1:{port}")).await.unwrap();
    (socket, bound.to_string())
}

/// The 4 frames of §B.5: topic, publisher id and sequence (u64 BE), event frame.
fn zmq_message(topic: &str, publisher_id: u64, sequence: u64, event_frame: Vec<u8>) -> ZmqMessage {
    ZmqMessage::try_from(vec![
        Bytes::copy_from_slice(topic.as_bytes()),
        Bytes::copy_from_slice(&publisher_id.to_be_bytes()),
        Bytes::copy_from_slice(&sequence.to_be_bytes()),
        Bytes::from(event_frame),
    ])
    .unwrap()
}

/// The captured first `kv-events` message of §B.5, frame 3 written out as on the wire.
fn captured_zmq_message() -> ZmqMessage {
    let mut frame = vec![0x01, 0x00, 0x00, 0x01, 0x18];
    frame.extend(captured_envelope());
    assert_eq!(frame.len(), 285, "frame3 LAST|LONG size 285");
    zmq_message(KV_EVENTS_TOPIC, BACKEND_PUBLISHER, 0, frame)
}

fn channel(scope: &EndpointPath, topic: &str, publisher_id: u64, endpoint: &str) -> ChannelChange {
    ChannelChange::Upsert(EventChannelRecord {
        scope: scope.clone(),
        topic: topic.to_owned(),
        publisher_id,
        transport: EventTransport::Zmq { endpoint: endpoint.to_owned() },
    })
}

/// Send `message` every 50 ms until an input comes through (PUB/SUB drops messages sent before
/// the subscription reached the publisher), failing after `wait`.
async fn publish_until_received(
    socket: &mut PubSocket,
    message: &ZmqMessage,
    inputs: &mut kvrelay::node::InputReceiver,
    wait: Duration,
) -> DcInput {
    tokio::time::timeout(wait, async {
        loop {
            socket.send(message.clone()).await.unwrap();
            if let Ok(Some(input)) =
                tokio::time::timeout(Duration::from_millis(50), inputs.recv_input()).await
            {
                return input;
            }
        }
    })
    .await
    .expect("no message came through the ZMQ subscription in time")
}

fn fast_zmq_config() -> ZmqEventPlaneConfig {
    ZmqEventPlaneConfig {
        connect_timeout: Duration::from_millis(200),
        reconnect_backoff_initial: Duration::from_millis(50),
        reconnect_backoff_max: Duration::from_millis(400),
        ..ZmqEventPlaneConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zmq_plane_decodes_the_captured_frames_per_channel() {
    bounded(async {
        let scope = endpoint("dynamo", "backend", "generate");
        let (mut events_pub, events_endpoint) = bind_publisher(0).await;
        let (mut metrics_pub, metrics_endpoint) = bind_publisher(0).await;
        let (changes_tx, changes) = mpsc::channel(8);
        let (sink, mut inputs) =
            kvrelay::node::input_queue(16, kvrelay::node::INPUT_QUEUE_BYTES_MAX_DEFAULT);
        let counters = EventPlaneCounters::new();
        let cancel = CancellationToken::new();
        let plane = kvrelay::runtime::spawn(run_zmq_event_plane(
            fast_zmq_config(),
            changes,
            sink,
            counters.clone(),
            cancel.clone(),
        ));
        changes_tx
            .send(channel(&scope, KV_EVENTS_TOPIC, BACKEND_PUBLISHER, &events_endpoint))
            .await
            .unwrap();
        // The `kv_metrics` channel is a separate publisher with its own id.
        let metrics_publisher = BACKEND_PUBLISHER + 1;
        changes_tx
            .send(channel(&scope, KV_METRICS_TOPIC, metrics_publisher, &metrics_endpoint))
            .await
            .unwrap();

        let input = publish_until_received(
            &mut events_pub,
            &captured_zmq_message(),
            &mut inputs,
            Duration::from_secs(20),
        )
        .await;
        let DcInput::KvEvents(batch) = input else { panic!("expected a KV event batch") };
        assert_eq!(batch.endpoint, scope);
        assert_eq!((batch.publisher_id, batch.sequence), (BACKEND_PUBLISHER, 0));
        assert_eq!(batch.events, captured_events());
        settle_and_drain(&mut inputs).await;

        // The captured `kv_metrics` message: a 177-byte event frame (`01 000000ac`).
        let frame =
            encode_zmq_event_frame(&load_envelope(metrics_publisher, 7, BACKEND_INSTANCE, 3))
                .unwrap();
        assert_eq!(frame[..5], [0x01, 0x00, 0x00, 0x00, 0xac]);
        assert_eq!(frame.len(), 177);
        let metrics = zmq_message(KV_METRICS_TOPIC, metrics_publisher, 7, frame);
        let input = publish_until_received(
            &mut metrics_pub,
            &metrics,
            &mut inputs,
            Duration::from_secs(20),
        )
        .await;
        let DcInput::Load { endpoint: load_endpoint, observation } = input else {
            panic!("expected a load report")
        };
        assert_eq!(load_endpoint, scope);
        assert_eq!(observation.source, SourceKey { worker_id: BACKEND_INSTANCE, dp_rank: 0 });
        assert_eq!(observation.kv_used_blocks, Some(3));

        // `publish_until_received` re-sends every 50 ms, so copies may still be in flight: let
        // them land and drain them before counting.
        settle_and_drain(&mut inputs).await;

        // On the kv-events channel: a kv_metrics frame is filtered by the PUB (prefix
        // subscription), a bad event frame and a foreign publisher are counted, then a valid
        // message (its own envelope sequence marks it) shows all of them were processed in order.
        let before = counters.snapshot();
        events_pub.send(metrics.clone()).await.unwrap();
        let mut bad_frame = vec![0x02, 0x00, 0x00, 0x01, 0x18];
        bad_frame.extend(captured_envelope());
        events_pub
            .send(zmq_message(KV_EVENTS_TOPIC, BACKEND_PUBLISHER, 1, bad_frame))
            .await
            .unwrap();
        let payload = encode_kv_events_payload(&captured_events()).unwrap();
        let foreign = encode_event_envelope(&EventEnvelope {
            publisher_id: 5,
            sequence: 2,
            published_at_ms: 1,
            topic: KV_EVENTS_TOPIC,
            payload: &payload,
        })
        .unwrap();
        let foreign = encode_zmq_event_frame(&foreign).unwrap();
        events_pub.send(zmq_message(KV_EVENTS_TOPIC, 5, 2, foreign)).await.unwrap();
        let marker = encode_event_envelope(&EventEnvelope {
            publisher_id: BACKEND_PUBLISHER,
            sequence: 9,
            published_at_ms: 1,
            topic: KV_EVENTS_TOPIC,
            payload: &payload,
        })
        .unwrap();
        let marker = encode_zmq_event_frame(&marker).unwrap();
        events_pub.send(zmq_message(KV_EVENTS_TOPIC, BACKEND_PUBLISHER, 9, marker)).await.unwrap();
        let DcInput::KvEvents(batch) = next_input(&mut inputs, Duration::from_secs(5)).await else {
            panic!("expected a KV event batch");
        };
        assert_eq!(batch.sequence, 9, "the marker is the only input after the drain");
        // `delivered` is counted once the sink accepted the input, just after we can see it.
        let after = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                let after = counters.snapshot();
                if after.delivered > before.delivered {
                    return after;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the marker was never counted as delivered");
        assert_eq!(
            after.decode.rejected(InputErrorKind::MalformedEventFrame),
            before.decode.rejected(InputErrorKind::MalformedEventFrame) + 1
        );
        assert_eq!(after.decode.rejected_total(), before.decode.rejected_total() + 1);
        assert_eq!(after.publisher_mismatches, before.publisher_mismatches + 1);
        assert_eq!(after.delivered, before.delivered + 1);

        cancel.cancel();
        assert!(matches!(plane.await.unwrap(), Ok(())));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zmq_plane_waits_for_a_late_publisher_and_stops_on_removal() {
    bounded(async {
        let scope = endpoint("dynamo", "backend", "generate");
        let port = free_port();
        let advertised = format!("tcp://127.0.0.1:{port}");
        let (changes_tx, changes) = mpsc::channel(8);
        let (sink, mut inputs) =
            kvrelay::node::input_queue(16, kvrelay::node::INPUT_QUEUE_BYTES_MAX_DEFAULT);
        let counters = EventPlaneCounters::new();
        let cancel = CancellationToken::new();
        let plane = kvrelay::runtime::spawn(run_zmq_event_plane(
            fast_zmq_config(),
            changes,
            sink,
            counters.clone(),
            cancel.clone(),
        ));
        changes_tx
            .send(channel(&scope, KV_EVENTS_TOPIC, BACKEND_PUBLISHER, &advertised))
            .await
            .unwrap();

        // Nothing listens yet: attempts fail and back off.
        tokio::time::timeout(Duration::from_secs(10), async {
            while counters.snapshot().connect_failures == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("no failed connection attempt was counted");

        // The publisher comes up on the advertised port; its messages arrive.
        let (mut publisher, _) = bind_publisher(port).await;
        let input = publish_until_received(
            &mut publisher,
            &captured_zmq_message(),
            &mut inputs,
            Duration::from_secs(20),
        )
        .await;
        assert!(matches!(input, DcInput::KvEvents(_)));
        assert!(counters.snapshot().connects >= 1);

        // Re-advertising the same channel is a no-op; removing it ends the subscription.
        changes_tx
            .send(channel(&scope, KV_EVENTS_TOPIC, BACKEND_PUBLISHER, &advertised))
            .await
            .unwrap();
        changes_tx
            .send(ChannelChange::Remove(EventRecordKey {
                scope: scope.clone(),
                topic: KV_EVENTS_TOPIC.to_owned(),
                publisher_id: BACKEND_PUBLISHER,
            }))
            .await
            .unwrap();
        // Drain what was in flight, then nothing more arrives.
        settle_and_drain(&mut inputs).await;
        for _ in 0..10 {
            publisher.send(captured_zmq_message()).await.unwrap();
        }
        let late = tokio::time::timeout(Duration::from_millis(500), inputs.recv_input()).await;
        assert!(late.is_err(), "a removed channel still delivered {late:?}");

        // Closing the change stream stops the plane cleanly.
        drop(changes_tx);
        assert!(matches!(plane.await.unwrap(), Ok(())));
    })
    .await;
}

/// What a hostile publisher does once a subscriber has completed the handshake.
#[derive(Debug, Clone, Copy)]
enum Attack {
    /// Declare one frame of 2^40 bytes and send 64 KiB of its body.
    HugeFrame,
    /// Send small frames flagged MORE without end.
    EndlessMultipart,
}

/// One connection the hostile publisher accepted.
#[derive(Debug, Clone)]
struct HostileSession {
    accepted_at: tokio::time::Instant,
    /// The subscription bytes the relay sent after the handshake.
    subscription: Vec<u8>,
    /// Bytes of the attack written before the relay dropped the connection.
    attack_bytes: u64,
    /// Whether the relay dropped the connection (rather than the attack running out of time).
    dropped: bool,
}

/// Most attack bytes one session writes before giving up (the relay never read that far).
const ATTACK_BYTES_MAX: u64 = 256 << 20;

/// A raw ZMTP 3.1 PUB on 127.0.0.1 that completes the handshake, reads the subscription, then
/// runs `attack`; each session is recorded when it ends (bounded to 10 s).
async fn hostile_publisher(
    attack: Attack,
) -> (String, std::sync::Arc<std::sync::Mutex<Vec<HostileSession>>>, JoinHandle<()>) {
    use kvrelay::event_plane::{encode_greeting, encode_message_frame, encode_ready};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let sessions = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = sessions.clone();
    let task = kvrelay::runtime::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else { return };
            let accepted_at = tokio::time::Instant::now();
            let record = record.clone();
            kvrelay::runtime::spawn(async move {
                let session = tokio::time::timeout(Duration::from_secs(10), async {
                    // The relay's greeting (64 B) and READY (27 B), then ours.
                    let mut hello = [0u8; 91];
                    stream.read_exact(&mut hello).await.ok()?;
                    let mut ours = encode_greeting().to_vec();
                    ours.extend(encode_ready(b"PUB"));
                    stream.write_all(&ours).await.ok()?;
                    // The 3.1 SUBSCRIBE command for `kv-events` is 21 bytes.
                    let mut subscription = vec![0u8; 21];
                    stream.read_exact(&mut subscription).await.ok()?;
                    let mut attack_bytes = 0u64;
                    let dropped = match attack {
                        Attack::HugeFrame => {
                            let mut frame = vec![0x02];
                            frame.extend((1u64 << 40).to_be_bytes());
                            frame.extend(vec![0u8; 64 << 10]);
                            // The relay may already have closed before the body is written.
                            if stream.write_all(&frame).await.is_ok() {
                                attack_bytes = frame.len() as u64;
                            }
                            let mut rest = [0u8; 64];
                            !matches!(stream.read(&mut rest).await, Ok(n) if n > 0)
                        }
                        Attack::EndlessMultipart => {
                            let chunk: Vec<u8> = (0..256)
                                .flat_map(|_| encode_message_frame(&[7u8; 255], true))
                                .collect();
                            loop {
                                if stream.write_all(&chunk).await.is_err() {
                                    break true;
                                }
                                attack_bytes += chunk.len() as u64;
                                if attack_bytes >= ATTACK_BYTES_MAX {
                                    break false;
                                }
                            }
                        }
                    };
                    Some(HostileSession { accepted_at, subscription, attack_bytes, dropped })
                })
                .await;
                if let Ok(Some(session)) = session {
                    record.lock().unwrap().push(session);
                }
            });
        }
    });
    (endpoint, sessions, task)
}

/// Resident memory of this test process, in KiB (Linux).
fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|line| line.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Run the ZMQ plane against a hostile publisher and a well-behaved one side by side: the hostile
/// sessions are refused with `kind` (counted, connection dropped, retried with a growing backoff),
/// memory stays put, and the well-behaved channel keeps delivering throughout.
async fn hostile_publisher_is_refused(attack: Attack, kind: kvrelay::event_plane::ZmtpErrorKind) {
    let rss_before = rss_kib();
    let scope = endpoint("dynamo", "backend", "generate");
    let hostile_scope = endpoint("dynamo", "hostile", "generate");
    let (hostile_endpoint, sessions, hostile_task) = hostile_publisher(attack).await;
    let (mut good_pub, good_endpoint) = bind_publisher(0).await;
    let (changes_tx, changes) = mpsc::channel(8);
    let (sink, mut inputs) =
        kvrelay::node::input_queue(16, kvrelay::node::INPUT_QUEUE_BYTES_MAX_DEFAULT);
    let counters = EventPlaneCounters::new();
    let cancel = CancellationToken::new();
    let config = fast_zmq_config();
    let plane = kvrelay::runtime::spawn(run_zmq_event_plane(
        config,
        changes,
        sink,
        counters.clone(),
        cancel.clone(),
    ));
    changes_tx.send(channel(&hostile_scope, KV_EVENTS_TOPIC, 99, &hostile_endpoint)).await.unwrap();
    changes_tx
        .send(channel(&scope, KV_EVENTS_TOPIC, BACKEND_PUBLISHER, &good_endpoint))
        .await
        .unwrap();
    let first = publish_until_received(
        &mut good_pub,
        &captured_zmq_message(),
        &mut inputs,
        Duration::from_secs(20),
    )
    .await;
    assert!(matches!(first, DcInput::KvEvents(ref batch) if batch.endpoint == scope));

    // Five hostile sessions, each refused and dropped.
    tokio::time::timeout(Duration::from_secs(30), async {
        while sessions.lock().unwrap().len() < 5 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the relay did not keep retrying the hostile publisher");
    let sessions = sessions.lock().unwrap().clone();
    let stats = counters.snapshot();
    assert!(stats.zmtp_errors.get(kind) >= 5, "{kind:?} not counted: {stats:?}");
    assert_eq!(stats.zmtp_errors.get(kind), stats.zmtp_errors.total());
    for session in &sessions {
        assert_eq!(
            session.subscription,
            [&[0x04, 0x13, 0x09][..], b"SUBSCRIBE", b"kv-events"].concat()
        );
        assert!(session.dropped, "the relay kept a hostile session open: {session:?}");
        // The relay stopped reading long before the attack ran out (socket buffers hold the rest).
        assert!(session.attack_bytes < 64 << 20, "{session:?}");
    }
    // No session carried a message, so the backoff keeps doubling up to its maximum.
    let mut accepted: Vec<_> = sessions.iter().map(|session| session.accepted_at).collect();
    accepted.sort();
    let mut wait = config.reconnect_backoff_initial;
    for pair in accepted.windows(2) {
        let gap = pair[1] - pair[0];
        assert!(gap + Duration::from_millis(5) >= wait, "retried after {gap:?}, backoff {wait:?}");
        wait = (wait * 2).min(config.reconnect_backoff_max);
    }

    // The well-behaved publisher is still read.
    settle_and_drain(&mut inputs).await;
    let again = publish_until_received(
        &mut good_pub,
        &captured_zmq_message(),
        &mut inputs,
        Duration::from_secs(20),
    )
    .await;
    assert!(matches!(again, DcInput::KvEvents(ref batch) if batch.endpoint == scope));
    let grown_mib = rss_kib().saturating_sub(rss_before) / 1024;
    assert!(grown_mib < 128, "resident memory grew by {grown_mib} MiB");

    cancel.cancel();
    assert!(matches!(plane.await.unwrap(), Ok(())));
    hostile_task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zmq_plane_refuses_a_frame_declared_at_2_pow_40_bytes() {
    bounded(hostile_publisher_is_refused(
        Attack::HugeFrame,
        kvrelay::event_plane::ZmtpErrorKind::FrameTooLarge,
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zmq_plane_refuses_an_endless_multipart_message() {
    bounded(hostile_publisher_is_refused(
        Attack::EndlessMultipart,
        kvrelay::event_plane::ZmtpErrorKind::TooManyFrames,
    ))
    .await;
}
