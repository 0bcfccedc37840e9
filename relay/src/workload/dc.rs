//! A simulated data center: a deployment of [`SimWorker`]s, the traffic they serve, and the
//! facts they publish — the inputs a relay sees, and the recovery answers it asks for.

use std::collections::{BTreeMap, BTreeSet};

use rand_core::Rng;

use super::traffic::{Traffic, TrafficConfig};
use super::worker::{SimWorker, WorkerSpec};
use crate::identity::EndpointPath;
use crate::inputs::{DcInput, EndpointInstances, KvEventBatch, RecoveryTarget, WorkerType};
use crate::rng::RelayRng;
use crate::sources::{RecoveryRequest, RecoveryResponse, TreeDumpScope};

/// Workers to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deployment {
    /// One entry per worker process.
    pub workers: Vec<WorkerSpec>,
}

fn path(text: &str) -> EndpointPath {
    text.parse().expect("preset endpoints are valid")
}

impl Deployment {
    /// The demo DC: an aggregated model on two workers (one with two DP ranks), a P/D model,
    /// and a LoRA base serving two adapters and an alias.
    #[must_use]
    pub fn demo() -> Self {
        let aggregated = WorkerSpec::aggregated(path("dynamo/backend/generate"), "tiny-llm");
        let mut aggregated_dp = aggregated.clone();
        aggregated_dp.data_parallel_size = 2;
        let mut prefill = WorkerSpec::aggregated(path("disagg/prefill/generate"), "pd-llm");
        prefill.worker_type = Some(WorkerType::Prefill);
        prefill.needs = vec![vec![WorkerType::Decode]];
        let mut decode = WorkerSpec::aggregated(path("disagg/backend/generate"), "pd-llm");
        decode.worker_type = Some(WorkerType::Decode);
        decode.needs = vec![vec![WorkerType::Prefill]];
        let mut lora = WorkerSpec::aggregated(path("loras/backend/generate"), "base-llm");
        lora.aliases = vec!["base-alias".to_owned()];
        lora.adapters = vec!["adapter-a".to_owned(), "adapter-b".to_owned()];
        Deployment { workers: vec![aggregated, aggregated_dp, prefill, decode, lora] }
    }
}

/// A running simulated DC.
#[derive(Debug, Clone)]
pub struct SimulatedDc {
    workers: Vec<SimWorker>,
    traffic: Traffic,
    next_worker_id: u64,
    /// Per-publisher message counters (the event-plane envelope sequence).
    message_sequences: BTreeMap<u64, u64>,
    clock_ms: u64,
}

impl SimulatedDc {
    /// Start every worker of `deployment`.
    pub fn start(deployment: &Deployment, traffic: TrafficConfig, rng: &mut RelayRng) -> Self {
        let traffic = Traffic::new(traffic, rng);
        let mut next_worker_id = 0x1000;
        let workers = deployment
            .workers
            .iter()
            .map(|spec| {
                next_worker_id += 1;
                SimWorker::start(spec.clone(), next_worker_id, rng)
            })
            .collect();
        SimulatedDc {
            workers,
            traffic,
            next_worker_id,
            message_sequences: BTreeMap::new(),
            clock_ms: 0,
        }
    }

    /// The workers.
    #[must_use]
    pub fn workers(&self) -> &[SimWorker] {
        &self.workers
    }

    /// The traffic model.
    #[must_use]
    pub fn traffic(&self) -> &Traffic {
        &self.traffic
    }

    /// Everything discovery shows: cards, adverts, and each endpoint's live instance set.
    #[must_use]
    pub fn discovery_facts(&self) -> Vec<DcInput> {
        let mut facts: Vec<DcInput> =
            self.workers.iter().flat_map(SimWorker::discovery_facts).collect();
        facts.extend(self.instance_facts());
        facts
    }

    fn instance_facts(&self) -> Vec<DcInput> {
        let mut by_endpoint: BTreeMap<EndpointPath, BTreeSet<u64>> = BTreeMap::new();
        for worker in &self.workers {
            by_endpoint
                .entry(worker.spec().endpoint.clone())
                .or_default()
                .insert(worker.worker_id());
        }
        by_endpoint
            .into_iter()
            .map(|(endpoint, live)| {
                DcInput::Instances(EndpointInstances { endpoint, live_workers: Some(live) })
            })
            .collect()
    }

    /// Serve `requests` requests on randomly chosen workers (adapter traffic on adapter-bearing
    /// workers half the time) and return the KV event messages they publish.
    pub fn step(&mut self, requests: usize, rng: &mut RelayRng) -> Vec<DcInput> {
        self.clock_ms += 1;
        let mut facts = Vec::new();
        for _ in 0..requests {
            if self.workers.is_empty() {
                break;
            }
            let index = (rng.next_u32() as usize) % self.workers.len();
            let request = self.traffic.next_request(rng);
            let worker = &mut self.workers[index];
            let adapters = worker.spec().adapters.clone();
            let adapter = (!adapters.is_empty() && rng.next_u32().is_multiple_of(2))
                .then(|| adapters[(rng.next_u32() as usize) % adapters.len()].clone());
            let rank = rng.next_u32() % worker.spec().data_parallel_size.max(1);
            let events = worker.serve(rank, &request.tokens, adapter.as_deref());
            if events.is_empty() {
                continue;
            }
            let publisher_id = worker.ranks()[rank as usize].publisher_id();
            let sequence = self.message_sequences.entry(publisher_id).or_default();
            facts.push(DcInput::KvEvents(KvEventBatch {
                endpoint: worker.spec().endpoint.clone(),
                publisher_id,
                sequence: *sequence,
                published_at_ms: self.clock_ms,
                events,
            }));
            *sequence += 1;
        }
        facts
    }

    /// Occupancy reports of every worker.
    #[must_use]
    pub fn load_facts(&self) -> Vec<DcInput> {
        self.workers.iter().flat_map(SimWorker::load_facts).collect()
    }

    /// Restart worker `index` (new worker id, new incarnations): the facts of it leaving, then
    /// of it coming back.
    pub fn restart_worker(&mut self, index: usize, rng: &mut RelayRng) -> Vec<DcInput> {
        let Some(worker) = self.workers.get_mut(index) else { return Vec::new() };
        let mut facts = worker.withdrawal_facts();
        self.next_worker_id += 1;
        worker.restart(self.next_worker_id, rng);
        facts.extend(worker.discovery_facts());
        facts.extend(self.instance_facts());
        facts
    }

    /// Answer a recovery query the way the worker's local indexer would.
    pub fn answer(
        &self,
        target: &RecoveryTarget,
        request: &RecoveryRequest,
    ) -> Result<RecoveryResponse, String> {
        let worker = self
            .workers
            .iter()
            .find(|worker| worker.worker_id() == target.instance_id)
            .ok_or_else(|| format!("no worker {:x}", target.instance_id))?;
        match request.start_event_id {
            None => {
                let (events, last_event_id) = worker.tree_dump(request.dp_rank);
                Ok(RecoveryResponse::TreeDump {
                    events,
                    last_event_id,
                    reset_scope: TreeDumpScope::Rank,
                })
            }
            Some(start) => {
                let newest = worker
                    .ranks()
                    .get(request.dp_rank as usize)
                    .map_or(0, |_| worker.tree_dump(request.dp_rank).1);
                let end = request.end_event_id.unwrap_or(newest);
                match worker.event_range(request.dp_rank, start, end) {
                    Some(events) => Ok(RecoveryResponse::Events { events, last_event_id: end }),
                    None => Ok(RecoveryResponse::TooNew {
                        requested_start: start,
                        requested_end: request.end_event_id,
                        newest_available: newest,
                    }),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::rng_from_seed;

    #[test]
    fn demo_dc_publishes_contiguous_messages_per_publisher() {
        let mut rng = rng_from_seed(4);
        let mut dc = SimulatedDc::start(&Deployment::demo(), TrafficConfig::default(), &mut rng);
        let facts = dc.discovery_facts();
        assert!(facts.iter().any(|f| matches!(f, DcInput::Instances(_))));
        let mut last: BTreeMap<(u64, u32), u64> = BTreeMap::new();
        for _ in 0..20 {
            for fact in dc.step(10, &mut rng) {
                let DcInput::KvEvents(batch) = fact else { panic!("only KV events") };
                for event in &batch.events {
                    let key = (event.worker_id, event.event.dp_rank);
                    let previous = last.insert(key, event.event.event_id).unwrap_or(0);
                    assert_eq!(event.event.event_id, previous + 1, "contiguous ids per rank");
                }
            }
        }
        assert!(dc.load_facts().len() >= 6);
    }
}
