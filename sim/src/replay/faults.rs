//! `--fault FILE`: faults in the scenario schema's `[[faults]]` form, layered on a replay at
//! simulated times. Only faults that act on the relay, its WAN or its DC planes apply: a
//! journal has no model of the workers behind its inputs, so worker-level faults are refused.

use std::path::Path;

use serde::Deserialize;

use crate::scenario::{ConsumerTarget, Fault, ScriptedFault};

/// A fault file: `[[faults]]` tables, nothing else.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultFile {
    #[serde(default)]
    faults: Vec<ScriptedFault>,
}

/// Why `fault` cannot be layered on a replay, if it cannot.
#[must_use]
pub fn unsupported(fault: &Fault) -> Option<String> {
    match fault {
        Fault::WanPartition { consumer }
        | Fault::WanRepair { consumer }
        | Fault::WanHold { consumer }
        | Fault::WanRelease { consumer } => match consumer {
            None | Some(ConsumerTarget::One(0) | ConsumerTarget::All) => None,
            Some(other) => Some(format!(
                "`{}` names {other:?}, but a replay runs one consumer, consumer-a",
                fault.action()
            )),
        },
        Fault::DcPartition { .. }
        | Fault::DcRepair
        | Fault::RelayRestart
        | Fault::ClockSkew { .. } => None,
        Fault::ConsumerBandwidth { .. } | Fault::ConsumerBandwidthLift { .. } => Some(format!(
            "`{}` paces a scenario's long-lived consumer link, which a replay's consumer does \
             not have",
            fault.action()
        )),
        Fault::EventPlaneRestart | Fault::DiscoveryRestart => Some(format!(
            "{} acts on the simulated planes host, which a replay does not have",
            fault.action()
        )),
        Fault::EventNoise(noise) => noise.validate().err(),
        worker_level => Some(format!(
            "`{}` acts on a simulated worker, and a replay has no worker model: its inputs are \
             the journal's (layer wan-*, dc-partition/dc-repair, event-noise, relay-restart or \
             clock-skew instead)",
            worker_level.action()
        )),
    }
}

/// Check `faults` for a replay, sorted by time (stable).
pub fn check(mut faults: Vec<ScriptedFault>) -> anyhow::Result<Vec<ScriptedFault>> {
    for scripted in &faults {
        if let Some(reason) = unsupported(&scripted.fault) {
            anyhow::bail!("fault at {} ms: {reason}", scripted.at_ms);
        }
    }
    faults.sort_by_key(|scripted| scripted.at_ms);
    Ok(faults)
}

/// Read and check the fault file at `path`.
pub fn load(path: &Path) -> anyhow::Result<Vec<ScriptedFault>> {
    let text = std::fs::read_to_string(path)
        .map_err(|error| anyhow::anyhow!("{}: {error}", path.display()))?;
    let file: FaultFile =
        toml::from_str(&text).map_err(|error| anyhow::anyhow!("{}: {error}", path.display()))?;
    check(file.faults).map_err(|error| anyhow::anyhow!("{}: {error}", path.display()))
}

/// Whether `faults` need the journal's inputs routed through simulated DC planes.
#[must_use]
pub fn need_planes(faults: &[ScriptedFault]) -> bool {
    faults.iter().any(|scripted| {
        matches!(scripted.fault, Fault::DcPartition { .. } | Fault::DcRepair | Fault::EventNoise(_))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_faults_are_refused_by_name_and_plane_faults_accepted() {
        let worker: FaultFile =
            toml::from_str("[[faults]]\nat_ms = 5\naction = \"restart-worker\"\nworker = 0\n")
                .unwrap();
        let error = check(worker.faults).unwrap_err().to_string();
        assert!(error.contains("`restart-worker`") && error.contains("at 5 ms"), "{error}");
        let plane: FaultFile = toml::from_str(
            "[[faults]]\nat_ms = 9\naction = \"dc-partition\"\nmode = \"drop\"\n\
             [[faults]]\nat_ms = 3\naction = \"wan-partition\"\n",
        )
        .unwrap();
        let faults = check(plane.faults).unwrap();
        assert_eq!(faults[0].at_ms, 3);
        assert!(need_planes(&faults));
        let noisy: FaultFile =
            toml::from_str("[[faults]]\nat_ms = 1\naction = \"event-noise\"\nloss = 0.9\n")
                .unwrap();
        assert!(check(noisy.faults).unwrap_err().to_string().contains("0..=0.5"));
    }
}
