//! The compact table `watch` and `demo` redraw in place on a terminal: one row per catalogued
//! pool with a short id, its endpoint, roles, models, filter state, sequence, resident slots,
//! load and readiness.
//!
//! Pure like [`crate::render`]: values in, `String`s out. Columns are padded to the widest cell,
//! so every row of one table lines up; the long identifiers stay in the plain-line output.

use std::fmt::Write as _;

use super::render::{role_name, state_name};
use super::state::{ConsumerSnapshot, PoolReplicaState};
use kvrelay_core::model::identity::PoolId;
use kvrelay_core::readiness::ReadinessState;

const HEADER: [&str; 10] =
    ["POOL", "GEN", "ENDPOINT", "ROLES", "MODELS", "FILTER", "SEQ", "SLOTS", "LOAD", "READY"];

/// Eight hex digits naming a pool on screen: the first four of its cache-semantics digest and
/// the first four of its routing-scope digest.
#[must_use]
pub fn short_pool_id(pool_id: &PoolId) -> String {
    let domain = pool_id.indexer_domain;
    let [a, b, ..] = domain.cache_semantics.digest;
    let [c, d, ..] = domain.routing_scope.digest;
    format!("{a:02x}{b:02x}{c:02x}{d:02x}")
}

/// The readiness of the topology entry that links `pool_id`, if one does (the least ready one
/// when several do).
fn readiness_of(snapshot: &ConsumerSnapshot, pool_id: &PoolId) -> Option<ReadinessState> {
    snapshot
        .readiness
        .iter()
        .filter(|entry| entry.members.iter().any(|member| member.pool_id.as_ref() == Some(pool_id)))
        .map(|entry| entry.state)
        .min_by_key(|state| match state {
            ReadinessState::Ready => 2,
            ReadinessState::Unknown => 1,
            _ => 0,
        })
}

fn row(snapshot: &ConsumerSnapshot, pool: &PoolReplicaState) -> [String; 10] {
    let descriptor = &pool.descriptor;
    let pool_id = descriptor.pool_id();
    let roles: Vec<&str> = descriptor.pool_roles.iter().map(|role| role_name(*role)).collect();
    let models: Vec<&str> = descriptor
        .registrations
        .iter()
        .map(|registration| registration.canonical_model_id.as_str())
        .collect();
    let load = snapshot.load.iter().find(|load| load.producer == pool.producer).map_or_else(
        || "-".to_owned(),
        |load| {
            let number =
                |value: Option<u64>| value.map_or_else(|| "?".to_owned(), |n| n.to_string());
            format!("{}/{}", number(load.kv_used_blocks), number(load.total_kv_blocks))
        },
    );
    [
        short_pool_id(&pool_id),
        pool.producer.layout_generation().to_string(),
        descriptor.serving_endpoint.to_string(),
        roles.join(","),
        models.join(","),
        pool.status.name().to_owned(),
        pool.sequence.map_or_else(|| "-".to_owned(), |sequence| sequence.to_string()),
        pool.resident_slots.to_string(),
        load,
        readiness_of(snapshot, &pool_id).map_or("-", state_name).to_owned(),
    ]
}

/// A summary line, the header and one aligned row per pool.
#[must_use]
pub fn table_lines(snapshot: &ConsumerSnapshot) -> Vec<String> {
    let rows: Vec<[String; 10]> = snapshot.pools.iter().map(|pool| row(snapshot, pool)).collect();
    let mut widths = HEADER.map(str::len);
    for cells in &rows {
        for (width, cell) in widths.iter_mut().zip(cells) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: &[&str]| {
        let mut text = String::new();
        for (index, (cell, width)) in cells.iter().zip(widths).enumerate() {
            if index + 1 == cells.len() {
                text.push_str(cell);
            } else {
                let _ = write!(text, "{cell:<width$}  ");
            }
        }
        text
    };
    let relay = snapshot.relay.map_or_else(
        || "no catalog yet".to_owned(),
        |relay| format!("relay {:08x}", relay.relay_incarnation & 0xffff_ffff),
    );
    let revision = snapshot.catalog_revision.map_or_else(|| "-".to_owned(), |r| r.to_string());
    let faults: u64 = snapshot.counters.faults.values().sum();
    let mut lines = vec![format!(
        "{relay}  catalog rev {revision}  pools {}  faults {faults}{}",
        snapshot.pools.len(),
        snapshot
            .halted
            .as_ref()
            .map_or_else(String::new, |halt| format!("  HALTED {}", halt.cause)),
    )];
    lines.push(line(&HEADER));
    for cells in &rows {
        let cells: Vec<&str> = cells.iter().map(String::as_str).collect();
        lines.push(line(&cells));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::tests::{pool, snapshot};

    #[test]
    fn a_row_per_pool_with_short_ids_and_aligned_columns() {
        let mut two = pool(3, Some(14));
        two.descriptor.serving_endpoint = "dynamo/prefill-workers/generate".parse().unwrap();
        let lines = table_lines(&snapshot(vec![pool(2, None), two]));
        assert_eq!(lines.len(), 4, "{lines:#?}");
        assert!(lines[0].starts_with("relay 00001234  catalog rev 3  pools 2  faults 0"));
        assert!(lines[1].starts_with("POOL      GEN  ENDPOINT"), "{}", lines[1]);
        let column = |line: &str| line.find("dynamo/").unwrap();
        assert_eq!(column(&lines[2]), lines[1].find("ENDPOINT").unwrap());
        assert_eq!(column(&lines[2]), column(&lines[3]));
        let short = short_pool_id(&pool(2, None).descriptor.pool_id());
        assert_eq!(short.len(), 8);
        assert!(lines[2].starts_with(&short), "{}", lines[2]);
        for part in ["PREFILL,DECODE", "tiny-lora,tiny-llm", "connecting", "12"] {
            assert!(lines[2].contains(part), "{part} missing from {}", lines[2]);
        }
        assert!(lines[3].contains("ready") && lines[3].contains("14"), "{}", lines[3]);
        // No load window and no readiness entry yet: both columns say so.
        let cells: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(cells[cells.len() - 2..], ["-", "-"], "{}", lines[2]);
    }
}
