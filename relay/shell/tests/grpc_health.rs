//! gRPC health of `kvrelay serve` over loopback, read with a real `grpc.health.v1` client:
//! NOT_SERVING while `/ready` does not hold (here: the NATS event plane has no server yet),
//! SERVING once it does (a real `nats-server` comes up on the configured port), NOT_SERVING
//! from the start of shutdown, for `""` and for the relay's service name, through both Check
//! and Watch. Reflection lists the health service and resolves its symbol, as `grpcurl`
//! needs. Every wait is bounded.

mod fake_worker;
mod serve_setup;
mod servers;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use futures::StreamExt;
use kvrelay::config::{self, CliValues};
use serve_setup::{FileStore, bounded, http_get_async, start_options};
use servers::{NatsServer, free_port};
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

const SERVICE: &str = kvrelay_proto::SERVICE_NAME;
const WAIT: Duration = Duration::from_secs(30);

fn serve_config(store: &FileStore, nats_port: u16) -> config::RelayConfig {
    let cli = CliValues {
        dc_id: Some("dc-a".into()),
        bind: Some("127.0.0.1:0".into()),
        ops_bind: Some("127.0.0.1:0".into()),
        ..CliValues::default()
    };
    let environment: BTreeMap<String, String> = [
        ("DYN_DISCOVERY_BACKEND", "file".to_owned()),
        ("DYN_FILE_KV", store.root.display().to_string()),
        ("DYN_EVENT_PLANE", "nats".to_owned()),
        ("NATS_SERVER", format!("nats://127.0.0.1:{nats_port}")),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value))
    .collect();
    config::resolve(&cli, &environment).unwrap()
}

async fn client(address: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{address}")).unwrap().connect().await.unwrap()
}

async fn check(health: &mut HealthClient<Channel>, service: &str) -> i32 {
    let request = HealthCheckRequest { service: service.to_owned() };
    health.check(request).await.unwrap().into_inner().status
}

async fn next(
    watch: &mut tonic::Streaming<HealthCheckResponse>,
) -> Option<Result<i32, tonic::Status>> {
    tokio::time::timeout(WAIT, watch.next())
        .await
        .expect("no health update in time")
        .map(|item| item.map(|response| response.status))
}

const SERVING: i32 = ServingStatus::Serving as i32;
const NOT_SERVING: i32 = ServingStatus::NotServing as i32;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_serving_exactly_while_ready_and_not_serving_from_shutdown_on() {
    bounded(async {
        let store = FileStore::new();
        let nats_port = free_port();
        let relay =
            kvrelay::serve::start(serve_config(&store, nats_port), start_options(3)).await.unwrap();
        let wan = relay.wan_address.unwrap();
        let ops = relay.ops_address.unwrap();
        let channel = client(wan).await;
        let mut health = HealthClient::new(channel.clone());

        // No NATS server: `/ready` refuses, and so does health, for both names.
        assert_eq!(http_get_async(ops, "/ready").await.0, 503);
        assert_eq!(check(&mut health, "").await, NOT_SERVING);
        assert_eq!(check(&mut health, SERVICE).await, NOT_SERVING);
        let unknown = health
            .check(HealthCheckRequest { service: "no.such.Service".into() })
            .await
            .unwrap_err();
        assert_eq!(unknown.code(), tonic::Code::NotFound);
        let mut watch_all =
            health.watch(HealthCheckRequest { service: String::new() }).await.unwrap().into_inner();
        let mut watch_relay = health
            .watch(HealthCheckRequest { service: SERVICE.into() })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(next(&mut watch_all).await.unwrap().unwrap(), NOT_SERVING);
        assert_eq!(next(&mut watch_relay).await.unwrap().unwrap(), NOT_SERVING);

        // The event plane's server comes up: the relay becomes ready and health follows.
        let nats = NatsServer::start_on(nats_port).await;
        assert_eq!(next(&mut watch_all).await.unwrap().unwrap(), SERVING);
        assert_eq!(next(&mut watch_relay).await.unwrap().unwrap(), SERVING);
        assert_eq!(http_get_async(ops, "/ready").await.0, 200);
        assert_eq!(check(&mut health, "").await, SERVING);
        assert_eq!(check(&mut health, SERVICE).await, SERVING);

        // Shutdown: NOT_SERVING first, then the watch streams end.
        let stopping = kvrelay::runtime::spawn(relay.shutdown());
        assert_eq!(next(&mut watch_all).await.unwrap().unwrap(), NOT_SERVING);
        assert_eq!(next(&mut watch_relay).await.unwrap().unwrap(), NOT_SERVING);
        for watch in [&mut watch_all, &mut watch_relay] {
            match next(watch).await {
                None => {}
                Some(Err(status)) => assert_eq!(status.code(), tonic::Code::Unavailable),
                Some(Ok(status)) => panic!("a health update after NOT_SERVING: {status}"),
            }
        }
        tokio::time::timeout(WAIT, stopping).await.unwrap().unwrap().unwrap();
        drop(nats);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_lists_and_resolves_the_health_service() {
    bounded(async {
        let store = FileStore::new();
        let relay = kvrelay::serve::start(serve_config(&store, free_port()), start_options(4))
            .await
            .unwrap();
        let mut reflection = ServerReflectionClient::new(client(relay.wan_address.unwrap()).await);
        let ask = |request: MessageRequest| ServerReflectionRequest {
            host: String::new(),
            message_request: Some(request),
        };
        let requests = futures::stream::iter([
            ask(MessageRequest::ListServices(String::new())),
            ask(MessageRequest::FileContainingSymbol("grpc.health.v1.Health".into())),
            ask(MessageRequest::FileContainingSymbol("grpc.health.v1.NoSuch".into())),
        ]);
        let mut answers = reflection.server_reflection_info(requests).await.unwrap().into_inner();
        let Some(MessageResponse::ListServicesResponse(list)) =
            answers.next().await.unwrap().unwrap().message_response
        else {
            panic!("ListServices answered with something else");
        };
        let names: Vec<String> = list.service.into_iter().map(|service| service.name).collect();
        for expected in [SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"] {
            assert!(names.iter().any(|name| name == expected), "{expected} missing from {names:?}");
        }
        let Some(MessageResponse::FileDescriptorResponse(files)) =
            answers.next().await.unwrap().unwrap().message_response
        else {
            panic!("the health symbol did not resolve to a file");
        };
        assert!(!files.file_descriptor_proto.is_empty());
        // An unknown symbol does not resolve (tonic's reflection ends the stream with NOT_FOUND).
        match answers.next().await.unwrap() {
            Err(status) => assert_eq!(status.code(), tonic::Code::NotFound),
            Ok(answer) => assert!(
                matches!(answer.message_response, Some(MessageResponse::ErrorResponse(_))),
                "an unknown symbol must not resolve: {answer:?}"
            ),
        }
        relay.shutdown().await.unwrap();
    })
    .await;
}
