//! Incidents as regression tests: a window cut out of a journal ([`cut`]) plus a small TOML
//! file naming it, the faults to layer and the outcome observed at the window's end
//! (`scenarios/incidents/*.toml`, schema in `scenarios/README.md`).
//!
//! A window cannot start from the recorded node's state: a checkpoint holds digests, not the
//! state itself. So the cut journal starts a fresh node (the recorded configuration and seed)
//! on a synthesized listing of the discovery state the inputs before the window leave
//! ([`DiscoveryState`](crate::replay::listing)) and, per advertised recoverable rank, the tree
//! dump its worker would answer to the query the fresh node makes on activating it: the rank's
//! blocks as the KV events and recovery answers before the window leave them
//! ([`RankStates`](crate::replay::dumps)), all stamped at the window's start; then the
//! window's inputs, recovery answers and checkpoints at their times shifted to the window (each
//! checkpoint renumbered to the cut's inputs). The cut's header has no cadence, so its replay
//! takes checkpoints exactly there and compares what a window reproduces
//! ([`Checkpoint::window_view`](kvrelay::journal::Checkpoint::window_view)). What the incident
//! file expects is what the recorded node published after the window's last input: its
//! catalog's pool count, its readiness and, per pool generation, its exact-block count and
//! canonical digest ([`kv`]).

pub mod kv;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use kvrelay::journal::{NO_CADENCE, Record, SegmentLimits, SegmentWriter, Stamp, read_journal};
use kvrelay_core::inputs::DcInput;
use kvrelay_core::sources::{RecoveryRequest, RecoveryResponse, TreeDumpScope};
use serde::{Deserialize, Serialize};

use self::kv::ExpectedPool;
use crate::replay::dumps::RankStates;
use crate::replay::listing::DiscoveryState;
use crate::replay::{ReplayOutcome, ReplaySetup, replay, replay_paused};
use crate::scenario::{ConsumerExpectations, Expect, ExpectedState, ScriptedFault, toml_files};

/// One incident file.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Incident {
    /// The incident's name (defaults to the file stem).
    #[serde(default)]
    pub name: String,
    /// Where it was cut from and what it shows.
    #[serde(default)]
    pub description: String,
    /// The journal (a segment file or a recording directory), relative to this file.
    pub journal: String,
    /// Faults layered on the replay (as `replay --fault`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub faults: Vec<ScriptedFault>,
    /// The outcome both the long-lived and a fresh consumer must see after the replay.
    pub expect: Expect,
    /// The KV state the replay must end with, per pool generation (checked when not empty).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kv: Vec<ExpectedPool>,
    /// Where the file was loaded from (not part of the schema).
    #[serde(skip)]
    pub path: Option<PathBuf>,
}

impl Incident {
    /// Whether the TOML `text` is an incident file (it names a `journal`) rather than a scenario.
    #[must_use]
    pub fn is_incident(text: &str) -> bool {
        toml::from_str::<toml::Table>(text).is_ok_and(|table| table.contains_key("journal"))
    }

    /// Load the incident file at `path`.
    pub fn load(path: &Path) -> anyhow::Result<Incident> {
        let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
        let mut incident: Incident =
            toml::from_str(&text).with_context(|| format!("{}", path.display()))?;
        if incident.name.is_empty() {
            let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("incident");
            stem.clone_into(&mut incident.name);
        }
        incident.path = Some(path.to_owned());
        Ok(incident)
    }

    /// Every `*.toml` incident in `dir` (none when it does not exist), sorted by file name.
    pub fn load_dir(dir: &Path) -> anyhow::Result<Vec<Incident>> {
        if !dir.is_dir() {
            return Ok(Vec::new());
        }
        let paths = toml_files(dir).with_context(|| format!("{}", dir.display()))?;
        paths.iter().map(|path| Incident::load(path)).collect()
    }

    /// The journal's path.
    #[must_use]
    pub fn journal_path(&self) -> PathBuf {
        let dir = self.path.as_deref().and_then(Path::parent).unwrap_or(Path::new("."));
        dir.join(&self.journal)
    }

    /// Replay the journal in the simulator with the faults and check the expectation.
    pub fn run(&self, seed: u64) -> anyhow::Result<ReplayOutcome> {
        let setup = ReplaySetup {
            until: None,
            faults: self.faults.clone(),
            seed,
            expect: Some(self.expect.clone()),
            consumer_after_end: false,
        };
        let mut outcome = replay(&self.journal_path(), &setup)
            .with_context(|| format!("incident {}", self.name))?;
        if !self.kv.is_empty() {
            let state = outcome.report.as_ref().and_then(|report| report.final_state.as_ref());
            outcome.checks.push(kv::check(&self.kv, state));
        }
        Ok(outcome)
    }

    /// The one command that reproduces a run.
    #[must_use]
    pub fn reproduce_command(&self, seed: u64) -> String {
        let file =
            self.path.as_ref().map_or_else(|| self.name.clone(), |p| p.display().to_string());
        format!("cargo run --profile test -p kvrelay-sim -- run {file} --seed {seed}")
    }
}

/// What [`cut`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct Cut {
    /// The journal file.
    pub journal: PathBuf,
    /// The incident file.
    pub incident: PathBuf,
    /// Facts of the synthesized discovery listing.
    pub listing: usize,
    /// Inputs of the window.
    pub inputs: usize,
    /// Recovery answers of the window.
    pub recoveries: usize,
    /// Recorded checkpoints of the window.
    pub checkpoints: usize,
    /// Synthesized tree dumps carrying the ranks' state at the window's start.
    pub dumps: usize,
    /// Blocks those dumps carry.
    pub carried_blocks: usize,
    /// Blocks held before the window that no dump could carry (an ancestor was removed).
    pub orphans: usize,
    /// Advertised ranks with no recovery target: their state before the window is not carried.
    pub live_only: usize,
    /// Bytes of the journal file.
    pub bytes: u64,
    /// The expectation written.
    pub expect: Expect,
    /// The KV state expected.
    pub kv: Vec<ExpectedPool>,
}

fn expected_state(entry_json: &str) -> Option<(String, ExpectedState)> {
    let entry: serde_json::Value = serde_json::from_str(entry_json).ok()?;
    let model = entry.get("canonical_model_id")?.as_str()?.to_owned();
    let state = match entry.get("state")?.as_str()? {
        "SERVING_READINESS_STATE_READY" => ExpectedState::Ready,
        "SERVING_READINESS_STATE_UNAVAILABLE" => ExpectedState::Unavailable,
        _ => ExpectedState::Unknown,
    };
    Some((model, state))
}

/// Cut the window `[from, to]` (node time) out of the journal at `journal` into `out.kvj` and
/// an incident file `out.toml` (see the module doc for what the window carries).
pub fn cut(journal: &Path, from: Duration, to: Duration, out: &Path) -> anyhow::Result<Cut> {
    anyhow::ensure!(from < to, "the window is empty: --from must be before --to");
    let name = out
        .file_name()
        .and_then(|name| name.to_str())
        .filter(|name| !name.is_empty())
        .context("--out must be DIR/NAME")?
        .to_owned();
    let journal_file = out.with_file_name(format!("{name}.kvj"));
    let incident_file = out.with_file_name(format!("{name}.toml"));
    anyhow::ensure!(
        !journal_file.exists() && !incident_file.exists(),
        "{} or {} already exists",
        journal_file.display(),
        incident_file.display()
    );
    let (header, records, fault) =
        read_journal(journal).with_context(|| format!("reading {}", journal.display()))?;
    if let Some(fault) = &fault {
        eprintln!("warning: the journal ends early: {fault}; cutting what precedes it");
    }
    let observed = replay_paused(journal, Some(to))?;
    let (_, state) = observed
        .final_state
        .as_ref()
        .with_context(|| format!("no input at or before {:.3} s", to.as_secs_f64()))?;
    let expect = Expect {
        pools: state.catalog.len(),
        readiness: state.readiness.iter().filter_map(|entry| expected_state(entry)).collect(),
        other_models: None,
        consumer: ConsumerExpectations::default(),
        capacity_omissions: false,
    };
    let kv: Vec<ExpectedPool> = state.pools.iter().map(ExpectedPool::of).collect();

    let mut discovery = DiscoveryState::new(header.node.control.scope.clone());
    let mut ranks = RankStates::new();
    let mut inputs_before = 0u64;
    let mut window = Vec::new();
    let mut start_wall = None;
    for record in records {
        let Some(at) = record.stamp() else { continue };
        let mono = at.mono();
        if mono < from {
            match &record {
                Record::Input { input, .. } => {
                    inputs_before += 1;
                    discovery.apply(input);
                    ranks.apply_input(input);
                }
                Record::Recovery { target, request, outcome, .. } => {
                    ranks.apply_recovery(target, request, outcome);
                }
                _ => {}
            }
            continue;
        }
        if mono > to {
            break;
        }
        let shift = |at: Stamp| Stamp {
            mono_ns: at.mono_ns.saturating_sub(u64::try_from(from.as_nanos()).unwrap_or(0)),
            wall_us: at.wall_us,
        };
        let wall = at.wall_us.saturating_sub(
            u64::try_from(mono.saturating_sub(from).as_micros()).unwrap_or(u64::MAX),
        );
        start_wall.get_or_insert(wall);
        // Publication points, pool starts and timer firings count from the node's start: a
        // window replays free of them.
        if let Record::Input { .. }
        | Record::Recovery { .. }
        | Record::Gap { .. }
        | Record::Checkpoint { .. } = record
        {
            let mut record = record;
            if let Some(at) = record.stamp_mut() {
                *at = shift(*at);
            }
            window.push(record);
        }
    }
    let start_wall = start_wall.context("no record in the window")?;
    let mut cut_header = header;
    cut_header.wall_origin_us = start_wall;
    // The window's recorded checkpoints are its checkpoints: see the module doc.
    cut_header.checkpoint_every_inputs = NO_CADENCE;
    cut_header.checkpoint_interval_ns = NO_CADENCE;
    cut_header.segment = 0;
    let listing = discovery.listing();
    let parts = out.with_file_name(format!(".{name}.parts"));
    let limits = SegmentLimits {
        max_segment_bytes: 1 << 40,
        max_segment_age: Duration::from_secs(1 << 40),
        max_total_bytes: 1 << 41,
    };
    let mut writer = SegmentWriter::create(&parts, cut_header, limits)?;
    let opening = Stamp { mono_ns: 0, wall_us: start_wall };
    for input in &listing {
        writer.append(&Record::Input { at: opening, input: input.clone() })?;
    }
    let (mut dumps, mut carried, mut orphans, mut live_only) = (0, 0, 0, 0);
    for input in &listing {
        let DcInput::SourceAdvertised(advert) = input else { continue };
        let Some(target) = &advert.recovery_target else {
            live_only += 1;
            continue;
        };
        let dump = ranks.dump(advert);
        dumps += 1;
        carried += dump.blocks;
        orphans += dump.orphans;
        writer.append(&Record::Recovery {
            at: opening,
            target: target.clone(),
            request: RecoveryRequest::tree_dump(advert.source),
            outcome: Ok(RecoveryResponse::TreeDump {
                events: dump.events,
                last_event_id: dump.last_event_id,
                reset_scope: TreeDumpScope::Rank,
            }),
        })?;
    }
    // A checkpoint counts the cut's inputs: the listing's, then the window's before it.
    let listed = listing.len() as u64;
    for record in &mut window {
        if let Record::Checkpoint { checkpoint, .. } = record {
            checkpoint.inputs_handled = checkpoint.inputs_handled - inputs_before + listed;
        }
        writer.append(record)?;
    }
    writer.flush(true)?;
    drop(writer);
    let segment = kvrelay::journal::segments::segment_path(&parts, 0);
    std::fs::rename(&segment, &journal_file)?;
    std::fs::remove_dir(&parts)?;
    let inputs = window.iter().filter(|r| matches!(r, Record::Input { .. })).count();
    let recoveries = window.iter().filter(|r| matches!(r, Record::Recovery { .. })).count();
    let checkpoints = window.iter().filter(|r| matches!(r, Record::Checkpoint { .. })).count();
    let incident = Incident {
        name: name.clone(),
        description: format!(
            "Cut from {} over [{:.3} s, {:.3} s]: {} discovery facts listed and {dumps} ranks' \
             state ({carried} blocks) answered as tree dumps at the start, {inputs} inputs, \
             {recoveries} recovery answers and {checkpoints} recorded checkpoints.",
            journal.display(),
            from.as_secs_f64(),
            to.as_secs_f64(),
            listing.len()
        ),
        journal: format!("{name}.kvj"),
        faults: Vec::new(),
        expect: expect.clone(),
        kv: kv.clone(),
        path: None,
    };
    std::fs::write(&incident_file, toml::to_string(&incident)?)?;
    Ok(Cut {
        bytes: std::fs::metadata(&journal_file)?.len(),
        journal: journal_file,
        incident: incident_file,
        listing: listing.len(),
        inputs,
        recoveries,
        checkpoints,
        dumps,
        carried_blocks: carried,
        orphans,
        live_only,
        expect,
        kv,
    })
}
