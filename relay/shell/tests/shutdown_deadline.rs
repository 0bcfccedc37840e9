//! SIGTERM of the built `kvrelay serve` under the worst clients: it exits 0 within
//! `DYN_RELAY_SHUTDOWN_TIMEOUT_MS` with stalled subscribers (a zero flow-control window, a
//! connection that never sent its preface), open health `Watch` streams and a file-discovery
//! directory on a hung mount (a FUSE mount whose daemon never answers). Health reports
//! NOT_SERVING and its watchers end before the relay streams end with UNAVAILABLE, and the
//! journal is on disk after the exit.

mod relay_process;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use kvrelay_proto::CONTRACT_MARKER;
use kvrelay_proto::v1 as proto;
use prost::Message;
use relay_process::RelayProcess;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// The configured shutdown bound of these tests.
const SHUTDOWN_BOUND: Duration = Duration::from_secs(4);
/// What the exit may take beyond the bound (runtime exit grace, process teardown).
const EXIT_SLACK: Duration = Duration::from_millis(1500);

async fn bounded<F: std::future::Future>(test: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(60), test).await.expect("test exceeded its bound")
}

fn catalog_request(subscriber: &str) -> proto::WatchKvPoolCatalogRequest {
    proto::WatchKvPoolCatalogRequest {
        subscriber_id: subscriber.into(),
        contract_marker: CONTRACT_MARKER,
    }
}

/// A catalog stream on a connection that grants no flow-control window: it never takes a byte.
async fn stalled_subscriber(relay: &RelayProcess) -> h2::client::SendRequest<Bytes> {
    let tcp = TcpStream::connect(relay.wan).await.unwrap();
    let (mut send, connection) =
        h2::client::Builder::new().initial_window_size(0).handshake(tcp).await.unwrap();
    kvrelay::runtime::spawn(connection);
    let request = http::Request::builder()
        .method("POST")
        .uri(format!("http://relay/{}/WatchKvPoolCatalog", kvrelay_proto::SERVICE_NAME))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (response, mut body) = send.send_request(request, false).unwrap();
    let message = catalog_request("stalled").encode_to_vec();
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(message.len() as u32).to_be_bytes());
    frame.extend_from_slice(&message);
    body.send_data(frame.into(), true).unwrap();
    assert_eq!(response.await.unwrap().status(), 200);
    send
}

/// Follow a health `Watch` to its end: the last status it sent and when it ended.
async fn follow_health(
    mut health: HealthClient<tonic::transport::Channel>,
) -> (Option<i32>, Instant) {
    let mut stream =
        health.watch(HealthCheckRequest { service: String::new() }).await.unwrap().into_inner();
    let mut last = None;
    while let Ok(Some(update)) = stream.message().await {
        last = Some(update.status);
    }
    (last, Instant::now())
}

/// Files under `root` and their total size.
fn files_under(root: &Path) -> (usize, u64) {
    let mut pending = vec![root.to_path_buf()];
    let (mut count, mut bytes) = (0, 0);
    while let Some(directory) = pending.pop() {
        for entry in std::fs::read_dir(&directory).into_iter().flatten().flatten() {
            let metadata = entry.metadata().unwrap();
            if metadata.is_dir() {
                pending.push(entry.path());
            } else {
                count += 1;
                bytes += metadata.len();
            }
        }
    }
    (count, bytes)
}

/// SIGTERM `relay` with stalled clients and health watchers attached, and check the order and
/// the bound.
async fn terminate_under_stalled_clients(mut relay: RelayProcess, healthy_before: bool) {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", relay.wan))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let health = HealthClient::new(channel.clone());
    if healthy_before {
        let answer = health.clone().check(HealthCheckRequest { service: String::new() }).await;
        assert!(answer.is_ok());
    }
    let watchers: Vec<_> =
        (0..3).map(|_| kvrelay::runtime::spawn(follow_health(health.clone()))).collect();
    let mut stalled = Vec::new();
    for _ in 0..3 {
        stalled.push(stalled_subscriber(&relay).await);
    }
    let silent = TcpStream::connect(relay.wan).await.unwrap();
    let mut client = proto::kv_event_relay_client::KvEventRelayClient::new(channel);
    let mut good =
        client.watch_kv_pool_catalog(catalog_request("good")).await.unwrap().into_inner();
    assert!(good.message().await.unwrap().is_some());
    tokio::time::sleep(Duration::from_millis(300)).await;

    let mut ordered = health
        .clone()
        .watch(HealthCheckRequest { service: String::new() })
        .await
        .unwrap()
        .into_inner();
    let mut last = ordered.message().await.unwrap().map(|update| update.status);

    let sent = Instant::now();
    relay.terminate();
    let status = loop {
        match good.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the catalog stream ended without a status"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    // Same connection, frames in order: a watch that ended first has its end here already.
    let mut ended = false;
    while let Some(next) = futures::FutureExt::now_or_never(ordered.message()) {
        match next {
            Ok(Some(update)) => last = Some(update.status),
            Ok(None) | Err(_) => {
                ended = true;
                break;
            }
        }
    }
    assert!(ended, "a health watch was still open when the relay streams ended");
    assert_eq!(last, Some(ServingStatus::NotServing as i32));
    let (exit, took) = relay
        .wait_exit(SHUTDOWN_BOUND + EXIT_SLACK)
        .await
        .expect("the relay did not exit within its shutdown bound");
    assert_eq!(exit.code(), Some(0), "exit status after SIGTERM");
    eprintln!("exited {took:?} after SIGTERM");
    for watcher in watchers {
        let (last, ended_at) = watcher.await.unwrap();
        assert_eq!(last, Some(ServingStatus::NotServing as i32), "the watch's last word");
        assert!(ended_at >= sent, "a health watch ended before SIGTERM");
    }
    drop((stalled, silent));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_stalled_clients_and_health_watchers_exits_zero_within_the_bound() {
    bounded(async {
        let discovery = tempfile::tempdir().unwrap();
        let record = tempfile::tempdir().unwrap();
        let record_dir = record.path().display().to_string();
        let relay = RelayProcess::spawn(
            discovery.path(),
            &[("DYN_RELAY_SHUTDOWN_TIMEOUT_MS", "4000"), ("DYN_RELAY_RECORD_DIR", &record_dir)],
        );
        relay.wait_listening().await;
        terminate_under_stalled_clients(relay, true).await;
        let (files, bytes) = files_under(record.path());
        assert!(files > 0 && bytes > 0, "no journal on disk after the exit ({files} files)");
    })
    .await;
}

/// A FUSE mount whose daemon (a shell holding `/dev/fuse`) never answers: every access below
/// it blocks until the daemon exits.
struct HungMount {
    point: PathBuf,
    daemon: Child,
}

impl HungMount {
    /// Mount one under `parent`, or `None` where mounting is not permitted.
    fn mount(parent: &Path) -> Option<HungMount> {
        let point = parent.join("hung");
        std::fs::create_dir_all(&point).unwrap();
        let script = format!(
            "exec 3<>/dev/fuse && mount -t fuse -o fd=3,rootmode=40000,user_id=0,group_id=0 \
             kvrelay-hung {} && echo mounted && exec sleep 120",
            point.display()
        );
        let mut daemon = Command::new("sh")
            .args(["-c", &script])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let mut line = String::new();
        let stdout = daemon.stdout.take()?;
        let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line);
        if line.trim() != "mounted" {
            let _ = daemon.kill();
            let _ = daemon.wait();
            return None;
        }
        Some(HungMount { point, daemon })
    }
}

impl Drop for HungMount {
    fn drop(&mut self) {
        // The daemon's exit aborts the FUSE connection; then the mount can go.
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
        let _ = Command::new("umount").arg("-l").arg(&self.point).status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_hung_discovery_mount_exits_zero_within_the_bound() {
    bounded(async {
        let parent = tempfile::tempdir().unwrap();
        let Some(mount) = HungMount::mount(parent.path()) else {
            eprintln!("SKIPPED: mounting FUSE is not permitted here (needs CAP_SYS_ADMIN)");
            return;
        };
        let relay = RelayProcess::spawn(
            &mount.point.join("kv"),
            &[("DYN_RELAY_SHUTDOWN_TIMEOUT_MS", "4000")],
        );
        relay.wait_listening().await;
        // The discovery scan is stuck in the mount: the relay never becomes ready.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut ready = TcpStream::connect(relay.ops).await.unwrap();
        tokio::io::AsyncWriteExt::write_all(
            &mut ready,
            b"GET /ready HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n",
        )
        .await
        .unwrap();
        let mut answer = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut ready, &mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 503"), "ready despite the hung mount: {answer}");
        terminate_under_stalled_clients(relay, false).await;
        drop(mount);
    })
    .await;
}
