//! Tests of a whole node fed by a simulated DC: what one misbehaving pool may and may not do to
//! the rest of the relay.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;

use super::{NodeConfig, NodeHandle, RecoveryTransport, start_node};
use crate::demo::SharedDc;
use crate::pool::PoolConfig;
use crate::publication::HubConfig;
use crate::runtime::{InlineExecutor, ManualWallClock};
use kvrelay_core::control::ControlConfig;
use kvrelay_core::discovery::DiscoveryScope;
use kvrelay_core::inputs::RecoveryTarget;
use kvrelay_core::model::identity::{EndpointPath, PoolId, RelayIdentity, stable_dc_id};
use kvrelay_core::pool::PoolStats;
use kvrelay_core::rng::{RelayRng, derive_seed, rng_from_seed};
use kvrelay_core::sources::{RecoveryFailure, RecoveryRequest, RecoveryResponse};
use kvrelay_core::wire;
use kvrelay_dc::{Deployment, SimulatedDc, TrafficConfig, WorkerSpec};

const SEED: u64 = 23;

/// The simulated DC's recovery answers, counted per worker instance.
#[derive(Debug, Clone)]
struct CountedRecovery {
    dc: SharedDc,
    queries: Arc<Mutex<BTreeMap<u64, u64>>>,
}

impl CountedRecovery {
    fn queries_to(&self, instance_id: u64) -> u64 {
        self.queries.lock().expect("not poisoned").get(&instance_id).copied().unwrap_or(0)
    }
}

impl RecoveryTransport for CountedRecovery {
    fn query(
        &self,
        target: RecoveryTarget,
        request: RecoveryRequest,
        timeout: Duration,
    ) -> BoxFuture<'static, Result<RecoveryResponse, RecoveryFailure>> {
        *self.queries.lock().expect("not poisoned").entry(target.instance_id).or_default() += 1;
        self.dc.query(target, request, timeout)
    }
}

fn endpoint(text: &str) -> EndpointPath {
    text.parse().expect("valid endpoint")
}

fn node_config(exact_state_bytes_max: usize) -> NodeConfig {
    let mut rng = rng_from_seed(derive_seed(SEED, "node-test/relay"));
    let relay = RelayIdentity::start(0x0070_0000_0000_0002, &mut rng);
    let scope = DiscoveryScope::new(Vec::new(), Vec::new(), true).expect("watch-all is valid");
    let mut control =
        ControlConfig::new(relay, stable_dc_id("node-test-dc").expect("valid"), scope);
    control.expected_unique_blocks = 4096;
    NodeConfig {
        control,
        pool: PoolConfig {
            exact_state_bytes_max: Some(exact_state_bytes_max),
            ..PoolConfig::default()
        },
        hub: HubConfig::default(),
        max_kicks: kvrelay_core::filter::ckf::MAX_KICKS_DEFAULT,
        rng_seed: derive_seed(SEED, "node-test/node"),
        load_window: Duration::from_secs(1),
        input_queue_capacity: 1024,
        load_fanout_capacity: 16,
        input_queue_bytes_max: super::INPUT_QUEUE_BYTES_MAX_DEFAULT,
    }
}

/// A simulated DC of `workers`, and the generator (seeded from `label`) that drives its traffic.
fn simulated_dc(
    workers: Vec<WorkerSpec>,
    traffic: TrafficConfig,
    label: &str,
) -> (SharedDc, RelayRng) {
    let mut rng = rng_from_seed(derive_seed(SEED, label));
    let deployment = Deployment { workers };
    let dc = SharedDc(Arc::new(Mutex::new(SimulatedDc::start(&deployment, traffic, &mut rng))));
    (dc, rng)
}

/// The pool serving `serving` in the node's published catalog.
fn pool_of(node: &NodeHandle, serving: &EndpointPath) -> Option<PoolId> {
    let catalog = wire::validate_catalog_update(&node.views.catalog.borrow()).ok()?;
    catalog.pools.iter().find(|pool| pool.serving_endpoint == *serving).map(|pool| pool.pool_id())
}

/// Start a node on `dc` (its recovery answers counted) and hand it the DC's discovery facts.
async fn start_on(dc: &SharedDc, config: NodeConfig) -> NodeHandle {
    let recovery = CountedRecovery { dc: dc.clone(), queries: Arc::default() };
    let clock = Arc::new(ManualWallClock::new(1_700_000_000_000_000));
    let node =
        start_node(config, Arc::new(InlineExecutor), clock, Arc::new(recovery)).expect("starts");
    for fact in dc.with(|dc| dc.discovery_facts()) {
        node.inputs.send(fact).await.expect("node runs");
    }
    node
}

/// The pools serving `endpoints`, once the node's catalog lists every one (at most 2 s).
async fn published(node: &NodeHandle, endpoints: &[EndpointPath]) -> Vec<PoolId> {
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let pools: Option<Vec<PoolId>> =
            endpoints.iter().map(|serving| pool_of(node, serving)).collect();
        if let Some(pools) = pools {
            return pools;
        }
    }
    panic!("the pools of {endpoints:?} were never published");
}

async fn stats(node: &NodeHandle, pool: &PoolId) -> PoolStats {
    node.publications.stats(pool).await.expect("the pool runs").1
}

/// One worker keeps every block it ever stores (a cache that never evicts, the way a broken or
/// hostile worker may report): its pool reaches the exact-state budget, refuses what would pass
/// it as a resource failure (the rank is recovered), and never holds more. A well-behaved
/// worker's pool on the same node keeps publishing and stays exact meanwhile.
#[tokio::test(start_paused = true)]
async fn a_pool_past_its_byte_budget_reports_resource_failures_while_another_keeps_publishing() {
    const BUDGET: usize = 96 << 10;
    let hoarder_endpoint = endpoint("hoard/backend/generate");
    let steady_endpoint = endpoint("steady/backend/generate");
    let mut hoarder = WorkerSpec::aggregated(hoarder_endpoint.clone(), "hoard-llm");
    hoarder.capacity_blocks_per_rank = 1 << 20;
    let mut steady = WorkerSpec::aggregated(steady_endpoint.clone(), "steady-llm");
    steady.capacity_blocks_per_rank = 128;
    let traffic = TrafficConfig {
        prefix_count: 8,
        prefix_tokens: 64,
        tail_tokens_max: 512,
        vocabulary: 32_000,
    };
    let (dc, mut rng) = simulated_dc(vec![hoarder, steady], traffic, "node-test/dc");
    let hoarder_id = dc.with(|dc| dc.workers()[0].worker_id());
    let recovery = CountedRecovery { dc: dc.clone(), queries: Arc::default() };
    let clock = Arc::new(ManualWallClock::new(1_700_000_000_000_000));
    let node = start_node(
        node_config(BUDGET),
        Arc::new(InlineExecutor),
        clock.clone(),
        Arc::new(recovery.clone()),
    )
    .expect("node starts");
    for fact in dc.with(|dc| dc.discovery_facts()) {
        node.inputs.send(fact).await.expect("node runs");
    }

    let mut interval = tokio::time::interval(Duration::from_millis(20));
    let mut pools = None;
    let mut steady_stream = None;
    let mut first_refusal: Option<(u64, PoolStats)> = None;
    for tick in 0..400u64 {
        interval.tick().await;
        clock.advance_us(20_000);
        for fact in dc.with(|dc| dc.step(4, &mut rng)) {
            node.inputs.send(fact).await.expect("node runs");
        }
        if pools.is_none() {
            pools = pool_of(&node, &hoarder_endpoint).zip(pool_of(&node, &steady_endpoint));
            // A subscriber gives the steady pool a lease, so its publications are numbered.
            if let Some((_, steady_pool)) = &pools {
                let producer = node.publications.producer(steady_pool).expect("active");
                let mut stream = node.publications.subscribe(&producer).await.expect("subscribes");
                steady_stream =
                    Some(crate::runtime::spawn(
                        async move { while stream.next().await.is_ok() {} },
                    ));
            }
            continue;
        }
        let Some((hoard_pool, steady_pool)) = &pools else { unreachable!() };
        let hoard = stats(&node, hoard_pool).await;
        assert_eq!(hoard.exact_state_bytes_max, BUDGET);
        assert!(hoard.exact_state_bytes <= BUDGET, "tick {tick}: {hoard:?}");
        if first_refusal.is_none() && hoard.counters.budget_refusals > 0 {
            first_refusal =
                Some((recovery.queries_to(hoarder_id), stats(&node, steady_pool).await));
        }
        if first_refusal.is_some() && tick >= 300 {
            break;
        }
    }
    let (hoard_pool, steady_pool) = pools.expect("both pools were published");
    let (queries_at_refusal, steady_at_refusal) =
        first_refusal.expect("the hoarding pool reached its budget");

    tokio::time::sleep(Duration::from_secs(1)).await;
    let hoard = stats(&node, &hoard_pool).await;
    let steady = stats(&node, &steady_pool).await;
    // The hoarder's pool refused, counted, and had its rank recovered; it still holds no more
    // than its budget.
    assert!(hoard.counters.budget_refusals >= 1);
    assert!(hoard.exact_state_bytes <= BUDGET);
    assert!(
        recovery.queries_to(hoarder_id) > queries_at_refusal,
        "a refusal is a resource failure: the rank is recovered ({queries_at_refusal} queries then)"
    );
    // The steady pool never met its budget, kept publishing, and holds exactly its worker's
    // cache.
    assert_eq!(steady.counters.budget_refusals, 0);
    assert_eq!(steady.counters.events_rejected, 0);
    assert!(steady.exact_state_bytes_max == BUDGET && steady.exact_state_bytes < BUDGET / 2);
    assert!(
        steady.sequence > steady_at_refusal.sequence,
        "published {} then {}",
        steady_at_refusal.sequence,
        steady.sequence
    );
    let steady_blocks = dc.with(|dc| dc.workers()[1].ranks()[0].len());
    assert_eq!(steady.owned_blocks, steady_blocks);
    assert!(node.status.borrow().healthy, "one pool at its bound leaves the node healthy");

    node.shutdown().await;
    if let Some(task) = steady_stream {
        task.abort();
    }
}

/// A burst queued while the node is busy is taken in batches (one wake-up, one write per pool
/// generation, for up to `BATCH_INPUTS_MAX` inputs), and the pools it writes end exactly as their
/// workers' caches: held writes are neither lost nor reordered.
#[tokio::test(start_paused = true)]
async fn a_queued_burst_is_taken_in_batches_and_every_pool_stays_exact() {
    let endpoints = [endpoint("one/backend/generate"), endpoint("two/backend/generate")];
    let workers = endpoints
        .iter()
        .enumerate()
        .map(|(i, serving)| {
            let mut worker = WorkerSpec::aggregated(serving.clone(), &format!("burst-llm-{i}"));
            worker.capacity_blocks_per_rank = 256;
            worker
        })
        .collect();
    let traffic = TrafficConfig {
        prefix_count: 4,
        prefix_tokens: 64,
        tail_tokens_max: 256,
        vocabulary: 32_000,
    };
    let (dc, mut rng) = simulated_dc(workers, traffic, "node-test/burst-dc");
    let node = start_on(&dc, node_config(64 << 20)).await;
    let [one, two] = published(&node, &endpoints).await[..] else { unreachable!() };
    let before = node.status.borrow().clone();

    // Queue the burst without yielding: the node takes none of it until the test waits.
    let mut burst = Vec::new();
    while burst.len() < 600 {
        burst.extend(dc.with(|dc| dc.step(8, &mut rng)));
    }
    let sent = burst.len() as u64;
    for fact in burst {
        node.inputs.send(fact).await.expect("room for the whole burst");
    }
    let mut status = node.status.clone();
    let target = before.inputs_handled + sent;
    let after = status.wait_for(|s| s.inputs_handled == target).await.expect("node runs").clone();
    let batches = after.input_batches - before.input_batches;
    let least = sent.div_ceil(super::batch::BATCH_INPUTS_MAX as u64);
    assert!(
        batches >= least && batches * 16 <= sent,
        "{sent} queued inputs in {batches} batches (at most {} each)",
        super::batch::BATCH_INPUTS_MAX
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    for (pool, worker) in [(one, 0), (two, 1)] {
        let stats = stats(&node, &pool).await;
        let blocks = dc.with(|dc| dc.workers()[worker].ranks()[0].len());
        assert_eq!(stats.owned_blocks, blocks, "pool of worker {worker}: {stats:?}");
        assert_eq!(stats.counters.events_rejected, 0);
    }
    node.shutdown().await;
}

/// A pool's publication timer is the node's: with the threshold out of reach, a write waits
/// unpublished until the delay passes, and then the node's loop publishes it with no other
/// input, report or request to wake it.
#[tokio::test(start_paused = true)]
async fn a_pool_publishes_on_its_own_timer_from_the_node_loop() {
    let serving = endpoint("timer/backend/generate");
    let mut worker = WorkerSpec::aggregated(serving.clone(), "timer-llm");
    worker.capacity_blocks_per_rank = 256;
    let traffic =
        TrafficConfig { prefix_count: 2, prefix_tokens: 32, tail_tokens_max: 64, vocabulary: 1000 };
    let (dc, mut rng) = simulated_dc(vec![worker], traffic, "node-test/timer-dc");
    let mut config = node_config(64 << 20);
    config.pool.publication_threshold_events = 1_000_000;
    let delay = config.pool.publication_delay;
    let node = start_on(&dc, config).await;
    let [pool] = published(&node, &[serving]).await[..] else { unreachable!() };
    // A subscriber gives the pool a lease, so its publications are numbered.
    let producer = node.publications.producer(&pool).expect("active");
    let mut stream = node.publications.subscribe(&producer).await.expect("subscribes");
    let reader = crate::runtime::spawn(async move { while stream.next().await.is_ok() {} });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let before = stats(&node, &pool).await;

    let mut status = node.status.clone();
    let mut written = before;
    for _ in 0..50 {
        let facts = dc.with(|dc| dc.step(1, &mut rng));
        let target = status.borrow().inputs_handled + facts.len() as u64;
        for fact in facts {
            node.inputs.send(fact).await.expect("node runs");
        }
        status.wait_for(|s| s.inputs_handled == target).await.expect("node runs");
        written = stats(&node, &pool).await;
        if written.counters.events_applied > before.counters.events_applied {
            break;
        }
    }
    assert!(written.counters.events_applied > before.counters.events_applied, "a write arrived");
    assert_eq!(written.sequence, before.sequence, "below the threshold nothing is published yet");
    tokio::time::sleep(delay + Duration::from_millis(1)).await;
    let published = stats(&node, &pool).await;
    assert_eq!(published.sequence, before.sequence + 1, "the delay published the write");
    assert_eq!(published.counters.events_applied, written.counters.events_applied);
    reader.abort();
    node.shutdown().await;
}

/// A queue's worth of inputs taken at once does not outrun the publication hubs: the node lets
/// them run after every batch cut at its bound, so a subscriber keeps its stream through a burst
/// whose deltas are several times what the hub's broadcast buffers (a hub that falls behind it
/// takes a new snapshot and ends every subscriber).
#[tokio::test(start_paused = true)]
async fn a_queued_burst_keeps_every_subscriber_of_its_pool() {
    let serving = endpoint("burst/backend/generate");
    let mut worker = WorkerSpec::aggregated(serving.clone(), "burst-llm");
    worker.capacity_blocks_per_rank = 4096;
    let traffic =
        TrafficConfig { prefix_count: 4, prefix_tokens: 32, tail_tokens_max: 64, vocabulary: 1000 };
    let (dc, mut rng) = simulated_dc(vec![worker], traffic, "node-test/hub-burst-dc");
    let mut config = node_config(64 << 20);
    config.input_queue_capacity = 8192;
    let broadcast = config.pool.delta_broadcast_capacity as u64;
    let threshold = u64::from(config.pool.publication_threshold_events);
    let node = start_on(&dc, config).await;
    let [pool] = published(&node, std::slice::from_ref(&serving)).await[..] else { unreachable!() };
    let producer = node.publications.producer(&pool).expect("active");
    let mut stream = node.publications.subscribe(&producer).await.expect("subscribes");
    let ended = Arc::new(Mutex::new(None));
    let reader = crate::runtime::spawn({
        let ended = Arc::clone(&ended);
        async move {
            let error = loop {
                if let Err(error) = stream.next().await {
                    break error;
                }
            };
            *ended.lock().expect("not poisoned") = Some(error);
        }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let before = stats(&node, &pool).await;

    // Queue the whole burst without yielding (no budgeted send): the node finds it all at once.
    let mut burst = Vec::new();
    let mut events = 0u64;
    while events < 8 * broadcast * threshold {
        let facts = dc.with(|dc| dc.step(8, &mut rng));
        events += facts
            .iter()
            .map(|fact| match fact {
                kvrelay_core::inputs::DcInput::KvEvents(batch) => batch.events.len() as u64,
                _ => 0,
            })
            .sum::<u64>();
        burst.extend(facts);
    }
    let sent = burst.len() as u64;
    for fact in burst {
        let room = node.inputs.try_reserve(fact.weight_bytes()).expect("node runs");
        room.expect("room for the whole burst").send(fact);
    }
    let mut status = node.status.clone();
    let target = status.borrow().inputs_handled + sent;
    status.wait_for(|s| s.inputs_handled == target).await.expect("node runs");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let after = stats(&node, &pool).await;
    let deltas = after.sequence - before.sequence;
    assert!(deltas > 2 * broadcast, "the burst published {deltas} deltas");
    let ended = *ended.lock().expect("not poisoned");
    assert_eq!(ended, None, "the subscriber's stream ended during the burst");
    reader.abort();
    node.shutdown().await;
}
