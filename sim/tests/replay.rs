//! `kvrelay-sim replay` on journals recorded from a simulated run: the demo DC (discovery,
//! traffic, a worker restart with recovery, load) drives a node under a paused clock while a
//! recorder journals it; the built binary then replays the journal with nothing but the
//! journal (the configuration comes from its header).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvrelay::demo::SharedDc;
use kvrelay::journal::{
    Record, RecorderConfig, SegmentLimits, SegmentWriter, read_journal, start_recorder,
};
use kvrelay::node::{NodeConfig, start_node_with_tap};
use kvrelay::pool::PoolConfig;
use kvrelay::publication::HubConfig;
use kvrelay::runtime::{InlineExecutor, ManualWallClock, WallClock};
use kvrelay_core::control::ControlConfig;
use kvrelay_core::discovery::DiscoveryScope;
use kvrelay_core::inputs::DcInput;
use kvrelay_core::model::identity::{RelayIdentity, stable_dc_id};
use kvrelay_core::rng::{derive_seed, rng_from_seed};
use kvrelay_core::sources::RecoveryResponse;
use kvrelay_dc::{Deployment, SimulatedDc, TrafficConfig};
use kvrelay_sim::incident::Incident;

const SEED: u64 = 0x5eed_0007;

fn recorded_node() -> NodeConfig {
    let mut rng = rng_from_seed(derive_seed(SEED, "replay-test/relay"));
    let relay = RelayIdentity::start(0x0071_0000_0000_0001, &mut rng);
    let scope = DiscoveryScope::new(Vec::new(), Vec::new(), true).unwrap();
    let mut control = ControlConfig::new(relay, stable_dc_id("sim-dc").unwrap(), scope);
    control.expected_unique_blocks = 4096;
    NodeConfig {
        control,
        pool: PoolConfig::default(),
        hub: HubConfig::default(),
        max_kicks: kvrelay_core::filter::ckf::MAX_KICKS_DEFAULT,
        rng_seed: derive_seed(SEED, "replay-test/node"),
        load_window: Duration::from_secs(1),
        input_queue_capacity: 1024,
        load_fanout_capacity: 16,
        input_queue_bytes_max: kvrelay::node::INPUT_QUEUE_BYTES_MAX_DEFAULT,
    }
}

/// Record 3 s of the demo DC (traffic every 50 ms, a worker restart half way) into `dir`.
fn record(dir: &Path) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(async {
        let clock = Arc::new(ManualWallClock::new(1_767_225_600_000_000));
        let mut recording =
            RecorderConfig::new(dir.to_path_buf(), 64 << 20, Duration::from_secs(60));
        recording.checkpoint_every_inputs = 40;
        recording.checkpoint_interval = Duration::from_millis(400);
        let node_config = recorded_node();
        let recorder = start_recorder(
            &recording,
            &node_config,
            Arc::clone(&clock) as Arc<dyn WallClock>,
            Arc::new(InlineExecutor),
        )
        .unwrap();
        let mut rng = rng_from_seed(derive_seed(SEED, "replay-test/dc"));
        let dc = SharedDc(Arc::new(Mutex::new(SimulatedDc::start(
            &Deployment::demo(),
            TrafficConfig::default(),
            &mut rng,
        ))));
        let node = start_node_with_tap(
            node_config,
            Arc::new(InlineExecutor),
            Arc::clone(&clock) as Arc<dyn WallClock>,
            recorder.recovery(Arc::new(dc.clone())),
            Some(recorder.tap()),
        )
        .unwrap();
        for fact in dc.with(|dc| dc.discovery_facts()) {
            node.inputs.send(fact).await.unwrap();
        }
        let mut ticks = tokio::time::interval(Duration::from_millis(50));
        for tick in 1..=60u64 {
            ticks.tick().await;
            clock.advance_us(50_000);
            let mut facts = dc.with(|dc| dc.step(5, &mut rng));
            if tick % 8 == 0 {
                facts.extend(dc.with(|dc| dc.load_facts()));
            }
            if tick == 30 {
                facts.extend(dc.with(|dc| dc.restart_worker(0, &mut rng)));
            }
            for fact in facts {
                node.inputs.send(fact).await.unwrap();
            }
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        node.shutdown().await;
        let stats = recorder.finish().await;
        assert_eq!(stats.records_dropped, 0);
    });
}

fn sim(args: &[&str]) -> (Output, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_kvrelay-sim")).args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output, text)
}

fn path(dir: &Path) -> &str {
    dir.to_str().unwrap()
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> =
        std::fs::read_dir(dir).unwrap().map(|entry| entry.unwrap().path()).collect();
    files.sort();
    files
}

#[test]
fn a_recorded_simulated_run_replays_every_checkpoint_from_the_journal_alone() {
    let dir = tempfile::tempdir().unwrap();
    record(dir.path());
    let (header, records, fault) = read_journal(dir.path()).unwrap();
    assert_eq!(fault, None);
    assert_eq!(*header.node, recorded_node(), "the header carries the configuration");
    let checkpoints =
        records.iter().filter(|record| matches!(record, Record::Checkpoint { .. })).count();
    let recoveries =
        records.iter().filter(|record| matches!(record, Record::Recovery { .. })).count();
    assert!(checkpoints >= 5, "{checkpoints} checkpoints");
    assert!(recoveries >= 1, "the restart's recovery answers are in the journal");

    let (output, text) = sim(&["replay", path(dir.path()), "--consumer-after-end"]);
    assert!(output.status.success(), "{text}");
    assert!(text.contains(&format!("\n{checkpoints} checkpoints reproduced\n")), "{text}");
    assert!(!text.contains("DIVERGED"), "{text}");
    assert!(!text.contains("state at"), "no dump without --until: {text}");
    let progress = text.lines().filter(|line| line.ends_with(" pools, reproduced")).count();
    assert_eq!(progress, checkpoints, "one progress line per checkpoint: {text}");

    let (output, until) =
        sim(&["replay", path(dir.path()), "--until", "1.5", "--consumer-after-end"]);
    assert!(output.status.success(), "{until}");
    assert!(until.contains("replaying") && until.contains("until 1.500 s"), "{until}");
    let compared: usize = until
        .lines()
        .find_map(|line| line.strip_suffix(" checkpoints reproduced"))
        .and_then(|count| count.parse().ok())
        .expect("a verdict line");
    assert!(compared >= 1 && compared < checkpoints, "{compared} of {checkpoints}: {until}");
    assert!(until.contains("\nstate at "), "{until}");
    assert!(until.contains("\ncatalog (revision "), "{until}");
    assert!(until.contains("\nreadiness (revision "), "{until}");
    assert!(until.contains(" exact blocks, canonical digest "), "{until}");
    let load = until.split("\nload (window ").nth(1).expect("the load window in the dump");
    assert!(load.contains(" blocks used, ") && load.contains(" ranks reported"), "{until}");
}

#[test]
fn a_divergence_names_its_time_and_entries_and_fails() {
    let dir = tempfile::tempdir().unwrap();
    record(dir.path());
    let (header, records, _) = read_journal(dir.path()).unwrap();
    // The journal without one KV event batch from the middle of the run.
    let victim = records
        .iter()
        .enumerate()
        .filter(|(_, record)| matches!(record, Record::Input { input: DcInput::KvEvents(_), .. }))
        .map(|(index, _)| index)
        .nth(40)
        .expect("enough batches");
    let tampered = tempfile::tempdir().unwrap();
    let limits = SegmentLimits {
        max_segment_bytes: 64 << 20,
        max_segment_age: Duration::from_secs(3600),
        max_total_bytes: 1 << 30,
    };
    let mut writer = SegmentWriter::create(tampered.path(), header, limits).unwrap();
    for (index, record) in records.iter().enumerate() {
        if index != victim {
            writer.append(record).unwrap();
        }
    }
    writer.flush(true).unwrap();
    let (output, text) = sim(&["replay", path(tampered.path())]);
    assert!(!output.status.success(), "{text}");
    let line = text.lines().find(|line| line.starts_with("DIVERGED at checkpoint ")).expect(&text);
    assert!(line.contains("recorded at ") && line.contains(" s, replayed at "), "{line}");
    assert!(text.contains("\n  "), "the differing entries follow: {text}");
}

#[test]
fn a_damaged_journal_fails_naming_the_file_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    record(dir.path());
    let segment = segments(dir.path()).pop().unwrap();
    let length = std::fs::metadata(&segment).unwrap().len();
    // Cut the last frame short: the records before it replay, the fault is reported.
    std::fs::OpenOptions::new().write(true).open(&segment).unwrap().set_len(length - 3).unwrap();
    let (output, text) = sim(&["replay", path(dir.path())]);
    assert!(!output.status.success(), "{text}");
    let name = segment.file_name().unwrap().to_str().unwrap();
    let fault = text.lines().find(|line| line.starts_with("journal error: ")).expect(&text);
    assert!(fault.contains(name) && fault.contains("byte offset "), "{fault}");

    // A bad magic cannot be opened at all.
    let mut bytes = std::fs::read(&segment).unwrap();
    bytes[0] = b'X';
    std::fs::write(&segment, bytes).unwrap();
    let (output, text) = sim(&["replay", path(dir.path())]);
    assert!(!output.status.success(), "{text}");
    assert!(text.contains(name) && text.contains("byte offset 0"), "{text}");
}

/// A recorded journal (in the first directory) and `faults` written as `faults.toml` in the
/// second, for `replay --fault`.
fn recorded_with_faults(faults: &str) -> (tempfile::TempDir, tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    record(dir.path());
    let out = tempfile::tempdir().unwrap();
    let file = write(out.path(), "faults.toml", faults);
    (dir, out, file)
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let file = dir.join(name);
    std::fs::write(&file, text).unwrap();
    file
}

fn check_line<'a>(text: &'a str, name: &str) -> &'a str {
    text.lines()
        .find(|line| line.trim_start().get(5..).is_some_and(|rest| rest.starts_with(name)))
        .unwrap_or_else(|| panic!("no {name} check in {text}"))
}

#[test]
fn in_the_simulator_the_consumer_ends_equal_to_a_fresh_subscriber() {
    let dir = tempfile::tempdir().unwrap();
    record(dir.path());
    let (output, text) = sim(&["replay", path(dir.path())]);
    for check in [
        "consumer-caught-up",
        "replica-equals-relay",
        "producer-identity-never-reused",
        "sequence-contiguity",
        "withdrawal-precedes-teardown",
    ] {
        assert!(check_line(&text, check).trim_start().starts_with("ok   "), "{text}");
    }
    assert!(check_line(&text, "consumer-caught-up").contains("consumer-a: 4 pools"), "{text}");
    let checkpoints = check_line(&text, "checkpoints");
    assert!(
        checkpoints.trim_start().starts_with("ok   ") && checkpoints.contains("reproduced"),
        "{text}"
    );
    assert!(output.status.success(), "{text}");
}

#[test]
fn replaying_a_journal_twice_gives_identical_traces() {
    let dir = tempfile::tempdir().unwrap();
    record(dir.path());
    let setup = kvrelay_sim::replay::ReplaySetup { seed: 3, ..Default::default() };
    let first = kvrelay_sim::replay::replay(dir.path(), &setup).unwrap();
    let second = kvrelay_sim::replay::replay(dir.path(), &setup).unwrap();
    assert!(first.trace.len() > 5, "{}", first.render(false));
    assert_eq!(first.trace, second.trace);
    assert_eq!(first.digest, second.digest);
    let other = kvrelay_sim::replay::replay(
        dir.path(),
        &kvrelay_sim::replay::ReplaySetup { seed: 4, ..Default::default() },
    )
    .unwrap();
    assert_eq!(
        first.report.as_ref().unwrap().inputs_replayed,
        other.report.unwrap().inputs_replayed,
        "the node's inputs do not depend on the simulation's seed"
    );

    let out = tempfile::tempdir().unwrap();
    let trace = out.path().join("trace.jsonl");
    let (output, text) = sim(&[
        "replay",
        path(dir.path()),
        "--consumer-after-end",
        "--twice",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    assert!(output.status.success(), "{text}");
    assert!(text.contains("\ndeterministic: "), "{text}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert!(text.contains(&format!("trace: {} events in ", lines.len())), "{text}");
    assert_eq!(lines[0]["kind"], "relay-boot");
    assert!(lines.iter().any(|line| line["kind"] == "relay-catalog"));
    assert!(lines.iter().any(|line| line["kind"] == "consumer"));
}

const FAULTS: &str = r#"
[[faults]]
at_ms = 300
action = "wan-partition"
[[faults]]
at_ms = 700
action = "wan-repair"
[[faults]]
at_ms = 800
action = "dc-partition"
mode = "drop"
[[faults]]
at_ms = 1100
action = "dc-repair"
[[faults]]
at_ms = 1200
action = "event-noise"
loss = 0.2
duplicate = 0.1
reorder = 0.1
[[faults]]
at_ms = 1800
action = "event-noise"
[[faults]]
at_ms = 1900
action = "clock-skew"
ms = -4000
[[faults]]
at_ms = 2200
action = "relay-restart"
"#;

#[test]
fn faults_layer_on_a_replay_and_the_consumer_still_converges() {
    let (dir, out, faults) = recorded_with_faults(FAULTS);
    let trace = out.path().join("trace.jsonl");
    let (output, text) = sim(&[
        "replay",
        path(dir.path()),
        "--fault",
        faults.to_str().unwrap(),
        "--trace",
        trace.to_str().unwrap(),
    ]);
    assert!(output.status.success(), "{text}");
    assert!(text.contains("with the faults of "), "{text}");
    let checkpoints = check_line(&text, "checkpoints");
    assert!(checkpoints.contains("(expected: faults are layered"), "{checkpoints}");
    assert!(check_line(&text, "inputs-decode").contains(" 0 DC-plane messages"), "{text}");
    assert!(check_line(&text, "consumer-caught-up").contains("consumer-a: 4 pools"), "{text}");
    let events: Vec<serde_json::Value> = std::fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    let kinds = |kind: &str| events.iter().filter(|e| e["kind"] == kind).count();
    assert_eq!(kinds("fault"), 8);
    assert_eq!(kinds("relay-boot"), 2, "the restart booted a second node");
    let incarnations: std::collections::BTreeSet<String> = events
        .iter()
        .filter(|e| e["kind"] == "relay-boot")
        .map(|e| e["incarnation"].to_string())
        .collect();
    assert_eq!(incarnations.len(), 2, "the restarted relay is a new incarnation");
    assert!(check_line(&text, "producer-identity-never-reused").contains("retired"), "{text}");
}

#[test]
fn faults_scripted_past_the_journals_end_are_played_and_the_replay_completes() {
    let (dir, _out, faults) = recorded_with_faults(
        "[[faults]]\nat_ms = 1200\naction = \"wan-partition\"\n\n\
         [[faults]]\nat_ms = 1500\naction = \"wan-repair\"\n",
    );
    let (output, text) =
        sim(&["replay", path(dir.path()), "--until", "1", "--fault", faults.to_str().unwrap()]);
    assert!(output.status.success(), "{text}");
    assert!(check_line(&text, "replica-equals-relay").contains("identical"), "{text}");
}

#[test]
fn worker_level_faults_are_refused_by_name() {
    let (dir, _out, faults) =
        recorded_with_faults("[[faults]]\nat_ms = 100\naction = \"expire-lease\"\nworker = 0\n");
    let (output, text) = sim(&["replay", path(dir.path()), "--fault", faults.to_str().unwrap()]);
    assert!(!output.status.success(), "{text}");
    assert!(text.contains("`expire-lease`") && text.contains("no worker model"), "{text}");
}

#[test]
fn a_cut_window_becomes_an_incident_that_run_checks() {
    let dir = tempfile::tempdir().unwrap();
    record(dir.path());
    let out = tempfile::tempdir().unwrap();
    let name = out.path().join("restart");
    let (output, text) =
        sim(&["cut", path(dir.path()), "--from", "1.0", "--to", "2.0", "--out", path(&name)]);
    assert!(output.status.success(), "{text}");
    let journal = out.path().join("restart.kvj");
    let incident = out.path().join("restart.toml");
    let (header, records, fault) = read_journal(&journal).unwrap();
    assert_eq!(fault, None);
    assert_eq!(*header.node, recorded_node(), "the cut keeps the configuration and seed");
    assert!(
        matches!(&records[0], Record::Input { input: DcInput::CardsListed { .. }, at } if at.mono_ns == 0)
    );
    let last = records.iter().filter_map(Record::stamp).map(|at| at.mono()).max().unwrap();
    assert!(last <= Duration::from_secs(1), "shifted to the window: {last:?}");
    assert!(records.iter().any(|r| matches!(r, Record::Recovery { .. })), "the restart's answers");
    let carried: usize = records
        .iter()
        .filter_map(|r| match r {
            Record::Recovery {
                at, outcome: Ok(RecoveryResponse::TreeDump { events, .. }), ..
            } if at.mono_ns == 0 => Some(events.len()),
            _ => None,
        })
        .sum();
    assert!(carried > 0, "the ranks' state at the window's start is answered as tree dumps");
    // The recorded cadence (every 40 inputs or 400 ms) puts checkpoints inside the window.
    let checkpoints = records.iter().filter(|r| matches!(r, Record::Checkpoint { .. })).count();
    assert!(checkpoints >= 2, "{checkpoints} recorded checkpoints in the window");

    let (output, run) = sim(&["run", path(&incident), "--seed", "2"]);
    assert!(output.status.success(), "{run}");
    for check in ["expected-outcome", "expected-kv", "checkpoints"] {
        assert!(check_line(&run, check).trim_start().starts_with("ok   "), "{run}");
    }
    assert!(
        check_line(&run, "checkpoints").contains(&format!("{checkpoints} checkpoints reproduced")),
        "{run}"
    );

    let text = std::fs::read_to_string(&incident).unwrap();
    let wrong = text.replace("pools = 4", "pools = 5");
    assert_ne!(text, wrong);
    std::fs::write(&incident, wrong).unwrap();
    let (output, run) = sim(&["run", path(&incident)]);
    assert!(!output.status.success(), "{run}");
    assert!(check_line(&run, "expected-outcome").contains("FAIL"), "{run}");
    assert!(run.contains("reproduce: cargo run --profile test -p kvrelay-sim -- run "), "{run}");

    let (output, again) =
        sim(&["cut", path(dir.path()), "--from", "1.0", "--to", "2.0", "--out", path(&name)]);
    assert!(!output.status.success() && again.contains("already exists"), "{again}");
}

/// The cut of [1.0 s, 2.0 s] and the state the whole journal's replay has at 2.0 s.
fn cut_and_state_at_its_end(
    dir: &Path,
    out: &Path,
) -> (Incident, Vec<kvrelay::journal::PoolCheckpoint>) {
    let (from, to) = (Duration::from_secs(1), Duration::from_secs(2));
    let cut = kvrelay_sim::incident::cut(dir, from, to, &out.join("window")).unwrap();
    assert!(cut.dumps > 0 && cut.carried_blocks > 0, "{cut:?}");
    assert_eq!(cut.orphans, 0, "{cut:?}");
    let whole = kvrelay_sim::replay::replay_paused(dir, Some(to)).unwrap();
    let (_, state) = whole.final_state.unwrap();
    (Incident::load(&cut.incident).unwrap(), state.pools)
}

#[test]
fn a_cut_window_replays_with_the_kv_state_the_whole_journal_has_at_its_end() {
    let dir = tempfile::tempdir().unwrap();
    record(dir.path());
    let out = tempfile::tempdir().unwrap();
    let (incident, recorded) = cut_and_state_at_its_end(dir.path(), out.path());
    assert!(recorded.iter().all(|pool| pool.exact_blocks > 0), "{recorded:?}");
    assert_eq!(incident.kv.len(), recorded.len());

    let outcome = incident.run(4).unwrap();
    assert!(outcome.passed(), "{}", outcome.render(true));
    let report = outcome.report.as_ref().unwrap();
    let (_, replayed) = report.final_state.clone().unwrap();
    let kv = |pools: &[kvrelay::journal::PoolCheckpoint]| -> Vec<(String, u64, u64, u64)> {
        pools
            .iter()
            .map(|p| (p.pool.clone(), p.layout_generation, p.exact_blocks, p.canonical_digest))
            .collect()
    };
    assert_eq!(kv(&replayed.pools), kv(&recorded), "{}", outcome.render(true));
    assert!(report.checkpoints_compared > 0 && report.divergence.is_none());
    let again = incident.run(4).unwrap();
    assert_eq!(outcome.trace, again.trace);
    assert_eq!(outcome.digest, again.digest);
    let out2 = tempfile::tempdir().unwrap();
    let (twin, _) = cut_and_state_at_its_end(dir.path(), out2.path());
    let bytes = |incident: &Incident| std::fs::read(incident.journal_path()).unwrap();
    assert_eq!(bytes(&incident), bytes(&twin), "cutting is a function of the journal");
}

#[test]
fn an_incident_whose_kv_state_is_not_reached_fails_naming_the_pool() {
    let dir = tempfile::tempdir().unwrap();
    record(dir.path());
    let out = tempfile::tempdir().unwrap();
    let (mut incident, _) = cut_and_state_at_its_end(dir.path(), out.path());
    let expected = incident.kv[0].exact_blocks;
    incident.kv[0].exact_blocks += 1;
    let outcome = incident.run(0).unwrap();
    assert!(!outcome.passed());
    let failure = outcome.failure().unwrap();
    assert!(failure.contains("expected-kv"), "{failure}");
    assert!(
        failure.contains(&format!(
            "{} generation {}: expected {} exact blocks",
            incident.kv[0].pool,
            incident.kv[0].layout_generation,
            expected + 1
        )),
        "{failure}"
    );
    assert!(failure.contains(&format!("replayed {expected} ")), "{failure}");
    // The checked-in incident would fail the same way if the window's KV events were dropped:
    // a node with no KV state does not meet the expectation.
    let empty = kvrelay::journal::Checkpoint::default();
    let check = kvrelay_sim::incident::kv::check(&incident.kv, Some(&(Duration::ZERO, empty)));
    assert!(!check.passed && check.detail.contains("not in the replayed state"), "{check:?}");
}

#[test]
fn a_scenario_run_records_a_journal_per_relay_boot() {
    let root = tempfile::tempdir().unwrap();
    let scenario = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios/relay-restart.toml");
    let (output, text) =
        sim(&["run", scenario.to_str().unwrap(), "--seed", "1", "--record", path(root.path())]);
    assert!(output.status.success(), "{text}");
    let boots = segments(root.path());
    assert_eq!(boots.len(), 2, "one recording per boot: {boots:?}");
    for boot in &boots {
        let (header, records, fault) = read_journal(boot).unwrap();
        assert_eq!(fault, None);
        assert_eq!(header.segment, 0);
        let inputs = records.iter().filter(|r| matches!(r, Record::Input { .. })).count();
        assert!(inputs > 10, "{inputs} inputs in {}", boot.display());
        let (_, replayed) = sim(&["replay", path(boot)]);
        assert!(check_line(&replayed, "replica-equals-relay").contains("ok   "), "{replayed}");
    }
}

#[test]
fn a_sweep_runs_the_incidents_of_its_directory() {
    let scenarios = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(scenarios.join("steady.toml"), dir.path().join("steady.toml")).unwrap();
    let incidents = dir.path().join("incidents");
    std::fs::create_dir(&incidents).unwrap();
    for file in ["worker-restart-window.toml", "worker-restart-window.kvj"] {
        std::fs::copy(scenarios.join("incidents").join(file), incidents.join(file)).unwrap();
    }
    let (output, text) = sim(&["sweep", path(dir.path()), "--seeds", "0..2"]);
    assert!(output.status.success(), "{text}");
    assert!(text.contains("[4/4] incidents/worker-restart-window done"), "{text}");
    assert!(text.contains("sweep: 4 passed, 0 failed"), "{text}");
}

/// With plane faults the inputs reach the node through the simulated planes. Without a restart
/// the journal's node is the only one fed, and it must be fed: before the planes client kept
/// following with nobody to send it recovery queries, it fed no input at all.
#[test]
fn plane_faults_alone_still_feed_the_journals_node() {
    let (dir, _out, faults) = recorded_with_faults(
        r#"
[[faults]]
at_ms = 800
action = "dc-partition"
mode = "drop"
[[faults]]
at_ms = 1100
action = "dc-repair"
"#,
    );
    let (output, text) = sim(&["replay", path(dir.path()), "--fault", faults.to_str().unwrap()]);
    assert!(output.status.success(), "{text}");
    assert!(check_line(&text, "consumer-caught-up").contains("consumer-a: 4 pools"), "{text}");
    assert!(check_line(&text, "replica-equals-relay").contains("4 pools identical"), "{text}");
}
