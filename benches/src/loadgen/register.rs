//! The discovery records a Dynamo worker writes (dc-inputs §1.3, §3.1; dynamo-live §9.1), for
//! the file backend (one file per key under `DYN_FILE_KV`, its modification time refreshed as
//! the owning process does) and for etcd (the logical keys under one lease).
//!
//! Per worker: its endpoint instance and base card (`data_parallel_size` = ranks, no local
//! indexer, so every rank is live-only); per rank: an `EventSource` advertisement and the NATS
//! `EventChannel` of its publisher. The JSON is the shape the relay's real-process tests write
//! (`relay/shell/tests/serve_setup`), keys come from [`DiscoveryKey`].

use std::path::{Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

use anyhow::{Context, Result};
use kvrelay::discovery_plane::{EtcdClient, EtcdConnectOptions};
use kvrelay::runtime::{SystemWallClock, WallClock};
use kvrelay_core::inputs::{
    CardInstanceId, DiscoveryKey, EventRecordKey, KV_EVENTS_TOPIC, event_subject_prefix,
};
use kvrelay_core::model::identity::EndpointPath;
use serde_json::{Value, json};

use super::shape::RankStream;

/// Tokens per KV block of every generated pool.
pub const BLOCK_SIZE: u64 = 16;
/// KV blocks per rank the cards advertise.
pub const TOTAL_KV_BLOCKS: u64 = 1_000_000;

/// The serving endpoint of pool `index`.
pub fn pool_endpoint(namespace: &str, index: usize) -> Result<EndpointPath> {
    EndpointPath::new(namespace, "backend", format!("generate{index}"))
        .with_context(|| format!("namespace {namespace:?} does not make an endpoint path"))
}

/// The model (display name and slug) served by pool `index`.
pub fn pool_model(index: usize) -> String {
    format!("loadgen-model-{index}")
}

/// Every record the generated workers write: (key, JSON value).
pub fn records(
    endpoints: &[EndpointPath],
    ranks: &[RankStream],
    dp_size: u32,
) -> Vec<(DiscoveryKey, String)> {
    let mut out = Vec::new();
    for stream in ranks {
        let endpoint = &endpoints[stream.pool];
        let (n, c, e) = (endpoint.namespace(), endpoint.component(), endpoint.endpoint());
        if stream.dp_rank == 0 {
            let instance = json!({
                "type": "Endpoint", "component": c, "endpoint": e, "namespace": n,
                "instance_id": stream.worker_id,
                "transport": {"tcp": format!("127.0.0.1:9/{:x}/{n}/{c}/{e}", stream.worker_id)},
                "device_type": "cuda", "request_plane_codec": "msgpack",
            });
            out.push((
                DiscoveryKey::Instance {
                    endpoint: endpoint.clone(),
                    instance_id: stream.worker_id,
                },
                instance.to_string(),
            ));
            out.push((
                DiscoveryKey::Model(CardInstanceId {
                    endpoint: endpoint.clone(),
                    instance_id: stream.worker_id,
                    model_suffix: None,
                }),
                card(endpoint, stream.pool, stream.worker_id, dp_size).to_string(),
            ));
        }
        let scope =
            json!({"kind": "endpoint", "endpoint": {"namespace": n, "component": c, "name": e}});
        let source = json!({
            "type": "EventSource", "scope": scope, "topic": KV_EVENTS_TOPIC,
            "publisher_id": stream.publisher_id,
            "metadata": {
                "kv_state_endpoint": {"namespace": n, "component": c, "name": e},
                "worker": {"worker_id": stream.worker_id, "dp_rank": stream.dp_rank},
                "publisher_id": stream.publisher_id,
            },
        });
        let channel = json!({
            "type": "EventChannel", "scope": scope, "topic": KV_EVENTS_TOPIC,
            "instance_id": stream.publisher_id,
            "transport": {"kind": "Nats", "config": {"subject_prefix": event_subject_prefix(endpoint)}},
        });
        let key = EventRecordKey {
            scope: endpoint.clone(),
            topic: KV_EVENTS_TOPIC.to_owned(),
            publisher_id: stream.publisher_id,
        };
        out.push((DiscoveryKey::EventSource(key.clone()), source.to_string()));
        out.push((DiscoveryKey::EventChannel(key), channel.to_string()));
    }
    out
}

fn card(endpoint: &EndpointPath, pool: usize, worker_id: u64, dp_size: u32) -> Value {
    let model = pool_model(pool);
    json!({
        "type": "Model",
        "namespace": endpoint.namespace(), "component": endpoint.component(),
        "endpoint": endpoint.endpoint(), "instance_id": worker_id,
        "card_json": {
            "display_name": model, "slug": model,
            "source_path": format!("/tmp/loadgen/models/{model}"),
            "kv_cache_block_size": BLOCK_SIZE, "context_length": 8192,
            "model_type": "Chat | Completions", "model_input": "Tokens",
            "worker_type": "aggregated", "needs": [],
            "runtime_config": {
                "total_kv_blocks": TOTAL_KV_BLOCKS, "max_num_seqs": 256,
                "max_num_batched_tokens": 8192, "data_parallel_start_rank": 0,
                "data_parallel_size": dp_size, "enable_local_indexer": false,
                "kv_event_publishing_enabled": true, "enable_eagle": false,
            },
            "migration_limit": 0,
        },
    })
}

/// Where the records live while the generator runs.
pub enum Registration {
    /// Files under a `DYN_FILE_KV` root, refreshed by [`Registration::refresh`].
    Files {
        /// The written files.
        paths: Vec<PathBuf>,
    },
    /// Keys under one etcd lease.
    Etcd {
        /// The client that wrote them.
        client: Box<EtcdClient>,
        /// The lease every key is attached to.
        lease: i64,
    },
}

impl Registration {
    /// Write every record as files under `root`.
    pub fn files(root: &Path, records: &[(DiscoveryKey, String)]) -> Result<Self> {
        let mut paths = Vec::with_capacity(records.len());
        for (key, value) in records {
            let path = root.join(key.file_path());
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)
                    .with_context(|| format!("creating {}", parent.display()))?;
            }
            // Written beside as a dot file (the relay skips those) and renamed: a poll never
            // reads a half-written record.
            let name = path.file_name().map(|name| name.to_string_lossy().into_owned());
            let temporary = path.with_file_name(format!(".{}.tmp", name.unwrap_or_default()));
            std::fs::write(&temporary, value)
                .with_context(|| format!("writing {}", temporary.display()))?;
            std::fs::rename(&temporary, &path).with_context(|| {
                format!("renaming {} to {}", temporary.display(), path.display())
            })?;
            paths.push(path);
        }
        Ok(Registration::Files { paths })
    }

    /// Put every record into etcd at `endpoint` under a fresh lease of `ttl`. The lease is not
    /// kept alive (the relay's etcd client has no keep-alive call): the TTL must cover the run.
    pub async fn etcd(
        endpoint: &str,
        ttl: Duration,
        records: &[(DiscoveryKey, String)],
    ) -> Result<Self> {
        let options = EtcdConnectOptions {
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            ..EtcdConnectOptions::default()
        };
        let mut client = EtcdClient::connect(endpoint, &options)
            .await
            .with_context(|| format!("connecting to etcd at {endpoint}"))?;
        let ttl_secs = i64::try_from(ttl.as_secs().max(10)).context("lease TTL too long")?;
        let lease = client.lease_grant(ttl_secs).await.context("granting the etcd lease")?;
        for (key, value) in records {
            let key = key.key_path();
            client
                .put(key.as_bytes(), value.as_bytes(), lease)
                .await
                .with_context(|| format!("putting {key}"))?;
        }
        Ok(Registration::Etcd { client: Box::new(client), lease })
    }

    /// Touch every file with the current time (a live owner's refresh); etcd needs nothing.
    /// Returns the number of files that could not be touched.
    pub fn refresh(&self) -> usize {
        let Registration::Files { paths } = self else { return 0 };
        let now = UNIX_EPOCH + Duration::from_micros(SystemWallClock.now_unix_us());
        paths
            .iter()
            .filter(|path| {
                std::fs::File::options()
                    .write(true)
                    .open(path)
                    .and_then(|file| file.set_modified(now))
                    .is_err()
            })
            .count()
    }

    /// Remove every record (files deleted, the lease revoked), as a clean shutdown does.
    pub async fn unregister(self) -> Result<()> {
        match self {
            Registration::Files { paths } => {
                for path in paths {
                    match std::fs::remove_file(&path) {
                        Ok(()) => {}
                        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                        Err(error) => {
                            return Err(error)
                                .with_context(|| format!("removing {}", path.display()));
                        }
                    }
                }
            }
            Registration::Etcd { mut client, lease } => {
                client.lease_revoke(lease).await.context("revoking the etcd lease")?;
            }
        }
        Ok(())
    }
}
