//! The `demo` command's engine: a relay node fed by an in-process simulated DC, its recovery
//! queries answered by the simulated workers, serving the WAN contract on a real listener.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::node::{NodeConfig, NodeHandle, RecoveryTransport, start_node};
use crate::pool::PoolConfig;
use crate::publication::HubConfig;
use crate::runtime::{BlockingExecutor, WallClock};
use kvrelay_core::control::ControlConfig;
use kvrelay_core::discovery::DiscoveryScope;
use kvrelay_core::inputs::RecoveryTarget;
use kvrelay_core::model::identity::{RelayIdentity, stable_dc_id};
use kvrelay_core::rng::{RelayRng, derive_seed, rng_from_seed};
use kvrelay_core::sources::{RecoveryFailure, RecoveryRequest, RecoveryResponse};
use kvrelay_dc::{Deployment, SimulatedDc, TrafficConfig};

/// A simulated DC shared between its driver and the recovery transport.
#[derive(Debug, Clone)]
pub struct SharedDc(pub Arc<Mutex<SimulatedDc>>);

impl SharedDc {
    /// Run `f` on the DC.
    pub fn with<R>(&self, f: impl FnOnce(&mut SimulatedDc) -> R) -> R {
        f(&mut self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }
}

impl RecoveryTransport for SharedDc {
    fn query(
        &self,
        target: RecoveryTarget,
        request: RecoveryRequest,
        _timeout: Duration,
    ) -> BoxFuture<'static, Result<RecoveryResponse, RecoveryFailure>> {
        let answer = self.with(|dc| dc.answer(&target, &request)).map_err(RecoveryFailure::Refused);
        Box::pin(async move { answer })
    }
}

/// How the demo runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DemoOptions {
    /// The one seed everything derives from.
    pub seed: u64,
    /// Requests served per tick.
    pub requests_per_tick: usize,
    /// Tick length.
    pub tick: Duration,
    /// Expected unique blocks per pool (filter sizing).
    pub expected_unique_blocks: u64,
    /// Publication deadlines on a precise timer ([`PoolConfig::precise_timer`]).
    pub precise_timer: bool,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            seed: 1,
            requests_per_tick: 8,
            tick: Duration::from_millis(50),
            expected_unique_blocks: 65_536,
            precise_timer: false,
        }
    }
}

/// A running demo: the node and its DC driver.
#[derive(Debug)]
pub struct Demo {
    /// The relay node.
    pub node: NodeHandle,
    /// The simulated DC.
    pub dc: SharedDc,
    stop: CancellationToken,
    driver: tokio::task::JoinHandle<()>,
}

impl Demo {
    /// Start the node and the DC driver.
    pub fn start(
        options: DemoOptions,
        executor: Arc<dyn BlockingExecutor>,
        clock: Arc<dyn WallClock>,
    ) -> Result<Demo, kvrelay_core::control::ControlError> {
        let mut rng = rng_from_seed(derive_seed(options.seed, "demo/relay"));
        let relay = RelayIdentity::start(0x00de_0000_0000_0001, &mut rng);
        let scope = DiscoveryScope::new(Vec::new(), Vec::new(), true).expect("watch-all is valid");
        let mut control =
            ControlConfig::new(relay, stable_dc_id("demo-dc").expect("valid name"), scope);
        control.expected_unique_blocks = options.expected_unique_blocks;
        let config = NodeConfig {
            control,
            pool: PoolConfig { precise_timer: options.precise_timer, ..PoolConfig::default() },
            hub: HubConfig::default(),
            max_kicks: kvrelay_core::filter::ckf::MAX_KICKS_DEFAULT,
            rng_seed: derive_seed(options.seed, "demo/node"),
            load_window: Duration::from_secs(1),
            input_queue_capacity: 1024,
            load_fanout_capacity: 16,
            input_queue_bytes_max: crate::node::INPUT_QUEUE_BYTES_MAX_DEFAULT,
        };
        let mut dc_rng = rng_from_seed(derive_seed(options.seed, "demo/dc"));
        let dc = SharedDc(Arc::new(Mutex::new(SimulatedDc::start(
            &Deployment::demo(),
            TrafficConfig::default(),
            &mut dc_rng,
        ))));
        let node = start_node(config, executor, clock, Arc::new(dc.clone()))?;
        let stop = CancellationToken::new();
        let driver = crate::runtime::spawn(drive(
            dc.clone(),
            node.inputs.clone(),
            options,
            dc_rng,
            stop.clone(),
        ));
        Ok(Demo { node, dc, stop, driver })
    }

    /// Stop the driver, then the node.
    pub async fn stop(self) {
        self.stop.cancel();
        let _ = self.driver.await;
        self.node.shutdown().await;
    }
}

async fn drive(
    dc: SharedDc,
    inputs: crate::node::InputSender,
    options: DemoOptions,
    mut rng: RelayRng,
    stop: CancellationToken,
) {
    for fact in dc.with(|dc| dc.discovery_facts()) {
        if inputs.send(fact).await.is_err() {
            return;
        }
    }
    let mut ticks = tokio::time::interval(options.tick);
    let mut tick_count = 0u64;
    loop {
        tokio::select! {
            biased;
            () = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        tick_count += 1;
        let mut facts = dc.with(|dc| dc.step(options.requests_per_tick, &mut rng));
        if tick_count.is_multiple_of(10) {
            facts.extend(dc.with(|dc| dc.load_facts()));
        }
        for fact in facts {
            if inputs.send(fact).await.is_err() {
                return;
            }
        }
    }
}
