//! Behaviour of the composed relay: writes held for the batch and published on the pool's own
//! timer, a pool's fault reaching the plane within the call that raised it, publications carried
//! as snapshots, and a stopped generation that runs until the shell stops it.
//!
//! A [`Dc`] plays the shell: it allocates a small pool for every `StartPool`, stops and releases
//! pools when told to, and keeps every other effect for the test to read.

use std::time::Duration;

use super::*;
use crate::control::tests::{
    BACKEND, PUBLISHER, WORKER, advert, card, card_input, endpoint, events, instances, relay,
    stored,
};
use crate::control::{ControlConfig, ControlPlane};
use crate::discovery::DiscoveryScope;
use crate::inputs::CardInstanceId;
use crate::inputs::WorkerType;
use crate::model::hashing::{ExternalBlockHash, LocalBlockHash};
use crate::model::identity::{LaneLease, ProducerIdentity, stable_dc_id};
use crate::model::kv_events::{KvCacheEventData, StoreData, StoredBlock};
use crate::pool::{CadenceConfig, Delta, PoolOwnership, PublicationRole};
use crate::rng::rng_from_seed;

const DELAY: Duration = Duration::from_millis(1);

/// Records every delta, as a subscriber that always listens.
#[derive(Debug, Default)]
struct Outlet {
    deltas: Vec<Delta>,
}

impl DeltaOutlet for Outlet {
    fn offer(&mut self, delta: Delta) -> Result<(), Delta> {
        self.deltas.push(delta);
        Ok(())
    }

    fn has_receivers(&self) -> bool {
        true
    }
}

struct Dc {
    relay: Relay<Outlet>,
    rng: RelayRng,
    now: Duration,
    /// Effects the harness does not carry out itself, in order.
    effects: Vec<RelayEffect>,
    /// Carry out `StopPool` and `ReleasePool` (otherwise they are only recorded).
    stops_pools: bool,
    /// Keep `StartPool`s for [`Dc::finish_starts`] (an allocation still running).
    defers_starts: bool,
    deferred: Vec<(EndpointPath, ProducerIdentity)>,
}

impl Dc {
    fn new() -> Self {
        let config = ControlConfig::new(
            relay(),
            stable_dc_id("dc-a").unwrap(),
            DiscoveryScope::watch_all(Vec::new()).unwrap(),
        );
        Dc {
            relay: Relay::new(ControlPlane::new(config).unwrap()),
            rng: rng_from_seed(11),
            now: Duration::ZERO,
            effects: Vec::new(),
            stops_pools: true,
            defers_starts: false,
            deferred: Vec::new(),
        }
    }

    fn input(&mut self, input: DcInput) {
        self.relay.handle(input, self.now, &mut self.rng);
        self.carry_out();
    }

    fn flush(&mut self) {
        self.relay.flush(self.now, &mut self.rng);
        self.carry_out();
    }

    fn carry_out(&mut self) {
        while let Some(effect) = self.relay.poll_effect() {
            let RelayEffect::Command(command) = effect else {
                self.effects.push(effect);
                continue;
            };
            match *command {
                ControlCommand::Host(HostCommand::StartPool { endpoint, producer, .. }) => {
                    if self.defers_starts {
                        self.deferred.push((endpoint, producer));
                    } else {
                        self.start(&endpoint, producer);
                    }
                }
                ControlCommand::Host(HostCommand::StopPool {
                    pool_id,
                    layout_generation,
                    mode,
                    ..
                }) if self.stops_pools => {
                    self.relay.stop_pool(&(pool_id, layout_generation), mode);
                }
                ControlCommand::Host(HostCommand::ReleasePool {
                    pool_id,
                    layout_generation,
                    ..
                }) if self.stops_pools => {
                    self.relay.release_pool(&(pool_id, layout_generation));
                }
                command => self.effects.push(RelayEffect::Command(Box::new(command))),
            }
        }
        self.relay.check_invariants().unwrap();
    }

    /// Allocate a small pool for `producer` and hand it to the relay; whether it runs.
    fn start(&mut self, endpoint: &EndpointPath, producer: ProducerIdentity) -> bool {
        let pool = PoolOwnership::new(producer.format(), 16, rng_from_seed(5)).unwrap();
        let cadence = CadenceConfig { threshold_events: 1_000, delay: DELAY };
        let machine = PoolMachine::new(pool, cadence, PublicationRole::Free);
        let key = (producer.pool_id(), producer.layout_generation());
        let (now, rng) = (self.now, &mut self.rng);
        self.relay.start_succeeded(endpoint, key, machine, Outlet::default(), now, rng)
    }

    /// Finish every deferred start, in issue order; whether each runs.
    fn finish_starts(&mut self) -> Vec<bool> {
        let deferred = std::mem::take(&mut self.deferred);
        let runs = deferred.into_iter().map(|(endpoint, producer)| {
            let runs = self.start(&endpoint, producer);
            self.carry_out();
            runs
        });
        runs.collect()
    }

    /// An aggregated worker with a live-only source, its pool running; returns the pool's key.
    fn up(&mut self) -> GenerationKey {
        self.input(instances(BACKEND, &[WORKER]));
        self.input(card_input(BACKEND, WORKER, card(WorkerType::Aggregated, vec![])));
        self.input(advert(BACKEND, WORKER, PUBLISHER, false));
        let producer = self.relay.plane().active_producer(&endpoint(BACKEND)).expect("active");
        (producer.pool_id(), producer.layout_generation())
    }

    fn owned_blocks(&self, key: &GenerationKey) -> usize {
        self.relay.pool_stats(key).expect("running").owned_blocks
    }

    fn deltas(&mut self, key: &GenerationKey) -> usize {
        let (now, rng) = (self.now, &mut self.rng);
        self.relay.with_pool(key, now, rng, |_, outlet| outlet.deltas.len()).expect("running")
    }

    /// A subscriber's barrier, so the pool's publications carry deltas.
    fn subscribe(&mut self, key: &GenerationKey) {
        let lease = LaneLease { consumer_instance: 1, physical_lane: 0, assignment_epoch: 1 };
        let (now, rng) = (self.now, &mut self.rng);
        let barrier =
            self.relay.with_pool(key, now, rng, |machine, outlet| machine.barrier(lease, outlet));
        barrier.expect("running").expect("barrier");
        self.carry_out();
    }

    fn faults_ignored(&self) -> u64 {
        let tracker = self.relay.plane().tracker(&endpoint(BACKEND)).expect("tracker");
        tracker.counters().faults_ignored
    }
}

fn catalogs(effects: &[RelayEffect]) -> Vec<&CatalogSnapshot> {
    let catalogs = effects.iter().filter_map(|effect| match effect {
        RelayEffect::Catalog(catalog) => Some(catalog),
        _ => None,
    });
    catalogs.collect()
}

#[test]
fn writes_are_held_until_the_flush_and_published_on_the_pools_own_timer() {
    let mut dc = Dc::new();
    let key = dc.up();
    dc.subscribe(&key);
    let published = dc.deltas(&key);

    dc.input(events(BACKEND, PUBLISHER, vec![stored(WORKER, 1, 0xabc)]));
    assert_eq!(dc.relay.held_blocks(), 1, "the write waits for the batch's end");
    assert_eq!(dc.relay.pool_stats(&key).unwrap().owned_blocks, 0);

    dc.flush();
    assert_eq!(dc.relay.held_blocks(), 0);
    assert_eq!(dc.owned_blocks(&key), 1, "the flush hands the write to its pool");
    assert_eq!(dc.relay.poll_timeout(), Some(dc.now + DELAY), "the pool's delay is the next timer");
    assert!(dc.relay.plane_timeout().is_none_or(|at| at > dc.now + DELAY));
    assert_eq!(dc.deltas(&key), published, "below the threshold nothing publishes at once");

    dc.now += DELAY;
    dc.relay.handle_timeout(dc.now, &mut dc.rng);
    dc.carry_out();
    assert_eq!(dc.deltas(&key), published + 1, "the pool's timer published the write");
    assert_eq!(dc.relay.poll_timeout(), dc.relay.plane_timeout(), "the pool's timer is spent");
}

#[test]
fn a_write_fault_reaches_the_plane_within_the_flush_that_raised_it() {
    let mut dc = Dc::new();
    let key = dc.up();
    dc.input(events(BACKEND, PUBLISHER, vec![stored(WORKER, 1, 0xabc)]));
    dc.flush();
    let ignored = dc.faults_ignored();

    // A store continuing a parent the rank never stored: the pool refuses it.
    let mut orphan = stored(WORKER, 2, 0xdef);
    orphan.event.data = KvCacheEventData::Stored(StoreData {
        parent_hash: Some(ExternalBlockHash(0x7777)),
        start_position: None,
        blocks: vec![StoredBlock {
            block_hash: ExternalBlockHash(0xdef),
            tokens_hash: LocalBlockHash(0x1234),
        }],
    });
    dc.input(events(BACKEND, PUBLISHER, vec![orphan]));
    assert_eq!(dc.faults_ignored(), ignored, "nothing is applied before the flush");
    dc.flush();

    // A live-only rank cannot be recovered: its tracker counts the fault and keeps the rank.
    assert_eq!(dc.faults_ignored(), ignored + 1, "the fault reached the rank's tracker");
    assert_eq!(dc.owned_blocks(&key), 1, "the refused store changed nothing");
    assert_eq!(dc.relay.running().count(), 1, "a live-only rank's fault keeps the pool");
}

#[test]
fn a_stopped_generation_runs_until_the_shell_stops_it_and_a_stray_pool_fails_the_audit() {
    let mut dc = Dc::new();
    let key = dc.up();
    let cataloged = catalogs(&dc.effects).last().map(|catalog| catalog.pools.len());
    assert_eq!(cataloged, Some(1), "the start's catalog names the pool");

    dc.subscribe(&key);
    dc.stops_pools = false;
    dc.input(events(BACKEND, PUBLISHER, vec![stored(WORKER, 1, 0xabc)]));
    let before = dc.effects.len();
    // The worker leaves: the pool is withdrawn and stopped. The harness ends no stream and stops
    // nothing, so the pool outlives its slot.
    dc.relay.handle(instances(BACKEND, &[]), dc.now, &mut dc.rng);
    while let Some(effect) = dc.relay.poll_effect() {
        dc.effects.push(effect);
    }
    let after = &dc.effects[before..];
    assert_eq!(catalogs(after).last().map(|catalog| catalog.pools.len()), Some(0));
    let stops = after.iter().any(|effect| match effect {
        RelayEffect::Command(command) => matches!(
            &**command,
            ControlCommand::Host(HostCommand::StopPool { pool_id, layout_generation, .. })
                if (*pool_id, *layout_generation) == key
        ),
        _ => false,
    });
    assert!(stops, "the plane asks for the pool's stop");
    assert_eq!(dc.owned_blocks(&key), 1, "the held write reached the pool before its stop left");
    let error = dc.relay.check_invariants().expect_err("a pool no slot holds");
    assert!(error.contains("no slot"), "{error}");

    let outlet = dc.relay.stop_pool(&key, StopMode::Graceful).expect("it was running");
    assert!(!outlet.deltas.is_empty(), "the graceful stop published the tail");
    dc.relay.check_invariants().unwrap();
    assert_eq!(dc.relay.running().count(), 0);
}

#[test]
fn a_start_whose_endpoint_left_while_its_filter_was_allocated_stops_unpublished() {
    let mut dc = Dc::new();
    dc.defers_starts = true;
    dc.input(instances(BACKEND, &[WORKER]));
    dc.input(card_input(BACKEND, WORKER, card(WorkerType::Aggregated, vec![])));
    dc.input(advert(BACKEND, WORKER, PUBLISHER, false));
    assert_eq!(dc.deferred.len(), 1, "the pool's filter is being allocated");

    // The card goes before the allocation ends; the plane still waits for the outcome.
    let id =
        CardInstanceId { endpoint: endpoint(BACKEND), instance_id: WORKER, model_suffix: None };
    dc.input(DcInput::CardRemoved { id });
    let before = dc.effects.len();
    assert_eq!(dc.finish_starts(), vec![true], "the start runs, to be stopped at once");
    assert_eq!(dc.relay.running().count(), 0, "the harness carried out its stop and release");
    assert!(catalogs(&dc.effects[before..]).is_empty(), "it was never published");
    assert!(dc.relay.plane().active_producer(&endpoint(BACKEND)).is_none());
}

#[test]
fn a_start_the_plane_does_not_wait_for_runs_nothing() {
    let mut dc = Dc::new();
    let key = dc.up();
    let producer = dc.relay.plane().active_producer(&endpoint(BACKEND)).unwrap();
    let stale = dc.relay.plane().counters().shell_reports_stale;

    // The running generation reported started a second time: not a start the plane waits for.
    assert!(!dc.relay.plane().is_starting(&endpoint(BACKEND), key.1));
    assert!(!dc.start(&endpoint(BACKEND), producer), "a stale start runs nothing");
    dc.carry_out();
    assert_eq!(dc.relay.plane().counters().shell_reports_stale, stale + 1);
    assert_eq!(dc.relay.running().collect::<Vec<_>>(), vec![&key], "the running pool is kept");
}
