//! The Kubernetes manifests of `docs/kubernetes/` checked against the binary they deploy:
//! `kvrelay.yaml` (the relay's WAN listener on the pod's network) and `kvrelay-mtls-sidecar.yaml`
//! (the WAN listener on loopback behind an mTLS-terminating Envoy sidecar). For both:
//!
//! - every environment variable of the relay's container is one `kvrelay serve` reads: the
//!   manifest's environment resolves to a valid configuration, and removing any one variable
//!   changes it;
//! - the probes use paths the ops listener serves and the port it binds, which is not loopback;
//!   the Service and the Prometheus annotations point at the listeners' ports;
//! - the Role grants `list`/`watch` on exactly the resources the Kubernetes discovery backend
//!   requests, nothing broader, and is bound to the Deployment's service account;
//! - the objects are valid against the Kubernetes API's schemas (when the validator is
//!   installed).
//!
//! For the sidecar layout also: the relay's WAN listener is loopback and plaintext; the sidecar
//! is a native sidecar (stopped after the relay), forwards to exactly that address, listens on
//! the port the Service's WAN port reaches, requires client certificates from files of a Secret
//! volume, offers ALPN `h2` and does not close idle connections within the relay's keepalive;
//! its ServiceAccount, Role and RoleBinding are kvrelay.yaml's, unchanged (the two files are
//! alternatives).
//!
//! Each check is a function of the parsed manifest returning what is wrong, and a test shows
//! each one firing on a broken copy of the manifests.

mod pki;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use kvrelay::config::{CliValues, RelayConfig, resolve};
use kvrelay::discovery_plane::{ApiAccess, DiscoveryBackend, KubeDiscoveryConfig};
use kvrelay::ops::{LIVE_PATH, METRICS_PATH, OPS_PATHS, READY_PATH};
use serde::Deserialize;
use serde_yaml::Value;

/// How a manifest exposes the relay's WAN listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WanExposure {
    /// The relay's container port, straight from the Service.
    Direct,
    /// Loopback only, behind the `mtls-proxy` sidecar.
    MtlsSidecar,
}

/// One manifest file and the layout it promises.
struct Manifest {
    path: &'static str,
    text: &'static str,
    wan: WanExposure,
    kinds: &'static [&'static str],
}

const KVRELAY: Manifest = Manifest {
    path: "docs/kubernetes/kvrelay.yaml",
    text: include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/kubernetes/kvrelay.yaml")),
    wan: WanExposure::Direct,
    kinds: &["ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"],
};

const MTLS_SIDECAR: Manifest = Manifest {
    path: "docs/kubernetes/kvrelay-mtls-sidecar.yaml",
    text: include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/kubernetes/kvrelay-mtls-sidecar.yaml"
    )),
    wan: WanExposure::MtlsSidecar,
    kinds: &["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment", "Service"],
};

const MANIFESTS: [&Manifest; 2] = [&KVRELAY, &MTLS_SIDECAR];

/// The relay's container and the sidecar's, by name.
const RELAY_CONTAINER: &str = "kvrelay";
const SIDECAR_CONTAINER: &str = "mtls-proxy";

static NULL: Value = Value::Null;

/// Stand-ins for what the kubelet provides: downward-API fields, and the in-cluster API (whose
/// service-account CA this machine lacks, so the API is named by URL).
fn field_value(path: &str) -> Option<&'static str> {
    match path {
        "metadata.namespace" => Some("dynamo"),
        "metadata.uid" => Some("3f1c9a52-0d7e-4b8e-9a41-6c2b8d1e7f00"),
        "metadata.name" => Some("kvrelay-7d9f-abcde"),
        _ => None,
    }
}
const IN_CLUSTER: [(&str, &str); 1] = [("KVRELAY_KUBE_API_URL", "http://127.0.0.1:6443")];

fn documents(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|document| Value::deserialize(document).expect("manifest is YAML"))
        .collect()
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = docs.iter().filter(|doc| doc["kind"].as_str() == Some(kind)).collect();
    assert_eq!(found.len(), 1, "exactly one {kind}");
    found[0]
}

fn text(value: &Value) -> &str {
    value.as_str().unwrap_or("")
}

fn pod_spec(docs: &[Value]) -> &Value {
    &of_kind(docs, "Deployment")["spec"]["template"]["spec"]
}

/// The pod's containers, native sidecars (restartable init containers) included.
fn pod_containers(docs: &[Value]) -> impl Iterator<Item = &Value> {
    let spec = pod_spec(docs);
    ["initContainers", "containers"]
        .into_iter()
        .flat_map(move |field| spec[field].as_sequence().into_iter().flatten())
}

/// The container called `name`, or null.
fn container_named<'a>(docs: &'a [Value], name: &str) -> &'a Value {
    pod_containers(docs).find(|container| text(&container["name"]) == name).unwrap_or(&NULL)
}

/// The relay's container.
fn container(docs: &[Value]) -> &Value {
    container_named(docs, RELAY_CONTAINER)
}

/// The container's environment with downward-API values filled in; `Err` names an entry that
/// has neither a value nor a known field reference.
fn environment(docs: &[Value]) -> Result<BTreeMap<String, String>, String> {
    let mut env = BTreeMap::new();
    for entry in container(docs)["env"].as_sequence().ok_or("no env")? {
        let name = text(&entry["name"]).to_owned();
        let value =
            match (entry["value"].as_str(), entry["valueFrom"]["fieldRef"]["fieldPath"].as_str()) {
                (Some(value), _) => value.to_owned(),
                (None, Some(path)) => {
                    field_value(path).ok_or(format!("{name}: unknown field {path}"))?.to_owned()
                }
                _ => return Err(format!("{name}: neither value nor fieldRef")),
            };
        if env.insert(name.clone(), value).is_some() {
            return Err(format!("{name} is set twice"));
        }
    }
    Ok(env)
}

fn resolved(env: &BTreeMap<String, String>) -> Result<RelayConfig, String> {
    let mut with_cluster = env.clone();
    for (name, value) in IN_CLUSTER {
        with_cluster.entry(name.to_owned()).or_insert_with(|| value.to_owned());
    }
    resolve(&CliValues::default(), &with_cluster).map_err(|error| error.to_string())
}

/// Variables a manifest may set for the C library, not for the relay's configuration (the
/// binary pins glibc's mmap threshold itself unless this one is set; `kvrelay_allocator`).
const READ_BY_THE_C_LIBRARY: [&str; 1] = ["MALLOC_MMAP_THRESHOLD_"];

/// Variables of the manifest the relay does not read (removing them changes nothing), or why
/// the environment does not resolve at all.
fn unread_variables(docs: &[Value]) -> Result<Vec<String>, String> {
    let args: Vec<&str> =
        container(docs)["args"].as_sequence().ok_or("no args")?.iter().map(text).collect();
    if args != ["serve"] {
        return Err(format!("args {args:?} are not [\"serve\"]"));
    }
    let env = environment(docs)?;
    let full = resolved(&env)?;
    Ok(env
        .keys()
        .filter(|name| !READ_BY_THE_C_LIBRARY.contains(&name.as_str()))
        .filter(|name| {
            let mut without = env.clone();
            without.remove(*name);
            resolved(&without).as_ref() == Ok(&full)
        })
        .cloned()
        .collect())
}

/// The port named `name` of any container of the pod (a Service's named `targetPort` is looked
/// up the same way).
fn container_port(docs: &[Value], name: &str) -> Option<u16> {
    pod_containers(docs)
        .flat_map(|container| container["ports"].as_sequence().into_iter().flatten())
        .find(|port| text(&port["name"]) == name)
        .and_then(|port| port["containerPort"].as_u64())
        .and_then(|port| u16::try_from(port).ok())
}

/// Whether `container` declares the port numbered `port`.
fn declares_port(container: &Value, port: u16) -> bool {
    container["ports"]
        .as_sequence()
        .into_iter()
        .flatten()
        .any(|declared| declared["containerPort"].as_u64() == Some(u64::from(port)))
}

/// A port reference (name or number) as a number.
fn port_number(docs: &[Value], reference: &Value) -> Option<u16> {
    match reference {
        Value::Number(number) => number.as_u64().and_then(|port| u16::try_from(port).ok()),
        Value::String(name) => container_port(docs, name),
        _ => None,
    }
}

/// What is wrong with the probes, ports, Service and scrape annotations, given how the WAN
/// listener is meant to be exposed.
fn listener_problems(docs: &[Value], wan: WanExposure) -> Vec<String> {
    let mut problems = Vec::new();
    let config = match environment(docs).and_then(|env| resolved(&env)) {
        Ok(config) => config,
        Err(error) => return vec![error],
    };
    let ops: Option<SocketAddr> = config.ops_bind;
    let Some(ops) = ops else { return vec!["the ops listener is off".into()] };
    if !ops.ip().is_unspecified() {
        problems.push(format!("ops listener {ops} is not reachable from the kubelet"));
    }
    if container_port(docs, "ops") != Some(ops.port()) {
        problems.push(format!("container port ops is not {}", ops.port()));
    }
    match wan {
        WanExposure::Direct => match config.bind {
            Some(wan) if container_port(docs, "grpc") == Some(wan.port()) => {}
            other => {
                problems.push(format!("container port grpc does not match the WAN bind {other:?}"))
            }
        },
        WanExposure::MtlsSidecar => problems.extend(sidecar_problems(docs, &config)),
    }
    for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
        let get = &container(docs)[probe]["httpGet"];
        let path = text(&get["path"]);
        if !OPS_PATHS.contains(&path) {
            problems.push(format!("{probe} path {path:?} is not served by the ops listener"));
        }
        if port_number(docs, &get["port"]) != Some(ops.port()) {
            problems.push(format!("{probe} port is not the ops port"));
        }
    }
    if text(&container(docs)["readinessProbe"]["httpGet"]["path"]) != READY_PATH {
        problems.push("readinessProbe must use /ready".into());
    }
    if text(&container(docs)["livenessProbe"]["httpGet"]["path"]) != LIVE_PATH {
        problems.push(
            "livenessProbe must use /live (a failing /health would restart a draining relay)"
                .into(),
        );
    }
    let annotations = &of_kind(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"];
    if text(&annotations["prometheus.io/port"]) != ops.port().to_string()
        || text(&annotations["prometheus.io/path"]) != METRICS_PATH
    {
        problems.push("Prometheus annotations do not point at the ops /metrics".into());
    }
    for port in of_kind(docs, "Service")["spec"]["ports"].as_sequence().into_iter().flatten() {
        if port_number(docs, &port["targetPort"]).is_none() {
            problems.push(format!("Service port {:?} targets no container port", port["name"]));
        }
    }
    problems
}

/// The sidecar's Envoy configuration: the ConfigMap entry mounted where its `-c` argument
/// points.
fn sidecar_config(docs: &[Value]) -> Result<Value, String> {
    let sidecar = container_named(docs, SIDECAR_CONTAINER);
    let args: Vec<&str> = sidecar["args"]
        .as_sequence()
        .ok_or(format!("no {SIDECAR_CONTAINER} container with args"))?
        .iter()
        .map(text)
        .collect();
    let path = args
        .windows(2)
        .find(|pair| pair[0] == "-c" || pair[0] == "--config-path")
        .map(|pair| Path::new(pair[1]))
        .ok_or("the sidecar names no config file (-c)")?;
    let (Some(directory), Some(file)) = (path.parent(), path.file_name().and_then(|f| f.to_str()))
    else {
        return Err(format!("the sidecar's config path {path:?} is not a file in a directory"));
    };
    let mount = sidecar["volumeMounts"]
        .as_sequence()
        .into_iter()
        .flatten()
        .find(|mount| Path::new(text(&mount["mountPath"])) == directory)
        .ok_or(format!("nothing is mounted at {directory:?}, where the sidecar's config is"))?;
    let config_map = text(&volume(docs, text(&mount["name"]))["configMap"]["name"]);
    let entry = docs
        .iter()
        .find(|doc| {
            text(&doc["kind"]) == "ConfigMap" && text(&doc["metadata"]["name"]) == config_map
        })
        .and_then(|doc| doc["data"][file].as_str())
        .ok_or(format!("no ConfigMap {config_map:?} with {file:?} for the sidecar's config"))?;
    serde_yaml::from_str(entry).map_err(|error| format!("the sidecar's config: {error}"))
}

/// The pod volume called `name`, or null.
fn volume<'a>(docs: &'a [Value], name: &str) -> &'a Value {
    pod_spec(docs)["volumes"]
        .as_sequence()
        .into_iter()
        .flatten()
        .find(|volume| text(&volume["name"]) == name)
        .unwrap_or(&NULL)
}

/// Where the sidecar's Secret volumes are mounted.
fn sidecar_secret_mounts(docs: &[Value]) -> Vec<&str> {
    container_named(docs, SIDECAR_CONTAINER)["volumeMounts"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter(|mount| !volume(docs, text(&mount["name"]))["secret"]["secretName"].is_null())
        .map(|mount| text(&mount["mountPath"]))
        .collect()
}

/// An Envoy `socket_address`.
fn socket_address(address: &Value) -> Option<SocketAddr> {
    let ip: IpAddr = text(&address["address"]).parse().ok()?;
    let port = u16::try_from(address["port_value"].as_u64()?).ok()?;
    Some(SocketAddr::new(ip, port))
}

/// An Envoy duration (`"3600s"`, `"0.5s"`).
fn envoy_duration(value: &Value) -> Option<Duration> {
    let seconds: f64 = text(value).strip_suffix('s')?.parse().ok()?;
    Duration::try_from_secs_f64(seconds).ok()
}

/// What is wrong with the WAN path of the sidecar layout: consumers must reach the relay only
/// through the sidecar, which must require their certificates and carry gRPC unharmed.
fn sidecar_problems(docs: &[Value], config: &RelayConfig) -> Vec<String> {
    let mut problems = Vec::new();
    let relay = match config.bind {
        Some(bind) if bind.ip().is_loopback() => bind,
        other => {
            return vec![format!(
                "the relay's WAN listener {other:?} is not loopback: consumers could bypass the sidecar"
            )];
        }
    };
    if config.wan_tls.is_some() {
        problems.push("the relay serves TLS itself behind the TLS-terminating sidecar".into());
    }
    // A native sidecar: started before the relay, stopped after it has drained. A plain init
    // container would have to exit before the relay starts.
    let native_sidecar =
        pod_spec(docs)["initContainers"].as_sequence().into_iter().flatten().any(|init| {
            text(&init["name"]) == SIDECAR_CONTAINER && text(&init["restartPolicy"]) == "Always"
        });
    if !native_sidecar {
        problems.push(format!(
            "{SIDECAR_CONTAINER} is not an init container with restartPolicy Always (a native sidecar)"
        ));
    }
    let envoy = match sidecar_config(docs) {
        Ok(envoy) => envoy,
        Err(error) => return vec![error],
    };
    let listeners =
        envoy["static_resources"]["listeners"].as_sequence().cloned().unwrap_or_default();
    let [listener] = listeners.as_slice() else {
        return vec![format!("the sidecar has {} listeners, not one", listeners.len())];
    };
    let chains = listener["filter_chains"].as_sequence().cloned().unwrap_or_default();
    let [chain] = chains.as_slice() else {
        return vec![format!("the sidecar's listener has {} filter chains, not one", chains.len())];
    };

    // Where the sidecar listens: the pod's network, on the port the Service's WAN port reaches.
    let Some(listen) = socket_address(&listener["address"]["socket_address"]) else {
        return vec!["the sidecar's listener has no socket address".into()];
    };
    if listen.ip().is_loopback() {
        problems.push(format!("the sidecar listens on {listen}, unreachable from other pods"));
    }
    if !declares_port(container_named(docs, SIDECAR_CONTAINER), listen.port()) {
        problems.push(format!("the sidecar listens on {} but does not declare it", listen.port()));
    }
    let service_ports = of_kind(docs, "Service")["spec"]["ports"].as_sequence().cloned();
    let grpc: Vec<Value> = service_ports
        .unwrap_or_default()
        .into_iter()
        .filter(|port| text(&port["appProtocol"]) == "grpc")
        .collect();
    match grpc.as_slice() {
        [port] if port_number(docs, &port["targetPort"]) == Some(listen.port()) => {}
        _ => problems.push(format!(
            "the Service's WAN port (appProtocol grpc) does not target the sidecar's {}",
            listen.port()
        )),
    }

    // What it forwards to: the relay's loopback listener, as bytes.
    let tcp_proxy = chain["filters"]
        .as_sequence()
        .into_iter()
        .flatten()
        .find(|filter| text(&filter["name"]) == "envoy.filters.network.tcp_proxy")
        .map(|filter| &filter["typed_config"])
        .unwrap_or(&NULL);
    let cluster = text(&tcp_proxy["cluster"]);
    let targets: Vec<Option<SocketAddr>> = envoy["static_resources"]["clusters"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter(|candidate| !cluster.is_empty() && text(&candidate["name"]) == cluster)
        .flat_map(|found| found["load_assignment"]["endpoints"].as_sequence().into_iter().flatten())
        .flat_map(|endpoints| endpoints["lb_endpoints"].as_sequence().into_iter().flatten())
        .map(|endpoint| socket_address(&endpoint["endpoint"]["address"]["socket_address"]))
        .collect();
    if targets != [Some(relay)] {
        problems.push(format!("the sidecar forwards to {targets:?}, not the relay's {relay}"));
    }
    // Envoy's default idle timeout is an hour; 0s disables it.
    if let Some(idle) = tcp_proxy.get("idle_timeout") {
        match envoy_duration(idle) {
            Some(idle) if idle.is_zero() || idle > config.wan.keepalive_interval => {}
            _ => problems.push(format!(
                "the sidecar's idle_timeout {idle:?} is not longer than the relay's keepalive {:?}",
                config.wan.keepalive_interval
            )),
        }
    }

    // TLS: client certificates required, h2 offered, every file from the Secret.
    let tls = &chain["transport_socket"]["typed_config"];
    if !text(&tls["@type"]).ends_with(".DownstreamTlsContext") {
        problems.push("the sidecar's listener does not terminate TLS".into());
    }
    if tls["require_client_certificate"].as_bool() != Some(true) {
        problems.push("the sidecar does not require a client certificate".into());
    }
    let common = &tls["common_tls_context"];
    let alpn = common["alpn_protocols"].as_sequence().into_iter().flatten();
    if !alpn.map(text).any(|protocol| protocol == "h2") {
        problems.push("the sidecar does not offer ALPN h2 (gRPC clients may refuse it)".into());
    }
    let certificates = &common["tls_certificates"][0];
    let files = [
        ("certificate chain", &certificates["certificate_chain"]["filename"]),
        ("private key", &certificates["private_key"]["filename"]),
        ("client CA", &common["validation_context"]["trusted_ca"]["filename"]),
    ];
    let secret_mounts = sidecar_secret_mounts(docs);
    for (role, file) in files {
        let file = Path::new(text(file));
        if !secret_mounts.iter().any(|mount| file.parent() == Some(Path::new(mount))) {
            problems.push(format!("the sidecar's {role} {file:?} is not in a mounted Secret"));
        }
    }
    problems
}

/// Accesses the backend needs that the Role does not grant, and grants beyond them.
fn rbac_problems(docs: &[Value]) -> Vec<String> {
    let mut problems = Vec::new();
    let config = match environment(docs).and_then(|env| resolved(&env)) {
        Ok(config) => config,
        Err(error) => return vec![error],
    };
    let DiscoveryBackend::Kubernetes(kube) = &config.discovery else {
        return vec!["the Deployment does not select the Kubernetes discovery backend".into()];
    };
    let kube: &KubeDiscoveryConfig = kube;
    let required: Vec<ApiAccess> = kube.required_access().to_vec();
    let role = of_kind(docs, "Role");
    let rules = role["rules"].as_sequence().cloned().unwrap_or_default();
    let list = |value: &Value| -> Vec<String> {
        value.as_sequence().into_iter().flatten().map(|v| text(v).to_owned()).collect()
    };
    for access in &required {
        let granted = rules.iter().any(|rule| {
            list(&rule["apiGroups"]).iter().any(|group| group == access.group)
                && list(&rule["resources"]).iter().any(|resource| resource == access.resource)
                && access.verbs.iter().all(|verb| list(&rule["verbs"]).iter().any(|v| v == verb))
        });
        if !granted {
            problems.push(format!("the Role does not grant {access:?}"));
        }
    }
    for rule in &rules {
        for verb in list(&rule["verbs"]) {
            if !["list", "watch"].contains(&verb.as_str()) {
                problems.push(format!("the Role grants {verb:?}, which discovery never uses"));
            }
        }
        for group in list(&rule["apiGroups"]) {
            for resource in list(&rule["resources"]) {
                if !required.iter().any(|a| a.group == group && a.resource == resource) {
                    problems.push(format!("the Role grants {group}/{resource} needlessly"));
                }
            }
        }
    }
    let namespace = text(&role["metadata"]["namespace"]);
    if namespace != kube.namespace {
        problems
            .push(format!("the Role is in {namespace:?}, discovery lists {:?}", kube.namespace));
    }
    let binding = of_kind(docs, "RoleBinding");
    let account =
        text(&of_kind(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]);
    let subject = &binding["subjects"][0];
    if text(&binding["roleRef"]["name"]) != text(&role["metadata"]["name"])
        || text(&subject["kind"]) != "ServiceAccount"
        || text(&subject["name"]) != account
        || text(&of_kind(docs, "ServiceAccount")["metadata"]["name"]) != account
    {
        problems.push("the RoleBinding does not bind the Role to the Deployment's account".into());
    }
    problems
}

/// `manifest` with the first `from` replaced by `to` (which must occur).
fn broken(manifest: &Manifest, from: &str, to: &str) -> Vec<Value> {
    assert!(manifest.text.contains(from), "{from:?} not in {}", manifest.path);
    documents(&manifest.text.replacen(from, to, 1))
}

#[test]
fn every_variable_of_the_deployment_is_read_by_kvrelay_serve() {
    for manifest in MANIFESTS {
        let docs = documents(manifest.text);
        let kinds: Vec<&str> = docs.iter().map(|doc| text(&doc["kind"])).collect();
        assert_eq!(kinds, manifest.kinds, "{}", manifest.path);
        assert!(docs.iter().all(|doc| text(&doc["metadata"]["namespace"]) == "dynamo"));
        assert_eq!(unread_variables(&docs), Ok(Vec::new()), "{}", manifest.path);

        let stray = broken(
            manifest,
            "            - name: DYN_DC_ID\n",
            "            - name: DYN_RELAY_NOT_A_SETTING\n              value: x\n            - name: DYN_DC_ID\n",
        );
        assert_eq!(unread_variables(&stray), Ok(vec!["DYN_RELAY_NOT_A_SETTING".to_owned()]));
        let bad = broken(manifest, "value: kubernetes", "value: zookeeper");
        assert!(unread_variables(&bad).unwrap_err().contains("DYN_DISCOVERY_BACKEND"));
    }
}

#[test]
fn probes_ports_and_service_match_the_listeners() {
    for manifest in MANIFESTS {
        let problems = listener_problems(&documents(manifest.text), manifest.wan);
        assert_eq!(problems, Vec::<String>::new(), "{}", manifest.path);
        for (from, to) in [
            ("path: /ready", "path: /readyz"),
            ("value: 0.0.0.0:9090", "value: 127.0.0.1:9090"),
            ("containerPort: 9090", "containerPort: 9091"),
            ("targetPort: ops", "targetPort: metrics"),
            ("prometheus.io/port: \"9090\"", "prometheus.io/port: \"8080\""),
        ] {
            let problems = listener_problems(&broken(manifest, from, to), manifest.wan);
            assert!(!problems.is_empty(), "{}: {from} -> {to} not caught", manifest.path);
        }
    }
    let moved = broken(&KVRELAY, "containerPort: 5561", "containerPort: 5562");
    assert!(!listener_problems(&moved, KVRELAY.wan).is_empty(), "a moved grpc port not caught");
}

#[test]
fn only_the_sidecar_reaches_the_relay_and_it_requires_client_certificates() {
    let dir = tempfile::tempdir().unwrap();
    let ca = pki::TestCa::new(dir.path(), "relay");
    let leaf = ca.server(dir.path(), "kvrelay");
    let relay_tls = format!(
        "            - name: DYN_RELAY_TLS_CERT\n              value: {}\n            - name: DYN_RELAY_TLS_KEY\n              value: {}\n            - name: DYN_DC_ID\n",
        pki::text(&leaf.cert_path),
        pki::text(&leaf.key_path),
    );
    for (from, to, expected) in [
        // The relay's own listener on the pod network: the sidecar could be bypassed.
        ("value: 127.0.0.1:5561", "value: 0.0.0.0:5561", "not loopback"),
        // The sidecar forwards somewhere else than the relay's listener.
        ("port_value: 5561", "port_value: 5563", "forwards to"),
        ("address: 127.0.0.1\n", "address: 10.0.0.7\n", "forwards to"),
        ("cluster: kvrelay_plaintext", "cluster: kvrelay", "forwards to"),
        // The sidecar listens where the Service does not send consumers, or only on loopback.
        ("port_value: 5562", "port_value: 5563", "does not declare it"),
        ("port_value: 5562", "port_value: 5563", "does not target the sidecar"),
        ("targetPort: grpc-tls", "targetPort: ops", "does not target the sidecar"),
        ("address: 0.0.0.0\n", "address: 127.0.0.1\n", "unreachable from other pods"),
        // What makes it mTLS, gRPC-capable and stream-friendly.
        (
            "require_client_certificate: true",
            "require_client_certificate: false",
            "client certificate",
        ),
        ("alpn_protocols: [\"h2\"]", "alpn_protocols: [\"http/1.1\"]", "ALPN h2"),
        ("idle_timeout: 3600s", "idle_timeout: 10s", "keepalive"),
        ("filename: /etc/kvrelay-wan-tls/ca.crt", "filename: /etc/ssl/ca.crt", "client CA"),
        ("mountPath: /etc/kvrelay-wan-tls", "mountPath: /etc/wan-tls", "not in a mounted Secret"),
        ("mountPath: /etc/envoy", "mountPath: /etc/proxy", "nothing is mounted at"),
        // Not a native sidecar: the pod would wait for it to exit, or stop it with the relay.
        ("          restartPolicy: Always\n", "", "native sidecar"),
        // TLS twice: the sidecar would forward decrypted bytes to a TLS listener.
        ("            - name: DYN_DC_ID\n", relay_tls.as_str(), "serves TLS itself"),
    ] {
        let problems = listener_problems(&broken(&MTLS_SIDECAR, from, to), MTLS_SIDECAR.wan);
        assert!(
            problems.iter().any(|problem| problem.contains(expected)),
            "{from} -> {to}: {problems:?} lacks {expected:?}"
        );
    }
    // kvrelay.yaml is not a sidecar layout: its WAN listener is on the pod network.
    let direct = listener_problems(&documents(KVRELAY.text), WanExposure::MtlsSidecar);
    assert!(direct.iter().any(|problem| problem.contains("not loopback")), "{direct:?}");
}

/// The kinds whose object in `docs` differs from kvrelay.yaml's.
fn rbac_drift(docs: &[Value]) -> Vec<&'static str> {
    let reference = documents(KVRELAY.text);
    ["ServiceAccount", "Role", "RoleBinding"]
        .into_iter()
        .filter(|kind| of_kind(docs, kind) != of_kind(&reference, kind))
        .collect()
}

#[test]
fn the_sidecar_manifest_carries_kvrelay_yaml_access_unchanged() {
    assert_eq!(rbac_drift(&documents(MTLS_SIDECAR.text)), Vec::<&str>::new());
    let reordered =
        broken(&MTLS_SIDECAR, "verbs: [\"list\", \"watch\"]", "verbs: [\"watch\", \"list\"]");
    assert_eq!(rbac_drift(&reordered), vec!["Role"]);
    let renamed = broken(
        &MTLS_SIDECAR,
        "kind: ServiceAccount\nmetadata:\n  name: kvrelay",
        "kind: ServiceAccount\nmetadata:\n  name: relay",
    );
    assert_eq!(rbac_drift(&renamed), vec!["ServiceAccount"]);
}

#[test]
fn the_role_grants_exactly_what_kubernetes_discovery_requests() {
    for manifest in MANIFESTS {
        assert_eq!(rbac_problems(&documents(manifest.text)), Vec::<String>::new());
        for (from, to) in [
            ("resources: [\"endpointslices\"]", "resources: [\"services\"]"),
            ("verbs: [\"list\", \"watch\"]", "verbs: [\"list\"]"),
            ("verbs: [\"list\", \"watch\"]", "verbs: [\"list\", \"watch\", \"delete\"]"),
            (
                "  - kind: ServiceAccount\n    name: kvrelay\n",
                "  - kind: ServiceAccount\n    name: other\n",
            ),
            ("value: kubernetes", "value: etcd"),
        ] {
            let problems = rbac_problems(&broken(manifest, from, to));
            assert!(!problems.is_empty(), "{}: {from} -> {to} not caught", manifest.path);
        }
        // Container mode reads Pods: the pod-mode Role no longer covers it.
        let container = broken(
            manifest,
            "            - name: DYN_DC_ID\n",
            "            - name: DYN_KUBE_DISCOVERY_MODE\n              value: container\n            - name: DYN_DC_ID\n",
        );
        assert!(
            rbac_problems(&container).iter().any(|p| p.contains("pods")),
            "{:?}",
            rbac_problems(&container)
        );
    }
}

/// The Kubernetes API's own schemas, through the PyPI validator `kubernetes-validate` that
/// `scripts/test.sh` installs: `None` when the manifests are valid objects (strict: no field the
/// API does not define), else the validator's report. `Err` when the validator is not installed.
fn schema_errors(manifests: &str) -> Result<Option<String>, String> {
    let dir = tempfile::tempdir().map_err(|error| error.to_string())?;
    let path = dir.path().join("manifests.yaml");
    std::fs::write(&path, manifests).map_err(|error| error.to_string())?;
    let output = std::process::Command::new("kubernetes-validate")
        .args(["--strict", "--quiet"])
        .arg(&path)
        .output()
        .map_err(|error| format!("kubernetes-validate: {error}"))?;
    if output.status.success() {
        return Ok(None);
    }
    let mut report = String::from_utf8_lossy(&output.stdout).into_owned();
    report.push_str(&String::from_utf8_lossy(&output.stderr));
    Ok(Some(report))
}

#[test]
fn the_manifests_validate_against_the_kubernetes_schemas() {
    for manifest in MANIFESTS {
        let errors = match schema_errors(manifest.text) {
            Ok(errors) => errors,
            // scripts/test.sh (and so CI) installs the validator; without PyPI, say what is missing.
            Err(missing) => {
                eprintln!("SKIPPED: {missing} (bash scripts/test.sh installs it from PyPI)");
                return;
            }
        };
        assert_eq!(errors, None, "{} holds valid Kubernetes objects", manifest.path);
        let mistyped = manifest.text.replacen("replicas: 1", "replicas: one", 1);
        assert_ne!(mistyped, manifest.text);
        let report = schema_errors(&mistyped).unwrap().expect("a mistyped field is refused");
        assert!(report.contains("spec.replicas"), "{report}");
        let unknown = manifest.text.replacen("replicas: 1", "replicas: 1\n  replica: 1", 1);
        assert!(schema_errors(&unknown).unwrap().is_some(), "an unknown field is refused (strict)");
    }
}
