//! Dynamo's launcher decisions (`python -m dynamo.kv_dc_relay`, its `cli.py` and CLI tests),
//! ported as one table: each row is a command line and an environment, and the decision Dynamo
//! makes for it: accepted (with what it resolves to) or refused (with the setting the error
//! names).

use std::collections::BTreeMap;
use std::time::Duration;

use super::*;
use kvrelay_core::discovery::NamespaceSelection;

/// Dynamo's tuning keys, as `DYN_RELAY_<KEY>` variables; the first three need no listener.
const TUNING: [&str; 20] = [
    "DYN_RELAY_PUBLICATION_THRESHOLD",
    "DYN_RELAY_PUBLICATION_DELAY_MS",
    "DYN_RELAY_RECOVERY_ATTEMPT_TIMEOUT_MS",
    "DYN_RELAY_MAX_MESSAGE_BYTES",
    "DYN_RELAY_KEEPALIVE_INTERVAL_MS",
    "DYN_RELAY_KEEPALIVE_TIMEOUT_MS",
    "DYN_RELAY_POOL_HEARTBEAT_INTERVAL_MS",
    "DYN_RELAY_READINESS_HEARTBEAT_INTERVAL_MS",
    "DYN_RELAY_SNAPSHOT_PROGRESS_TIMEOUT_MS",
    "DYN_RELAY_LOAD_WINDOW_MS",
    "DYN_RELAY_LOAD_FANOUT_CAPACITY",
    "DYN_RELAY_PUBLICATION_QUEUE_CAPACITY",
    "DYN_RELAY_PUBLICATION_QUEUE_BYTES",
    "DYN_RELAY_PUBLICATION_ENCODING_CONCURRENCY",
    "DYN_RELAY_MAX_CATALOG_SUBSCRIBERS",
    "DYN_RELAY_MAX_POOL_STREAMS_TOTAL",
    "DYN_RELAY_MAX_SUBSCRIBERS_PER_POOL",
    "DYN_RELAY_MAX_INITIALIZED_POOL_HUBS",
    "DYN_RELAY_MAX_READINESS_SUBSCRIBERS",
    "DYN_RELAY_MAX_LOAD_SUBSCRIBERS",
];

/// A command line as Dynamo's argparse would read it.
fn argv(args: &[&str]) -> CliValues {
    let mut cli = CliValues::default();
    let mut args = args.iter();
    while let Some(flag) = args.next() {
        let mut value = || (*args.next().expect("flag without a value")).to_owned();
        match *flag {
            "--dc-id" => cli.dc_id = Some(value()),
            "--namespaces" => cli.namespaces = Some(value()),
            "--namespace-filter" => cli.namespace_filter = Some(value()),
            "--watch-all" => cli.watch_all = true,
            "--endpoint-prefix" => cli.endpoint_prefixes.push(value()),
            "--expected-unique-blocks" => cli.expected_unique_blocks = Some(value()),
            "--bind" => cli.bind = Some(value()),
            "--sources-file" => cli.sources_file = Some(value().into()),
            other => panic!("not a launcher flag: {other}"),
        }
    }
    cli
}

fn environment(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(name, value)| ((*name).to_owned(), (*value).to_owned())).collect()
}

fn namespaces(config: &RelayConfig) -> Vec<&str> {
    match config.scope.namespace_selection() {
        NamespaceSelection::All => Vec::new(),
        NamespaceSelection::Namespaces(names) => names.iter().map(String::as_str).collect(),
    }
}

fn prefixes(config: &RelayConfig) -> Vec<&str> {
    config.scope.endpoint_prefixes().iter().map(String::as_str).collect()
}

fn watches_all(config: &RelayConfig) -> bool {
    *config.scope.namespace_selection() == NamespaceSelection::All
}

type Check = fn(&RelayConfig);

/// What Dynamo decides.
enum Decision {
    /// Accepted; the resolved configuration passes the check.
    Accept(Check),
    /// Refused; the error names this setting.
    Reject(&'static str),
}
use Decision::{Accept, Reject};

struct Row {
    name: &'static str,
    argv: &'static [&'static str],
    env: &'static [(&'static str, &'static str)],
    decision: Decision,
}

const DC: [&str; 2] = ["--dc-id", "dc-a"];

fn rows() -> Vec<Row> {
    vec![
        Row {
            name: "the default watches every namespace",
            argv: &DC,
            env: &[],
            decision: Accept(|c| {
                assert!(watches_all(c) && prefixes(c).is_empty() && c.bind.is_none());
                assert_eq!(c.expected_unique_blocks, 1_048_576);
            }),
        },
        Row {
            name: "--namespace-filter selects one namespace",
            argv: &[
                "--dc-id",
                "dc-a",
                "--namespace-filter",
                "production",
                "--endpoint-prefix",
                "production.backend",
            ],
            env: &[],
            decision: Accept(|c| {
                assert_eq!(namespaces(c), ["production"]);
                assert_eq!(prefixes(c), ["production.backend"]);
            }),
        },
        Row {
            name: "the command line wins over the environment",
            argv: &[
                "--dc-id",
                "cli-dc",
                "--namespaces",
                "cli-a, cli-b",
                "--endpoint-prefix",
                "cli-a.backend",
                "--endpoint-prefix",
                "cli-b.backend",
            ],
            env: &[
                ("DYN_DC_ID", "environment-dc"),
                ("DYN_RELAY_NAMESPACES", "environment-a, environment-b"),
                ("DYN_RELAY_ENDPOINT_PREFIXES", "environment-a.backend"),
                ("DYN_RELAY_BIND", "0.0.0.0:50051"),
                ("DYN_RELAY_PUBLICATION_THRESHOLD", "7"),
            ],
            decision: Accept(|c| {
                assert_eq!(c.dc_name, "cli-dc");
                assert_eq!(namespaces(c), ["cli-a", "cli-b"]);
                assert_eq!(prefixes(c), ["cli-a.backend", "cli-b.backend"]);
                assert_eq!(c.bind, Some("0.0.0.0:50051".parse().unwrap()));
                assert_eq!(c.producer.publication_threshold_events, 7);
            }),
        },
        Row {
            name: "tuning comes from the environment; unrelated DYN_RELAY_ names are ignored",
            argv: &["--dc-id", "dc-a", "--watch-all"],
            env: &[
                ("DYN_RELAY_BIND", "127.0.0.1:50051"),
                ("DYN_RELAY_MAX_POOL_STREAMS_TOTAL", "71"),
                ("DYN_RELAY_MAX_SUBSCRIBERS_PER_POOL", "8"),
                ("DYN_RELAY_MAX_INITIALIZED_POOL_HUBS", "3"),
                ("DYN_RELAY_UNRELATED", "9"),
            ],
            decision: Accept(|c| {
                assert_eq!((c.wan.max_pool_streams_total, c.wan.max_subscribers_per_pool), (71, 8));
                assert_eq!(c.wan.max_initialized_pool_hubs, 3);
            }),
        },
        Row {
            name: "producer tuning needs no listener",
            argv: &DC,
            env: &[
                ("DYN_RELAY_PUBLICATION_THRESHOLD", "7"),
                ("DYN_RELAY_PUBLICATION_DELAY_MS", "20"),
                ("DYN_RELAY_RECOVERY_ATTEMPT_TIMEOUT_MS", "1000"),
            ],
            decision: Accept(|c| {
                assert_eq!(c.producer.publication_delay, Duration::from_millis(20));
                assert_eq!(c.producer.recovery_attempt_timeout, Duration::from_secs(1));
            }),
        },
        Row {
            name: "environment namespaces and prefixes are comma lists",
            argv: &[],
            env: &[
                ("DYN_DC_ID", "dc-a"),
                ("DYN_RELAY_NAMESPACES", "prod-a,prod-b"),
                ("DYN_RELAY_ENDPOINT_PREFIXES", "prod-a.backend,prod-b.backend"),
            ],
            decision: Accept(|c| {
                assert_eq!(namespaces(c), ["prod-a", "prod-b"]);
                assert_eq!(prefixes(c), ["prod-a.backend", "prod-b.backend"]);
            }),
        },
        Row {
            name: "--bind wins over DYN_RELAY_BIND",
            argv: &["--dc-id", "dc-a", "--watch-all", "--bind", "[::1]:50051"],
            env: &[("DYN_RELAY_BIND", "127.0.0.1:50051")],
            decision: Accept(|c| assert_eq!(c.bind, Some("[::1]:50051".parse().unwrap()))),
        },
        Row {
            name: "a sources file that does not exist yet is a valid setting",
            argv: &["--dc-id", "dc-a", "--sources-file", "/nonexistent/kvrelay/sources.json"],
            env: &[],
            decision: Accept(|c| assert!(c.sources_file.is_some() && watches_all(c))),
        },
        Row {
            name: "DYN_RELAY_NAMESPACES and DYN_RELAY_WATCH_ALL=false select namespaces",
            argv: &DC,
            env: &[("DYN_RELAY_NAMESPACES", "prod"), ("DYN_RELAY_WATCH_ALL", "false")],
            decision: Accept(|c| assert_eq!(namespaces(c), ["prod"])),
        },
        Row { name: "no DC id", argv: &["--watch-all"], env: &[], decision: Reject("DYN_DC_ID") },
        Row {
            name: "an empty DC id",
            argv: &["--dc-id", ""],
            env: &[],
            decision: Reject("--dc-id"),
        },
        Row {
            name: "an empty DYN_DC_ID",
            argv: &[],
            env: &[("DYN_DC_ID", "")],
            decision: Reject("DYN_DC_ID"),
        },
        Row {
            name: "a DC id with surrounding whitespace",
            argv: &[],
            env: &[("DYN_DC_ID", "dc-a ")],
            decision: Reject("DYN_DC_ID"),
        },
        Row {
            name: "--watch-all with --namespaces",
            argv: &["--dc-id", "dc-a", "--watch-all", "--namespaces", "prod"],
            env: &[],
            decision: Reject("--namespaces"),
        },
        Row {
            name: "--namespace-filter with --namespaces",
            argv: &["--dc-id", "dc-a", "--namespace-filter", "prod", "--namespaces", "prod"],
            env: &[],
            decision: Reject("--namespace-filter"),
        },
        Row {
            name: "--namespace-filter with --watch-all",
            argv: &["--dc-id", "dc-a", "--namespace-filter", "prod", "--watch-all"],
            env: &[],
            decision: Reject("--namespace-filter"),
        },
        Row {
            name: "--namespace-filter with --sources-file",
            argv: &["--dc-id", "dc-a", "--sources-file", "s.json", "--namespace-filter", "p"],
            env: &[],
            decision: Reject("--namespace-filter"),
        },
        Row {
            name: "an empty --namespace-filter",
            argv: &["--dc-id", "dc-a", "--namespace-filter", ""],
            env: &[],
            decision: Reject("--namespace-filter"),
        },
        Row {
            name: "a --namespace-filter with surrounding whitespace",
            argv: &["--dc-id", "dc-a", "--namespace-filter", " prod"],
            env: &[],
            decision: Reject("--namespace-filter"),
        },
        Row {
            name: "DYN_RELAY_NAMESPACES with DYN_RELAY_WATCH_ALL=true",
            argv: &DC,
            env: &[("DYN_RELAY_NAMESPACES", "prod"), ("DYN_RELAY_WATCH_ALL", "true")],
            decision: Reject("DYN_RELAY_WATCH_ALL"),
        },
        Row {
            name: "an empty DYN_RELAY_NAMESPACES",
            argv: &DC,
            env: &[("DYN_RELAY_NAMESPACES", "")],
            decision: Reject("DYN_RELAY_NAMESPACES"),
        },
        Row {
            name: "an empty DYN_RELAY_WATCH_ALL",
            argv: &DC,
            env: &[("DYN_RELAY_WATCH_ALL", "")],
            decision: Reject("DYN_RELAY_WATCH_ALL"),
        },
        Row {
            name: "DYN_RELAY_WATCH_ALL=false without namespaces",
            argv: &DC,
            env: &[("DYN_RELAY_WATCH_ALL", "false")],
            decision: Reject("DYN_RELAY_NAMESPACES"),
        },
        Row {
            name: "a prefix outside the selected namespaces",
            argv: &[
                "--dc-id",
                "dc-a",
                "--namespaces",
                "prod",
                "--endpoint-prefix",
                "other.backend",
            ],
            env: &[],
            decision: Reject("other.backend"),
        },
        Row {
            name: "a prefix with leading whitespace",
            argv: &["--dc-id", "dc-a", "--endpoint-prefix", " prod.backend"],
            env: &[],
            decision: Reject("surrounding whitespace"),
        },
        Row {
            name: "a prefix with trailing whitespace",
            argv: &["--dc-id", "dc-a", "--endpoint-prefix", "prod.backend "],
            env: &[],
            decision: Reject("surrounding whitespace"),
        },
        Row {
            name: "a repeated prefix",
            argv: &["--dc-id", "dc-a", "--endpoint-prefix", "p.b", "--endpoint-prefix", "p.b"],
            env: &[],
            decision: Reject("more than once"),
        },
        Row {
            name: "an empty DYN_RELAY_ENDPOINT_PREFIXES",
            argv: &DC,
            env: &[("DYN_RELAY_ENDPOINT_PREFIXES", "")],
            decision: Reject("DYN_RELAY_ENDPOINT_PREFIXES"),
        },
        Row {
            name: "zero expected unique blocks",
            argv: &["--dc-id", "dc-a", "--watch-all", "--expected-unique-blocks", "0"],
            env: &[],
            decision: Reject("--expected-unique-blocks"),
        },
        Row {
            name: "an empty DYN_RELAY_BIND",
            argv: &DC,
            env: &[("DYN_RELAY_BIND", "")],
            decision: Reject("DYN_RELAY_BIND"),
        },
        Row {
            name: "zero encoding concurrency",
            argv: &["--dc-id", "dc-a", "--bind", "127.0.0.1:0"],
            env: &[("DYN_RELAY_PUBLICATION_ENCODING_CONCURRENCY", "0")],
            decision: Reject("DYN_RELAY_PUBLICATION_ENCODING_CONCURRENCY"),
        },
    ]
}

fn decide(row: &Row) {
    let result = resolve(&argv(row.argv), &environment(row.env));
    match (&row.decision, result) {
        (Accept(check), Ok(config)) => check(&config),
        (Accept(_), Err(error)) => panic!("{}: refused ({error}); Dynamo accepts it", row.name),
        (Reject(setting), Err(error)) => {
            assert!(error.to_string().contains(setting), "{}: {error} names {setting}", row.name);
        }
        (Reject(_), Ok(_)) => panic!("{}: accepted; Dynamo refuses it", row.name),
    }
}

#[test]
fn kvrelay_decides_as_dynamos_launcher() {
    for row in rows() {
        decide(&row);
    }
}

#[test]
fn every_tuning_key_must_be_a_positive_integer() {
    for key in TUNING {
        for bad in ["0", "", "-1", "x"] {
            let env = [(key, bad), ("DYN_RELAY_BIND", "127.0.0.1:0")];
            let error = resolve(&argv(&DC), &environment(&env)).unwrap_err();
            assert!(error.to_string().contains(key), "{key}={bad:?}: {error}");
        }
    }
}

#[test]
fn wan_tuning_requires_a_listener_and_producer_tuning_does_not() {
    for (index, key) in TUNING.into_iter().enumerate() {
        let result = resolve(&argv(&DC), &environment(&[(key, "1")]));
        if index < 3 {
            assert!(result.is_ok(), "{key} is producer tuning");
        } else {
            assert_eq!(
                result.unwrap_err(),
                ConfigError::Conflict { first: key, second: "no --bind listener" },
                "{key}"
            );
        }
    }
}

#[test]
fn every_accepted_tuning_key_is_honoured() {
    // Values other than the defaults (and large enough for the minima) reach the configuration.
    let env: Vec<(&str, &str)> = TUNING
        .into_iter()
        .map(|key| (key, "5000000"))
        .chain([("DYN_RELAY_BIND", "127.0.0.1:0"), ("DYN_RELAY_LOAD_FANOUT_CAPACITY", "3")])
        .collect();
    let config = resolve(&argv(&DC), &environment(&env)).unwrap();
    let ms = Duration::from_millis(5_000_000);
    assert_eq!(config.producer.publication_threshold_events, 5_000_000);
    assert_eq!(
        (config.producer.publication_delay, config.producer.recovery_attempt_timeout),
        (ms, ms)
    );
    let wan = config.wan;
    assert_eq!(
        [
            wan.keepalive_interval,
            wan.keepalive_timeout,
            wan.pool_heartbeat_interval,
            wan.readiness_heartbeat_interval,
            wan.snapshot_progress_timeout,
            wan.load_window,
        ],
        [ms; 6]
    );
    assert_eq!(
        [
            wan.max_message_bytes,
            wan.publication_queue_frames,
            wan.publication_queue_bytes,
            wan.publication_encoding_concurrency,
            wan.max_catalog_subscribers,
            wan.max_pool_streams_total,
            wan.max_subscribers_per_pool,
            wan.max_initialized_pool_hubs,
            wan.max_readiness_subscribers,
            wan.max_load_subscribers,
        ],
        [5_000_000; 10]
    );
    assert_eq!(wan.load_fanout_capacity, 3);
    assert_eq!(crate::publication::HubConfig::from_tuning(&wan).encoding_concurrency, 5_000_000);
}
