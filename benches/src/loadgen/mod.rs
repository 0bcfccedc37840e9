//! The load generator behind `loadgen`: fake Dynamo workers that register in discovery and
//! publish `kv-events` and `kv_metrics` on NATS at a set rate and shape, writing a trace that
//! [`verify`] checks a relay's pool filters against.

pub mod register;
pub mod shape;
pub mod trace;
pub mod verify;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use kvrelay::runtime::{SystemWallClock, WallClock};
use kvrelay_core::inputs::{
    EventEnvelope, KV_EVENTS_TOPIC, KV_METRICS_TOPIC, LoadObservation, encode_active_load,
    encode_event_envelope, encode_kv_events_payload, event_subject,
};
use kvrelay_core::model::kv_events::{KvCacheEventData, SourceKey};
use kvrelay_core::rng::rng_from_seed;
use tokio::time::Instant;

use register::Registration;
use shape::{Model, Shape};
use trace::{Counters, PoolTrace, TRACE_VERSION, Trace};
use verify::{Verdict, VerifyOptions};

/// Where the workers register.
#[derive(Debug, Clone)]
pub enum Discovery {
    /// Dynamo's file backend: the `DYN_FILE_KV` root.
    Dir(PathBuf),
    /// etcd at this endpoint (`http://host:port`).
    Etcd(String),
}

/// Everything one run needs (validated flags).
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// NATS server URL.
    pub nats: String,
    /// Discovery backend.
    pub discovery: Discovery,
    /// Dynamo namespace of every pool.
    pub namespace: String,
    /// Stream shape.
    pub shape: Shape,
    /// Stored events per second, in total.
    pub rate: f64,
    /// Publishing time.
    pub duration: Duration,
    /// Period of the `kv_metrics` reports.
    pub load_interval: Duration,
    /// Most the generator runs behind before it skips events (counted).
    pub max_lag: Duration,
    /// Wait between registering and the first event (the relay discovers and subscribes).
    pub warmup: Duration,
    /// Keep the records registered this long after publishing (and verifying).
    pub linger: Duration,
    /// Seed of every draw.
    pub seed: u64,
    /// Where the trace goes.
    pub trace: PathBuf,
    /// Verify against this relay after publishing.
    pub verify: Option<(String, VerifyOptions)>,
    /// The flags as given, recorded in the trace.
    pub echo: serde_json::Value,
}

/// What a run ended with.
#[derive(Debug)]
pub struct RunOutcome {
    /// The verification, if asked for.
    pub verdict: Option<Verdict>,
}

/// Touch every file each second until the task is aborted.
fn start_refresher(paths: Vec<PathBuf>) -> tokio::task::JoinHandle<()> {
    kvrelay::runtime::spawn(async move {
        let registration = Registration::Files { paths };
        let mut failures_reported = false;
        loop {
            let failed = registration.refresh();
            if failed > 0 && !failures_reported {
                eprintln!("[loadgen] warning: {failed} discovery files could not be refreshed");
                failures_reported = true;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    })
}

/// Run the generator: register, warm up, publish, write the trace, verify, linger, unregister.
pub async fn run(config: RunConfig) -> Result<RunOutcome> {
    let mut rng = rng_from_seed(config.seed);
    let mut model = Model::new(config.shape, &mut rng);
    let endpoints = (0..config.shape.pools)
        .map(|index| register::pool_endpoint(&config.namespace, index))
        .collect::<Result<Vec<_>>>()?;
    let event_subjects: Vec<async_nats::Subject> =
        endpoints.iter().map(|endpoint| event_subject(endpoint, KV_EVENTS_TOPIC).into()).collect();
    let load_subjects: Vec<async_nats::Subject> =
        endpoints.iter().map(|endpoint| event_subject(endpoint, KV_METRICS_TOPIC).into()).collect();

    let client = async_nats::connect(config.nats.as_str())
        .await
        .with_context(|| format!("connecting to NATS at {}", config.nats))?;
    let records = register::records(&endpoints, &model.ranks, config.shape.ranks);
    let registration = match &config.discovery {
        Discovery::Dir(root) => Registration::files(root, &records)?,
        Discovery::Etcd(endpoint) => {
            let verify = config.verify.as_ref().map_or(Duration::ZERO, |(_, o)| o.timeout);
            let ttl =
                config.warmup + config.duration + config.linger + verify + Duration::from_secs(60);
            Registration::etcd(endpoint, ttl, &records).await?
        }
    };
    let refresher = match &registration {
        Registration::Files { paths } => Some(start_refresher(paths.clone())),
        Registration::Etcd { .. } => None,
    };
    eprintln!(
        "[loadgen] registered {} workers ({} ranks, {} records) in {} pools; warming up {:?}",
        config.shape.pools * config.shape.workers_per_pool,
        model.ranks.len(),
        records.len(),
        config.shape.pools,
        config.warmup
    );
    tokio::time::sleep(config.warmup).await;

    let result =
        publish(&config, &client, &mut model, &mut rng, &event_subjects, &load_subjects).await;
    let outcome = match result {
        Ok(counters) => finish(&config, &model, &endpoints, counters).await,
        Err(error) => Err(error),
    };
    if outcome.is_ok() && !config.linger.is_zero() {
        eprintln!("[loadgen] keeping the workers registered for {:?}", config.linger);
        linger(config.linger).await;
    }
    if let Some(refresher) = refresher {
        refresher.abort();
    }
    let unregistered = registration.unregister().await;
    let outcome = outcome?;
    unregistered?;
    Ok(outcome)
}

/// Sleep for `bound`, or less if SIGTERM or Ctrl-C arrives first: the records are then
/// unregistered as after a full linger (a fault-injection script ends a phase this way).
async fn linger(bound: Duration) {
    let sleep = tokio::time::sleep(bound);
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut terminate) = signal(SignalKind::terminate()) {
            tokio::select! {
                biased;
                _ = terminate.recv() => eprintln!("[loadgen] SIGTERM: ending the linger early"),
                _ = tokio::signal::ctrl_c() => eprintln!("[loadgen] Ctrl-C: ending the linger early"),
                () = sleep => {}
            }
            return;
        }
    }
    tokio::select! {
        biased;
        _ = tokio::signal::ctrl_c() => eprintln!("[loadgen] Ctrl-C: ending the linger early"),
        () = sleep => {}
    }
}

async fn finish(
    config: &RunConfig,
    model: &Model,
    endpoints: &[kvrelay_core::model::identity::EndpointPath],
    counters: Counters,
) -> Result<RunOutcome> {
    let pools = model
        .pools
        .iter()
        .zip(endpoints)
        .enumerate()
        .map(|(index, (keys, endpoint))| PoolTrace {
            endpoint: endpoint.to_string(),
            model: register::pool_model(index),
            live: keys.live_sorted(),
            removed: keys.removed_sorted(),
            removals: keys.removals,
            removed_sample_shift: keys.removed_shift(),
        })
        .collect();
    let trace = Trace { version: TRACE_VERSION, config: config.echo.clone(), counters, pools };
    trace.write(&config.trace)?;
    let live: usize = trace.pools.iter().map(|pool| pool.live.len()).sum();
    let removed: usize = trace.pools.iter().map(|pool| pool.removed.len()).sum();
    eprintln!(
        "[loadgen] trace {} written: {live} live keys, {removed} removed keys kept",
        config.trace.display()
    );
    let c = &trace.counters;
    eprintln!(
        "[loadgen] done: {} stored events in {:.2}s = {:.1}/s (asked {}), {} removed events, blocks stored {} removed {}, {} kv-events + {} kv_metrics messages, {} bytes, publish errors {}, skipped {}",
        c.stored_events,
        c.elapsed_secs,
        c.achieved_rate,
        config.rate,
        c.removed_events,
        c.blocks_stored,
        c.blocks_removed,
        c.event_messages,
        c.load_messages,
        c.bytes_published,
        c.publish_errors,
        c.skipped_events,
    );
    let verdict = match &config.verify {
        None => None,
        Some((address, options)) => {
            let verdict = verify::verify(address, &trace, *options).await?;
            // Reported now: the run may linger registered for a while before it returns.
            verify::report(&verdict);
            Some(verdict)
        }
    };
    Ok(RunOutcome { verdict })
}

/// The publishing loop: paced on the tokio clock, bounded catch-up, progress every second.
async fn publish(
    config: &RunConfig,
    client: &async_nats::Client,
    model: &mut Model,
    rng: &mut kvrelay_core::rng::RelayRng,
    event_subjects: &[async_nats::Subject],
    load_subjects: &[async_nats::Subject],
) -> Result<Counters> {
    let rate = config.rate;
    let total = (rate * config.duration.as_secs_f64()).round().max(1.0) as u64;
    let max_lag_events = ((rate * config.max_lag.as_secs_f64()) as u64).max(1);
    let mut counters = Counters::default();
    let mut load_sequences = vec![0u64; model.ranks.len()];
    let mut issued = 0u64;
    let start = Instant::now();
    let mut next_load = start;
    let mut next_progress = start + Duration::from_secs(1);
    let mut last_progress = (start, 0u64);
    while issued < total {
        let now = Instant::now();
        if now >= next_load {
            publish_loads(client, model, load_subjects, &mut load_sequences, &mut counters).await?;
            next_load = (next_load + config.load_interval).max(now);
        }
        if now >= next_progress {
            let (then, stored_then) = last_progress;
            let window = now.duration_since(then).as_secs_f64();
            eprintln!(
                "[loadgen] t={:.1}s stored events {} ({:.0}/s), blocks +{} -{}, messages {}, {:.1} MB, publish errors {}, skipped {}",
                now.duration_since(start).as_secs_f64(),
                counters.stored_events,
                (counters.stored_events - stored_then) as f64 / window,
                counters.blocks_stored,
                counters.blocks_removed,
                counters.event_messages + counters.load_messages,
                counters.bytes_published as f64 / 1e6,
                counters.publish_errors,
                counters.skipped_events,
            );
            last_progress = (now, counters.stored_events);
            next_progress += Duration::from_secs(1);
        }
        let due = ((now.duration_since(start).as_secs_f64() * rate) as u64 + 1).min(total);
        if due > issued + max_lag_events {
            let skip = due - issued - max_lag_events;
            counters.skipped_events += skip;
            issued += skip;
        }
        let mut burst = 0;
        while issued < due && burst < 256 {
            let step = model.step(rng);
            let stream = &mut model.ranks[step.rank];
            let payload = encode_kv_events_payload(&step.events).context("encoding KV events")?;
            let envelope = encode_event_envelope(&EventEnvelope {
                publisher_id: stream.publisher_id,
                sequence: stream.next_sequence,
                published_at_ms: SystemWallClock.now_unix_ms(),
                topic: KV_EVENTS_TOPIC,
                payload: &payload,
            })
            .context("encoding a kv-events envelope")?;
            stream.next_sequence += 1;
            counters.bytes_published += envelope.len() as u64;
            counters.event_messages += 1;
            counters.stored_events += 1;
            counters.blocks_stored += step.stored_blocks as u64;
            counters.blocks_removed += step.removed_blocks as u64;
            counters.removed_events += step
                .events
                .iter()
                .filter(|event| matches!(event.event.data, KvCacheEventData::Removed(_)))
                .count() as u64;
            let subject = event_subjects[stream.pool].clone();
            if client.publish(subject, Bytes::from(envelope)).await.is_err() {
                counters.publish_errors += 1;
            }
            issued += 1;
            burst += 1;
        }
        if issued >= due {
            let next_event = start + Duration::from_secs_f64(issued as f64 / rate);
            tokio::time::sleep_until(next_event.min(next_load).min(next_progress)).await;
        } else {
            tokio::task::yield_now().await;
        }
    }
    // A last load report with the final occupancy, then everything out to the server.
    publish_loads(client, model, load_subjects, &mut load_sequences, &mut counters).await?;
    if let Err(error) = client.flush().await {
        eprintln!("[loadgen] warning: the final NATS flush failed: {error}");
        counters.publish_errors += 1;
    }
    counters.elapsed_secs = start.elapsed().as_secs_f64();
    counters.achieved_rate = counters.stored_events as f64 / counters.elapsed_secs.max(1e-9);
    Ok(counters)
}

/// One `kv_metrics` report per rank: its live blocks as `kv_used_blocks`.
async fn publish_loads(
    client: &async_nats::Client,
    model: &Model,
    subjects: &[async_nats::Subject],
    sequences: &mut [u64],
    counters: &mut Counters,
) -> Result<()> {
    for (stream, sequence) in model.ranks.iter().zip(sequences.iter_mut()) {
        let payload = encode_active_load(&LoadObservation {
            source: SourceKey { worker_id: stream.worker_id, dp_rank: stream.dp_rank },
            kv_used_blocks: Some(stream.live_blocks() as u64),
            active_decode_blocks: Some(0),
            active_prefill_tokens: None,
        })
        .context("encoding a load report")?;
        let envelope = encode_event_envelope(&EventEnvelope {
            publisher_id: stream.publisher_id,
            sequence: *sequence,
            published_at_ms: SystemWallClock.now_unix_ms(),
            topic: KV_METRICS_TOPIC,
            payload: &payload,
        })
        .context("encoding a kv_metrics envelope")?;
        *sequence += 1;
        counters.load_messages += 1;
        counters.bytes_published += envelope.len() as u64;
        if client.publish(subjects[stream.pool].clone(), Bytes::from(envelope)).await.is_err() {
            counters.publish_errors += 1;
        }
    }
    Ok(())
}
