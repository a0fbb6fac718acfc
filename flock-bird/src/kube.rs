//! The agent's pod source in kube mode (`--kube`): every fact about a pod from the
//! Kubernetes API, none from annotations.
//!
//! At a CNI ADD the runtime tells the agent the pod's namespace, name and UID; the
//! rest comes from the API ([`KubePods::admit`]):
//!
//! * the Pod object, from this node's pod reflector, or by a direct GET when the ADD
//!   raced ahead of the watch event ([`KubeWatch::pod`], waiting at most
//!   `--kube-pod-wait`);
//! * its UID must be the runtime's when the runtime passes one: a pod deleted and
//!   re-created under the same name is another pod, and the sandbox of one must not
//!   get the other's identity. A reflector copy that disagrees is confirmed by a
//!   direct GET first (the reflector may not have seen the re-creation yet);
//! * `flock_kube::map::pod_facts` with its namespace's labels decides whether it is
//!   meshed (opt-in by the `flock.io/mesh` label), its identity (the service account)
//!   and its ports (its containers'); a pod that is not meshed is ignored, one that is
//!   terminating or bound to another node is refused;
//! * `flock_core::pod::admit_api` validates the record with the same rules as an
//!   annotated pod's. The record names no service: its memberships are the Services
//!   that select it, recomputed from the reflector whenever labels or Services change
//!   ([`KubePods::members`]; the agent's resync task applies them to the registry).
//!
//! The identity annotations (`flock.io/service`, `flock.io/ports`,
//! `flock.io/service-account`) are ignored in kube mode — anyone who can create a pod
//! can write annotations, while the API's service account is what RBAC and the
//! admission chain govern — and a log line says so when a pod carries them.
//!
//! When the API cannot be asked (unreachable, no answer) the ADD fails with a message
//! the runtime shows: the agent refuses to guess a pod's identity.

use crate::agent::{AddPodInput, PodError};
use crate::model::{
    PORTS_ANNOTATION, PodPort, PodRecord, Protocol, SERVICE_ACCOUNT_ANNOTATION, SERVICE_ANNOTATION,
};
use flock_core::pod::{AdmittedPod, PodKey};
use flock_core::sync::{Mutex, lock};
use flock_kube::map;
use flock_kube::watch::{KubeWatch, LookupError, Snapshot};
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// The annotations that give a pod its identity and ports outside kube mode; ignored
/// (and logged) in kube mode.
pub const IDENTITY_ANNOTATIONS: [&str; 3] = [
    SERVICE_ANNOTATION,
    PORTS_ANNOTATION,
    SERVICE_ACCOUNT_ANNOTATION,
];

/// How long a direct GET (a pod or a namespace the reflector does not hold) may take.
const GET_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the API may take to answer an ADD's lookups, beyond the `pod_wait` spent
/// waiting for the reflector. The CNI plugin gives up after its `timeout_ms` (5 s by
/// default) with a bare "deadline exceeded"; the agent must answer first, with the
/// reason, so the default `pod_wait` (2 s) plus this stays under it. An API server that
/// accepts connections but never answers would otherwise hold the ADD for the GETs'
/// full timeouts.
pub const API_ANSWER_BUDGET: Duration = Duration::from_millis(2500);

/// One Service port a pod is a member of: what it registers.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct MemberPort {
    /// The Service's name.
    pub service: String,
    /// The Service's port.
    pub service_port: u16,
    /// How the port speaks.
    pub protocol: Protocol,
    /// The pod port it targets.
    pub app_port: u16,
    /// Envoy's inbound listener for that pod port (a proxyless port: the app's own):
    /// the endpoint's port.
    pub listen_port: u16,
}

/// A pod's memberships as the API describes it now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Members {
    /// Every Service port the pod is a member of, sorted.
    pub ports: Vec<MemberPort>,
    /// The pod is terminating (`deletionTimestamp` set): its endpoints are draining.
    pub terminating: bool,
    /// The pod's labels its endpoints carry ([`endpoint_labels`]).
    pub labels: flock_core::labels::Labels,
}

/// The label keys to give `--endpoint-labels` for version subsets: the version labels
/// of Istio's convention and of Kubernetes' recommended labels. Not the default: an
/// agent older than endpoint labels refuses a registry entry that has them (its
/// entries have no unknown fields), so they are turned on once every node runs an
/// agent that reads them.
pub const VERSION_LABELS: [&str; 2] = ["version", "app.kubernetes.io/version"];

/// The labels of `labels` whose keys are in `keys` (pure): what a pod's endpoints
/// carry for route subsets. A value the label rules refuse is left out (the API
/// server validates labels as [`flock_core::labels`] does, so only a test double's
/// could be).
pub fn endpoint_labels(
    labels: &BTreeMap<String, String>,
    keys: &[String],
) -> flock_core::labels::Labels {
    keys.iter()
        .take(flock_core::labels::MAX_LABELS)
        .filter_map(|k| {
            let v = labels.get(k)?;
            flock_core::labels::check_value(v).ok()?;
            Some((k.clone(), v.clone()))
        })
        .collect()
}

impl Members {
    /// The Service ports the pod's ports serve, for the policies that govern them.
    pub fn port_services(&self) -> Vec<flock_core::authz::PortService> {
        self.ports
            .iter()
            .map(|m| flock_core::authz::PortService {
                app_port: m.app_port,
                service: m.service.clone(),
                service_port: m.service_port,
            })
            .collect()
    }
}

/// What kube mode decided for a CNI ADD.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KubeAdmission {
    /// Meshed: the validated pod and its memberships at this moment.
    Meshed {
        /// The record's fields (service empty; account and ports from the API).
        pod: Box<AdmittedPod>,
        /// Its memberships.
        members: Members,
    },
    /// Not meshed (not opted in, opted out, host network); the message says why.
    Ignored(String),
}

/// The message of a CNI ADD whose pod the API could not identify.
pub fn unidentified(pod: &str, e: &LookupError) -> PodError {
    match e {
        LookupError::Unreachable(cause) => unreachable_api(pod, cause),
        other => PodError::Unidentified(format!(
            "cannot identify pod {pod}: {other}; refusing to guess its identity"
        )),
    }
}

fn unreachable_api(pod: &str, cause: &str) -> PodError {
    PodError::Unidentified(format!(
        "cannot identify pod {pod}: the Kubernetes API is unreachable ({cause}); refusing to \
         guess its identity"
    ))
}

/// Whether the runtime's UID (`K8S_POD_UID`, may be empty) and the API's disagree.
fn uid_differs(runtime_uid: &str, pod: &Pod) -> bool {
    let api_uid = pod.metadata.uid.as_deref().unwrap_or_default();
    !runtime_uid.is_empty() && !api_uid.is_empty() && runtime_uid != api_uid
}

/// The Services of `namespace` in `snapshot`.
pub fn services_in<'a>(
    snapshot: &'a Snapshot,
    namespace: &'a str,
) -> impl Iterator<Item = &'a Service> + 'a {
    snapshot
        .services
        .range((namespace.to_string(), String::new())..)
        .take_while(move |((ns, _), _)| ns == namespace)
        .map(|(_, svc)| svc.as_ref())
}

/// A pod's member ports: each membership port whose target is one of `ports` (the
/// record's, whose listeners Envoy serves), sorted.
pub fn member_ports(memberships: &[map::Membership], ports: &[PodPort]) -> Vec<MemberPort> {
    let mut out: Vec<MemberPort> = memberships
        .iter()
        .flat_map(|m| {
            m.ports.iter().filter_map(|p| {
                let served = ports.iter().find(|q| q.app_port == p.app_port)?;
                Some(MemberPort {
                    service: m.service.clone(),
                    service_port: p.service_port,
                    protocol: p.protocol,
                    app_port: served.app_port,
                    listen_port: served.dialled_port(),
                })
            })
        })
        .collect();
    out.sort();
    out
}

/// Decides a CNI ADD from the Pod the API has (pure): the UID check, the mesh
/// decision, the refusals (terminating, another node), the record and its current
/// memberships among `services` (its namespace's).
pub fn decide<'a>(
    input: &AddPodInput,
    pod: &Pod,
    namespace_labels: Option<&BTreeMap<String, String>>,
    services: impl IntoIterator<Item = &'a Service>,
    node: &str,
    label_keys: &[String],
) -> Result<KubeAdmission, PodError> {
    let pod_ref = format!("{}/{}", input.namespace, input.name);
    if uid_differs(&input.uid, pod) {
        return Err(PodError::Unidentified(format!(
            "cannot identify pod {pod_ref}: the Kubernetes API's pod of that name has uid {:?}, \
             the runtime's sandbox is for uid {:?} (the pod was deleted and re-created under \
             the same name); refusing to give one pod's sandbox the other's identity",
            pod.metadata.uid.as_deref().unwrap_or_default(),
            input.uid.chars().take(64).collect::<String>()
        )));
    }
    let facts = map::pod_facts(pod, namespace_labels)
        .map_err(|e| PodError::Invalid(format!("pod {pod_ref} cannot be meshed: {e}")))?;
    if let map::MeshDecision::NotMeshed(why) = &facts.mesh {
        return Ok(KubeAdmission::Ignored(format!(
            "pod {pod_ref} is not meshed: {why}"
        )));
    }
    if let Some(why) = facts.refusal(node) {
        return Err(PodError::Invalid(format!("{why}: not meshed on this node")));
    }
    let mut admitted =
        flock_core::pod::admit_api(input, facts.service_account.clone(), facts.ports.clone())
            .map_err(|e| PodError::Invalid(format!("pod {pod_ref} cannot be meshed: {e}")))?;
    // Capture from the API's annotations, like every other fact in kube mode.
    admitted.capture = facts.capture.clone();
    // And the pod's own authorization policy (it narrows, never widens).
    admitted.authz = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(flock_core::authz::ANNOTATION))
        .cloned();
    if let Some(a) = &admitted.authz {
        flock_core::authz::check_annotation_size(a).map_err(|e| {
            PodError::Invalid(format!(
                "pod {pod_ref} cannot be meshed: {}: {e}",
                flock_core::authz::ANNOTATION
            ))
        })?;
    }
    let members = Members {
        ports: member_ports(&map::memberships(&facts, services), &admitted.ports),
        terminating: facts.terminating,
        labels: endpoint_labels(&facts.labels, label_keys),
    };
    Ok(KubeAdmission::Meshed {
        pod: Box::new(admitted),
        members,
    })
}

/// A live pod's memberships from `snapshot` (pure): `None` when the snapshot has no pod
/// of that name with the record's UID (deleted from the API, or re-created as another
/// pod), or the pod no longer maps.
pub fn members_in(snapshot: &Snapshot, rec: &PodRecord, label_keys: &[String]) -> Option<Members> {
    let pod = snapshot
        .pods
        .get(&(rec.namespace.clone(), rec.name.clone()))?;
    if uid_differs(&rec.uid, pod) {
        return None;
    }
    let facts = map::pod_facts(pod, snapshot.namespaces.get(&rec.namespace)).ok()?;
    let memberships = map::memberships(&facts, services_in(snapshot, &rec.namespace));
    Some(Members {
        ports: member_ports(&memberships, &rec.ports),
        terminating: facts.terminating,
        labels: endpoint_labels(&facts.labels, label_keys),
    })
}

/// The pod source of kube mode: the reflectors, this node's name, and each live pod's
/// last-known memberships.
pub struct KubePods {
    watch: Arc<KubeWatch>,
    node_name: String,
    pod_wait: Duration,
    /// The memberships last computed for each live pod: what it registers while the
    /// reflector does not show it (an ADD that raced ahead of the watch event; a pod
    /// deleted from the API whose CNI DEL has not come yet).
    last: Mutex<BTreeMap<PodKey, Members>>,
    /// The pod label keys endpoints carry ([`endpoint_labels`]).
    label_keys: Vec<String>,
}

impl KubePods {
    /// A pod source over `watch` for the node `node_name`; an ADD waits at most
    /// `pod_wait` for the pod to appear in the reflector before asking the API
    /// directly.
    pub fn new(watch: Arc<KubeWatch>, node_name: impl Into<String>, pod_wait: Duration) -> Self {
        Self {
            watch,
            node_name: node_name.into(),
            pod_wait,
            last: Mutex::new(BTreeMap::new()),
            label_keys: Vec::new(),
        }
    }

    /// Endpoints carry the pod labels of these keys (`--endpoint-labels`; default
    /// none, see [`VERSION_LABELS`]).
    pub fn with_endpoint_labels(mut self, keys: Vec<String>) -> Self {
        self.label_keys = keys;
        self
    }

    /// The reflectors.
    pub fn watch(&self) -> &Arc<KubeWatch> {
        &self.watch
    }

    /// The current snapshot of the reflectors.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.watch.view().borrow().clone()
    }

    /// Why kube mode is not ready (the reflectors have not listed everything yet), or
    /// `None`.
    pub fn not_ready(&self) -> Option<String> {
        let snapshot = self.snapshot();
        if snapshot.synced {
            return None;
        }
        Some(match &snapshot.last_error {
            Some(e) => format!("Kubernetes API reflectors not synced yet ({e})"),
            None => "Kubernetes API reflectors not synced yet".to_string(),
        })
    }

    /// Decides a CNI ADD from the API (see the module docs).
    pub async fn admit(&self, input: &AddPodInput) -> Result<KubeAdmission, PodError> {
        let pod_ref = format!("{}/{}", input.namespace, input.name);
        let carried: Vec<&str> = IDENTITY_ANNOTATIONS
            .into_iter()
            .filter(|a| input.annotations.contains_key(*a))
            .collect();
        if !carried.is_empty() {
            tracing::info!(
                pod = %pod_ref,
                annotations = ?carried,
                "identity annotations ignored: with --kube a pod's identity, ports and \
                 memberships come from the Kubernetes API"
            );
        }
        let budget = self.pod_wait + API_ANSWER_BUDGET;
        match tokio::time::timeout(budget, self.lookup(input, &pod_ref)).await {
            Ok(decided) => decided,
            Err(_) => Err(unreachable_api(
                &pod_ref,
                &format!("no answer within {budget:?}"),
            )),
        }
    }

    /// The lookups of [`admit`](Self::admit) and its decision.
    async fn lookup(&self, input: &AddPodInput, pod_ref: &str) -> Result<KubeAdmission, PodError> {
        let pod = self
            .watch
            .pod(&input.namespace, &input.name, self.pod_wait)
            .await
            .map_err(|e| unidentified(pod_ref, &e))?;
        // The reflector may still hold the pod this name belonged to before: ask the
        // API itself before refusing.
        let pod = if uid_differs(&input.uid, &pod) {
            Arc::new(self.get_pod(&input.namespace, &input.name).await?)
        } else {
            pod
        };
        let snapshot = self.snapshot();
        let namespace_labels = match snapshot.namespaces.get(&input.namespace) {
            Some(labels) => Some(labels.clone()),
            None => self.namespace_labels(&input.namespace, pod_ref).await?,
        };
        decide(
            input,
            &pod,
            namespace_labels.as_ref(),
            services_in(&snapshot, &input.namespace),
            &self.node_name,
            &self.label_keys,
        )
    }

    /// A direct GET of a pod.
    async fn get_pod(&self, namespace: &str, name: &str) -> Result<Pod, PodError> {
        let pod_ref = format!("{namespace}/{name}");
        let api: kube::Api<Pod> = kube::Api::namespaced(self.watch.client().clone(), namespace);
        match tokio::time::timeout(GET_TIMEOUT, api.get_opt(name)).await {
            Err(_) => Err(unreachable_api(
                &pod_ref,
                &format!("GET pod {pod_ref}: no answer within {GET_TIMEOUT:?}"),
            )),
            Ok(Err(e)) => Err(unreachable_api(
                &pod_ref,
                &format!("GET pod {pod_ref}: {e}"),
            )),
            Ok(Ok(None)) => Err(unidentified(
                &pod_ref,
                &LookupError::NotFound {
                    pod: pod_ref.clone(),
                },
            )),
            Ok(Ok(Some(pod))) => Ok(pod),
        }
    }

    /// A namespace's labels by a direct GET (the reflector has not listed it yet):
    /// `None` when it does not exist. The opt-in label may be on it, so an
    /// unreachable API refuses the ADD rather than guess "not meshed".
    async fn namespace_labels(
        &self,
        namespace: &str,
        pod_ref: &str,
    ) -> Result<Option<BTreeMap<String, String>>, PodError> {
        let api: kube::Api<Namespace> = kube::Api::all(self.watch.client().clone());
        match tokio::time::timeout(GET_TIMEOUT, api.get_opt(namespace)).await {
            Err(_) => Err(unreachable_api(
                pod_ref,
                &format!("GET namespace {namespace}: no answer within {GET_TIMEOUT:?}"),
            )),
            Ok(Err(e)) => Err(unreachable_api(
                pod_ref,
                &format!("GET namespace {namespace}: {e}"),
            )),
            Ok(Ok(ns)) => Ok(ns.map(|ns| ns.metadata.labels.unwrap_or_default())),
        }
    }

    /// A live pod's memberships now: from the reflectors when they show the pod (and
    /// remembered), else the last known.
    pub fn members(&self, rec: &PodRecord) -> Members {
        let snapshot = self.snapshot();
        if snapshot.synced
            && let Some(members) = members_in(&snapshot, rec, &self.label_keys)
        {
            lock(&self.last).insert(rec.key.clone(), members.clone());
            return members;
        }
        lock(&self.last).get(&rec.key).cloned().unwrap_or_default()
    }

    /// Remembers a pod's memberships (at ADD, before the reflector may show it).
    pub fn remember(&self, key: &PodKey, members: Members) {
        lock(&self.last).insert(key.clone(), members);
    }

    /// Forgets a removed pod.
    pub fn forget(&self, key: &PodKey) {
        lock(&self.last).remove(key);
    }

    /// Forgets every pod but `live` (a lookup that raced a RemovePod may have
    /// remembered a pod after its [`forget`](Self::forget)).
    pub fn retain(&self, live: &std::collections::BTreeSet<PodKey>) {
        lock(&self.last).retain(|key, _| live.contains(key));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::INBOUND_BASE_PORT;
    use serde_json::json;

    const UID: &str = "6f1c0b6e-0000-4000-8000-000000000001";

    fn pod(extra: serde_json::Value) -> Pod {
        let mut base = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web-0", "namespace": "shop", "uid": UID,
                         "labels": {"app": "web"}},
            "spec": {
                "nodeName": "n1",
                "serviceAccountName": "web-sa",
                "containers": [{"name": "app", "image": "x",
                    "ports": [{"containerPort": 8080, "name": "http"},
                              {"containerPort": 9090, "name": "metrics"}]}]
            }
        });
        merge(&mut base, extra);
        serde_json::from_value(base).unwrap()
    }

    fn merge(into: &mut serde_json::Value, patch: serde_json::Value) {
        match (into, patch) {
            (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
                for (k, v) in b {
                    merge(a.entry(k).or_insert(serde_json::Value::Null), v);
                }
            }
            (slot, v) => *slot = v,
        }
    }

    fn service(name: &str, selector: serde_json::Value, ports: serde_json::Value) -> Service {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "shop"},
            "spec": {"selector": selector, "ports": ports}
        }))
        .unwrap()
    }

    fn input() -> AddPodInput {
        AddPodInput {
            container_id: "c1".into(),
            ifname: "eth0".into(),
            netns: "/var/run/netns/c1".into(),
            name: "web-0".into(),
            namespace: "shop".into(),
            uid: UID.into(),
            ips: vec!["10.0.0.5/24".into()],
            gateways: vec!["10.0.0.1".into()],
            annotations: BTreeMap::new(),
            network_name: "k8s-pod-network".into(),
        }
    }

    fn keys() -> Vec<String> {
        VERSION_LABELS.map(String::from).to_vec()
    }

    fn meshed_ns() -> BTreeMap<String, String> {
        [(map::MESH_LABEL.to_string(), "enabled".to_string())].into()
    }

    fn admitted(r: Result<KubeAdmission, PodError>) -> (AdmittedPod, Members) {
        match r {
            Ok(KubeAdmission::Meshed { pod, members }) => (*pod, members),
            other => panic!("expected a meshed pod, got {other:?}"),
        }
    }

    #[test]
    fn identity_and_ports_come_from_the_api_and_annotations_change_nothing() {
        let mut req = input();
        req.annotations = [
            (SERVICE_ACCOUNT_ANNOTATION.to_string(), "admin".to_string()),
            (SERVICE_ANNOTATION.to_string(), "payments".to_string()),
            (PORTS_ANNOTATION.to_string(), "7000/grpc".to_string()),
        ]
        .into();
        let (rec, members) = admitted(decide(
            &req,
            &pod(json!({})),
            Some(&meshed_ns()),
            [],
            "n1",
            &keys(),
        ));
        assert_eq!(rec.service_account, "web-sa");
        assert_eq!(rec.service, "");
        assert_eq!(
            rec.ports
                .iter()
                .map(|p| (p.app_port, p.listen_port, p.protocol))
                .collect::<Vec<_>>(),
            vec![
                (8080, INBOUND_BASE_PORT, Protocol::Http),
                (9090, INBOUND_BASE_PORT + 1, Protocol::Tcp)
            ]
        );
        // No Service selects it yet: a member of nothing.
        assert_eq!(members, Members::default());
    }

    #[test]
    fn capture_comes_from_the_api_pods_annotations_not_the_cni_requests() {
        use flock_core::capture::policy::{
            CAPTURE_ANNOTATION, EXCLUDE_OUTBOUND_PORTS_ANNOTATION, Setting,
        };
        let mut req = input();
        req.annotations = [(CAPTURE_ANNOTATION.to_string(), "off".to_string())].into();
        let p = pod(json!({"metadata": {"annotations": {
            "flock.io/capture": "permissive",
            "flock.io/capture-exclude-outbound-ports": "5432",
        }}}));
        let (rec, _) = admitted(decide(&req, &p, Some(&meshed_ns()), [], "n1", &keys()));
        assert_eq!(rec.capture.setting, Some(Setting::Permissive));
        assert_eq!(rec.capture.exclude_outbound_ports, vec![5432]);
        // A bad value refuses the meshed pod, naming the API field.
        let p = pod(json!({"metadata": {"annotations": {
            "flock.io/capture-exclude-outbound-ports": "postgres",
        }}}));
        match decide(&input(), &p, Some(&meshed_ns()), [], "n1", &keys()) {
            Err(PodError::Invalid(m)) => assert!(
                m.contains(&format!(
                    "metadata.annotations[{EXCLUDE_OUTBOUND_PORTS_ANNOTATION}]"
                )) && m.contains("\"postgres\" is not a port"),
                "{m}"
            ),
            other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
        }
        // Not meshed: its capture annotations are not judged.
        assert!(matches!(
            decide(&input(), &p, Some(&BTreeMap::new()), [], "n1", &keys()),
            Ok(KubeAdmission::Ignored(_))
        ));
    }

    #[test]
    fn the_namespaces_capture_label_reaches_the_record_and_a_bad_one_refuses() {
        use flock_core::capture::policy::{NAMESPACE_LABEL, Setting};
        let mut labels = meshed_ns();
        labels.insert(NAMESPACE_LABEL.into(), "off".into());
        let (rec, _) = admitted(decide(
            &input(),
            &pod(json!({})),
            Some(&labels),
            [],
            "n1",
            &keys(),
        ));
        assert_eq!(rec.capture.namespace, Some(Setting::Off));
        assert_eq!(rec.capture.setting, None);
        labels.insert(NAMESPACE_LABEL.into(), "none".into());
        match decide(&input(), &pod(json!({})), Some(&labels), [], "n1", &keys()) {
            Err(PodError::Invalid(m)) => assert!(
                m.contains(&format!("metadata.labels[{NAMESPACE_LABEL}]"))
                    && m.contains("\"none\" is not a capture mode"),
                "{m}"
            ),
            other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
        }
    }

    #[test]
    fn a_pod_without_a_service_account_runs_as_default() {
        let p = pod(json!({"spec": {"serviceAccountName": null}}));
        let (rec, _) = admitted(decide(&input(), &p, Some(&meshed_ns()), [], "n1", &keys()));
        assert_eq!(rec.service_account, "default");
    }

    #[test]
    fn a_pod_not_opted_in_is_ignored_with_the_reason() {
        match decide(
            &input(),
            &pod(json!({})),
            Some(&BTreeMap::new()),
            [],
            "n1",
            &keys(),
        ) {
            Ok(KubeAdmission::Ignored(why)) => {
                assert!(
                    why.contains("shop/web-0") && why.contains("not meshed"),
                    "{why}"
                )
            }
            other => panic!("{other:?}"),
        }
        // Opted out by its own label, in a meshed namespace.
        let out = pod(json!({"metadata": {"labels": {"flock.io/mesh": "disabled"}}}));
        assert!(matches!(
            decide(&input(), &out, Some(&meshed_ns()), [], "n1", &keys()),
            Ok(KubeAdmission::Ignored(_))
        ));
        // Opted in by its own label, in an unlabelled namespace.
        let opted = pod(json!({"metadata": {"labels": {"flock.io/mesh": "enabled"}}}));
        admitted(decide(&input(), &opted, None, [], "n1", &keys()));
    }

    #[test]
    fn a_recreated_pod_of_the_same_name_is_refused() {
        let other = pod(json!({"metadata": {"uid": "11111111-2222-4333-8444-555555555555"}}));
        match decide(&input(), &other, Some(&meshed_ns()), [], "n1", &keys()) {
            Err(PodError::Unidentified(m)) => {
                assert!(m.contains("re-created") && m.contains("11111111"), "{m}")
            }
            other => panic!("{other:?}"),
        }
        // The runtime passed no UID: nothing to compare.
        let mut req = input();
        req.uid = String::new();
        admitted(decide(&req, &other, Some(&meshed_ns()), [], "n1", &keys()));
    }

    #[test]
    fn a_pod_of_another_node_or_terminating_is_refused() {
        match decide(
            &input(),
            &pod(json!({})),
            Some(&meshed_ns()),
            [],
            "n2",
            &keys(),
        ) {
            Err(PodError::Invalid(m)) => assert!(m.contains("\"n1\""), "{m}"),
            other => panic!("{other:?}"),
        }
        let going = pod(json!({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}));
        match decide(&input(), &going, Some(&meshed_ns()), [], "n1", &keys()) {
            Err(PodError::Invalid(m)) => assert!(m.contains("terminating"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn endpoints_carry_only_the_pods_labels_of_the_configured_keys() {
        let labelled = pod(json!({"metadata": {"labels": {
            "version": "v2", "app.kubernetes.io/version": "2.1.0", "team": "x"}}}));
        let (_, members) = admitted(decide(
            &input(),
            &labelled,
            Some(&meshed_ns()),
            [],
            "n1",
            &keys(),
        ));
        assert_eq!(
            flock_core::labels::render(&members.labels),
            "app.kubernetes.io/version=2.1.0,version=v2"
        );
        let (_, members) = admitted(decide(
            &input(),
            &labelled,
            Some(&meshed_ns()),
            [],
            "n1",
            &["team".to_string(), "absent".to_string()],
        ));
        assert_eq!(flock_core::labels::render(&members.labels), "team=x");
        // A live relabel is followed: the snapshot's pod, not the ADD's.
        let rec = crate::model::PodRecord::admitted(
            admitted(decide(
                &input(),
                &labelled,
                Some(&meshed_ns()),
                [],
                "n1",
                &keys(),
            ))
            .0,
            flock_core::time::UnixMs(0),
        );
        let mut snapshot = Snapshot {
            synced: true,
            ..Default::default()
        };
        snapshot.namespaces.insert("shop".into(), meshed_ns());
        snapshot.pods.insert(
            ("shop".into(), "web-0".into()),
            Arc::new(pod(json!({"metadata": {"labels": {"version": "v3"}}}))),
        );
        let live = members_in(&snapshot, &rec, &keys()).unwrap();
        assert_eq!(flock_core::labels::render(&live.labels), "version=v3");
        // A value a test double could hold but the API server never would is left out.
        let odd = BTreeMap::from([("version".to_string(), "a,b".to_string())]);
        assert!(endpoint_labels(&odd, &keys()).is_empty());
    }

    #[test]
    fn unreachable_api_says_so_and_refuses_to_guess() {
        let e = unidentified(
            "shop/web-0",
            &LookupError::Unreachable("connection refused".into()),
        );
        assert_eq!(
            e.to_string(),
            "cannot identify pod shop/web-0: the Kubernetes API is unreachable (connection \
             refused); refusing to guess its identity"
        );
        let e = unidentified(
            "shop/web-0",
            &LookupError::NotFound {
                pod: "shop/web-0".into(),
            },
        );
        assert!(e.to_string().contains("refusing to guess"), "{e}");
    }

    #[test]
    fn memberships_register_the_service_port_at_the_targets_listener() {
        let svcs = [
            // By name: "http" is 8080, the first listener.
            service(
                "web",
                json!({"app": "web"}),
                json!([{"port": 80, "targetPort": "http", "name": "http"}]),
            ),
            // By number, and a port targeting nothing the pod serves (left out).
            service(
                "metrics",
                json!({"app": "web"}),
                json!([{"port": 9090}, {"port": 7777}]),
            ),
            // Selects other pods.
            service("db", json!({"app": "db"}), json!([{"port": 5432}])),
        ];
        let (_, members) = admitted(decide(
            &input(),
            &pod(json!({})),
            Some(&meshed_ns()),
            svcs.iter(),
            "n1",
            &keys(),
        ));
        assert_eq!(
            members.ports,
            vec![
                MemberPort {
                    service: "metrics".into(),
                    service_port: 9090,
                    protocol: Protocol::Tcp,
                    app_port: 9090,
                    listen_port: INBOUND_BASE_PORT + 1,
                },
                MemberPort {
                    service: "web".into(),
                    service_port: 80,
                    protocol: Protocol::Http,
                    app_port: 8080,
                    listen_port: INBOUND_BASE_PORT,
                },
            ]
        );
    }

    #[test]
    fn live_memberships_follow_the_snapshot_and_never_another_pods_uid() {
        let (admitted_pod, _) = admitted(decide(
            &input(),
            &pod(json!({})),
            Some(&meshed_ns()),
            [],
            "n1",
            &keys(),
        ));
        let rec = PodRecord::admitted(admitted_pod, flock_core::UnixMs(0));
        let mut snapshot = Snapshot {
            synced: true,
            ..Snapshot::default()
        };
        snapshot.namespaces.insert("shop".into(), meshed_ns());
        // The pod is not in the snapshot (deleted from the API, or not listed yet).
        assert_eq!(members_in(&snapshot, &rec, &keys()), None);
        let key = ("shop".to_string(), "web-0".to_string());
        snapshot.pods.insert(key.clone(), Arc::new(pod(json!({}))));
        assert_eq!(
            members_in(&snapshot, &rec, &keys()),
            Some(Members::default())
        );
        let svc = service(
            "web",
            json!({"app": "web"}),
            json!([{"port": 80, "targetPort": 8080}]),
        );
        snapshot
            .services
            .insert(("shop".into(), "web".into()), Arc::new(svc));
        // A Service of another namespace with the same selector is not one of its.
        let mut elsewhere = service(
            "other",
            json!({"app": "web"}),
            json!([{"port": 81, "targetPort": 8080}]),
        );
        elsewhere.metadata.namespace = Some("zzz".into());
        snapshot
            .services
            .insert(("zzz".into(), "other".into()), Arc::new(elsewhere));
        let members = members_in(&snapshot, &rec, &keys()).unwrap();
        assert_eq!(
            members
                .ports
                .iter()
                .map(|m| (m.service.as_str(), m.service_port))
                .collect::<Vec<_>>(),
            vec![("web", 80)]
        );
        // A label change moves it out.
        snapshot.pods.insert(
            key.clone(),
            Arc::new(pod(json!({"metadata": {"labels": {"app": "web-v2"}}}))),
        );
        assert_eq!(
            members_in(&snapshot, &rec, &keys()),
            Some(Members::default())
        );
        // The name now belongs to another pod: not this record's memberships.
        snapshot.pods.insert(
            key,
            Arc::new(pod(
                json!({"metadata": {"uid": "11111111-2222-4333-8444-555555555555"}}),
            )),
        );
        assert_eq!(members_in(&snapshot, &rec, &keys()), None);
    }
}
