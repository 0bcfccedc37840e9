//! Scenario files (`Scenario::parse`): TOML decoding and validation, then everything derived
//! from a valid file without running it — the deployment, the traffic and the fault script a
//! seed draws.
#![no_main]

use kvrelay_sim::scenario::Scenario;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(scenario) = Scenario::parse(text, "fuzz") else { return };
    let _ = scenario.traffic();
    if let Ok(deployment) = scenario.deployment() {
        let seed = data.len() as u64;
        let _ = scenario.script(seed, deployment.workers.len());
    }
});
