//! A timeline of one run as a self-contained HTML page with an inline SVG: faults, relay boots,
//! the relay's readiness per model, its catalog (pool count, each revision a tick) and the
//! convergence of each long-lived consumer (replicas ready out of catalogued, subscriptions).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::trace::{Stamped, TraceEvent};

const WIDTH: f64 = 1200.0;
const LEFT: f64 = 170.0;
const LANE: f64 = 34.0;

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn colour(state: &str) -> &'static str {
    match state {
        "ready" => "#3a3",
        "unavailable" => "#d33",
        _ => "#999",
    }
}

/// Render `events` of a run of `title` as an HTML page.
#[must_use]
pub fn render(title: &str, events: &[Stamped]) -> String {
    let end = events.last().map_or(1, |event| event.ms.max(1)) as f64;
    let x = |ms: u64| LEFT + (ms as f64 / end) * (WIDTH - LEFT - 10.0);
    // Readiness lanes per model: (start, state) runs.
    let mut readiness: BTreeMap<String, Vec<(u64, &'static str)>> = BTreeMap::new();
    let mut catalog: Vec<(u64, usize)> = Vec::new();
    let mut consumers: BTreeMap<&str, Vec<(u64, usize, usize, u64)>> = BTreeMap::new();
    let mut faults: Vec<(u64, String)> = Vec::new();
    let mut boots: Vec<u64> = Vec::new();
    for event in events {
        match &event.event {
            TraceEvent::RelayReadiness { entries, .. } => {
                for lane in readiness.values_mut() {
                    lane.push((event.ms, "absent"));
                }
                for entry in entries {
                    let lane = readiness.entry(entry.model.clone()).or_default();
                    lane.retain(|(ms, _)| *ms != event.ms);
                    lane.push((event.ms, entry.state));
                }
            }
            TraceEvent::RelayCatalog { pools, .. } => catalog.push((event.ms, pools.len())),
            TraceEvent::Consumer(view) => {
                let ready = view.pools.iter().filter(|pool| pool.status == "ready").count();
                consumers.entry(view.consumer.as_str()).or_default().push((
                    event.ms,
                    ready,
                    view.pools.len(),
                    view.subscriptions,
                ));
            }
            TraceEvent::Fault { fault } => {
                let name = serde_json::to_value(fault)
                    .ok()
                    .and_then(|v| v.get("action").and_then(|a| a.as_str()).map(str::to_owned))
                    .unwrap_or_default();
                faults.push((event.ms, name));
            }
            TraceEvent::RelayBoot { .. } => boots.push(event.ms),
            _ => {}
        }
    }
    let lanes = 2 + readiness.len() + consumers.len().max(1);
    let height = 40.0 + LANE * lanes as f64 + 20.0;
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="monospace" font-size="11">"#
    );
    let top = |lane: usize| 40.0 + LANE * lane as f64;
    let label = |svg: &mut String, lane: usize, text: &str| {
        let _ = write!(svg, r#"<text x="4" y="{}">{}</text>"#, top(lane) + 18.0, escape(text));
    };
    // Time axis.
    for step in 0..=10 {
        let ms = (end * f64::from(step) / 10.0) as u64;
        let _ = write!(
            svg,
            r##"<line x1="{0}" y1="30" x2="{0}" y2="{1}" stroke="#eee"/><text x="{0}" y="24">{2:.1}s</text>"##,
            x(ms),
            height - 20.0,
            ms as f64 / 1000.0
        );
    }
    // Lane 0: faults and boots.
    label(&mut svg, 0, "faults / boots");
    for (ms, name) in &faults {
        let _ = write!(
            svg,
            r##"<line x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="#c60" stroke-dasharray="3,3"/><text x="{3}" y="{4}" fill="#c60" transform="rotate(-20 {3} {4})">{5}</text>"##,
            x(*ms),
            top(0),
            height - 20.0,
            x(*ms) + 2.0,
            top(0) + 14.0,
            escape(name)
        );
    }
    for ms in &boots {
        let _ = write!(
            svg,
            r##"<circle cx="{}" cy="{}" r="5" fill="#06c"><title>relay boot</title></circle>"##,
            x(*ms),
            top(0) + 26.0
        );
    }
    // Readiness lanes.
    for (index, (model, runs)) in readiness.iter().enumerate() {
        let lane = 1 + index;
        label(&mut svg, lane, &format!("ready {model}"));
        for (run, (start, state)) in runs.iter().enumerate() {
            let stop = runs.get(run + 1).map_or(end as u64, |next| next.0);
            if *state == "absent" {
                continue;
            }
            let _ = write!(
                svg,
                r#"<rect x="{}" y="{}" width="{}" height="20" fill="{}"><title>{state} from {start} ms</title></rect>"#,
                x(*start),
                top(lane) + 4.0,
                (x(stop) - x(*start)).max(1.0),
                colour(state)
            );
        }
    }
    // Catalog lane: pool count as text at each revision, a tick per revision.
    let lane = 1 + readiness.len();
    label(&mut svg, lane, "relay catalog pools");
    for (ms, pools) in &catalog {
        let _ = write!(
            svg,
            r##"<line x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="#333"/><text x="{3}" y="{2}">{4}</text>"##,
            x(*ms),
            top(lane) + 4.0,
            top(lane) + 24.0,
            x(*ms) + 2.0,
            pools
        );
    }
    // A lane per consumer: fraction of replicas ready, and subscriptions.
    for (index, (name, consumer)) in consumers.iter().enumerate() {
        let lane = lane + 1 + index;
        label(&mut svg, lane, &format!("{name} ready/pools"));
        for (run, (ms, ready, pools, subscriptions)) in consumer.iter().enumerate() {
            let stop = consumer.get(run + 1).map_or(end as u64, |next| next.0);
            let converged = *pools > 0 && ready == pools;
            let _ = write!(
                svg,
                r#"<rect x="{}" y="{}" width="{}" height="20" fill="{}"><title>{name}: {ready}/{pools} ready, {subscriptions} subscriptions at {ms} ms</title></rect>"#,
                x(*ms),
                top(lane) + 4.0,
                (x(stop) - x(*ms)).max(1.0),
                if converged { "#3a3" } else { "#fb3" }
            );
        }
    }
    svg.push_str("</svg>");
    format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{0}</title></head><body>\
         <h3>{0}</h3><p>green: READY / converged; red: UNAVAILABLE; grey: UNKNOWN; amber: \
         consumer replicas not all ready. Hover for details.</p>{svg}</body></html>\n",
        escape(title)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Fault;
    use crate::trace::EntryTrace;

    #[test]
    fn the_timeline_shows_faults_boots_and_readiness() {
        let events = vec![
            Stamped { ms: 0, event: TraceEvent::RelayBoot { boot: 0, incarnation: 1 } },
            Stamped {
                ms: 5,
                event: TraceEvent::RelayReadiness {
                    boot: 0,
                    revision: 2,
                    entries: vec![EntryTrace {
                        model: "m<1>".into(),
                        state: "ready",
                        missing: Vec::new(),
                    }],
                },
            },
            Stamped { ms: 900, event: TraceEvent::Fault { fault: Fault::RelayRestart } },
        ];
        let html = render("t", &events);
        assert!(html.contains("relay-restart"));
        assert!(html.contains("ready m&lt;1&gt;"));
        assert!(html.contains("#3a3"));
        assert!(html.contains("relay boot"));
    }
}
