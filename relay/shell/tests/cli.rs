//! The built `kvrelay` binary as an operator runs it: `serve --check-config` prints the
//! resolved configuration as JSON and exits 0, or names the bad setting and exits 2 (as does a
//! flag Dynamo's launcher no longer has). The environment is cleared for every run, so the
//! host's `DYN_*` variables never leak in. Also `scripts/test.sh --plan`: the fresh-machine
//! test command installs exactly the missing tools.

use std::process::{Command, Output};

const KVRELAY: &str = env!("CARGO_BIN_EXE_kvrelay");

fn kvrelay(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(KVRELAY)
        .args(args)
        .env_clear()
        .envs(env.iter().copied())
        .output()
        .expect("the kvrelay binary runs")
}

/// A command line, its environment, and the setting a refusal must name.
type BadCase<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);

fn check_config(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut full = vec!["serve", "--check-config"];
    full.extend_from_slice(args);
    kvrelay(&full, env)
}

#[test]
fn check_config_prints_the_resolved_configuration_and_exits_zero() {
    let output = check_config(
        &["--dc-id", "dc-a", "--namespace-filter", "prod", "--bind", "127.0.0.1:5561"],
        &[
            ("DYN_RELAY_PUBLICATION_ENCODING_CONCURRENCY", "4"),
            ("DYN_EVENT_PLANE", "zmq"),
            ("DYN_RELAY_POOL_EXACT_STATE_BYTES_MAX", "8388608"),
            ("DYN_RELAY_NATS_BACKLOG_BYTES_MAX", "2097152"),
            ("DYN_RELAY_RECOVERY_RESPONSE_BYTES_MAX", "4194304"),
            ("DYN_RELAY_JOURNAL_QUEUE_BYTES_MAX", "3145728"),
        ],
    );
    assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stderr));
    let document: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(document["dcId"], "dc-a");
    assert_eq!(document["dcIdHex"], "04f110c98b1bfc48");
    assert_eq!(document["scope"]["namespaces"], serde_json::json!(["prod"]));
    assert_eq!(document["bind"], "127.0.0.1:5561");
    assert_eq!(document["wan"]["publicationEncodingConcurrency"], 4);
    assert_eq!(document["eventPlane"]["plane"], "zmq");
    assert_eq!(document["discovery"]["backend"], "etcd");
    let memory = &document["memory"];
    assert_eq!(memory["poolExactStateBytesMax"], 8 << 20);
    assert_eq!(memory["inputQueueBytesMax"], 256 << 20, "the default");
    assert_eq!(memory["natsBacklogBytesMax"], 2 << 20);
    assert_eq!(memory["recoveryResponseBytesMax"], 4 << 20);
    assert_eq!(memory["recoveryAnswersBytesMax"], 256 << 20, "the default");
    assert_eq!(memory["journalQueueBytesMax"], 3 << 20);
}

#[test]
fn check_config_names_the_bad_setting_and_exits_two() {
    let cases: [BadCase<'_>; 6] = [
        (&["--dc-id", "dc-a"], &[("DYN_RELAY_NAMESPACES", "")], "DYN_RELAY_NAMESPACES"),
        (&["--dc-id", "dc-a", "--endpoint-prefix", " prod.backend"], &[], "surrounding whitespace"),
        (
            &["--dc-id", "dc-a", "--bind", "127.0.0.1:0"],
            &[("DYN_RELAY_PUBLICATION_ENCODING_CONCURRENCY", "0")],
            "DYN_RELAY_PUBLICATION_ENCODING_CONCURRENCY",
        ),
        (&[], &[], "DYN_DC_ID"),
        (&["--dc-id", "dc-a", "--metrics-bind", "127.0.0.1:1"], &[], "--metrics-bind"),
        (
            &["--dc-id", "dc-a"],
            &[("DYN_RELAY_INPUT_QUEUE_BYTES_MAX", "4096")],
            "DYN_RELAY_INPUT_QUEUE_BYTES_MAX",
        ),
    ];
    for (args, env, setting) in cases {
        let output = check_config(args, env);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?} {env:?}: {stderr}");
        assert!(stderr.contains(setting), "{args:?} {env:?}: {stderr} should name {setting}");
        assert!(output.stdout.is_empty(), "nothing is printed on stdout for a bad configuration");
    }
    // The runtime's worker threads are read before anything else runs: a bad count stops the
    // binary, naming the setting, whatever the command.
    let output = check_config(&["--dc-id", "dc-a"], &[("DYN_RELAY_WORKER_THREADS", "0")]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("DYN_RELAY_WORKER_THREADS"), "{stderr}");
}

/// `scripts/test.sh --plan` with `path` as the whole PATH, no extra tool directories and an
/// empty private tool environment.
fn test_script_plan(path: &std::path::Path) -> String {
    let tools = tempfile::tempdir().unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/test.sh");
    let output = Command::new("/bin/bash")
        .args([script, "--plan", "-p", "kvrelay"])
        .env_clear()
        .env("PATH", path)
        .env("KVRELAY_TOOL_DIRS", path)
        .env("KVRELAY_TOOLS", tools.path())
        .output()
        .expect("bash runs");
    assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn the_test_script_installs_only_what_is_missing_and_runs_the_workspace_tests() {
    let bare = tempfile::tempdir().unwrap();
    let plan = test_script_plan(bare.path());
    assert_eq!(
        plan.lines().collect::<Vec<_>>(),
        [
            "install nats-server (Debian package nats-server)",
            "install etcd (Debian package etcd-server)",
            "install kubernetes-validate (PyPI package kubernetes-validate)",
            "run cargo test --workspace --all-targets -p kvrelay",
        ]
    );
    let equipped = tempfile::tempdir().unwrap();
    for tool in ["nats-server", "etcd", "kubernetes-validate"] {
        let path = equipped.path().join(tool);
        std::fs::write(&path, "#!/bin/sh\n").unwrap();
        let mut permissions = std::fs::metadata(&path).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut permissions, 0o755);
        std::fs::set_permissions(&path, permissions).unwrap();
    }
    let plan = test_script_plan(equipped.path());
    assert_eq!(
        plan.lines().collect::<Vec<_>>(),
        [
            "have nats-server",
            "have etcd",
            "have kubernetes-validate",
            "run cargo test --workspace --all-targets -p kvrelay"
        ]
    );
}
