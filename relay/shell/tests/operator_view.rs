//! The operator's view of the built binaries: `--version` with the source revision; logs with
//! no ANSI escape off a terminal, JSON lines with `DYN_LOGGING_JSONL`, levels from `DYN_LOG`;
//! and `--json` on `watch`, `query` and `kvrelay-compare`, against a running `kvrelay demo`.
//! Every child is ended by PID; every wait is bounded.

use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use kvrelay::runtime::{TokioBlockingExecutor, run_blocking};

const KVRELAY: &str = env!("CARGO_BIN_EXE_kvrelay");
const COMPARE: &str = env!("CARGO_BIN_EXE_kvrelay-compare");

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn every_relay_binary_prints_its_version_and_revision() {
    for (binary, name) in [(KVRELAY, "kvrelay"), (COMPARE, "kvrelay-compare")] {
        let output = Command::new(binary).arg("--version").output().unwrap();
        assert_eq!(output.status.code(), Some(0), "{name} --version");
        let text = String::from_utf8(output.stdout).unwrap();
        assert_eq!(text.trim(), format!("{name} {}", kvrelay::build_info::VERSION_LINE));
        assert!(text.contains(&format!("(rev {})", kvrelay::build_info::REVISION)), "{text}");
    }
    // Built from a git checkout, the revision is HEAD's short hash.
    let head = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output();
    if let Ok(head) = head
        && head.status.success()
    {
        let head = String::from_utf8(head.stdout).unwrap();
        assert_eq!(kvrelay::build_info::REVISION, head.trim());
    }
}

/// A `kvrelay serve` with file discovery in `dir`, ZMQ and no operations listener.
fn serve(dir: &std::path::Path, env: &[(&str, &str)]) -> Child {
    Command::new(KVRELAY)
        .args(["serve", "--dc-id", "dc-a", "--bind", "127.0.0.1:0", "--ops-bind", "off"])
        .env_clear()
        .env("DYN_DISCOVERY_BACKEND", "file")
        .env("DYN_FILE_KV", dir)
        .env("DYN_EVENT_PLANE", "zmq")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Let `child` run for a moment, send SIGTERM, and collect what it wrote.
async fn stop(child: Child) -> Output {
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let pid = child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    run_blocking(&TokioBlockingExecutor, move || child.wait_with_output().unwrap()).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_carry_no_ansi_off_a_terminal_and_follow_dyn_log_and_jsonl() {
    let dir = tempfile::tempdir().unwrap();

    let plain = stop(serve(dir.path(), &[])).await;
    let text = String::from_utf8(plain.stderr).unwrap();
    assert!(text.contains("relay started"), "{text}");
    assert!(!text.contains('\u{1b}'), "an ANSI escape reached a pipe:\n{text:?}");

    let quiet = stop(serve(dir.path(), &[("DYN_LOG", "warn"), ("RUST_LOG", "debug")])).await;
    let text = String::from_utf8(quiet.stderr).unwrap();
    assert!(!text.contains("relay started"), "DYN_LOG=warn hides INFO:\n{text}");
    assert!(!text.contains("DEBUG"), "DYN_LOG wins over RUST_LOG:\n{text}");

    let json = stop(serve(dir.path(), &[("DYN_LOGGING_JSONL", "true")])).await;
    let text = String::from_utf8(json.stderr).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|_| panic!("not JSON: {line:?}")))
        .collect();
    let started = lines
        .iter()
        .find(|line| line["message"] == "relay started")
        .unwrap_or_else(|| panic!("no relay-started line in {text}"));
    assert_eq!(started["level"], "INFO");
    assert_eq!(started["dc"], "dc-a");
    assert!(started["timestamp"].is_string() && started["target"].is_string());
    assert!(!text.contains('\u{1b}'));
}

/// Run `binary args` to completion (bounded by its own duration flags) and parse every stdout
/// line as one JSON object.
async fn json_lines(binary: &'static str, args: Vec<String>) -> Vec<serde_json::Value> {
    let output = run_blocking(&TokioBlockingExecutor, move || {
        Command::new(binary).args(&args).env_clear().stdin(Stdio::null()).output().unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(
        output.status.success(),
        "{binary}: {:?}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!stdout.trim().is_empty(), "{binary} printed nothing");
    stdout
        .lines()
        .map(|line| {
            serde_json::from_str(line).unwrap_or_else(|_| panic!("not one object: {line:?}"))
        })
        .collect()
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|item| (*item).to_owned()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_query_and_compare_print_one_json_object_per_line() {
    let port = free_port();
    let relay = format!("127.0.0.1:{port}");
    let mut demo = Command::new(KVRELAY)
        .args(["demo", "--listen", &relay, "--duration-secs", "40"])
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();

    let watched = json_lines(
        KVRELAY,
        strings(&["watch", "--relay", &relay, "--duration-secs", "4", "--json"]),
    )
    .await;
    assert!(watched.iter().all(|line| line["type"] == "snapshot"));
    let last = watched.last().unwrap();
    let pools = last["pools"].as_array().unwrap();
    assert!(!pools.is_empty(), "the demo's pools reached watch: {last}");
    assert!(pools.iter().any(|pool| pool["models"][0]["canonicalModelId"] == "tiny-llm"));
    assert!(last["readiness"].as_array().is_some_and(|entries| !entries.is_empty()));

    let tokens: Vec<String> = (1..=64).map(|token| token.to_string()).collect();
    let queried = json_lines(
        KVRELAY,
        strings(&[
            "query",
            "--relay",
            &relay,
            "--model",
            "tiny-llm",
            "--tokens",
            &tokens.join(","),
            "--settle-secs",
            "2",
            "--json",
        ]),
    )
    .await;
    assert_eq!(queried.len(), 1, "{queried:?}");
    assert_eq!(queried[0]["type"], "query");
    assert_eq!(queried[0]["model"], "tiny-llm");
    let answers = queried[0]["answers"].as_array().unwrap();
    assert!(!answers.is_empty() && answers.iter().all(|a| a["totalBlocks"].is_u64()));

    // The demo compared with itself agrees.
    let compared = json_lines(
        COMPARE,
        strings(&[
            "--left",
            &relay,
            "--right",
            &relay,
            "--timeout-secs",
            "20",
            "--stable-checks",
            "1",
            "--interval-ms",
            "300",
            "--json",
        ]),
    )
    .await;
    let result = compared.last().unwrap();
    assert_eq!(result["type"], "result");
    assert_eq!(result["result"], "MATCH", "{compared:?}");
    assert_eq!(compared.iter().filter(|line| line["type"] == "section").count(), 4);

    let _ = demo.kill();
    let _ = demo.wait();
}
