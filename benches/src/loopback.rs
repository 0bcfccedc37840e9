//! Plumbing of the loopback measuring binaries (`fanout`, `latency`): the relay's real gRPC
//! service on 127.0.0.1, raw subscribers that check and apply every pool frame exactly as a
//! consumer does, single-thread runtimes with names so that CPU time can be split between the
//! relay side and the client side, and CPU time read from `/proc`.

use std::net::SocketAddr;
use std::time::Duration;

use kvrelay::config::WanTuning;
use kvrelay::wan::{RelayService, serve};
use kvrelay_core::filter::FilterReplica;
use kvrelay_core::model::identity::ProducerIdentity;
use kvrelay_core::wire::{FilterStreamGuard, encode};
use kvrelay_proto::CONTRACT_MARKER;
use kvrelay_proto::v1 as proto;
use kvrelay_proto::v1::kv_event_relay_client::KvEventRelayClient;
use tokio::net::TcpListener;
use tokio::runtime::Runtime;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::Streaming;
use tonic::transport::Channel;

/// Largest message a client decodes (a full snapshot chunk plus headers).
pub const MAX_MESSAGE_BYTES: usize = 8 << 20;

/// Thread name of the relay side's runtime (node and its pools, hubs, gRPC server).
pub const RELAY_THREADS: &str = "kvr-relay";
/// Thread name of the client side's runtime (subscribers).
pub const CLIENT_THREADS: &str = "kvr-client";

/// A runtime with one worker thread; its threads (blocking ones included) are named `name`.
///
/// # Panics
/// If the OS refuses the thread.
#[must_use]
pub fn runtime(name: &str) -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(name)
        .enable_all()
        .build()
        .expect("a runtime")
}

/// Serve `service` on an ephemeral loopback port until the returned sender is dropped or
/// fired. Must run inside a runtime (the server task is spawned on it).
///
/// # Panics
/// If no loopback port can be bound.
pub async fn serve_loopback(
    service: RelayService,
    tuning: WanTuning,
) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("a loopback port");
    let address = listener.local_addr().expect("a bound address");
    let (shutdown, stop) = tokio::sync::oneshot::channel::<()>();
    kvrelay::runtime::spawn(async move {
        let _ = serve(service, TcpListenerStream::new(listener), &tuning, async {
            let _ = stop.await;
        })
        .await;
    });
    (address, shutdown)
}

/// A client on its own HTTP/2 connection (as a separate consumer process would have).
///
/// # Panics
/// If the relay does not accept the connection.
pub async fn client(address: SocketAddr) -> KvEventRelayClient<Channel> {
    KvEventRelayClient::connect(format!("http://{address}"))
        .await
        .expect("the relay accepts")
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
}

/// One pool stream and the replica it builds; every frame is checked against the expected
/// producer and applied, as the reference consumer does.
pub struct PoolFollower {
    stream: Streaming<proto::FilterUpdate>,
    guard: FilterStreamGuard,
    /// The replica built from the stream.
    pub replica: FilterReplica,
}

/// What ended or broke a pool stream.
#[derive(Debug)]
pub enum FollowError {
    /// The relay ended the stream.
    Status(tonic::Status),
    /// The stream ended without a status.
    Ended,
    /// A frame failed the consumer's checks.
    Invalid(String),
}

impl PoolFollower {
    /// Subscribe to `producer` and install its complete snapshot.
    ///
    /// # Errors
    /// If the subscription is refused or the snapshot does not arrive intact.
    pub async fn open(
        client: &mut KvEventRelayClient<Channel>,
        producer: &ProducerIdentity,
        subscriber_id: &str,
    ) -> Result<Self, FollowError> {
        let request = proto::SubscribeKvPoolRequest {
            subscriber_id: subscriber_id.into(),
            expected_producer: Some(encode::producer(producer)),
            contract_marker: CONTRACT_MARKER,
        };
        let stream =
            client.subscribe_kv_pool(request).await.map_err(FollowError::Status)?.into_inner();
        let replica = FilterReplica::new(producer.format(), producer.pool_id().dc_id.0)
            .map_err(|error| FollowError::Invalid(error.to_string()))?;
        let mut follower =
            PoolFollower { stream, guard: FilterStreamGuard::new(*producer), replica };
        while follower.replica.sequence().is_none() {
            follower.next().await?;
        }
        Ok(follower)
    }

    /// Apply the next chunk or delta (heartbeats are skipped); its CBI1 payload length.
    ///
    /// # Errors
    /// If the stream ends or a frame fails the checks.
    pub async fn next(&mut self) -> Result<usize, FollowError> {
        loop {
            let update = self
                .stream
                .message()
                .await
                .map_err(FollowError::Status)?
                .ok_or(FollowError::Ended)?;
            if update.kind == proto::FilterUpdateKind::Heartbeat as i32 {
                continue;
            }
            let checked = self
                .guard
                .check(&update)
                .map_err(|error| FollowError::Invalid(error.to_string()))?;
            self.replica
                .accept(checked.frame)
                .map_err(|error| FollowError::Invalid(error.to_string()))?;
            return Ok(update.payload.len());
        }
    }

    /// The replica's sequence (0 before the snapshot is complete).
    #[must_use]
    pub fn sequence(&self) -> u64 {
        self.replica.sequence().unwrap_or(0)
    }
}

/// Linux reports CPU time in ticks of 1/100 s (`USER_HZ`, fixed by the kernel ABI).
const TICKS_PER_SECOND: f64 = 100.0;

/// User + system CPU seconds of one `/proc/.../stat` line (fields 14 and 15, counted after the
/// parenthesised command name, which may itself contain spaces).
fn stat_cpu_seconds(stat: &str) -> Option<(String, f64)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let name = stat.get(open + 1..close)?.to_owned();
    let mut fields = stat.get(close + 1..)?.split_whitespace();
    let user: u64 = fields.nth(11)?.parse().ok()?;
    let system: u64 = fields.next()?.parse().ok()?;
    Some((name, (user + system) as f64 / TICKS_PER_SECOND))
}

/// CPU seconds of the whole process so far (every thread, exited ones included).
#[must_use]
pub fn process_cpu_seconds() -> f64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| stat_cpu_seconds(&stat))
        .map_or(0.0, |(_, seconds)| seconds)
}

/// CPU seconds of this process's live threads whose name starts with `prefix`.
#[must_use]
pub fn thread_cpu_seconds(prefix: &str) -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return 0.0 };
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| std::fs::read_to_string(task.path().join("stat")).ok())
        .filter_map(|stat| stat_cpu_seconds(&stat))
        .filter(|(name, _)| name.starts_with(prefix))
        .map(|(_, seconds)| seconds)
        .sum()
}

/// CPU seconds at one instant: relay threads, client threads, whole process.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuSample {
    /// Threads named [`RELAY_THREADS`].
    pub relay: f64,
    /// Threads named [`CLIENT_THREADS`].
    pub clients: f64,
    /// The whole process.
    pub process: f64,
}

impl CpuSample {
    /// Read now.
    #[must_use]
    pub fn now() -> Self {
        CpuSample {
            relay: thread_cpu_seconds(RELAY_THREADS),
            clients: thread_cpu_seconds(CLIENT_THREADS),
            process: process_cpu_seconds(),
        }
    }

    /// CPU spent since `earlier`.
    #[must_use]
    pub fn since(&self, earlier: &CpuSample) -> CpuSample {
        CpuSample {
            relay: self.relay - earlier.relay,
            clients: self.clients - earlier.clients,
            process: self.process - earlier.process,
        }
    }
}

/// The `q`-quantile (0..=1) of sorted samples, nearest rank.
#[must_use]
pub fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_with_spaces_in_the_name_parse() {
        let line = "4242 (kvr relay) S 1 2 3 4 5 6 7 8 9 10 250 75 0 0 20 0 3 0";
        let (name, seconds) = stat_cpu_seconds(line).unwrap();
        assert_eq!(name, "kvr relay");
        assert!((seconds - 3.25).abs() < 1e-9, "{seconds}");
    }

    #[test]
    fn quantiles_use_the_nearest_rank() {
        let samples: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(quantile(&samples, 0.5), Duration::from_millis(50));
        assert_eq!(quantile(&samples, 0.99), Duration::from_millis(99));
        assert_eq!(quantile(&samples, 1.0), Duration::from_millis(100));
        assert_eq!(quantile(&[], 0.5), Duration::ZERO);
    }
}
