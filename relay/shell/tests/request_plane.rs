//! The recovery client against a fake Dynamo 1.6.1 worker written from
//! `reference/dynamo-planes-wire.md` §A: a TCP server that reads request frames on a persistent
//! connection, ACKs them, and calls home to the `connection_info` address with the handshake,
//! prologue, data, end marker and sentinel. Frames are byte-checked against the §A.9 capture.
//!
//! Everything runs on loopback and every test is bounded in time.

mod fake_worker;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use fake_worker::*;
use kvrelay::request_plane::{
    CALL_HOME_HANDSHAKE_TIMEOUT, CALL_HOME_HANDSHAKES_IN_FLIGHT_MAX, PayloadCodec, QueryPhase,
    RecoveryClient, RecoveryClientConfig, RecoveryError,
};
use kvrelay::runtime::TokioBlockingExecutor;
use kvrelay_core::inputs::{RecoveryTarget, RequestPlaneTransport};
use kvrelay_core::model::hashing::{ExternalBlockHash, LocalBlockHash};
use kvrelay_core::model::identity::EndpointPath;
use kvrelay_core::model::kv_events::{
    KvCacheEvent, KvCacheEventData, RemoveData, ResidencyDomain, RouterEvent, SourceKey,
    StorageTier, StoreData, StoredBlock,
};
use kvrelay_core::sources::{RecoveryRequest, RecoveryResponse, TreeDumpScope};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Bound of every test.
const TEST_TIMEOUT: Duration = Duration::from_secs(60);
/// The captured worker instance (`small`).
const SMALL_INSTANCE: u64 = 15_884_517_127_758_876_217;
/// The captured endpoint path (§A.2).
const CAPTURED_PATH: &str = "dc71242afcad0e39/dynamo/small/worker_kv_query_source_1bbe13eb67504f";

/// The 100-byte msgpack body of the captured tree-dump request (§A.9).
fn captured_request_body() -> Vec<u8> {
    [
        &b"\x86"[..],
        b"\xa9worker_id\xcf\xdc\x71\x24\x2a\xfc\xad\x0e\x39",
        b"\xa7dp_rank\x00",
        b"\xaestart_event_id\xc0",
        b"\xacend_event_id\xc0",
        b"\xb9supports_tree_dump_failed\xc3",
        b"\xa4kind\xa8recovery",
    ]
    .concat()
}

/// The captured tree-dump data frame body (§A.9), with its events 1 (stored) and 5 (removed)
/// typed out byte for byte (the capture elides events 2–4).
fn captured_tree_dump_body() -> Vec<u8> {
    let router_event_head: &[&[u8]] = &[
        b"\x84",
        b"\xa9worker_id\xcf\xdc\x71\x24\x2a\xfc\xad\x0e\x39",
        b"\xacstorage_tier\xa6device",
        b"\xb0residency_domain\xa6worker",
    ];
    [
        &[&b"\x82"[..], b"\xa4data\x81\xa8TreeDump\x83", b"\xa6events\x92"][..],
        router_event_head,
        &[
            b"\xa5event\x83\xa8event_id\x01",
            b"\xa4data\x81\xa6stored\x83\xabparent_hash\xc0\xaestart_position\xc0",
            b"\xa6blocks\x91\x83\xaablock_hash\xcf\x4b\xdb\xa8\x49\x3c\xeb\x3f\xfd",
            b"\xabtokens_hash\xcf\xea\x06\xfc\x71\xa5\xee\x6e\x88",
            b"\xadmm_extra_info\xc0",
            b"\xa7dp_rank\x00",
        ],
        router_event_head,
        &[
            b"\xa5event\x83\xa8event_id\x05",
            b"\xa4data\x81\xa7removed\x81\xacblock_hashes\x91\xcf\x4b\xdb\xa8\x49\x3c\xeb\x3f\xfd",
            b"\xa7dp_rank\x00",
            b"\xadlast_event_id\x05\xabreset_scope\xa3all",
            b"\xaecomplete_final\xc2",
        ],
    ]
    .concat()
    .concat()
}

/// `{complete_final: true}` in msgpack: the captured 17-byte end marker.
const CAPTURED_END_MARKER: &[u8] = b"\x81\xaecomplete_final\xc3";

/// The frames of a normal answer after the handshake: prologue, item, end marker, sentinel.
fn answer_frames(item_body: Vec<u8>) -> Vec<Vec<u8>> {
    vec![prologue(), two_part(b"", &item_body), two_part(b"", CAPTURED_END_MARKER), sentinel()]
}

impl FakeWorker {
    fn target(&self) -> RecoveryTarget {
        RecoveryTarget {
            endpoint: EndpointPath::new("dynamo", "small", "worker_kv_query_source_1bbe13eb67504f")
                .unwrap(),
            instance_id: SMALL_INSTANCE,
            transport: RequestPlaneTransport::Tcp(format!("{}/{CAPTURED_PATH}", self.address)),
        }
    }
}

async fn client(config: RecoveryClientConfig) -> RecoveryClient {
    RecoveryClient::bind(config, Arc::new(TokioBlockingExecutor)).await.unwrap()
}

fn dump_request() -> RecoveryRequest {
    RecoveryRequest::tree_dump(SourceKey { worker_id: SMALL_INSTANCE, dp_rank: 0 })
}

fn accept_and_answer(item_body: Vec<u8>) -> Script {
    Arc::new(move |_| Reply {
        ack: Some(Vec::new()),
        call_home: Some(answer_frames(item_body.clone())),
        ..Reply::default()
    })
}

async fn bounded<F: std::future::Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, test).await.expect("test exceeded its time bound")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captured_tree_dump_query_round_trips_byte_for_byte() {
    bounded(async {
        let mut worker = FakeWorker::start(accept_and_answer(captured_tree_dump_body())).await;
        let client = client(RecoveryClientConfig::new(11)).await;
        let answer =
            client.query(&worker.target(), dump_request(), Duration::from_secs(10)).await.unwrap();

        // The request frame, checked against the §A.9 capture.
        let request = worker.requests.recv().await.unwrap();
        assert_eq!(request.raw[..2], [0x00, 0x43], "path_len = 67");
        assert_eq!(request.path, CAPTURED_PATH);
        let id = request.control["id"].as_str().unwrap().to_owned();
        assert_eq!(request.headers["request-id"], id.as_str());
        assert_eq!(request.headers["x-endpoint-path"], CAPTURED_PATH);
        assert_eq!(request.checksum, 0);
        let address = client.advertised_address().to_owned();
        assert_eq!(address, client.response_address().to_string());
        let subject = request.info_text("subject");
        let expected_control = format!(
            concat!(
                r#"{{"id":"{id}","request_type":"single_in","response_type":"many_out","#,
                r#""payload_codec":"msgpack","connection_info":{{"transport":"tcp_server","#,
                r#""info":"{{\"address\":\"{address}\",\"subject\":\"{subject}\","#,
                r#"\"context\":\"{id}\",\"stream_type\":\"response\"}}"}}}}"#
            ),
            id = id,
            address = address,
            subject = subject,
        );
        assert_eq!(String::from_utf8(request.control_bytes.clone()).unwrap(), expected_control);
        if address.len() == "127.0.0.1:46067".len() {
            assert_eq!(request.control_bytes.len(), 348, "captured control header_len");
        }
        assert_eq!(request.body, captured_request_body());
        assert_eq!(request.info_text("context"), id);
        assert_eq!(id.len(), 36);
        assert_eq!(subject.len(), 36);

        // The answer, mapped to the domain.
        let block_hash = ExternalBlockHash(0x4bdb_a849_3ceb_3ffd);
        let head = |event_id, data| RouterEvent {
            worker_id: SMALL_INSTANCE,
            storage_tier: StorageTier::Device,
            residency_domain: Some(ResidencyDomain::Worker),
            event: KvCacheEvent { event_id, dp_rank: 0, data },
        };
        assert_eq!(
            answer,
            RecoveryResponse::TreeDump {
                events: vec![
                    head(
                        1,
                        KvCacheEventData::Stored(StoreData {
                            parent_hash: None,
                            start_position: None,
                            blocks: vec![StoredBlock {
                                block_hash,
                                tokens_hash: LocalBlockHash(0xea06_fc71_a5ee_6e88),
                            }],
                        })
                    ),
                    head(
                        5,
                        KvCacheEventData::Removed(RemoveData { block_hashes: vec![block_hash] })
                    ),
                ],
                last_event_id: 5,
                reset_scope: TreeDumpScope::Rank,
            }
        );
        // The relay closed the call-home connection after the sentinel, sending nothing.
        assert_eq!(worker.closed_by_relay.recv().await, Some(true));
        let stats = client.stats();
        assert_eq!((stats.queries, stats.answered, stats.failed), (1, 1, 0));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_after_the_stream_still_answers_and_the_connection_is_pooled() {
    bounded(async {
        let body = captured_tree_dump_body();
        let script: Script = Arc::new(move |_| Reply {
            ack: Some(Vec::new()),
            ack_after_stream: true,
            call_home: Some(answer_frames(body.clone())),
            ..Reply::default()
        });
        let worker = FakeWorker::start(script).await;
        let client = client(RecoveryClientConfig::new(12)).await;
        for _ in 0..3 {
            let answer = client
                .query(&worker.target(), dump_request(), Duration::from_secs(10))
                .await
                .unwrap();
            assert!(matches!(answer, RecoveryResponse::TreeDump { last_event_id: 5, .. }));
        }
        assert_eq!(worker.accepts.load(Ordering::SeqCst), 1, "one persistent request connection");
        let stats = client.stats();
        assert_eq!((stats.connections_opened, stats.connections_reused), (1, 2));
    })
    .await;
}

#[derive(Serialize)]
struct WireBlock {
    block_hash: u64,
    tokens_hash: u64,
    mm_extra_info: Option<()>,
}

#[derive(Serialize)]
struct WireStored {
    parent_hash: Option<u64>,
    start_position: Option<u32>,
    blocks: Vec<WireBlock>,
}

#[derive(Serialize)]
#[serde(rename_all = "snake_case")]
enum WireData {
    Stored(WireStored),
}

#[derive(Serialize)]
struct WireEvent {
    event_id: u64,
    data: WireData,
    dp_rank: u32,
}

#[derive(Serialize)]
struct WireRouterEvent {
    worker_id: u64,
    storage_tier: &'static str,
    residency_domain: &'static str,
    event: WireEvent,
}

#[derive(Serialize)]
struct WireTreeDump {
    events: Vec<WireRouterEvent>,
    last_event_id: u64,
    reset_scope: &'static str,
}

#[derive(Serialize)]
enum WireAnswer {
    TreeDump(WireTreeDump),
}

#[derive(Serialize)]
struct WireItem {
    data: WireAnswer,
    complete_final: bool,
}

/// A radix-style dump (§A.6: synthetic ids, stored only, chains of multi-block runs) of
/// `events × blocks_per_event` blocks, as one msgpack item body.
fn radix_dump_body(events: u64, blocks_per_event: u64) -> Vec<u8> {
    let item = WireItem {
        data: WireAnswer::TreeDump(WireTreeDump {
            events: (0..events)
                .map(|event| WireRouterEvent {
                    worker_id: SMALL_INSTANCE,
                    storage_tier: "device",
                    residency_domain: "worker",
                    event: WireEvent {
                        event_id: event,
                        dp_rank: 0,
                        data: WireData::Stored(WireStored {
                            parent_hash: None,
                            start_position: None,
                            blocks: (0..blocks_per_event)
                                .map(|block| WireBlock {
                                    block_hash: u64::MAX - (event << 20 | block),
                                    tokens_hash: (event << 20 | block).wrapping_mul(0x9e37_79b9),
                                    mm_extra_info: None,
                                })
                                .collect(),
                        }),
                    },
                })
                .collect(),
            last_event_id: 20_000,
            reset_scope: "all",
        }),
        complete_final: false,
    };
    rmp_serde::to_vec_named(&item).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_tree_dump_streams_in_within_the_byte_bound() {
    bounded(async {
        // 2,000 runs of 100 blocks: 200,000 blocks, about 11.6 MB in one frame.
        let body = radix_dump_body(2_000, 100);
        assert!(body.len() > 11 << 20, "dump is {} bytes", body.len());
        let worker = FakeWorker::start(accept_and_answer(body)).await;
        let client = client(RecoveryClientConfig::new(13)).await;
        let answer =
            client.query(&worker.target(), dump_request(), Duration::from_secs(30)).await.unwrap();
        let RecoveryResponse::TreeDump { events, last_event_id, reset_scope } = answer else {
            panic!("not a tree dump");
        };
        assert_eq!(last_event_id, 20_000);
        assert_eq!(reset_scope, TreeDumpScope::Rank);
        assert_eq!(events.len(), 2_000);
        let blocks: usize = events
            .iter()
            .map(|event| match &event.event.data {
                KvCacheEventData::Stored(stored) => stored.blocks.len(),
                _ => 0,
            })
            .sum();
        assert_eq!(blocks, 200_000);
        let KvCacheEventData::Stored(last) = &events[1_999].event.data else { panic!() };
        assert_eq!(last.blocks[99].block_hash, ExternalBlockHash(u64::MAX - (1_999 << 20 | 99)));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dump_over_the_byte_bound_fails_cleanly_and_the_client_goes_on() {
    bounded(async {
        let large = radix_dump_body(300, 100); // ~1.7 MB
        let small = captured_tree_dump_body();
        let calls = Arc::new(AtomicUsize::new(0));
        let script: Script = Arc::new(move |_| {
            let body = if calls.fetch_add(1, Ordering::SeqCst) == 0 { &large } else { &small };
            Reply {
                ack: Some(Vec::new()),
                call_home: Some(answer_frames(body.clone())),
                ..Reply::default()
            }
        });
        let worker = FakeWorker::start(script).await;
        let mut config = RecoveryClientConfig::new(14);
        config.response_bytes_max = 1 << 20;
        let client = client(config).await;
        let too_large =
            client.query(&worker.target(), dump_request(), Duration::from_secs(10)).await;
        assert_eq!(too_large, Err(RecoveryError::ResponseTooLarge { max: 1 << 20 }));
        let answer =
            client.query(&worker.target(), dump_request(), Duration::from_secs(10)).await.unwrap();
        assert!(matches!(answer, RecoveryResponse::TreeDump { last_event_id: 5, .. }));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_never_calls_home_times_out_and_its_connection_is_replaced() {
    bounded(async {
        // The silent failure of §A.8: an empty ACK and no call-home, ever.
        let silent: Script = Arc::new(|_| Reply { ack: Some(Vec::new()), ..Reply::default() });
        let worker = FakeWorker::start(silent).await;
        let client = client(RecoveryClientConfig::new(15)).await;
        for round in 1..=2 {
            // Generous enough that a loaded machine still reaches the call-home wait.
            let timeout = Duration::from_secs(1);
            let result = client.query(&worker.target(), dump_request(), timeout).await;
            assert_eq!(
                result,
                Err(RecoveryError::Timeout { timeout, phase: QueryPhase::AwaitingCallHome })
            );
            assert_eq!(
                worker.accepts.load(Ordering::SeqCst),
                round,
                "a timed-out query's connection is not pooled"
            );
        }
        let stats = client.stats();
        assert_eq!((stats.timeouts, stats.failed, stats.connections_reused), (2, 2, 0));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_stalls_mid_stream_times_out() {
    bounded(async {
        let stalling: Script = Arc::new(|_| Reply {
            ack: Some(Vec::new()),
            call_home: Some(vec![prologue()]),
            end: CallHomeEnd::Stall,
            ..Reply::default()
        });
        let worker = FakeWorker::start(stalling).await;
        let client = client(RecoveryClientConfig::new(16)).await;
        let timeout = Duration::from_secs(1);
        let result = client.query(&worker.target(), dump_request(), timeout).await;
        assert_eq!(
            result,
            Err(RecoveryError::Timeout { timeout, phase: QueryPhase::ReceivingResponse })
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_reports_the_worker_text() {
    bounded(async {
        let text = format!("Server unavailable: unknown endpoint {CAPTURED_PATH}");
        let ack = text.clone().into_bytes();
        let refusing: Script =
            Arc::new(move |_| Reply { ack: Some(ack.clone()), ..Reply::default() });
        let worker = FakeWorker::start(refusing).await;
        let client = client(RecoveryClientConfig::new(17)).await;
        let result = client.query(&worker.target(), dump_request(), Duration::from_secs(5)).await;
        assert_eq!(result, Err(RecoveryError::Rejected { message: text }));
        // The refusal left the connection in sync: the next query reuses it.
        let _ = client.query(&worker.target(), dump_request(), Duration::from_secs(5)).await;
        assert_eq!(worker.accepts.load(Ordering::SeqCst), 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_prologue_and_a_stream_cut_short_are_errors() {
    bounded(async {
        let calls = Arc::new(AtomicUsize::new(0));
        let script: Script = Arc::new(move |_| {
            if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                let frames = vec![two_part(br#"{"error":"engine gone"}"#, b""), sentinel()];
                Reply { ack: Some(Vec::new()), call_home: Some(frames), ..Reply::default() }
            } else {
                // Prologue and item, then the worker closes without complete_final.
                let frames = vec![prologue(), two_part(b"", &captured_tree_dump_body())];
                Reply {
                    ack: Some(Vec::new()),
                    call_home: Some(frames),
                    end: CallHomeEnd::Close,
                    ..Reply::default()
                }
            }
        });
        let worker = FakeWorker::start(script).await;
        let client = client(RecoveryClientConfig::new(18)).await;
        let failed = client.query(&worker.target(), dump_request(), Duration::from_secs(5)).await;
        assert_eq!(failed, Err(RecoveryError::StreamFailed { message: "engine gone".into() }));
        let cut = client.query(&worker.target(), dump_request(), Duration::from_secs(5)).await;
        assert_eq!(
            cut,
            Err(RecoveryError::StreamEnded { after: "the prologue, before complete_final" })
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_codec_queries_use_json_bodies_and_wrappers() {
    bounded(async {
        let script: Script = Arc::new(|request| {
            assert_eq!(request.control["payload_codec"], "json");
            let body: serde_json::Value = serde_json::from_slice(&request.body).unwrap();
            assert_eq!(body["start_event_id"], 18_977);
            assert_eq!(body["kind"], "recovery");
            let item = serde_json::json!({"data": {"Events": {"events": [
                {"worker_id": SMALL_INSTANCE, "storage_tier": "device", "residency_domain": "worker",
                 "event": {"event_id": 18_977, "dp_rank": 0,
                           "data": {"removed": {"block_hashes": [12_129_935_312_930_971_799u64]}}}}],
                "last_event_id": 20_000}}, "complete_final": false});
            Reply {
                ack: Some(Vec::new()),
                call_home: Some(vec![
                    prologue(),
                    two_part(b"", &serde_json::to_vec(&item).unwrap()),
                    two_part(b"", br#"{"complete_final":true}"#),
                    sentinel(),
                ]),
                ..Reply::default()
            }
        });
        let worker = FakeWorker::start(script).await;
        let client = client(RecoveryClientConfig::new(19)).await;
        let request =
            RecoveryRequest::range(SourceKey { worker_id: SMALL_INSTANCE, dp_rank: 0 }, 18_977, None);
        let answer = client
            .query_with_codec(&worker.target(), PayloadCodec::Json, request, Duration::from_secs(5))
            .await
            .unwrap();
        let RecoveryResponse::Events { events, last_event_id: 20_000 } = answer else {
            panic!("not events: {answer:?}");
        };
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].event.event_id, 18_977);
    })
    .await;
}

/// A worker that answers a tree dump `delay` after the request, and signals when it has the
/// request (so the query is pending from then until the answer).
fn answer_after(delay: Duration, asked: Arc<tokio::sync::Notify>) -> Script {
    let frames = answer_frames(captured_tree_dump_body());
    Arc::new(move |_| {
        asked.notify_one();
        Reply {
            ack: Some(Vec::new()),
            call_home: Some(frames.clone()),
            call_home_delay: delay,
            ..Reply::default()
        }
    })
}

/// Open a connection to the response listener and wait (bounded) until the relay closes it.
async fn closed_by_listener(address: std::net::SocketAddr, sent: &[u8]) -> bool {
    let mut connection = TcpStream::connect(address).await.unwrap();
    let _ = connection.write_all(sent).await;
    let mut probe = [0u8; 8];
    let read = tokio::time::timeout(Duration::from_secs(5), connection.read(&mut probe)).await;
    matches!(read, Ok(Ok(0)) | Ok(Err(_)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_call_homes_are_closed_and_counted() {
    bounded(async {
        let client = Arc::new(client(RecoveryClientConfig::new(20)).await);
        let address = client.response_address();
        let handshake =
            br#"{"subject":"00000000-0000-4000-8000-000000000000","stream_type":"response"}"#;
        let stranger = two_part(handshake, b"");
        // With no query pending, every connection is closed unread.
        assert!(closed_by_listener(address, &stranger).await);
        assert!(closed_by_listener(address, &[0xff; 24]).await);
        assert_eq!(client.stats().call_homes_unmatched, 2);
        assert_eq!(client.stats().call_homes_malformed, 0);

        // While one is pending, handshakes are read: a foreign subject and garbage are refused
        // and the real answer still arrives.
        let asked = Arc::new(tokio::sync::Notify::new());
        let worker =
            FakeWorker::start(answer_after(Duration::from_millis(500), Arc::clone(&asked))).await;
        let query = {
            let client = Arc::clone(&client);
            let target = worker.target();
            kvrelay::runtime::spawn(async move {
                client.query(&target, dump_request(), Duration::from_secs(5)).await
            })
        };
        asked.notified().await;
        assert!(closed_by_listener(address, &stranger).await);
        assert!(closed_by_listener(address, &[0xff; 24]).await);
        assert_eq!(client.stats().call_homes_unmatched, 3);
        assert_eq!(client.stats().call_homes_malformed, 1);
        assert!(query.await.unwrap().is_ok());
    })
    .await;
}

/// Connections that never send a handshake cannot keep a worker's answer out: at the bound the
/// oldest unfinished handshake is closed to admit the newest, so the answer, which sends its
/// handshake at once, gets through long before the silent ones would time out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_call_homes_cannot_hold_the_handshake_slots() {
    bounded(async {
        const SILENT: usize = CALL_HOME_HANDSHAKES_IN_FLIGHT_MAX + 16;
        let client = Arc::new(client(RecoveryClientConfig::new(22)).await);
        let asked = Arc::new(tokio::sync::Notify::new());
        let worker =
            FakeWorker::start(answer_after(Duration::from_millis(300), Arc::clone(&asked))).await;
        let started = tokio::time::Instant::now();
        let query = {
            let client = Arc::clone(&client);
            let target = worker.target();
            kvrelay::runtime::spawn(async move {
                client.query(&target, dump_request(), Duration::from_secs(10)).await
            })
        };
        asked.notified().await;
        let mut silent = Vec::with_capacity(SILENT);
        for _ in 0..SILENT {
            silent.push(TcpStream::connect(client.response_address()).await.unwrap());
        }
        let answer = query.await.unwrap();
        assert!(answer.is_ok(), "{answer:?}");
        assert!(
            started.elapsed() < CALL_HOME_HANDSHAKE_TIMEOUT,
            "the answer waited for silent handshakes to time out"
        );
        assert!(client.stats().call_homes_refused >= 16, "{:?}", client.stats());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_workers_and_unsupported_targets_fail_fast() {
    bounded(async {
        let client = client(RecoveryClientConfig::new(21)).await;
        let closed_port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let mut target = FakeWorker::start(accept_and_answer(Vec::new())).await.target();
        target.transport =
            RequestPlaneTransport::Tcp(format!("127.0.0.1:{closed_port}/{CAPTURED_PATH}"));
        let refused = client.query(&target, dump_request(), Duration::from_secs(5)).await;
        assert!(matches!(refused, Err(RecoveryError::Connect { .. })), "{refused:?}");
        target.transport = RequestPlaneTransport::NatsTcp("subject".into());
        let nats = client.query(&target, dump_request(), Duration::from_secs(5)).await;
        assert!(matches!(nats, Err(RecoveryError::UnsupportedTransport(_))));
    })
    .await;
}

/// A call-home that sends the prologue and `sent` bytes of an item frame declaring `declared`
/// body bytes, then stalls: an answer caught mid-read.
fn stalls_mid_item(declared: usize, sent: usize) -> Script {
    let mut item = two_part(b"", &vec![7u8; declared]);
    item.truncate(24 + sent);
    Arc::new(move |_| Reply {
        ack: Some(Vec::new()),
        call_home: Some(vec![prologue(), item.clone()]),
        end: CallHomeEnd::Stall,
        ..Reply::default()
    })
}

/// Wait (bounded by the test's own bound) until the client's answers hold at least `bytes`.
async fn answers_hold_at_least(client: &RecoveryClient, bytes: u64) {
    while client.stats().answer_bytes_in_use < bytes {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Per-answer bound 2 MiB, shared bound 3 MiB: one answer stalled at about 2 MiB leaves room
/// for small answers but not for a second large one.
fn small_answer_budget(seed: u64) -> RecoveryClientConfig {
    let mut config = RecoveryClientConfig::new(seed);
    config.response_bytes_max = 2 << 20;
    config.answers_bytes_max = 3 << 20;
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_in_flight_share_one_byte_budget_and_the_over_budget_call_waits_out_its_deadline() {
    bounded(async {
        let client = Arc::new(client(small_answer_budget(23)).await);
        // A: 1.5 MiB of a body declared at 2 MiB - 1 KiB arrive, then the worker stalls. Its
        // buffer grew to the declared length after the first MiB arrived: that much is held.
        let declared = (2 << 20) - 1024;
        let stalled = FakeWorker::start(stalls_mid_item(declared, 3 << 19)).await;
        let holding = {
            let client = Arc::clone(&client);
            let target = stalled.target();
            kvrelay::runtime::spawn(async move {
                client.query(&target, dump_request(), Duration::from_secs(50)).await
            })
        };
        answers_hold_at_least(&client, declared as u64).await;

        // B: a complete 1.7 MB dump, within its own bound but not within what A leaves.
        let large = radix_dump_body(300, 100);
        assert!(large.len() > 3 << 19 && large.len() < (2 << 20) - 4096, "{}", large.len());
        let small = captured_tree_dump_body();
        let calls = Arc::new(AtomicUsize::new(0));
        let script: Script = Arc::new(move |_| {
            let body = if calls.fetch_add(1, Ordering::SeqCst) == 0 { &large } else { &small };
            Reply {
                ack: Some(Vec::new()),
                call_home: Some(answer_frames(body.clone())),
                ..Reply::default()
            }
        });
        let worker = FakeWorker::start(script).await;
        let timeout = Duration::from_secs(3);
        let waited = client.query(&worker.target(), dump_request(), timeout).await;
        assert_eq!(
            waited,
            Err(RecoveryError::Timeout { timeout, phase: QueryPhase::ReceivingResponse })
        );
        let stats = client.stats();
        assert!(stats.answer_bytes_waits >= 1, "{stats:?}");
        assert!(stats.answer_bytes_peak <= 3 << 20, "the budget was exceeded: {stats:?}");
        assert!(stats.answer_bytes_peak > declared as u64, "{stats:?}");
        // B's bytes came back when it failed; A still holds its own.
        assert!(stats.answer_bytes_in_use >= declared as u64, "{stats:?}");
        assert!(stats.answer_bytes_in_use < (2 << 20) + 4096, "{stats:?}");

        // C: a small answer fits beside A and is answered.
        let answer =
            client.query(&worker.target(), dump_request(), Duration::from_secs(10)).await.unwrap();
        assert!(matches!(answer, RecoveryResponse::TreeDump { last_event_id: 5, .. }));
        assert!(client.stats().answer_bytes_peak <= 3 << 20);
        assert!(!holding.is_finished(), "A is still mid-read");
        holding.abort();
    })
    .await;
}

/// Several answers, each within its own bound, that together exceed the shared budget, all
/// caught partway at once: every reader has reserved its first MiB (or waits for it) when the
/// workers send the rest. A plain semaphore of bytes then had every reader hold a MiB and wait
/// for 0.7 MiB more until the deadline; under the budget's rule the answer holding the most never
/// waits, so all of them complete, one after another, long before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_that_together_exceed_the_budget_all_complete_before_any_deadline() {
    bounded(async {
        const ANSWERS: usize = 4;
        const MIB: u64 = 1 << 20;
        let deadline = Duration::from_secs(30);
        let mut config = RecoveryClientConfig::new(25);
        config.response_bytes_max = 2 << 20;
        // Every reader's first MiB fits, and then no reader's growth does.
        config.answers_bytes_max = (4 << 20) + (64 << 10);
        let client = Arc::new(client(config).await);
        let body = radix_dump_body(300, 100);
        assert!(body.len() > (1 << 20) + (64 << 10) && body.len() < (2 << 20) - 4096);

        // The prologue and the item's 24-byte prefix: the reader reserves its first MiB of the
        // body and waits for bytes that come only on release.
        let (release, released) = tokio::sync::watch::channel(false);
        let pause = CallHomePause { after_bytes: prologue().len() + 24, resume: released };
        let mut workers = Vec::with_capacity(ANSWERS);
        let mut calls = Vec::with_capacity(ANSWERS);
        for _ in 0..ANSWERS {
            let (body, pause) = (body.clone(), pause.clone());
            let script: Script = Arc::new(move |_| Reply {
                ack: Some(Vec::new()),
                call_home: Some(answer_frames(body.clone())),
                pause: Some(pause.clone()),
                ..Reply::default()
            });
            let worker = FakeWorker::start(script).await;
            let client = Arc::clone(&client);
            let target = worker.target();
            calls.push(kvrelay::runtime::spawn(async move {
                client.query(&target, dump_request(), deadline).await
            }));
            workers.push(worker);
        }
        // All readers are partway: each holds its first MiB, or one waits for it.
        loop {
            let stats = client.stats();
            if stats.answer_bytes_waits >= 1 || stats.answer_bytes_in_use >= ANSWERS as u64 * MIB {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let stats = client.stats();
        assert!(stats.answer_bytes_in_use >= 3 * MIB, "{stats:?}");

        let released_at = tokio::time::Instant::now();
        release.send(true).unwrap();
        for call in calls {
            let answer = call.await.unwrap();
            assert!(matches!(answer, Ok(RecoveryResponse::TreeDump { .. })), "{answer:?}");
        }
        let took = released_at.elapsed();
        assert!(took < deadline / 3, "the answers waited for a deadline: {took:?}");
        let stats = client.stats();
        assert_eq!((stats.answered, stats.failed, stats.answer_bytes_in_use), (4, 0, 0));
        assert!(stats.answer_bytes_waits >= 1, "{stats:?}");
        assert!(stats.answer_bytes_peak <= (4 << 20) + (64 << 10), "{stats:?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_dropped_mid_read_returns_its_answer_bytes() {
    bounded(async {
        let client = client(small_answer_budget(24)).await;
        let declared = (2 << 20) - 1024;
        let stalled = FakeWorker::start(stalls_mid_item(declared, 3 << 19)).await;
        let target = stalled.target();
        let query = client.query(&target, dump_request(), Duration::from_secs(50));
        tokio::select! {
            biased;
            outcome = query => panic!("a stalled answer completed: {outcome:?}"),
            () = answers_hold_at_least(&client, declared as u64) => {}
        }
        // The query future is gone: every byte it held is back.
        assert_eq!(client.stats().answer_bytes_in_use, 0);

        // The whole budget is usable again: an answer at the per-answer bound's edge fits.
        let body = radix_dump_body(300, 100);
        let worker = FakeWorker::start(accept_and_answer(body)).await;
        let answer =
            client.query(&worker.target(), dump_request(), Duration::from_secs(10)).await.unwrap();
        assert!(matches!(answer, RecoveryResponse::TreeDump { .. }));
        let stats = client.stats();
        assert_eq!((stats.answer_bytes_in_use, stats.answer_bytes_waits), (0, 0));
    })
    .await;
}
