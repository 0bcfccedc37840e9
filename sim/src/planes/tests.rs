//! The planes over turmoil: a relay-side client follows the planes host through partitions
//! and holds.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvrelay::demo::SharedDc;
use kvrelay_core::discovery::DiscoveryScope;
use kvrelay_core::inputs::DcInput;
use kvrelay_core::rng::rng_from_seed;
use kvrelay_dc::{Deployment, SimulatedDc, TrafficConfig};

use super::client::PlanesClient;
use super::frame::ToPlanes;
use super::publisher::Publisher;
use super::records::registrations;
use super::{PLANES_HOST, Planes, server};

const RELAY: &str = "relay";

/// What the relay side received, by kind.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Received {
    listings: usize,
    withdrawals: usize,
    kv_batches: usize,
}

fn count(facts: &[DcInput]) -> Received {
    let mut received = Received::default();
    for fact in facts {
        match fact {
            DcInput::CardsListed { .. } => received.listings += 1,
            DcInput::SourceWithdrawn { .. } => received.withdrawals += 1,
            DcInput::KvEvents(_) => received.kv_batches += 1,
            _ => {}
        }
    }
    received
}

/// Run a planes host and a relay-side client; `script` runs on the relay host with the planes
/// state, the DC and a drain of the facts received so far.
fn run<F, Fut>(script: F)
where
    F: FnOnce(Arc<Mutex<Planes>>, SharedDc, Arc<Mutex<Vec<DcInput>>>) -> Fut + 'static,
    Fut: Future<Output = ()> + 'static,
{
    let mut rng = rng_from_seed(11);
    let dc = SharedDc(Arc::new(Mutex::new(SimulatedDc::start(
        &Deployment::demo(),
        TrafficConfig::default(),
        &mut rng,
    ))));
    let planes = Arc::new(Mutex::new(Planes::new(rng_from_seed(12))));
    let desired = registrations(&dc.with(|dc| dc.discovery_facts()));
    planes.lock().unwrap().register(&desired, 0);
    let mut sim = turmoil::Builder::new()
        .simulation_duration(Duration::from_secs(60))
        .tick_duration(Duration::from_millis(1))
        .build();
    let (host_planes, host_dc) = (Arc::clone(&planes), dc.clone());
    sim.host(PLANES_HOST, move || {
        let (planes, dc) = (Arc::clone(&host_planes), host_dc.clone());
        async move { Ok(server::serve(planes, Arc::new(dc)).await?) }
    });
    sim.client(RELAY, async move {
        let scope = DiscoveryScope::new(Vec::new(), Vec::new(), true).expect("watch-all");
        let (client, _recovery) = PlanesClient::new(scope, Arc::default());
        let (inputs, mut facts) =
            kvrelay::node::input_queue(1024, kvrelay::node::INPUT_QUEUE_BYTES_MAX_DEFAULT);
        kvrelay::runtime::spawn(client.run(inputs));
        let received = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&received);
        kvrelay::runtime::spawn(async move {
            while let Some(fact) = facts.recv_input().await {
                sink.lock().unwrap().push(fact);
            }
        });
        script(planes, dc, received).await;
        Ok(())
    });
    sim.run().expect("the simulation completes");
}

/// Publish `facts` the way host `dc` does: encoded by the publisher, applied by the planes.
fn publish(planes: &Mutex<Planes>, facts: Vec<DcInput>) {
    let mut publisher = Publisher::default();
    publisher.publish(facts);
    if let Some(ToPlanes::Publish(publications)) = publisher.take() {
        planes.lock().unwrap().apply(publications, 0);
    }
}

fn crash_worker(planes: &Mutex<Planes>, dc: &SharedDc, worker: usize) {
    dc.with(|dc| dc.crash_worker(worker));
    let desired = registrations(&dc.with(|dc| dc.discovery_facts()));
    planes.lock().unwrap().register(&desired, 0);
}

#[test]
fn after_a_dropping_partition_the_watch_resumes_from_its_revision() {
    run(|planes, dc, received| async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(count(&received.lock().unwrap()).listings, 1);
        turmoil::partition(RELAY, PLANES_HOST);
        crash_worker(&planes, &dc, 0);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(count(&received.lock().unwrap()).withdrawals, 0, "cut off meanwhile");
        turmoil::repair(RELAY, PLANES_HOST);
        tokio::time::sleep(Duration::from_secs(1)).await;
        let after = count(&received.lock().unwrap());
        assert_eq!((after.listings, after.withdrawals), (1, 1), "resumed without a relist");
    });
}

#[test]
fn a_watch_whose_revision_was_compacted_relists() {
    run(|planes, dc, received| async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        turmoil::partition(RELAY, PLANES_HOST);
        crash_worker(&planes, &dc, 0);
        for round in 0..=super::store::HISTORY_MAX {
            let facts = dc.with(|dc| {
                if round % 2 == 0 {
                    dc.load_adapter(4, "churn")
                } else {
                    dc.unload_adapter(4, "churn")
                }
            });
            assert_eq!(facts.len(), 1);
            let desired = registrations(&dc.with(|dc| dc.discovery_facts()));
            planes.lock().unwrap().register(&desired, 0);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        turmoil::repair(RELAY, PLANES_HOST);
        tokio::time::sleep(Duration::from_secs(1)).await;
        let after = count(&received.lock().unwrap());
        assert_eq!(after.listings, 2, "relisted");
        assert_eq!(after.withdrawals, 1, "the relist withdrew the crashed worker's source");
    });
}

#[test]
fn a_hold_delays_events_without_losing_them() {
    run(|planes, dc, received| async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        turmoil::hold(RELAY, PLANES_HOST);
        let mut rng = rng_from_seed(13);
        let mut published = 0;
        for _ in 0..20 {
            let step = dc.with(|dc| dc.step(4, &mut rng));
            published += step.len();
            publish(&planes, step);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(count(&received.lock().unwrap()).kv_batches, 0, "held");
        turmoil::release(RELAY, PLANES_HOST);
        tokio::time::sleep(Duration::from_secs(1)).await;
        let after = count(&received.lock().unwrap());
        assert!(published > 0);
        assert_eq!((after.kv_batches, after.listings), (published, 1));
        assert_eq!(planes.lock().unwrap().counters.delivered as usize, published);
    });
}

#[test]
fn malformed_event_messages_are_refused_by_the_decoders() {
    let message = |endpoint: &str, topic: &str, bytes: &[u8]| super::frame::EventMessage {
        endpoint: endpoint.to_owned(),
        topic: topic.to_owned(),
        bytes: bytes.to_vec(),
    };
    assert!(super::decode_event(&message("no-endpoint", "kv-events", &[0x90])).is_err());
    assert!(super::decode_event(&message("a/b/c", "kv-events", &[0xc1, 0, 1])).is_err());
    assert!(super::decode_event(&message("a/b/c", "kv_metrics", &[])).is_err());
    let mut rng = rng_from_seed(14);
    let mut dc = SimulatedDc::start(&Deployment::demo(), TrafficConfig::default(), &mut rng);
    let mut planes = Planes::new(rng_from_seed(15));
    let connection = planes.connection_id();
    planes.subscribe(connection, None);
    let published = dc.step(4, &mut rng);
    let mut publisher = Publisher::default();
    publisher.publish(published.clone());
    let Some(ToPlanes::Publish(publications)) = publisher.take() else { panic!("queued") };
    planes.apply(publications, 0);
    let Some(items) = planes.take_outbox(connection) else { panic!("subscribed") };
    let decoded: Vec<DcInput> = items
        .iter()
        .map(|item| match item {
            super::frame::Item::Event(message) => super::decode_event(message).expect("decodes"),
            super::frame::Item::Change(_) => panic!("no discovery change was made"),
        })
        .collect();
    assert_eq!(decoded, published);
}
