//! A simulated data center: a deployment of [`SimWorker`]s, the traffic they serve, and the
//! facts they publish — the inputs a relay sees, and the recovery answers it asks for.

use std::collections::{BTreeMap, BTreeSet};

use rand_core::Rng;

use super::local_indexer;
use super::traffic::{Traffic, TrafficConfig};
use super::worker::{SimWorker, WorkerSpec};
use kvrelay_core::inputs::{DcInput, EndpointInstances, KvEventBatch, RecoveryTarget, WorkerType};
use kvrelay_core::model::identity::EndpointPath;
use kvrelay_core::rng::RelayRng;
use kvrelay_core::sources::{RecoveryRequest, RecoveryResponse};

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

/// A previous incarnation of a worker that lives on: advertised during an overlap, then a
/// zombie whose events are stale.
#[derive(Debug, Clone)]
struct Ghost {
    worker: SimWorker,
    advertised: bool,
}

/// A running simulated DC.
///
/// A worker slot is *listed* unless it crashed or its discovery lease expired; only listed
/// workers serve traffic, appear in discovery and answer recovery queries. During an overlap a
/// slot also has a *ghost*: its previous publisher incarnation, still advertised, answering
/// recovery queries for its own incarnations and able to publish stale events; after the overlap
/// ends it is withdrawn (its recovery endpoints with it) but keeps publishing (a zombie whose
/// events a relay must drop).
#[derive(Debug, Clone)]
pub struct SimulatedDc {
    workers: Vec<SimWorker>,
    unlisted: BTreeSet<usize>,
    ghosts: BTreeMap<usize, Ghost>,
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
            unlisted: BTreeSet::new(),
            ghosts: BTreeMap::new(),
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

    /// Whether worker `index` is listed in discovery (neither crashed nor lease-expired).
    #[must_use]
    pub fn is_listed(&self, index: usize) -> bool {
        index < self.workers.len() && !self.unlisted.contains(&index)
    }

    /// The listed workers.
    pub fn listed_workers(&self) -> impl Iterator<Item = &SimWorker> + '_ {
        self.workers.iter().enumerate().filter(|(i, _)| self.is_listed(*i)).map(|(_, w)| w)
    }

    /// Everything discovery shows: cards, adverts (a ghost's too), and each endpoint's live
    /// instance set.
    #[must_use]
    pub fn discovery_facts(&self) -> Vec<DcInput> {
        let mut facts: Vec<DcInput> =
            self.listed_workers().flat_map(SimWorker::discovery_facts).collect();
        facts.extend(
            self.ghosts
                .values()
                .filter(|ghost| ghost.advertised)
                .flat_map(|ghost| ghost.worker.discovery_facts()),
        );
        facts.extend(self.instance_facts());
        facts
    }

    fn instance_facts(&self) -> Vec<DcInput> {
        let mut by_endpoint: BTreeMap<EndpointPath, BTreeSet<u64>> = BTreeMap::new();
        for (index, worker) in self.workers.iter().enumerate() {
            let live = by_endpoint.entry(worker.spec().endpoint.clone()).or_default();
            if self.is_listed(index) {
                live.insert(worker.worker_id());
            }
        }
        by_endpoint
            .into_iter()
            .map(|(endpoint, live)| {
                DcInput::Instances(EndpointInstances { endpoint, live_workers: Some(live) })
            })
            .collect()
    }

    /// Serve `requests` requests on randomly chosen listed workers (adapter traffic on
    /// adapter-bearing workers half the time) and return the KV event messages they publish.
    pub fn step(&mut self, requests: usize, rng: &mut RelayRng) -> Vec<DcInput> {
        self.clock_ms += 1;
        let listed: Vec<usize> = (0..self.workers.len()).filter(|i| self.is_listed(*i)).collect();
        let mut facts = Vec::new();
        for _ in 0..requests {
            if listed.is_empty() {
                break;
            }
            let index = listed[(rng.next_u32() as usize) % listed.len()];
            let request = self.traffic.next_request(rng);
            facts.extend(Self::serve_on(
                &mut self.workers[index],
                &request.tokens,
                &mut self.message_sequences,
                self.clock_ms,
                rng,
            ));
        }
        facts
    }

    /// Serve `requests` requests on the ghosts (previous incarnations still publishing during an
    /// overlap): the stale events a relay must not apply.
    pub fn ghost_step(&mut self, requests: usize, rng: &mut RelayRng) -> Vec<DcInput> {
        let mut facts = Vec::new();
        let indices: Vec<usize> = self.ghosts.keys().copied().collect();
        for index in indices.iter().cycle().take(if indices.is_empty() { 0 } else { requests }) {
            let request = self.traffic.next_request(rng);
            let Some(ghost) = self.ghosts.get_mut(index) else { continue };
            facts.extend(Self::serve_on(
                &mut ghost.worker,
                &request.tokens,
                &mut self.message_sequences,
                self.clock_ms,
                rng,
            ));
        }
        facts
    }

    fn serve_on(
        worker: &mut SimWorker,
        tokens: &[u32],
        message_sequences: &mut BTreeMap<u64, u64>,
        clock_ms: u64,
        rng: &mut RelayRng,
    ) -> Option<DcInput> {
        let adapters = worker.spec().adapters.clone();
        let adapter = (!adapters.is_empty() && rng.next_u32().is_multiple_of(2))
            .then(|| adapters[(rng.next_u32() as usize) % adapters.len()].clone());
        let rank = rng.next_u32() % worker.spec().data_parallel_size.max(1);
        let events = worker.serve(rank, tokens, adapter.as_deref());
        Self::batch(worker, rank, events, message_sequences, clock_ms)
    }

    fn batch(
        worker: &SimWorker,
        rank: u32,
        events: Vec<kvrelay_core::model::kv_events::RouterEvent>,
        message_sequences: &mut BTreeMap<u64, u64>,
        clock_ms: u64,
    ) -> Option<DcInput> {
        if events.is_empty() {
            return None;
        }
        let publisher_id = worker.ranks()[rank as usize].publisher_id();
        let sequence = message_sequences.entry(publisher_id).or_default();
        let batch = DcInput::KvEvents(KvEventBatch {
            endpoint: worker.spec().endpoint.clone(),
            publisher_id,
            sequence: *sequence,
            published_at_ms: clock_ms,
            events,
        });
        *sequence += 1;
        Some(batch)
    }

    /// Occupancy reports of every worker.
    #[must_use]
    pub fn load_facts(&self) -> Vec<DcInput> {
        self.listed_workers().flat_map(SimWorker::load_facts).collect()
    }

    /// Restart worker `index` (new worker id, new incarnations): the facts of it leaving, then
    /// of it coming back.
    pub fn restart_worker(&mut self, index: usize, rng: &mut RelayRng) -> Vec<DcInput> {
        let mut facts = self.crash_worker(index);
        facts.extend(self.start_worker(index, false, rng));
        facts
    }

    /// Worker `index` crashes: its adverts and cards are withdrawn and it leaves the instance set.
    /// Nothing if it is not listed.
    pub fn crash_worker(&mut self, index: usize) -> Vec<DcInput> {
        if !self.is_listed(index) {
            return Vec::new();
        }
        self.unlisted.insert(index);
        let mut facts = self.workers[index].withdrawal_facts();
        facts.extend(self.instance_facts());
        facts
    }

    /// Worker `index` starts again as a new process (new incarnations, empty caches, event ids
    /// from 1), under its old worker id (as on Kubernetes) or a new one (as on etcd). A listed
    /// worker is crashed first.
    pub fn start_worker(
        &mut self,
        index: usize,
        same_id: bool,
        rng: &mut RelayRng,
    ) -> Vec<DcInput> {
        if index >= self.workers.len() {
            return Vec::new();
        }
        let mut facts = self.crash_worker(index);
        let worker_id = if same_id {
            self.workers[index].worker_id()
        } else {
            self.next_worker_id += 1;
            self.next_worker_id
        };
        self.workers[index].restart(worker_id, rng);
        self.unlisted.remove(&index);
        facts.extend(self.workers[index].discovery_facts());
        facts.extend(self.instance_facts());
        facts
    }

    /// Worker `index`'s discovery lease expires while the process lives on (caches intact): it
    /// disappears from discovery and gets no traffic until [`Self::renew_lease`].
    pub fn expire_lease(&mut self, index: usize) -> Vec<DcInput> {
        self.crash_worker(index)
    }

    /// Worker `index` registers again with its old worker id and publisher incarnations.
    pub fn renew_lease(&mut self, index: usize) -> Vec<DcInput> {
        if index >= self.workers.len() || !self.unlisted.remove(&index) {
            return Vec::new();
        }
        let mut facts = self.workers[index].discovery_facts();
        facts.extend(self.instance_facts());
        facts
    }

    /// Worker `index` starts a new process under the same worker id while the old one is still
    /// advertised: both incarnations of every rank are advertised at once (an overlap) and the
    /// old one lives on as a ghost until [`Self::end_overlap`].
    pub fn begin_overlap(&mut self, index: usize, rng: &mut RelayRng) -> Vec<DcInput> {
        if !self.is_listed(index) || self.ghosts.contains_key(&index) {
            return Vec::new();
        }
        let worker = &mut self.workers[index];
        let ghost = worker.clone();
        worker.restart(ghost.worker_id(), rng);
        let facts = worker.discovery_facts();
        self.ghosts.insert(index, Ghost { worker: ghost, advertised: true });
        facts
    }

    /// The overlap of worker `index` ends: the old incarnations' adverts are withdrawn (the
    /// old process keeps publishing stale events).
    pub fn end_overlap(&mut self, index: usize) -> Vec<DcInput> {
        let Some(ghost) = self.ghosts.get_mut(&index).filter(|ghost| ghost.advertised) else {
            return Vec::new();
        };
        ghost.advertised = false;
        let worker = &ghost.worker;
        worker
            .ranks()
            .iter()
            .filter(|_| worker.spec().publishes_kv)
            .map(|rank| DcInput::SourceWithdrawn {
                kv_state_endpoint: worker.spec().endpoint.clone(),
                publisher_id: rank.publisher_id(),
            })
            .collect()
    }

    /// Whether worker `index` has an advertised ghost (an overlap is in progress).
    #[must_use]
    pub fn in_overlap(&self, index: usize) -> bool {
        self.ghosts.get(&index).is_some_and(|ghost| ghost.advertised)
    }

    /// Load LoRA adapter `adapter` on worker `index`.
    pub fn load_adapter(&mut self, index: usize, adapter: &str) -> Vec<DcInput> {
        if !self.is_listed(index) {
            return Vec::new();
        }
        self.workers[index].load_adapter(adapter)
    }

    /// Unload LoRA adapter `adapter` from worker `index`.
    pub fn unload_adapter(&mut self, index: usize, adapter: &str) -> Vec<DcInput> {
        if !self.is_listed(index) {
            return Vec::new();
        }
        self.workers[index].unload_adapter(adapter)
    }

    /// Worker `index` resets the cache of `rank`: one `Cleared` event.
    pub fn clear_rank(&mut self, index: usize, rank: u32) -> Vec<DcInput> {
        if !self.is_listed(index) {
            return Vec::new();
        }
        let worker = &mut self.workers[index];
        let ranks = worker.ranks().len().max(1) as u32;
        let events = worker.clear(rank % ranks);
        Self::batch(worker, rank % ranks, events, &mut self.message_sequences, self.clock_ms)
            .into_iter()
            .collect()
    }

    /// Answer a recovery query the way the worker's local indexer would: the process holding
    /// the publisher incarnation whose endpoint `target` names answers for that rank (a listed
    /// worker, or during an overlap the previous incarnation). An endpoint no listed process or
    /// advertised ghost serves is rejected with the request plane's text
    /// (`Server unavailable: unknown endpoint <path>`).
    ///
    /// # Errors
    /// The rejection text when no live incarnation serves `target`.
    pub fn answer(
        &self,
        target: &RecoveryTarget,
        request: &RecoveryRequest,
    ) -> Result<RecoveryResponse, String> {
        let ghosts =
            self.ghosts.values().filter(|ghost| ghost.advertised).map(|ghost| &ghost.worker);
        self.listed_workers()
            .chain(ghosts)
            .find_map(|worker| {
                worker.recovery_rank(target).map(|rank| worker.answer_recovery(rank, request))
            })
            .ok_or_else(|| local_indexer::unknown_endpoint(target))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_core::model::kv_events::SourceKey;
    use kvrelay_core::rng::rng_from_seed;

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

    fn adverts(facts: &[DcInput]) -> Vec<u64> {
        facts
            .iter()
            .filter_map(|fact| match fact {
                DcInput::SourceAdvertised(advert) => Some(advert.publisher_id),
                _ => None,
            })
            .collect()
    }

    fn live(facts: &[DcInput], endpoint: &str) -> Option<BTreeSet<u64>> {
        facts.iter().rev().find_map(|fact| match fact {
            DcInput::Instances(set) if set.endpoint.to_string() == endpoint => {
                set.live_workers.clone()
            }
            _ => None,
        })
    }

    #[test]
    fn crashed_and_expired_workers_leave_discovery_and_traffic_until_they_return() {
        let mut rng = rng_from_seed(6);
        let mut dc = SimulatedDc::start(&Deployment::demo(), TrafficConfig::default(), &mut rng);
        let id = dc.workers()[0].worker_id();
        let facts = dc.crash_worker(0);
        assert!(facts.iter().any(|f| matches!(f, DcInput::SourceWithdrawn { .. })));
        assert!(!live(&facts, "dynamo/backend/generate").unwrap().contains(&id));
        assert!(!dc.is_listed(0));
        assert!(dc.crash_worker(0).is_empty(), "crashing twice says nothing");
        for _ in 0..20 {
            for fact in dc.step(10, &mut rng) {
                let DcInput::KvEvents(batch) = fact else { continue };
                assert!(batch.events.iter().all(|e| e.worker_id != id), "no traffic while down");
            }
        }
        let facts = dc.start_worker(0, true, &mut rng);
        assert_eq!(dc.workers()[0].worker_id(), id, "same id on request");
        assert!(live(&facts, "dynamo/backend/generate").unwrap().contains(&id));

        let before = adverts(&dc.discovery_facts());
        assert!(!dc.expire_lease(2).is_empty());
        let facts = dc.renew_lease(2);
        assert!(before.iter().any(|p| adverts(&facts).contains(p)), "same incarnations");
        assert!(dc.renew_lease(2).is_empty());
    }

    #[test]
    fn an_overlap_advertises_both_incarnations_until_it_ends_and_the_ghost_stays_stale() {
        let mut rng = rng_from_seed(7);
        let mut dc = SimulatedDc::start(&Deployment::demo(), TrafficConfig::default(), &mut rng);
        let old = adverts(&dc.workers()[1].discovery_facts());
        let new = adverts(&dc.begin_overlap(1, &mut rng));
        assert_eq!((old.len(), new.len()), (2, 2));
        assert!(old.iter().all(|p| !new.contains(p)));
        assert!(dc.in_overlap(1));
        let listed = adverts(&dc.discovery_facts());
        assert!(old.iter().chain(&new).all(|p| listed.contains(p)));
        let withdrawn = dc.end_overlap(1);
        assert_eq!(withdrawn.len(), 2);
        assert!(!dc.in_overlap(1));
        assert!(old.iter().all(|p| !adverts(&dc.discovery_facts()).contains(p)));
        let stale = dc.ghost_step(4, &mut rng);
        assert!(
            stale.iter().all(
                |f| matches!(f, DcInput::KvEvents(batch) if old.contains(&batch.publisher_id))
            )
        );
        assert!(!stale.is_empty());
    }

    fn recovery_targets(facts: &[DcInput]) -> Vec<(SourceKey, RecoveryTarget)> {
        facts
            .iter()
            .filter_map(|fact| match fact {
                DcInput::SourceAdvertised(advert) => {
                    Some((advert.source, advert.recovery_target.clone()?))
                }
                _ => None,
            })
            .collect()
    }

    fn dump_of(dc: &SimulatedDc, source: SourceKey, target: &RecoveryTarget) -> (usize, u64) {
        match dc.answer(target, &RecoveryRequest::tree_dump(source)) {
            Ok(RecoveryResponse::TreeDump { events, last_event_id, .. }) => {
                (events.len(), last_event_id)
            }
            other => panic!("a tree dump, got {other:?}"),
        }
    }

    #[test]
    fn recovery_is_answered_by_the_incarnation_the_target_names() {
        let mut rng = rng_from_seed(9);
        let mut dc = SimulatedDc::start(&Deployment::demo(), TrafficConfig::default(), &mut rng);
        for request in 0..3u32 {
            let _ = dc.workers[1].serve(
                0,
                &(request * 100..request * 100 + 32).collect::<Vec<_>>(),
                None,
            );
        }
        let old = recovery_targets(&dc.workers()[1].discovery_facts());
        let (source, old_target) = old[0].clone();
        assert_eq!(source.dp_rank, 0);
        assert_eq!(dump_of(&dc, source, &old_target), (6, 3));

        // Same worker id, new incarnation: both answer, each for its own rank state.
        let new = recovery_targets(&dc.begin_overlap(1, &mut rng));
        let (new_source, new_target) = new[0].clone();
        assert_eq!((new_source, new_target.instance_id), (source, old_target.instance_id));
        assert_ne!(new_target.endpoint, old_target.endpoint);
        let _ = dc.workers[1].serve(0, &(0..16).collect::<Vec<_>>(), None);
        assert_eq!(dump_of(&dc, source, &new_target), (1, 1));
        assert_eq!(dump_of(&dc, source, &old_target), (6, 3));
        let ranged = dc.answer(&old_target, &RecoveryRequest::range(source, 2, None)).unwrap();
        assert!(
            matches!(&ranged, RecoveryResponse::Events { events, last_event_id: 3 } if events.len() == 2)
        );

        // The overlap ends: the old incarnation's endpoint is gone, as on a real request plane.
        let _ = dc.end_overlap(1);
        let gone = dc.answer(&old_target, &RecoveryRequest::tree_dump(source)).unwrap_err();
        assert_eq!(
            gone,
            format!(
                "Server unavailable: unknown endpoint {:x}/{}",
                old_target.instance_id, old_target.endpoint
            )
        );
        assert_eq!(dump_of(&dc, source, &new_target), (1, 1));
        // A restart under the same id retires the new incarnation's endpoint too.
        let _ = dc.start_worker(1, true, &mut rng);
        assert!(dc.answer(&new_target, &RecoveryRequest::tree_dump(source)).is_err());
        let (_, restarted) = recovery_targets(&dc.workers()[1].discovery_facts())[0].clone();
        assert_eq!(dump_of(&dc, source, &restarted), (0, 0));
    }

    #[test]
    fn adapters_load_and_unload_as_cards() {
        let mut rng = rng_from_seed(8);
        let mut dc = SimulatedDc::start(&Deployment::demo(), TrafficConfig::default(), &mut rng);
        let loaded = dc.load_adapter(4, "adapter-c");
        assert!(matches!(&loaded[..], [DcInput::CardUpserted { card, .. }]
            if card.lora.as_ref().is_some_and(|lora| lora.name == "adapter-c")));
        assert!(dc.load_adapter(4, "adapter-c").is_empty());
        assert!(matches!(&dc.unload_adapter(4, "adapter-a")[..], [DcInput::CardRemoved { .. }]));
        assert!(dc.unload_adapter(4, "adapter-a").is_empty());
    }
}
