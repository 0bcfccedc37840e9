//! The Kubernetes discovery backend (`DYN_DISCOVERY_BACKEND=kubernetes`).
//!
//! On Kubernetes, Dynamo keeps each worker's discovery records in one namespaced custom resource,
//! `DynamoWorkerMetadata` (`nvidia.com/v1alpha1`, plural `dynamoworkermetadatas`), whose
//! `spec.data` holds the maps `endpoints`, `model_cards`, `event_channels` and `event_sources`,
//! keyed by the same paths as the key-value backends' keys below `v1/{instances,mdc,
//! event_channels,event_sources}/` (dc-inputs §1.3). A record only counts while its worker is
//! ready, and readiness comes from a second resource, selected by the labels
//! [`DISCOVERY_LABEL_SELECTOR`] (the mode comes from `DYN_KUBE_DISCOVERY_MODE`, as in Dynamo):
//!
//! - **pod** mode (default): `EndpointSlice`s; every endpoint whose `conditions.ready` is true
//!   names its pod in `targetRef.name`, and that pod's resource is the one named like the pod;
//! - **container** mode: `Pod`s; every ready entry of `status.containerStatuses` is one worker,
//!   whose resource is named `{pod}-{container}`, or `{pod}` for the pod's main container (the
//!   `nvidia.com/dynamo-main-container-name` annotation, `main` by default).
//!
//! The backend lists both resources in the relay pod's namespace (`POD_NAMESPACE`, else the
//! service account's namespace file, else `default`), then watches both from the listed
//! `resourceVersion`s with bookmarks. After every change it hands the records of the ready
//! workers to the same [`RecordDiffer`] the etcd backend uses, as one complete listing of
//! logical keys: every record is validated by the same rules whatever the backend.
//!
//! Invariants:
//!
//! - **Snapshot semantics.** A record is present iff its resource exists, is the resource of a
//!   ready worker, and its last readable `spec.data` holds it. A resource whose `spec.data`
//!   becomes unreadable (null, not an object) keeps its last readable data while its `uid`
//!   stays the same; a re-created resource (new `uid`) starts empty. The worker id inside the
//!   records is the workers' own (a hash of the resource name, stable across container restarts),
//!   so a restarted container comes back under the same id with a new publisher id.
//! - **Relist on expiry.** A `410 Gone` (on a list's `continue` token, on opening a watch, or as
//!   a watch `ERROR` event) drops the resource versions and relists both resources; the relist
//!   is applied as a [`ListingMode::Relist`], so nothing seen before is lost or duplicated. A
//!   watch the server closes (its `timeoutSeconds`) is reopened from the last version seen, and
//!   both are relisted every `reconcile_interval` (30 s,
//!   `DYN_RELAY_DISCOVERY_RELIST_INTERVAL_MS`); that reconciling relist reports only what
//!   drifted, as differences (nothing when the cluster matches what was reported).
//! - **Bounded.** List pages hold at most `page_limit` items and `list_bytes_max` bytes; a watch
//!   line (one object) and a listed object are at most `object_bytes_max` bytes; at most
//!   [`DISCOVERY_RECORDS_MAX`] objects per resource and records per listing are held. An object
//!   that is too large or malformed is counted in [`DiscoveryStats::rejected_objects`] once per
//!   object version (logged at warn then, at debug when listed again), and skipped: a listed
//!   object too large to read counts as present but unreadable, so it keeps what it held.
//!   Everything else keeps working.
//! - **Read-only, namespaced.** Only `list` and `watch` on the two resources in one namespace
//!   are requested (see `docs/kubernetes/` for the matching Role).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use kube::api::{ListParams, WatchParams};

use super::kube_client::{
    ApiRequest, KubeApiConfig, KubeClient, KubeError, SERVICE_ACCOUNT_DIR, WatchLine, WatchLines,
};
use super::records::{EntryValue, KeyForm, ListingEntry, ListingMode, RecordDiffer};
use super::{
    Backoff, DISCOVERY_RECORDS_MAX, Delivery, DiscoveryOutput, DiscoveryPlaneError, DiscoverySink,
    DiscoveryStats, sleep_or_cancel,
};
use kvrelay_core::discovery::DiscoveryScope;
use kvrelay_core::inputs::InputError;
use kvrelay_core::inputs::limits::DISCOVERY_RECORD_BYTES_MAX;

/// `KVRELAY_KUBE_API_URL`: the API server (`http(s)://host:port`), replacing the in-cluster
/// `KUBERNETES_SERVICE_HOST`/`KUBERNETES_SERVICE_PORT` (for tests and out-of-cluster runs).
pub const KUBE_API_URL_ENV: &str = "KVRELAY_KUBE_API_URL";
/// `KVRELAY_KUBE_TOKEN_FILE`: the bearer-token file (default: the service account's `token`).
pub const KUBE_TOKEN_FILE_ENV: &str = "KVRELAY_KUBE_TOKEN_FILE";
/// `KVRELAY_KUBE_CA_FILE`: the API server's CA (default: the service account's `ca.crt`).
pub const KUBE_CA_FILE_ENV: &str = "KVRELAY_KUBE_CA_FILE";
/// Dynamo's discovery mode variable: `pod` (default) or `container`.
pub const KUBE_DISCOVERY_MODE_ENV: &str = "DYN_KUBE_DISCOVERY_MODE";
/// The namespace the relay lists in (set from the downward API in Dynamo's pods).
pub const POD_NAMESPACE_ENV: &str = "POD_NAMESPACE";
/// The in-cluster API host variable Kubernetes sets in every pod.
pub const KUBERNETES_SERVICE_HOST_ENV: &str = "KUBERNETES_SERVICE_HOST";
/// The in-cluster API port variable (default 443).
pub const KUBERNETES_SERVICE_PORT_ENV: &str = "KUBERNETES_SERVICE_PORT";
/// The labels Dynamo's operator puts on the readiness resources of discoverable workers.
pub const DISCOVERY_LABEL_SELECTOR: &str =
    "nvidia.com/dynamo-discovery-backend=kubernetes,nvidia.com/dynamo-discovery-enabled=true";
/// The worker-metadata resource's plural name.
pub const WORKER_METADATA_PLURAL: &str = "dynamoworkermetadatas";
/// The pod annotation naming a pod's main container (container mode).
pub const MAIN_CONTAINER_ANNOTATION: &str = "nvidia.com/dynamo-main-container-name";
/// The main container's name when the annotation is absent.
pub const DEFAULT_MAIN_CONTAINER: &str = "main";

/// Marks the stand-in for a listed object larger than the object limit: only its identity
/// (`name`, `uid`, `resourceVersion`) is kept, and it counts as present but unreadable.
const OVERSIZED_MARK: &str = "kvrelayOversized";

/// The `spec.data` maps and the key-value bucket each one's keys live under.
const DATA_MAPS: [(&str, &str); 4] = [
    ("endpoints", "instances"),
    ("model_cards", "mdc"),
    ("event_channels", "event_channels"),
    ("event_sources", "event_sources"),
];

/// Where worker readiness comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KubeDiscoveryMode {
    /// `EndpointSlice`s: one worker per ready pod.
    Pod,
    /// `Pod`s: one worker per ready container.
    Container,
}

/// Configuration of the Kubernetes backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeDiscoveryConfig {
    /// How to reach the API server.
    pub api: KubeApiConfig,
    /// The Kubernetes namespace listed and watched (a DNS label).
    pub namespace: String,
    /// Where readiness comes from.
    pub mode: KubeDiscoveryMode,
    /// Items per list page (default 500).
    pub page_limit: u32,
    /// Largest list page body (default 32 MiB).
    pub list_bytes_max: usize,
    /// Largest single object or watch line (default 2 MiB).
    pub object_bytes_max: usize,
    /// Server-side watch timeout (`timeoutSeconds`, default 5 min).
    pub watch_timeout: Duration,
    /// First delay after a failure (default 100 ms), doubling per failure.
    pub reconnect_backoff_initial: Duration,
    /// Longest delay after failures (default 5 s).
    pub reconnect_backoff_max: Duration,
    /// Time between reconciliation relists (default 30 s).
    pub reconcile_interval: Duration,
}

impl KubeDiscoveryConfig {
    /// The defaults for `api` and `namespace`, in pod mode.
    #[must_use]
    pub fn new(api: KubeApiConfig, namespace: impl Into<String>) -> Self {
        KubeDiscoveryConfig {
            api,
            namespace: namespace.into(),
            mode: KubeDiscoveryMode::Pod,
            page_limit: 500,
            list_bytes_max: 32 << 20,
            object_bytes_max: 2 << 20,
            watch_timeout: Duration::from_secs(300),
            reconnect_backoff_initial: Duration::from_millis(100),
            reconnect_backoff_max: Duration::from_secs(5),
            reconcile_interval: Duration::from_secs(30),
        }
    }

    /// Read the settings through `setting` (trimmed, blank = unset), with the service-account
    /// files under `service_account_dir` as defaults for the token, CA and namespace.
    pub fn from_lookup(
        setting: impl Fn(&str) -> Option<String>,
        service_account_dir: &Path,
    ) -> Result<Self, DiscoveryPlaneError> {
        let account_file = |name: &str| {
            let path = service_account_dir.join(name);
            path.is_file().then_some(path)
        };
        let api_url = match setting(KUBE_API_URL_ENV) {
            Some(url) => url,
            None => {
                let host = setting(KUBERNETES_SERVICE_HOST_ENV).ok_or(
                    DiscoveryPlaneError::MissingSetting {
                        variable: KUBERNETES_SERVICE_HOST_ENV,
                        backend: "kubernetes",
                    },
                )?;
                let port = setting(KUBERNETES_SERVICE_PORT_ENV).unwrap_or_else(|| "443".into());
                if host.contains(':') {
                    format!("https://[{host}]:{port}")
                } else {
                    format!("https://{host}:{port}")
                }
            }
        };
        let mut api = KubeApiConfig::new(api_url);
        api.token_file = setting(KUBE_TOKEN_FILE_ENV).map(PathBuf::from).or(account_file("token"));
        api.ca_file = setting(KUBE_CA_FILE_ENV).map(PathBuf::from).or(account_file("ca.crt"));
        let namespace = match setting(POD_NAMESPACE_ENV) {
            Some(namespace) => namespace,
            None => account_file("namespace")
                .and_then(|path| std::fs::read(path).ok())
                .filter(|bytes| bytes.len() <= 253)
                .and_then(|bytes| String::from_utf8(bytes).ok())
                .map(|text| text.trim().to_owned())
                .filter(|text| !text.is_empty())
                .unwrap_or_else(|| "default".to_owned()),
        };
        let mut config = KubeDiscoveryConfig::new(api, namespace);
        config.mode = match setting(KUBE_DISCOVERY_MODE_ENV).map(|m| m.to_ascii_lowercase()) {
            None => KubeDiscoveryMode::Pod,
            Some(mode) if mode == "pod" => KubeDiscoveryMode::Pod,
            Some(mode) if mode == "container" => KubeDiscoveryMode::Container,
            Some(_) => {
                return Err(DiscoveryPlaneError::InvalidConfig {
                    field: KUBE_DISCOVERY_MODE_ENV,
                    reason: "must be pod or container",
                });
            }
        };
        config.validate()?;
        Ok(config)
    }

    /// Like [`KubeDiscoveryConfig::from_lookup`] with the in-cluster service-account directory.
    pub fn from_env_lookup(
        setting: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, DiscoveryPlaneError> {
        Self::from_lookup(setting, Path::new(SERVICE_ACCOUNT_DIR))
    }

    /// Check the values are usable.
    pub fn validate(&self) -> Result<(), DiscoveryPlaneError> {
        let invalid = |field, reason| Err(DiscoveryPlaneError::InvalidConfig { field, reason });
        if let Err(error) = self.api.kube_config() {
            return Err(DiscoveryPlaneError::InvalidKubeApi(error.to_string()));
        }
        if !is_dns_label(&self.namespace) {
            return invalid(POD_NAMESPACE_ENV, "must be a Kubernetes namespace name (DNS label)");
        }
        if self.page_limit == 0 || self.list_bytes_max == 0 || self.object_bytes_max == 0 {
            return invalid("limits", "page, list and object limits must be positive");
        }
        if self.watch_timeout.as_secs() == 0 || self.reconcile_interval.is_zero() {
            return invalid(
                "watch_timeout",
                "watch timeout (whole seconds) and reconcile must be positive",
            );
        }
        if self.reconnect_backoff_initial.is_zero()
            || self.reconnect_backoff_max < self.reconnect_backoff_initial
        {
            return invalid("reconnect_backoff", "must be positive with initial <= max");
        }
        Ok(())
    }

    /// The collection path of `resource` in the configured namespace.
    fn collection(&self, resource: Resource) -> String {
        let (group, version, plural) = api_resource(resource, self.mode);
        let namespace = &self.namespace;
        if group.is_empty() {
            format!("/api/{version}/namespaces/{namespace}/{plural}")
        } else {
            format!("/apis/{group}/{version}/namespaces/{namespace}/{plural}")
        }
    }

    /// Every API permission this configuration's backend uses, for RBAC: `list` and `watch` on
    /// the worker-metadata resources and on the readiness resources, in the one namespace.
    #[must_use]
    pub fn required_access(&self) -> [ApiAccess; 2] {
        [Resource::Metadata, Resource::Readiness].map(|resource| {
            let (group, _, plural) = api_resource(resource, self.mode);
            ApiAccess { group, resource: plural, verbs: &["list", "watch"] }
        })
    }

    /// The label selector of `resource`'s requests, if it has one.
    fn selector(resource: Resource) -> Option<&'static str> {
        match resource {
            Resource::Metadata => None,
            Resource::Readiness => Some(DISCOVERY_LABEL_SELECTOR),
        }
    }

    /// The request for one list page (built by `kube`'s request builder).
    fn list_request(
        &self,
        resource: Resource,
        continue_token: Option<&str>,
    ) -> Result<ApiRequest, KubeError> {
        let mut params = ListParams::default().limit(self.page_limit);
        if let Some(selector) = Self::selector(resource) {
            params = params.labels(selector);
        }
        if let Some(token) = continue_token {
            params = params.continue_token(token);
        }
        kube::core::Request::new(self.collection(resource))
            .list(&params)
            .map_err(|error| KubeError::Http(format!("building a list request: {error}")))
    }

    /// The request for a watch of `resource` from `resource_version`, with bookmarks.
    fn watch_request(
        &self,
        resource: Resource,
        resource_version: &str,
    ) -> Result<ApiRequest, KubeError> {
        let seconds = u32::try_from(self.watch_timeout.as_secs()).unwrap_or(u32::MAX);
        let mut params = WatchParams::default().timeout(seconds);
        if let Some(selector) = Self::selector(resource) {
            params = params.labels(selector);
        }
        kube::core::Request::new(self.collection(resource))
            .watch(&params, resource_version)
            .map_err(|error| KubeError::Http(format!("building a watch request: {error}")))
    }
}

/// Whether `name` is a DNS label (lowercase alphanumerics and `-`, 1..=63, no edge `-`).
fn is_dns_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// `(API group, version, plural)` of `resource` in `mode`; the core group is `""`. The one
/// table both the request paths and [`KubeDiscoveryConfig::required_access`] come from.
fn api_resource(
    resource: Resource,
    mode: KubeDiscoveryMode,
) -> (&'static str, &'static str, &'static str) {
    match (resource, mode) {
        (Resource::Metadata, _) => ("nvidia.com", "v1alpha1", WORKER_METADATA_PLURAL),
        (Resource::Readiness, KubeDiscoveryMode::Pod) => {
            ("discovery.k8s.io", "v1", "endpointslices")
        }
        (Resource::Readiness, KubeDiscoveryMode::Container) => ("", "v1", "pods"),
    }
}

/// One API permission the backend uses: `verbs` on `resource` of API group `group` (`""` is the
/// core group), namespaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiAccess {
    /// The API group.
    pub group: &'static str,
    /// The resource's plural name.
    pub resource: &'static str,
    /// The verbs used.
    pub verbs: &'static [&'static str],
}

/// The two resources the backend follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resource {
    /// `DynamoWorkerMetadata`.
    Metadata,
    /// `EndpointSlice` (pod mode) or `Pod` (container mode).
    Readiness,
}

/// What is held for one worker-metadata resource.
#[derive(Debug, Clone)]
struct HeldMetadata {
    uid: Option<String>,
    /// The records of its last readable `spec.data`, keyed by logical key.
    records: Option<BTreeMap<String, EntryValue>>,
}

/// Why an object was skipped.
type Rejection = &'static str;

/// The backend's view of the cluster: worker-metadata resources and readiness, by object name.
#[derive(Debug)]
struct ClusterView {
    mode: KubeDiscoveryMode,
    metadata: BTreeMap<String, HeldMetadata>,
    /// Readiness object name -> the resource names of its ready workers.
    ready: BTreeMap<String, BTreeSet<String>>,
}

/// `object.metadata.name`, non-empty.
fn object_name(object: &Value) -> Result<String, Rejection> {
    match object.pointer("/metadata/name").and_then(Value::as_str) {
        Some(name) if !name.is_empty() && name.len() <= 253 => Ok(name.to_owned()),
        _ => Err("object has no usable metadata.name"),
    }
}

/// `{resource}/{name}@{resourceVersion}`: one version of one object, so a rejection is counted
/// once however often the same version is listed; `None` without a name or version.
fn object_identity(resource: Resource, object: &Value) -> Option<String> {
    let name = object.pointer("/metadata/name").and_then(Value::as_str)?;
    let version = object.pointer("/metadata/resourceVersion").and_then(Value::as_str)?;
    Some(format!("{resource:?}/{name}@{version}"))
}

/// The records of a `spec.data` document, or why it is unreadable as a whole.
fn data_records(data: Option<&Value>) -> Result<BTreeMap<String, EntryValue>, Rejection> {
    let Some(Value::Object(data)) = data else {
        return Err("spec.data is missing, null or not an object");
    };
    let mut records = BTreeMap::new();
    for (field, bucket) in DATA_MAPS {
        let map = match data.get(field) {
            None | Some(Value::Null) => continue,
            Some(Value::Object(map)) => map,
            Some(_) => return Err("a spec.data map is not an object"),
        };
        for (path, record) in map {
            if records.len() >= DISCOVERY_RECORDS_MAX {
                return Err("spec.data holds too many records");
            }
            let key = format!("v1/{bucket}/{path}");
            let bytes = serde_json::to_vec(record).unwrap_or_default();
            let value = if bytes.len() > DISCOVERY_RECORD_BYTES_MAX {
                EntryValue::Rejected(InputError::TooLarge {
                    what: "discovery record",
                    bytes: bytes.len(),
                    max: DISCOVERY_RECORD_BYTES_MAX,
                })
            } else {
                EntryValue::Bytes(bytes)
            };
            records.insert(key, value);
        }
    }
    Ok(records)
}

/// The resource names of the ready workers an `EndpointSlice` lists.
fn slice_ready(object: &Value) -> Result<BTreeSet<String>, Rejection> {
    let endpoints = match object.get("endpoints") {
        None | Some(Value::Null) => return Ok(BTreeSet::new()),
        Some(Value::Array(endpoints)) => endpoints,
        Some(_) => return Err("EndpointSlice endpoints is not an array"),
    };
    Ok(endpoints
        .iter()
        .filter(|endpoint| {
            endpoint.pointer("/conditions/ready").and_then(Value::as_bool).unwrap_or(false)
        })
        .filter_map(|endpoint| endpoint.pointer("/targetRef/name").and_then(Value::as_str))
        .filter(|pod| !pod.is_empty())
        .map(str::to_owned)
        .collect())
}

/// The resource names of a `Pod`'s ready containers.
fn pod_ready(object: &Value, pod: &str) -> Result<BTreeSet<String>, Rejection> {
    let main = object
        .pointer("/metadata/annotations")
        .and_then(|annotations| annotations.get(MAIN_CONTAINER_ANNOTATION))
        .and_then(Value::as_str)
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .unwrap_or(DEFAULT_MAIN_CONTAINER);
    let statuses = match object.pointer("/status/containerStatuses") {
        None | Some(Value::Null) => return Ok(BTreeSet::new()),
        Some(Value::Array(statuses)) => statuses,
        Some(_) => return Err("Pod status.containerStatuses is not an array"),
    };
    Ok(statuses
        .iter()
        .filter(|status| status.get("ready").and_then(Value::as_bool).unwrap_or(false))
        .filter_map(|status| status.get("name").and_then(Value::as_str))
        .map(
            |container| {
                if container == main { pod.to_owned() } else { format!("{pod}-{container}") }
            },
        )
        .collect())
}

impl ClusterView {
    fn new(mode: KubeDiscoveryMode) -> Self {
        ClusterView { mode, metadata: BTreeMap::new(), ready: BTreeMap::new() }
    }

    /// Apply an added or modified object. `Err` names why it was skipped; for a metadata
    /// resource with unreadable data the held records stay (same `uid`) and the error is
    /// still returned, so it is counted.
    fn upsert(&mut self, resource: Resource, object: &Value) -> Result<(), Rejection> {
        let name = object_name(object)?;
        let oversized = object.get(OVERSIZED_MARK).is_some();
        if oversized && resource == Resource::Readiness {
            // The readiness it held before stays.
            return Err("object larger than the object limit");
        }
        match resource {
            Resource::Metadata => {
                let uid =
                    object.pointer("/metadata/uid").and_then(Value::as_str).map(str::to_owned);
                let parsed = if oversized {
                    Err("object larger than the object limit")
                } else {
                    data_records(object.pointer("/spec/data"))
                };
                let previous = self.metadata.remove(&name);
                let kept = previous.filter(|held| held.uid == uid).and_then(|held| held.records);
                let (records, outcome) = match parsed {
                    Ok(records) => (Some(records), Ok(())),
                    Err(rejection) => (kept, Err(rejection)),
                };
                if self.metadata.len() >= DISCOVERY_RECORDS_MAX {
                    return Err("too many worker-metadata resources");
                }
                self.metadata.insert(name, HeldMetadata { uid, records });
                outcome
            }
            Resource::Readiness => {
                let ready = match self.mode {
                    KubeDiscoveryMode::Pod => slice_ready(object)?,
                    KubeDiscoveryMode::Container => pod_ready(object, &name)?,
                };
                if !self.ready.contains_key(&name) && self.ready.len() >= DISCOVERY_RECORDS_MAX {
                    return Err("too many readiness objects");
                }
                self.ready.insert(name, ready);
                Ok(())
            }
        }
    }

    /// Apply a deleted object.
    fn delete(&mut self, resource: Resource, object: &Value) -> Result<(), Rejection> {
        let name = object_name(object)?;
        match resource {
            Resource::Metadata => {
                self.metadata.remove(&name);
            }
            Resource::Readiness => {
                self.ready.remove(&name);
            }
        }
        Ok(())
    }

    /// Replace everything held of `resource` with a complete listing of its objects; returns
    /// the rejections with the identity of the object each is about. Objects that stay (same
    /// name, and for metadata the same `uid`) keep what they held if their listed value is
    /// unreadable.
    fn replace(
        &mut self,
        resource: Resource,
        objects: &[Value],
    ) -> Vec<(Option<String>, Rejection)> {
        let mut rejections = Vec::new();
        let mut listed = BTreeSet::new();
        for object in objects {
            if let Ok(name) = object_name(object) {
                listed.insert(name);
            }
            if let Err(rejection) = self.upsert(resource, object) {
                rejections.push((object_identity(resource, object), rejection));
            }
        }
        match resource {
            Resource::Metadata => self.metadata.retain(|name, _| listed.contains(name)),
            Resource::Readiness => self.ready.retain(|name, _| listed.contains(name)),
        }
        rejections
    }

    /// The records of every ready worker, as one complete listing. A key two ready workers
    /// both hold is taken from the first in resource-name order.
    fn listing(&self) -> Vec<ListingEntry> {
        let ready: BTreeSet<&String> = self.ready.values().flatten().collect();
        let mut entries: BTreeMap<&str, &EntryValue> = BTreeMap::new();
        for name in ready {
            let Some(records) = self.metadata.get(name).and_then(|held| held.records.as_ref())
            else {
                continue;
            };
            for (key, value) in records {
                if entries.len() >= DISCOVERY_RECORDS_MAX {
                    break;
                }
                entries.entry(key).or_insert(value);
            }
        }
        entries
            .into_iter()
            .map(|(key, value)| ListingEntry { key: key.to_owned(), value: value.clone() })
            .collect()
    }
}

/// One decoded watch event.
enum WatchEvent {
    Upsert(Value),
    Delete(Value),
    Bookmark(Value),
    /// `ERROR` with the `Status` code.
    Error {
        code: i64,
        message: String,
    },
}

fn parse_watch_line(line: &[u8]) -> Result<WatchEvent, Rejection> {
    let mut event: Value = serde_json::from_slice(line).map_err(|_| "watch line is not JSON")?;
    let kind = event.get("type").and_then(Value::as_str).unwrap_or("").to_owned();
    let object = event.get_mut("object").map(Value::take).ok_or("watch event has no object")?;
    if !object.is_object() {
        return Err("watch event object is not an object");
    }
    match kind.as_str() {
        "ADDED" | "MODIFIED" => Ok(WatchEvent::Upsert(object)),
        "DELETED" => Ok(WatchEvent::Delete(object)),
        "BOOKMARK" => Ok(WatchEvent::Bookmark(object)),
        "ERROR" => Ok(WatchEvent::Error {
            code: object.get("code").and_then(Value::as_i64).unwrap_or(0),
            message: object
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("")
                .chars()
                .take(256)
                .collect(),
        }),
        _ => Err("watch event type is unknown"),
    }
}

fn resource_version(object: &Value) -> Option<String> {
    object.pointer("/metadata/resourceVersion").and_then(Value::as_str).map(str::to_owned)
}

/// How one session ended.
enum SessionEnd {
    Cancelled,
    Failed(KubeError),
}

/// The state that survives sessions.
struct KubeWatcher {
    config: KubeDiscoveryConfig,
    client: KubeClient,
    view: ClusterView,
    differ: RecordDiffer,
    stats: DiscoveryStats,
    /// The resource versions to watch from; `None` until listed (or after a `410`).
    versions: Option<(String, String)>,
    /// The next relist is the periodic reconciliation: it reports what drifted as differences.
    reconciling: bool,
    /// Object versions already counted as rejected (at most [`DISCOVERY_RECORDS_MAX`]; emptied
    /// when full).
    rejected: BTreeSet<String>,
}

impl KubeWatcher {
    /// Count and log a skipped object, once per object version (`identity`); a rejection
    /// without identity (a watch line that could not be read) is counted every time.
    fn reject(&mut self, resource: Resource, identity: Option<String>, rejection: Rejection) {
        if let Some(identity) = identity {
            if self.rejected.contains(&identity) {
                debug!(identity, rejection, "Kubernetes discovery object still unreadable");
                return;
            }
            if self.rejected.len() >= DISCOVERY_RECORDS_MAX {
                self.rejected.clear();
            }
            warn!(identity, rejection, "skipping a Kubernetes discovery object");
            self.rejected.insert(identity);
        } else {
            warn!(?resource, rejection, "skipping a Kubernetes discovery watch line");
        }
        self.stats.rejected_objects = self.stats.rejected_objects.saturating_add(1);
    }

    fn fail(&mut self, error: &KubeError) {
        self.stats.transport_errors = self.stats.transport_errors.saturating_add(1);
        self.stats.last_error = Some(error.to_string());
    }

    /// Every object of `resource` (all pages) and the list's resource version. A `continue`
    /// token that expired restarts the listing once.
    async fn list_all(&mut self, resource: Resource) -> Result<(Vec<Value>, String), KubeError> {
        let mut restarted = false;
        'restart: loop {
            let mut objects = Vec::new();
            let mut continue_token: Option<String> = None;
            loop {
                let request = self.config.list_request(resource, continue_token.as_deref())?;
                let body = match self.client.get(request, self.config.list_bytes_max).await {
                    Ok(body) => body,
                    Err(KubeError::Gone { .. }) if continue_token.is_some() && !restarted => {
                        restarted = true;
                        continue 'restart;
                    }
                    Err(error) => return Err(error),
                };
                let mut list: Value = serde_json::from_slice(&body)
                    .map_err(|e| KubeError::Http(format!("list body is not JSON: {e}")))?;
                let version = list
                    .pointer("/metadata/resourceVersion")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned();
                let next = list
                    .pointer("/metadata/continue")
                    .and_then(Value::as_str)
                    .filter(|token| !token.is_empty())
                    .map(str::to_owned);
                let items = match list.get_mut("items").map(Value::take) {
                    Some(Value::Array(items)) => items,
                    None | Some(Value::Null) => Vec::new(),
                    Some(_) => return Err(KubeError::Http("list items is not an array".into())),
                };
                for item in items {
                    if objects.len() >= DISCOVERY_RECORDS_MAX {
                        let identity = object_identity(resource, &item);
                        self.reject(resource, identity, "more objects than the backend holds");
                        continue;
                    }
                    if encoded_len(&item) > self.config.object_bytes_max {
                        // Kept as present but unreadable (counted when applied).
                        let metadata = &item["metadata"];
                        objects.push(serde_json::json!({
                            "metadata": {
                                "name": metadata.get("name"),
                                "uid": metadata.get("uid"),
                                "resourceVersion": metadata.get("resourceVersion"),
                            },
                            OVERSIZED_MARK: true,
                        }));
                        continue;
                    }
                    objects.push(item);
                }
                match next {
                    Some(token) => continue_token = Some(token),
                    None => return Ok((objects, version)),
                }
            }
        }
    }

    /// List both resources and apply them as a relist.
    async fn relist(&mut self) -> Result<Vec<DiscoveryOutput>, KubeError> {
        let (metadata, metadata_version) = self.list_all(Resource::Metadata).await?;
        let (readiness, readiness_version) = self.list_all(Resource::Readiness).await?;
        for (identity, rejection) in self.view.replace(Resource::Metadata, &metadata) {
            self.reject(Resource::Metadata, identity, rejection);
        }
        for (identity, rejection) in self.view.replace(Resource::Readiness, &readiness) {
            self.reject(Resource::Readiness, identity, rejection);
        }
        self.stats.revision = metadata_version.parse().unwrap_or(0);
        self.versions = Some((metadata_version, readiness_version));
        self.stats.listings = self.stats.listings.saturating_add(1);
        let mode = if std::mem::take(&mut self.reconciling) {
            self.stats.relists = self.stats.relists.saturating_add(1);
            ListingMode::Poll
        } else {
            ListingMode::Relist
        };
        let outputs = self.differ.apply_listing(self.view.listing(), mode);
        self.stats.records = self.differ.counters().clone();
        self.stats.soft_errors = self.differ.soft_errors().clone();
        debug!(
            metadata = self.view.metadata.len(),
            readiness = self.view.ready.len(),
            "Kubernetes discovery listed"
        );
        Ok(outputs)
    }

    /// Apply one watch line of `resource`. `Err(Some(error))` ends the session;
    /// `Err(None)` asks for a relist.
    fn apply_line(
        &mut self,
        resource: Resource,
        line: WatchLine,
    ) -> Result<Vec<DiscoveryOutput>, Option<KubeError>> {
        let line = match line {
            WatchLine::Line(line) => line,
            WatchLine::Oversized { bytes } => {
                debug!(bytes, "oversized watch line");
                self.reject(resource, None, "watch event larger than the object limit");
                return Ok(Vec::new());
            }
        };
        let event = match parse_watch_line(&line) {
            Ok(event) => event,
            Err(rejection) => {
                self.reject(resource, None, rejection);
                return Ok(Vec::new());
            }
        };
        let (outcome, object) = match event {
            WatchEvent::Upsert(object) => (self.view.upsert(resource, &object), object),
            WatchEvent::Delete(object) => (self.view.delete(resource, &object), object),
            WatchEvent::Bookmark(object) => {
                self.set_version(resource, &object);
                return Ok(Vec::new());
            }
            WatchEvent::Error { code: 410, message } => {
                info!(?resource, message, "Kubernetes watch expired (410); relisting");
                self.stats.compactions = self.stats.compactions.saturating_add(1);
                return Err(None);
            }
            WatchEvent::Error { code, message } => {
                return Err(Some(KubeError::Status {
                    status: u16::try_from(code).unwrap_or(0),
                    message,
                }));
            }
        };
        if let Err(rejection) = outcome {
            let identity = object_identity(resource, &object);
            self.reject(resource, identity, rejection);
        }
        self.set_version(resource, &object);
        self.stats.watch_events = self.stats.watch_events.saturating_add(1);
        let outputs = self.differ.apply_listing(self.view.listing(), ListingMode::Poll);
        self.stats.records = self.differ.counters().clone();
        self.stats.soft_errors = self.differ.soft_errors().clone();
        Ok(outputs)
    }

    fn set_version(&mut self, resource: Resource, object: &Value) {
        let (Some(version), Some(versions)) = (resource_version(object), self.versions.as_mut())
        else {
            return;
        };
        match resource {
            Resource::Metadata => {
                self.stats.revision = version.parse().unwrap_or(self.stats.revision);
                versions.0 = version;
            }
            Resource::Readiness => versions.1 = version,
        }
    }

    async fn deliver(
        &self,
        sink: &DiscoverySink,
        outputs: Vec<DiscoveryOutput>,
        cancel: &CancellationToken,
    ) -> Result<bool, DiscoveryPlaneError> {
        let delivery = sink.deliver(outputs, cancel).await?;
        sink.publish_stats(&self.stats);
        Ok(delivery == Delivery::Cancelled)
    }

    async fn open_watches(&self) -> Result<(WatchLines, WatchLines), KubeError> {
        let Some((metadata_version, readiness_version)) = &self.versions else {
            return Err(KubeError::Gone { message: "nothing listed yet".into() });
        };
        let line_max = self.config.object_bytes_max;
        let metadata = self
            .client
            .watch(self.config.watch_request(Resource::Metadata, metadata_version)?, line_max)
            .await?;
        let readiness = self
            .client
            .watch(self.config.watch_request(Resource::Readiness, readiness_version)?, line_max)
            .await?;
        Ok((metadata, readiness))
    }

    /// List if needed, then watch both resources until an error.
    async fn session(
        &mut self,
        sink: &DiscoverySink,
        backoff: &mut Backoff,
        cancel: &CancellationToken,
    ) -> Result<SessionEnd, DiscoveryPlaneError> {
        let mut namespaces = sink.namespaces.clone();
        let period = self.config.reconcile_interval;
        let mut reconcile = tokio::time::interval_at(Instant::now() + period, period);
        reconcile.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            if let Some(limit) = sink.namespace_limit_change(self.differ.namespace_limit()) {
                info!(namespaces = ?limit, "Kubernetes discovery scope narrowed; relisting");
                self.differ.set_namespace_limit(limit);
                self.versions = None;
            }
            if self.versions.is_none() {
                let outputs = match self.relist().await {
                    Ok(outputs) => outputs,
                    Err(error) => return Ok(SessionEnd::Failed(error)),
                };
                if self.deliver(sink, outputs, cancel).await? {
                    return Ok(SessionEnd::Cancelled);
                }
            }
            let (mut metadata, mut readiness) = match self.open_watches().await {
                Ok(watches) => watches,
                Err(KubeError::Gone { message }) => {
                    info!(message, "Kubernetes watch version expired (410); relisting");
                    self.stats.compactions = self.stats.compactions.saturating_add(1);
                    self.versions = None;
                    continue;
                }
                Err(error) => return Ok(SessionEnd::Failed(error)),
            };
            backoff.reset();
            debug!(namespace = self.config.namespace, "Kubernetes discovery watching");
            loop {
                let applied = tokio::select! {
                    biased;
                    () = cancel.cancelled() => return Ok(SessionEnd::Cancelled),
                    () = DiscoverySink::namespace_limit_changed(&mut namespaces) => break,
                    _ = reconcile.tick() => {
                        self.versions = None;
                        self.reconciling = true;
                        break;
                    }
                    line = metadata.next_line() => (Resource::Metadata, line),
                    line = readiness.next_line() => (Resource::Readiness, line),
                };
                let outputs = match applied {
                    (_, Err(error)) => return Ok(SessionEnd::Failed(error)),
                    // The server closed the watch (its timeout): reopen from the versions seen.
                    (_, Ok(None)) => break,
                    (resource, Ok(Some(line))) => match self.apply_line(resource, line) {
                        Ok(outputs) => outputs,
                        Err(None) => {
                            self.versions = None;
                            break;
                        }
                        Err(Some(error)) => return Ok(SessionEnd::Failed(error)),
                    },
                };
                if self.deliver(sink, outputs, cancel).await? {
                    return Ok(SessionEnd::Cancelled);
                }
            }
        }
    }
}

/// The length of `value` encoded as JSON, counted without buffering it.
fn encoded_len(value: &Value) -> usize {
    struct Counter(usize);
    impl std::io::Write for Counter {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 = self.0.saturating_add(bytes.len());
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut counter = Counter(0);
    let _ = serde_json::to_writer(&mut counter, value);
    counter.0
}

/// Run the Kubernetes backend until `cancel` fires (`Ok(())`) or the sink closes
/// ([`DiscoveryPlaneError::SinkClosed`]). Fails at once only on an invalid configuration;
/// connection, HTTP and API errors are retried forever with backoff.
pub async fn run_kube_discovery(
    config: KubeDiscoveryConfig,
    scope: DiscoveryScope,
    sink: DiscoverySink,
    cancel: CancellationToken,
) -> Result<(), DiscoveryPlaneError> {
    config.validate()?;
    let client = KubeClient::new(config.api.clone())
        .map_err(|error| DiscoveryPlaneError::InvalidKubeApi(error.to_string()))?;
    let mut backoff = Backoff::new(config.reconnect_backoff_initial, config.reconnect_backoff_max);
    info!(
        api = config.api.api_url,
        namespace = config.namespace,
        mode = ?config.mode,
        "Kubernetes discovery starting"
    );
    let mut watcher = KubeWatcher {
        view: ClusterView::new(config.mode),
        config,
        client,
        differ: RecordDiffer::new(scope, KeyForm::Logical),
        stats: DiscoveryStats::default(),
        versions: None,
        reconciling: false,
        rejected: BTreeSet::new(),
    };
    let mut sessions = 0u64;
    loop {
        if sessions > 0 {
            watcher.stats.reconnects = watcher.stats.reconnects.saturating_add(1);
        }
        sessions += 1;
        let error = match watcher.session(&sink, &mut backoff, &cancel).await? {
            SessionEnd::Cancelled => return Ok(()),
            SessionEnd::Failed(error) => error,
        };
        watcher.fail(&error);
        sink.publish_stats(&watcher.stats);
        let delay = backoff.next_delay();
        warn!(%error, retry_in = ?delay, "Kubernetes discovery interrupted");
        if sleep_or_cancel(delay, &cancel).await {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn metadata(name: &str, uid: &str, data: Value) -> Value {
        json!({"metadata": {"name": name, "uid": uid, "resourceVersion": "7"}, "spec": {"data": data}})
    }

    fn worker_data(path: &str) -> Value {
        json!({
            "endpoints": {path: {"type": "Endpoint"}},
            "model_cards": {path: {"type": "Model"}},
            "event_channels": null,
        })
    }

    fn slice(name: &str, pods: &[(&str, bool)]) -> Value {
        let endpoints: Vec<Value> = pods
            .iter()
            .map(|(pod, ready)| json!({"conditions": {"ready": ready}, "targetRef": {"kind": "Pod", "name": pod}}))
            .collect();
        json!({"metadata": {"name": name}, "endpoints": endpoints})
    }

    fn keys(view: &ClusterView) -> Vec<String> {
        view.listing().into_iter().map(|entry| entry.key).collect()
    }

    #[test]
    fn records_of_ready_workers_only_are_listed_under_logical_keys() {
        let mut view = ClusterView::new(KubeDiscoveryMode::Pod);
        view.upsert(
            Resource::Metadata,
            &metadata("w-0", "u0", worker_data("dynamo/backend/generate/a")),
        )
        .unwrap();
        view.upsert(
            Resource::Metadata,
            &metadata("w-1", "u1", worker_data("dynamo/backend/generate/b")),
        )
        .unwrap();
        assert!(keys(&view).is_empty(), "nothing is ready yet");
        view.upsert(Resource::Readiness, &slice("s", &[("w-0", true), ("w-1", false)])).unwrap();
        assert_eq!(
            keys(&view),
            vec!["v1/instances/dynamo/backend/generate/a", "v1/mdc/dynamo/backend/generate/a"]
        );
        view.delete(Resource::Readiness, &slice("s", &[])).unwrap();
        assert!(keys(&view).is_empty());
    }

    #[test]
    fn unreadable_data_keeps_the_last_readable_records_for_the_same_uid_only() {
        let mut view = ClusterView::new(KubeDiscoveryMode::Pod);
        view.upsert(Resource::Readiness, &slice("s", &[("w-0", true)])).unwrap();
        view.upsert(Resource::Metadata, &metadata("w-0", "u0", worker_data("ns/c/e/a"))).unwrap();
        assert_eq!(keys(&view).len(), 2);
        assert!(view.upsert(Resource::Metadata, &metadata("w-0", "u0", Value::Null)).is_err());
        assert_eq!(keys(&view).len(), 2, "a transiently invalid resource keeps its records");
        assert!(
            view.upsert(Resource::Metadata, &metadata("w-0", "u0", json!({"endpoints": 3})))
                .is_err()
        );
        assert_eq!(keys(&view).len(), 2);
        assert!(view.upsert(Resource::Metadata, &metadata("w-0", "u9", Value::Null)).is_err());
        assert!(keys(&view).is_empty(), "a re-created resource starts empty");
        assert_eq!(
            view.upsert(Resource::Metadata, &json!({"metadata": {}})),
            Err("object has no usable metadata.name")
        );
    }

    #[test]
    fn a_relist_drops_unlisted_resources_and_keeps_data_of_listed_ones() {
        let mut view = ClusterView::new(KubeDiscoveryMode::Pod);
        view.upsert(Resource::Readiness, &slice("s", &[("w-0", true), ("w-1", true)])).unwrap();
        view.upsert(Resource::Metadata, &metadata("w-0", "u0", worker_data("ns/c/e/a"))).unwrap();
        view.upsert(Resource::Metadata, &metadata("w-1", "u1", worker_data("ns/c/e/b"))).unwrap();
        let rejected = view.replace(Resource::Metadata, &[metadata("w-0", "u0", Value::Null)]);
        assert_eq!(rejected.len(), 1);
        assert_eq!(keys(&view), vec!["v1/instances/ns/c/e/a", "v1/mdc/ns/c/e/a"]);
    }

    #[test]
    fn container_mode_names_resources_per_container_with_the_main_container_as_the_pod() {
        let pod = json!({
            "metadata": {"name": "p", "annotations": {MAIN_CONTAINER_ANNOTATION: "engine"}},
            "status": {"containerStatuses": [
                {"name": "engine", "ready": true},
                {"name": "side", "ready": true},
                {"name": "slow", "ready": false},
            ]},
        });
        assert_eq!(pod_ready(&pod, "p").unwrap(), BTreeSet::from(["p".into(), "p-side".into()]));
        let plain = json!({"metadata": {"name": "q"}, "status": {"containerStatuses": [{"name": "main", "ready": true}]}});
        assert_eq!(pod_ready(&plain, "q").unwrap(), BTreeSet::from(["q".into()]));
        assert!(pod_ready(&json!({"status": {"containerStatuses": 5}}), "q").is_err());
    }

    #[test]
    fn oversized_records_are_rejected_values_not_dropped_keys() {
        let big = "x".repeat(DISCOVERY_RECORD_BYTES_MAX);
        let records =
            data_records(Some(&json!({"endpoints": {"ns/c/e/a": {"pad": big}}}))).unwrap();
        assert!(matches!(
            records.get("v1/instances/ns/c/e/a"),
            Some(EntryValue::Rejected(InputError::TooLarge { .. }))
        ));
    }

    #[test]
    fn watch_lines_decode_every_event_type_and_refuse_garbage() {
        let upsert = br#"{"type":"MODIFIED","object":{"metadata":{"name":"a"}}}"#;
        assert!(matches!(parse_watch_line(upsert), Ok(WatchEvent::Upsert(_))));
        let gone = br#"{"type":"ERROR","object":{"kind":"Status","code":410,"message":"too old"}}"#;
        assert!(matches!(parse_watch_line(gone), Ok(WatchEvent::Error { code: 410, .. })));
        assert!(parse_watch_line(b"{not json").is_err());
        assert!(parse_watch_line(br#"{"type":"ADDED","object":3}"#).is_err());
        assert!(parse_watch_line(br#"{"type":"RENAMED","object":{}}"#).is_err());
    }

    #[test]
    fn required_access_names_exactly_the_collections_requested() {
        let mut config = KubeDiscoveryConfig::new(KubeApiConfig::new("http://h:1"), "ns");
        for mode in [KubeDiscoveryMode::Pod, KubeDiscoveryMode::Container] {
            config.mode = mode;
            for (access, resource) in
                config.required_access().iter().zip([Resource::Metadata, Resource::Readiness])
            {
                let path = config.collection(resource);
                assert!(path.ends_with(&format!("/namespaces/ns/{}", access.resource)), "{path}");
                let prefix = if access.group.is_empty() {
                    "/api/".to_owned()
                } else {
                    format!("/apis/{}/", access.group)
                };
                assert!(path.starts_with(&prefix), "{path}");
                assert_eq!(access.verbs, ["list", "watch"]);
            }
        }
        config.mode = KubeDiscoveryMode::Pod;
        assert_eq!(
            config.collection(Resource::Metadata),
            "/apis/nvidia.com/v1alpha1/namespaces/ns/dynamoworkermetadatas"
        );
    }

    #[test]
    fn settings_come_from_the_environment_and_the_service_account() {
        let account = tempfile::tempdir().unwrap();
        std::fs::write(account.path().join("token"), "t0k3n\n").unwrap();
        std::fs::write(account.path().join("namespace"), "dynamo-system\n").unwrap();
        let lookup = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs.iter().find(|(key, _)| *key == name).map(|(_, value)| (*value).to_owned())
            }
        };
        let explicit = KubeDiscoveryConfig::from_lookup(
            lookup(&[
                (KUBE_API_URL_ENV, "http://127.0.0.1:8001"),
                ("DYN_KUBE_DISCOVERY_MODE", "Container"),
            ]),
            account.path(),
        )
        .unwrap();
        assert_eq!(explicit.namespace, "dynamo-system");
        assert_eq!(explicit.mode, KubeDiscoveryMode::Container);
        assert_eq!(explicit.api.token_file, Some(account.path().join("token")));
        // `kube`'s builder leaves an empty pair after `?`, which API servers ignore.
        assert_eq!(
            explicit.watch_request(Resource::Readiness, "41").unwrap().uri().to_string(),
            "/api/v1/namespaces/dynamo-system/pods?&watch=true&timeoutSeconds=300&labelSelector=nvidia.com%2Fdynamo-discovery-backend%3Dkubernetes%2Cnvidia.com%2Fdynamo-discovery-enabled%3Dtrue&allowWatchBookmarks=true&resourceVersion=41"
        );
        assert_eq!(
            explicit.list_request(Resource::Metadata, Some("a b/c")).unwrap().uri().to_string(),
            "/apis/nvidia.com/v1alpha1/namespaces/dynamo-system/dynamoworkermetadatas?&limit=500&continue=a+b%2Fc"
        );
        // In-cluster: https needs the CA, which this account directory lacks.
        let in_cluster = KubeDiscoveryConfig::from_lookup(
            lookup(&[(KUBERNETES_SERVICE_HOST_ENV, "10.96.0.1"), (POD_NAMESPACE_ENV, "dynamo")]),
            account.path(),
        );
        assert!(
            matches!(in_cluster, Err(DiscoveryPlaneError::InvalidKubeApi(_))),
            "{in_cluster:?}"
        );
        assert!(matches!(
            KubeDiscoveryConfig::from_lookup(lookup(&[]), account.path()),
            Err(DiscoveryPlaneError::MissingSetting { variable: KUBERNETES_SERVICE_HOST_ENV, .. })
        ));
        assert!(matches!(
            KubeDiscoveryConfig::from_lookup(
                lookup(&[(KUBE_API_URL_ENV, "http://h:1"), (POD_NAMESPACE_ENV, "../etc")]),
                account.path()
            ),
            Err(DiscoveryPlaneError::InvalidConfig { field: POD_NAMESPACE_ENV, .. })
        ));
        assert!(matches!(
            KubeDiscoveryConfig::from_lookup(
                lookup(&[(KUBE_API_URL_ENV, "http://h:1"), (KUBE_DISCOVERY_MODE_ENV, "node")]),
                account.path()
            ),
            Err(DiscoveryPlaneError::InvalidConfig { field: KUBE_DISCOVERY_MODE_ENV, .. })
        ));
    }
}
