//! The `loadgen` binary against a real `nats-server` and the real relay (`kvrelay::serve`,
//! file discovery), loopback only: the generator registers two workers, publishes 200 stored
//! events/s for 2 s with removals, and verifies its trace against the relay (no false
//! negatives); `--verify-only` then passes on the same trace and fails, naming one false
//! negative, on a trace with a live key that was never published.

#[path = "../../relay/shell/tests/servers/mod.rs"]
mod servers;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use kvrelay::config::{self, CliValues};
use kvrelay::runtime::{SystemWallClock, TokioBlockingExecutor};
use kvrelay::serve::ServeOptions;
use serde_json::Value;
use servers::NatsServer;

const LOADGEN: &str = env!("CARGO_BIN_EXE_loadgen");
/// Bound of the whole test.
const TEST_TIMEOUT: Duration = Duration::from_secs(180);
/// A key no run with these flags publishes.
const NEVER_PUBLISHED: u64 = 0x0123_4567_89ab_cdef;

/// A child killed by its PID when dropped (also when the test fails).
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_loadgen(args: &[&str], stdout: &Path, stderr: &Path) -> Killed {
    let child = Command::new(LOADGEN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(stdout).unwrap())
        .stderr(std::fs::File::create(stderr).unwrap())
        .spawn()
        .expect("the loadgen binary starts");
    Killed(child)
}

async fn wait_exit(child: &mut Killed, bound: Duration) -> ExitStatus {
    tokio::time::timeout(bound, async {
        loop {
            if let Some(status) = child.0.try_wait().unwrap() {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("loadgen exited in time")
}

/// The first line of `path` that parses as a JSON object, once one is there.
async fn wait_verdict(path: &Path, stderr: &Path, bound: Duration) -> Value {
    let found = tokio::time::timeout(bound, async {
        loop {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            if let Some(verdict) = text.lines().find_map(|line| serde_json::from_str(line).ok()) {
                return verdict;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    found.unwrap_or_else(|_| {
        panic!("no verdict within {bound:?}; stderr:\n{}", std::fs::read_to_string(stderr).unwrap())
    })
}

/// Run `loadgen --verify-only` on `trace`: its exit status and verdict.
async fn verify_only(address: &str, trace: &Path, dir: &Path, name: &str) -> (ExitStatus, Value) {
    let stdout = dir.join(format!("{name}.out"));
    let stderr = dir.join(format!("{name}.err"));
    let trace = trace.display().to_string();
    let args = ["--verify-only", "--verify", address, "--trace", &trace, "--quiet-ms", "500"];
    let mut child = spawn_loadgen(&args, &stdout, &stderr);
    let status = wait_exit(&mut child, Duration::from_secs(60)).await;
    let verdict = wait_verdict(&stdout, &stderr, Duration::from_secs(1)).await;
    (status, verdict)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loadgen_trace_verifies_against_the_relay_and_a_never_published_key_fails() {
    tokio::time::timeout(TEST_TIMEOUT, run()).await.expect("the test exceeded its time bound");
}

async fn run() {
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("kvstore");
    std::fs::create_dir_all(&root).unwrap();
    let cli = CliValues {
        dc_id: Some("dc-a".into()),
        bind: Some("127.0.0.1:0".into()),
        ops_bind: Some("127.0.0.1:0".into()),
        ..CliValues::default()
    };
    let environment: BTreeMap<String, String> = [
        ("DYN_DISCOVERY_BACKEND", "file".to_owned()),
        ("DYN_FILE_KV", root.display().to_string()),
        ("DYN_EVENT_PLANE", "nats".to_owned()),
        ("NATS_SERVER", nats.url()),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value))
    .collect();
    let relay_config = config::resolve(&cli, &environment).unwrap();
    let options = ServeOptions {
        seed: 7,
        executor: Arc::new(TokioBlockingExecutor),
        clock: Arc::new(SystemWallClock),
    };
    let relay = kvrelay::serve::start(relay_config, options).await.unwrap();
    let address = relay.wan_address.unwrap().to_string();

    // 200 stored events/s for 2 s over 2 workers: 200 stores of 4 blocks per worker, 256 live.
    let trace = dir.path().join("trace.json");
    let (stdout, stderr) = (dir.path().join("run.out"), dir.path().join("run.err"));
    let (root_arg, trace_arg, nats_url) =
        (root.display().to_string(), trace.display().to_string(), nats.url());
    let mut generator = spawn_loadgen(
        &[
            "--nats",
            &nats_url,
            "--discovery-dir",
            &root_arg,
            "--pools",
            "1",
            "--workers-per-pool",
            "2",
            "--ranks",
            "1",
            "--rate",
            "200",
            "--duration-secs",
            "2",
            "--blocks-per-event",
            "4",
            "--chain-share",
            "0.5",
            "--live-cap",
            "256",
            "--load-interval-ms",
            "200",
            "--warmup-ms",
            "3000",
            "--seed",
            "5",
            "--trace",
            &trace_arg,
            "--verify",
            &address,
            "--quiet-ms",
            "500",
            // Stay registered while the verify-only runs below follow the same relay.
            "--linger-secs",
            "120",
        ],
        &stdout,
        &stderr,
    );
    let verdict = wait_verdict(&stdout, &stderr, Duration::from_secs(90)).await;
    let log = std::fs::read_to_string(&stderr).unwrap();
    assert_eq!(verdict["false_negatives"], 0, "{verdict}\n{log}");
    assert_eq!(verdict["removed_beyond_bound"], false, "{verdict}\n{log}");
    let pool = &verdict["pools"][0];
    assert_eq!(pool["endpoint"], "dynamo/backend/generate0");
    assert_eq!(pool["live"], 2 * 256, "{verdict}");
    assert_eq!(pool["removed_checked"], 2 * (200 * 4 - 256), "{verdict}");
    assert!(pool["resident_slots"].as_u64().unwrap() >= 2 * 256, "{verdict}");

    let written: Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let counters = &written["counters"];
    assert_eq!(counters["stored_events"], 400, "{counters}");
    assert_eq!(counters["blocks_stored"], 1600, "{counters}");
    assert_eq!(counters["blocks_removed"], 2 * (800 - 256), "{counters}");
    assert_eq!(counters["publish_errors"], 0, "{counters}");
    assert_eq!(counters["skipped_events"], 0, "{counters}");
    assert!(counters["load_messages"].as_u64().unwrap() >= 10, "{counters}");
    assert_eq!(written["pools"][0]["live"].as_array().unwrap().len(), 512);

    // The same trace passes on its own.
    let (status, again) = verify_only(&address, &trace, dir.path(), "again").await;
    assert!(status.success(), "{status:?}: {again}");
    assert_eq!(again["false_negatives"], 0);

    // A live key that was never published is a false negative: exit 1, named.
    let mut tampered = written.clone();
    let live = tampered["pools"][0]["live"].as_array_mut().unwrap();
    assert!(!live.contains(&Value::from(NEVER_PUBLISHED)));
    live.push(Value::from(NEVER_PUBLISHED));
    let tampered_path = dir.path().join("tampered.json");
    std::fs::write(&tampered_path, serde_json::to_vec(&tampered).unwrap()).unwrap();
    let (status, caught) = verify_only(&address, &tampered_path, dir.path(), "tampered").await;
    assert_eq!(status.code(), Some(1), "{caught}");
    assert_eq!(caught["false_negatives"], 1, "{caught}");
    assert_eq!(caught["pools"][0]["false_negative_examples"][0], NEVER_PUBLISHED, "{caught}");

    let _ = generator.0.kill();
    let _ = wait_exit(&mut generator, Duration::from_secs(10)).await;
    relay.shutdown().await.unwrap();
}
