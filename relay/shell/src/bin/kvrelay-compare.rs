//! `kvrelay-compare`: follow two relays with the reference consumer and compare what they
//! publish (catalog, readiness, load, filter membership; see `kvrelay_consumer::compare`).
//!
//! Both relays must watch the same deployment. The tool waits until both catalogs are known,
//! at least `--min-pools` pools are catalogued on each side and every pool's replica is
//! installed, then compares every `--interval-ms` until `--stable-checks` consecutive
//! comparisons agree completely (exit 0) or `--timeout-secs` passes (exit 1 with the last
//! differences). Exit 2 when the sides never settled or a consumer halted. With
//! `--accept-right-load-coverage`, a pool whose load only the right side observed on every
//! expected rank (a coverage gap, see `kvrelay_consumer::compare::CoverageGap`) is reported
//! and does not count against agreement; one the left side alone covers always does.
//!
//! Run: `kvrelay-compare --left 127.0.0.1:5561 --right 127.0.0.1:5562`.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Result, bail};
use clap::Parser;
use kvrelay_consumer::compare::{Comparison, Section, Side, Which, compare};
use kvrelay_consumer::{ConsumerConfig, ConsumerSnapshot, FilterCopy, FilterStatus, RelayConsumer};
use kvrelay_core::model::identity::PoolId;
use kvrelay_core::rng::rng_from_seed;

#[derive(Debug, Parser)]
#[command(
    name = "kvrelay-compare",
    version = kvrelay::build_info::VERSION_LINE,
    about = "Compare what two relays publish"
)]
struct Args {
    /// The first relay (host:port).
    #[arg(long, default_value = "127.0.0.1:5561")]
    left: String,
    /// The second relay (host:port).
    #[arg(long, default_value = "127.0.0.1:5562")]
    right: String,
    /// Label of the first relay in the report.
    #[arg(long, default_value = "dynamo")]
    left_name: String,
    /// Label of the second relay in the report.
    #[arg(long, default_value = "kvrelay")]
    right_name: String,
    /// Pools each side must catalog before comparing.
    #[arg(long, default_value_t = 1)]
    min_pools: usize,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 60)]
    timeout_secs: u64,
    /// Consecutive complete agreements required.
    #[arg(long, default_value_t = 3)]
    stable_checks: u32,
    /// Pause between comparisons.
    #[arg(long, default_value_t = 1000)]
    interval_ms: u64,
    /// Print the report as JSON, one object per line (`type`: `section`, `filter`, `coverage`,
    /// `diff`, then `result`).
    #[arg(long)]
    json: bool,
    /// Agree although some pools' load is complete on the right side only (every expected
    /// rank observed there, fewer on the left, nothing else different): the right relay kept a
    /// rank's report the left one lost.
    #[arg(long)]
    accept_right_load_coverage: bool,
    /// TLS for `host:port` sides when --tls-ca is given and for `https://` sides always;
    /// an `http://` side stays plaintext.
    #[command(flatten)]
    tls: kvrelay_consumer::ClientTlsArgs,
}

fn main() -> ExitCode {
    let args = Args::parse();
    kvrelay::logging::init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("kvrelay-compare: {error}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(&args)) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("kvrelay-compare: {error:#}");
            ExitCode::from(2)
        }
    }
}

struct Followed {
    consumer: RelayConsumer,
}

impl Followed {
    fn start(address: &str, tls: &kvrelay_consumer::ClientTlsArgs, seed: u64) -> Result<Self> {
        let config =
            ConsumerConfig { subscriber_id: "kvrelay-compare".to_owned(), ..Default::default() };
        let consumer =
            RelayConsumer::start(tls.connect_lazy(address)?, config, &mut rng_from_seed(seed))?;
        Ok(Followed { consumer })
    }

    /// The snapshot and its replicas, or why this side is not ready to compare.
    fn settled(
        &self,
        min_pools: usize,
    ) -> Result<(ConsumerSnapshot, BTreeMap<PoolId, FilterCopy>), String> {
        let snapshot = self.consumer.snapshot();
        if snapshot.catalog_revision.is_none() {
            return Err("no catalog yet".to_owned());
        }
        if snapshot.pools.len() < min_pools {
            return Err(format!("{} of {min_pools} pools catalogued", snapshot.pools.len()));
        }
        let pending: Vec<String> = snapshot
            .pools
            .iter()
            .filter(|pool| pool.status != FilterStatus::Ready)
            .map(|pool| format!("{}={}", pool.descriptor.serving_endpoint, pool.status.name()))
            .collect();
        if !pending.is_empty() {
            return Err(format!("replicas not installed: {}", pending.join(" ")));
        }
        let mut filters = BTreeMap::new();
        for pool in &snapshot.pools {
            let pool_id = pool.descriptor.pool_id();
            match self.consumer.filter_copy(&pool_id) {
                Some(copy) => {
                    filters.insert(pool_id, copy);
                }
                None => return Err(format!("replica of {pool_id} not installed")),
            }
        }
        Ok((snapshot, filters))
    }
}

/// The report as JSON lines: one `section` object per section, one `filter` object per pool,
/// one `coverage` object per coverage gap, one `diff` object per difference.
fn print_json_report(comparison: &Comparison) {
    for section in Section::ALL {
        let (left, right, unit) = section_counts(comparison, section);
        let line = serde_json::json!({
            "type": "section",
            "section": section.name(),
            "left": left,
            "right": right,
            "unit": unit,
            "differences": comparison.differences_in(section),
        });
        println!("{line}");
    }
    for filter in &comparison.filters {
        let line = serde_json::json!({
            "type": "filter",
            "poolId": filter.pool_id.to_string(),
            "leftSlots": filter.left_slots,
            "rightSlots": filter.right_slots,
            "onlyLeft": filter.only_left,
            "onlyRight": filter.only_right,
            "identicalWords": filter.identical_words,
        });
        println!("{line}");
    }
    for gap in &comparison.coverage_gaps {
        let line = serde_json::json!({
            "type": "coverage",
            "poolId": gap.pool_id.to_string(),
            "complete": if gap.complete == Which::Left { "left" } else { "right" },
            "leftObservedRanks": gap.left_observed,
            "rightObservedRanks": gap.right_observed,
            "expectedRanks": gap.expected,
        });
        println!("{line}");
    }
    for difference in &comparison.differences {
        let line = serde_json::json!({
            "type": "diff",
            "section": difference.section.to_string(),
            "key": difference.key,
            "field": difference.field,
            "left": difference.left,
            "right": difference.right,
        });
        println!("{line}");
    }
}

/// The closing line: `MATCH`, `DIFF` or `NOT_SETTLED`, with its figures.
fn print_result(args: &Args, result: &str, detail: serde_json::Value, text: String) {
    if args.json {
        let line = serde_json::json!({
            "type": "result",
            "result": result,
            "left": args.left_name,
            "right": args.right_name,
            "detail": detail,
        });
        println!("{line}");
    } else {
        println!("{text}");
    }
}

/// Left and right figures of `section` and their unit.
fn section_counts(comparison: &Comparison, section: Section) -> (usize, usize, &'static str) {
    match section {
        Section::Catalog => (comparison.pools.left, comparison.pools.right, "pools"),
        Section::Readiness => (comparison.readiness.left, comparison.readiness.right, "entries"),
        Section::Load => (comparison.load.left, comparison.load.right, "pools"),
        Section::Filter => {
            let slots = |pick: fn(&kvrelay_consumer::compare::FilterSummary) -> u64| {
                comparison.filters.iter().map(pick).sum::<u64>() as usize
            };
            (slots(|f| f.left_slots), slots(|f| f.right_slots), "slots")
        }
    }
}

fn print_report(args: &Args, comparison: &Comparison) {
    if args.json {
        print_json_report(comparison);
        return;
    }
    let (l, r) = (&args.left_name, &args.right_name);
    println!("{:<10} {:>12} {:>12}  result", "section", l, r);
    for section in Section::ALL {
        let (left, right, unit) = section_counts(comparison, section);
        let differences = comparison.differences_in(section);
        let gaps = if section == Section::Load { comparison.coverage_gaps.len() } else { 0 };
        let verdict = match (differences, gaps) {
            (0, 0) => "MATCH".to_owned(),
            (0, gaps) => format!("COVERAGE ({gaps})"),
            (differences, _) => format!("DIFF ({differences})"),
        };
        println!(
            "{:<10} {:>12} {:>12}  {verdict}",
            section.name(),
            format!("{left} {unit}"),
            format!("{right} {unit}")
        );
    }
    for filter in &comparison.filters {
        println!(
            "filter {}: slots {}={} {}={}, only-{}={} only-{}={}, words {}",
            filter.pool_id,
            l,
            filter.left_slots,
            r,
            filter.right_slots,
            l,
            filter.only_left,
            r,
            filter.only_right,
            if filter.identical_words { "identical" } else { "differ (placement)" }
        );
    }
    for gap in &comparison.coverage_gaps {
        let complete = if gap.complete == Which::Left { l } else { r };
        println!(
            "coverage load {}: observed ranks {}={} {}={} of {}, complete on {complete} only",
            gap.pool_id, l, gap.left_observed, r, gap.right_observed, gap.expected
        );
    }
    for difference in &comparison.differences {
        println!(
            "diff {} {} {}: {}={} {}={}",
            difference.section,
            difference.key,
            difference.field,
            l,
            difference.left,
            r,
            difference.right
        );
    }
}

async fn run(args: &Args) -> Result<ExitCode> {
    if args.stable_checks == 0 {
        bail!("--stable-checks must be at least 1");
    }
    let left = Followed::start(&args.left, &args.tls, 1)?;
    let right = Followed::start(&args.right, &args.tls, 2)?;
    let interval = Duration::from_millis(args.interval_ms.max(1));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.timeout_secs);
    let mut agreeing = 0u32;
    let mut last: Option<Comparison> = None;
    let mut waiting = String::new();
    while tokio::time::Instant::now() < deadline {
        tokio::time::sleep(interval).await;
        for (side, name) in [(&left, &args.left_name), (&right, &args.right_name)] {
            if let Some(halt) = side.consumer.halted() {
                bail!("{name}: consumer halted on {} ({})", halt.plane, halt.cause);
            }
        }
        let settled = (left.settled(args.min_pools), right.settled(args.min_pools));
        let ((left_view, left_filters), (right_view, right_filters)) = match settled {
            (Ok(l), Ok(r)) => (l, r),
            (l, r) => {
                waiting = [(l.err(), &args.left_name), (r.err(), &args.right_name)]
                    .into_iter()
                    .filter_map(|(why, name)| why.map(|why| format!("{name}: {why}")))
                    .collect::<Vec<_>>()
                    .join("; ");
                agreeing = 0;
                continue;
            }
        };
        let comparison = compare(
            Side { snapshot: &left_view, filters: &left_filters },
            Side { snapshot: &right_view, filters: &right_filters },
        );
        let agrees = if args.accept_right_load_coverage {
            comparison.matches_where_more_complete(Which::Right)
        } else {
            comparison.matches()
        };
        agreeing = if agrees { agreeing + 1 } else { 0 };
        let done = agreeing >= args.stable_checks;
        last = Some(comparison);
        if done {
            break;
        }
    }
    left.consumer.shutdown().await;
    right.consumer.shutdown().await;
    match last {
        None => {
            let text = format!("RESULT: NOT SETTLED after {} s ({waiting})", args.timeout_secs);
            let detail = serde_json::json!({"timeoutSecs": args.timeout_secs, "waiting": waiting});
            print_result(args, "NOT_SETTLED", detail, text);
            Ok(ExitCode::from(2))
        }
        Some(comparison) => {
            print_report(args, &comparison);
            if agreeing >= args.stable_checks {
                let gaps = comparison.coverage_gaps.len();
                let text = if gaps == 0 {
                    format!("RESULT: MATCH ({agreeing} consecutive agreeing comparisons)")
                } else {
                    format!(
                        "RESULT: MATCH ({agreeing} consecutive agreeing comparisons; {gaps} pool load(s) complete on {} only)",
                        args.right_name
                    )
                };
                let detail = serde_json::json!({"agreeing": agreeing, "coverageGaps": gaps});
                print_result(args, "MATCH", detail, text);
                Ok(ExitCode::SUCCESS)
            } else {
                let differences = comparison.differences.len() + comparison.coverage_gaps.len();
                let text =
                    format!("RESULT: DIFF ({differences} differences at the last comparison)");
                let detail = serde_json::json!({"differences": differences});
                print_result(args, "DIFF", detail, text);
                Ok(ExitCode::from(1))
            }
        }
    }
}
