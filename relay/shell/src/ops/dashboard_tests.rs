//! `docs/grafana/kvrelay-dashboard.json` against the exposition `/metrics` renders: every
//! metric name a PromQL expression uses is one the relay emits, and every label it groups by is
//! one those metrics carry (or Prometheus's own `job` / `instance`).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::render_metrics;
use super::tests::snapshot;

const DASHBOARD: &str =
    include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/grafana/kvrelay-dashboard.json"));

/// Metric name -> the label names its samples carry, from exposition text.
fn emitted(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut names: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in text.lines().filter(|line| !line.starts_with('#') && !line.is_empty()) {
        let end = line.find(['{', ' ']).unwrap_or(line.len());
        let labels = names.entry(line[..end].to_owned()).or_default();
        if let Some(body) = line[end..].strip_prefix('{').and_then(|rest| rest.split_once('}')) {
            for pair in body.0.split(',') {
                if let Some((label, _)) = pair.split_once('=') {
                    labels.insert(label.trim().to_owned());
                }
            }
        }
    }
    names
}

/// The identifiers of a PromQL expression (`[A-Za-z_:][A-Za-z0-9_:]*`), outside quoted strings.
fn identifiers(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    let mut quoted = false;
    for c in expr.chars() {
        if c == '"' {
            quoted = !quoted;
        }
        if !quoted && (c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            current.push(c);
        } else if !current.is_empty() {
            out.push(std::mem::take(&mut current));
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// The labels of every `by (...)` / `without (...)` clause.
fn grouping_labels(expr: &str) -> Vec<String> {
    let mut labels = Vec::new();
    for keyword in ["by", "without"] {
        let pattern = format!("{keyword} (");
        let mut rest = expr;
        while let Some(start) = rest.find(&pattern) {
            let after = &rest[start + pattern.len()..];
            let Some(end) = after.find(')') else { break };
            labels.extend(after[..end].split(',').map(|label| label.trim().to_owned()));
            rest = &after[end..];
        }
    }
    labels
}

/// Why `expr` does not fit the emitted metrics, if it does not.
fn check(expr: &str, metrics: &BTreeMap<String, BTreeSet<String>>) -> Result<(), String> {
    let used: Vec<String> = identifiers(expr)
        .into_iter()
        .filter(|word| word.starts_with("kvrelay_") || word.starts_with("kv_dc_relay_"))
        .collect();
    if used.is_empty() {
        return Err(format!("{expr}: uses no kvrelay metric"));
    }
    for name in &used {
        if !metrics.contains_key(name) {
            return Err(format!("{expr}: {name} is not emitted"));
        }
    }
    for label in grouping_labels(expr) {
        let carried = used.iter().any(|name| metrics[name].contains(&label));
        if !carried && label != "job" && label != "instance" {
            return Err(format!("{expr}: no metric it uses carries the label {label}"));
        }
    }
    let balance = |open, close| expr.matches(open).count() == expr.matches(close).count();
    if !(balance('(', ')') && balance('{', '}') && balance('[', ']')) {
        return Err(format!("{expr}: unbalanced brackets"));
    }
    Ok(())
}

fn expressions(dashboard: &Value) -> Vec<String> {
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            exprs.push(target["expr"].as_str().expect("expr").to_owned());
        }
    }
    for variable in dashboard["templating"]["list"].as_array().expect("templating") {
        if variable["type"] == "query" {
            exprs.push(variable["query"].as_str().expect("query").to_owned());
        }
    }
    exprs
}

#[test]
fn every_dashboard_expression_uses_only_emitted_metrics_and_labels() {
    let metrics = emitted(&render_metrics(&snapshot()));
    assert!(metrics.contains_key("kvrelay_build_info") && metrics.len() > 50);
    let dashboard: Value = serde_json::from_str(DASHBOARD).expect("dashboard is JSON");
    let exprs = expressions(&dashboard);
    assert!(exprs.len() >= 30, "{} expressions", exprs.len());
    let failures: Vec<String> =
        exprs.iter().filter_map(|expr| check(expr, &metrics).err()).collect();
    assert!(failures.is_empty(), "{failures:#?}");
    let ids: BTreeSet<u64> =
        dashboard["panels"].as_array().unwrap().iter().map(|p| p["id"].as_u64().unwrap()).collect();
    assert_eq!(ids.len(), dashboard["panels"].as_array().unwrap().len(), "panel ids are unique");
}

#[test]
fn the_check_refuses_unknown_metrics_labels_and_metric_free_expressions() {
    let metrics = emitted(&render_metrics(&snapshot()));
    assert!(check("rate(kvrelay_dc_inputs_total[5m])", &metrics).is_ok());
    assert!(check("rate(kvrelay_not_emitted_total[5m])", &metrics).is_err());
    assert!(check("sum by (stream) (kv_dc_relay_subscribers)", &metrics).is_ok());
    assert!(check("sum by (reason) (kv_dc_relay_subscribers)", &metrics).is_err());
    assert!(check("up", &metrics).is_err());
    assert!(check("rate(kvrelay_dc_inputs_total[5m]", &metrics).is_err());
    // A metric name inside a quoted label value is not a use.
    assert!(check(r#"kvrelay_healthy{job="kvrelay_fake"}"#, &metrics).is_ok());
}
