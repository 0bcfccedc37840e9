//! `docs/kubernetes/kvrelay.yaml` checked against the binary it deploys:
//!
//! - every environment variable of the container is one `kvrelay serve` reads: the manifest's
//!   environment resolves to a valid configuration, and removing any one variable changes it;
//! - the probes use paths the ops listener serves and the port it binds, which is not loopback;
//!   the Service and the Prometheus annotations point at the listeners' ports;
//! - the Role grants `list`/`watch` on exactly the resources the Kubernetes discovery backend
//!   requests, nothing broader, and is bound to the Deployment's service account.
//!
//! Each check is a function returning what is wrong, and a test shows each one firing on a
//! broken copy of the manifests.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use kvrelay::config::{CliValues, RelayConfig, resolve};
use kvrelay::discovery_plane::{ApiAccess, DiscoveryBackend, KubeDiscoveryConfig};
use kvrelay::ops::{LIVE_PATH, METRICS_PATH, OPS_PATHS, READY_PATH};
use serde::Deserialize;
use serde_yaml::Value;

const MANIFESTS: &str =
    include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/kubernetes/kvrelay.yaml"));

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

fn container(docs: &[Value]) -> &Value {
    &of_kind(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
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
        .filter(|name| {
            let mut without = env.clone();
            without.remove(*name);
            resolved(&without).as_ref() == Ok(&full)
        })
        .cloned()
        .collect())
}

fn container_port(docs: &[Value], name: &str) -> Option<u16> {
    container(docs)["ports"]
        .as_sequence()?
        .iter()
        .find(|port| text(&port["name"]) == name)
        .and_then(|port| port["containerPort"].as_u64())
        .and_then(|port| u16::try_from(port).ok())
}

/// A port reference (name or number) as a number.
fn port_number(docs: &[Value], reference: &Value) -> Option<u16> {
    match reference {
        Value::Number(number) => number.as_u64().and_then(|port| u16::try_from(port).ok()),
        Value::String(name) => container_port(docs, name),
        _ => None,
    }
}

/// What is wrong with the probes, ports, Service and scrape annotations.
fn listener_problems(docs: &[Value]) -> Vec<String> {
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
    match config.bind {
        Some(wan) if container_port(docs, "grpc") == Some(wan.port()) => {}
        other => {
            problems.push(format!("container port grpc does not match the WAN bind {other:?}"))
        }
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

/// `MANIFESTS` with `from` replaced by `to` (which must occur).
fn broken(from: &str, to: &str) -> Vec<Value> {
    assert!(MANIFESTS.contains(from), "{from:?} not in the manifests");
    documents(&MANIFESTS.replacen(from, to, 1))
}

#[test]
fn every_variable_of_the_deployment_is_read_by_kvrelay_serve() {
    let docs = documents(MANIFESTS);
    assert_eq!(docs.len(), 5, "ServiceAccount, Role, RoleBinding, Deployment, Service");
    assert!(docs.iter().all(|doc| text(&doc["metadata"]["namespace"]) == "dynamo"));
    assert_eq!(unread_variables(&docs), Ok(Vec::new()));

    let stray = broken(
        "            - name: DYN_DC_ID\n",
        "            - name: DYN_RELAY_NOT_A_SETTING\n              value: x\n            - name: DYN_DC_ID\n",
    );
    assert_eq!(unread_variables(&stray), Ok(vec!["DYN_RELAY_NOT_A_SETTING".to_owned()]));
    let bad = broken("value: kubernetes", "value: zookeeper");
    assert!(unread_variables(&bad).unwrap_err().contains("DYN_DISCOVERY_BACKEND"));
}

#[test]
fn probes_ports_and_service_match_the_listeners() {
    assert_eq!(listener_problems(&documents(MANIFESTS)), Vec::<String>::new());
    for (from, to) in [
        ("path: /ready", "path: /readyz"),
        ("value: 0.0.0.0:9090", "value: 127.0.0.1:9090"),
        ("containerPort: 5561", "containerPort: 5562"),
        ("targetPort: ops", "targetPort: metrics"),
        ("prometheus.io/port: \"9090\"", "prometheus.io/port: \"8080\""),
    ] {
        assert!(!listener_problems(&broken(from, to)).is_empty(), "{from} -> {to} not caught");
    }
}

#[test]
fn the_role_grants_exactly_what_kubernetes_discovery_requests() {
    assert_eq!(rbac_problems(&documents(MANIFESTS)), Vec::<String>::new());
    for (from, to) in [
        ("resources: [\"endpointslices\"]", "resources: [\"services\"]"),
        ("verbs: [\"list\", \"watch\"]", "verbs: [\"list\"]"),
        ("verbs: [\"list\", \"watch\"]", "verbs: [\"list\", \"watch\", \"delete\"]"),
        (
            "    name: kvrelay\n    namespace: dynamo\n---\napiVersion: apps/v1",
            "    name: other\n    namespace: dynamo\n---\napiVersion: apps/v1",
        ),
        ("value: kubernetes", "value: etcd"),
    ] {
        assert!(!rbac_problems(&broken(from, to)).is_empty(), "{from} -> {to} not caught");
    }
    // Container mode reads Pods: the pod-mode Role no longer covers it.
    let container = broken(
        "            - name: DYN_DC_ID\n",
        "            - name: DYN_KUBE_DISCOVERY_MODE\n              value: container\n            - name: DYN_DC_ID\n",
    );
    assert!(
        rbac_problems(&container).iter().any(|p| p.contains("pods")),
        "{:?}",
        rbac_problems(&container)
    );
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
    let errors = match schema_errors(MANIFESTS) {
        Ok(errors) => errors,
        // scripts/test.sh (and so CI) installs the validator; without PyPI, say what is missing.
        Err(missing) => {
            eprintln!("SKIPPED: {missing} (bash scripts/test.sh installs it from PyPI)");
            return;
        }
    };
    assert_eq!(errors, None, "the manifests are valid Kubernetes objects");
    let mistyped = MANIFESTS.replacen("replicas: 1", "replicas: one", 1);
    assert_ne!(mistyped, MANIFESTS);
    let report = schema_errors(&mistyped).unwrap().expect("a mistyped field is refused");
    assert!(report.contains("spec.replicas"), "{report}");
    let unknown = MANIFESTS.replacen("replicas: 1", "replicas: 1\n  replica: 1", 1);
    assert!(schema_errors(&unknown).unwrap().is_some(), "an unknown field is refused (strict)");
}
