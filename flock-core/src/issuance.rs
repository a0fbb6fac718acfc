//! Whether the signer may issue a workload certificate to the node that asks for it.
//!
//! No node holds a key that can sign another node's pods: the signer (`flock-ca`)
//! issues every SVID, and issues one only to the node the pod runs on, for the
//! service account the pod runs as. A node's root therefore obtains only the
//! identities of the pods it already hosts, as Istio's ztunnel does with istiod and a
//! SPIRE agent with its node attestation.
//!
//! The node is what the transport authenticated (the URI SAN of its node credential,
//! [`node_of`]), never a field of the request. The pod's facts come from a source the
//! node cannot write: the Kubernetes API ([`PodFacts`] from a GET of the pod), or a
//! static scope the operator wrote ([`Scope`]).

use std::collections::{BTreeMap, BTreeSet};

/// The path of a node credential's SPIFFE ID under the trust domain:
/// `spiffe://<td>/flock/node/<node>`. No workload identity has this shape
/// (`/ns/<ns>/sa/<sa>`), so a node credential is never accepted as a workload.
pub const NODE_PATH: &str = "/flock/node/";

/// The SPIFFE ID of node `node`'s credential.
pub fn node_id(trust_domain: &str, node: &str) -> String {
    format!("spiffe://{trust_domain}{NODE_PATH}{node}")
}

/// The node a verified credential names, if its SPIFFE ID is a node credential of
/// `trust_domain`; `None` for anything else (a workload SVID, another trust domain, a
/// node name that is not a DNS-1123 subdomain).
pub fn node_of(trust_domain: &str, spiffe_id: &str) -> Option<String> {
    let rest = spiffe_id.strip_prefix("spiffe://")?;
    let (td, path) = rest.split_once('/')?;
    if td != trust_domain {
        return None;
    }
    let node = path.strip_prefix(&NODE_PATH[1..])?;
    crate::pod::check_node_name(node).ok()?;
    Some(node.to_string())
}

/// What a node asks to be signed: a certificate for the pod's service account.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request<'a> {
    /// The pod's namespace.
    pub namespace: &'a str,
    /// The pod's name.
    pub pod_name: &'a str,
    /// The pod's UID (empty: not known to the node).
    pub pod_uid: &'a str,
    /// The service account the node says the pod runs as.
    pub service_account: &'a str,
}

/// What the Kubernetes API says of the pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodFacts {
    /// `spec.nodeName` (empty: not scheduled yet).
    pub node_name: String,
    /// `spec.serviceAccountName` (empty: Kubernetes' `default`).
    pub service_account: String,
    /// `metadata.uid`.
    pub uid: String,
    /// `status.phase` is `Succeeded` or `Failed`: the pod will not run again.
    pub finished: bool,
}

/// The operator's static scope, for nodes without a Kubernetes API: which service
/// accounts (`<ns>/<sa>`) may run on which node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scope {
    /// Node → the `(namespace, service account)` pairs it may host.
    pub nodes: BTreeMap<String, BTreeSet<(String, String)>>,
}

/// Why the signer refused. The messages name the pod, the node and what did not
/// match; they are returned to the node and logged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The API has no such pod.
    #[error("pod {namespace}/{pod} does not exist")]
    NoSuchPod {
        /// Namespace.
        namespace: String,
        /// Pod name.
        pod: String,
    },
    /// The pod runs on another node (or on none yet).
    #[error(
        "pod {namespace}/{pod} runs on node {actual:?}, not on {caller:?}, the node that asked"
    )]
    OtherNode {
        /// Namespace.
        namespace: String,
        /// Pod name.
        pod: String,
        /// The pod's node as the API says (empty: unscheduled).
        actual: String,
        /// The authenticated node.
        caller: String,
    },
    /// The pod runs as another service account.
    #[error("pod {namespace}/{pod} runs as service account {actual:?}, not {asked:?}")]
    OtherServiceAccount {
        /// Namespace.
        namespace: String,
        /// Pod name.
        pod: String,
        /// The pod's service account as the API says.
        actual: String,
        /// The account the node asked for.
        asked: String,
    },
    /// The UID the node gave is not the pod's (a pod of the same name was replaced).
    #[error("pod {namespace}/{pod} has uid {actual:?}, not {asked:?}")]
    OtherUid {
        /// Namespace.
        namespace: String,
        /// Pod name.
        pod: String,
        /// The pod's UID as the API says.
        actual: String,
        /// The UID the node gave.
        asked: String,
    },
    /// The pod has finished and will not run again.
    #[error("pod {namespace}/{pod} has finished")]
    Finished {
        /// Namespace.
        namespace: String,
        /// Pod name.
        pod: String,
    },
    /// The static scope does not let the node host the account.
    #[error(
        "node {node:?} may not host service account {namespace}/{service_account} (not in the signer's scope file)"
    )]
    OutOfScope {
        /// The authenticated node.
        node: String,
        /// Namespace.
        namespace: String,
        /// Service account.
        service_account: String,
    },
}

/// Kubernetes' service account of a pod whose spec names none.
const DEFAULT_SERVICE_ACCOUNT: &str = "default";

/// Whether `caller` (the authenticated node) may get a certificate for `req`, given
/// what the API says of the pod (`None`: no such pod).
pub fn decide_kube(
    caller: &str,
    req: &Request<'_>,
    facts: Option<&PodFacts>,
) -> Result<(), Refusal> {
    let pod = || (req.namespace.to_string(), req.pod_name.to_string());
    let Some(facts) = facts else {
        let (namespace, pod) = pod();
        return Err(Refusal::NoSuchPod { namespace, pod });
    };
    // The one check that confines a node to its own pods.
    if facts.node_name != caller && !crate::reintroduced!("issuance-any-node") {
        let (namespace, pod) = pod();
        return Err(Refusal::OtherNode {
            namespace,
            pod,
            actual: facts.node_name.clone(),
            caller: caller.to_string(),
        });
    }
    let actual_sa = if facts.service_account.is_empty() {
        DEFAULT_SERVICE_ACCOUNT
    } else {
        facts.service_account.as_str()
    };
    if actual_sa != req.service_account {
        let (namespace, pod) = pod();
        return Err(Refusal::OtherServiceAccount {
            namespace,
            pod,
            actual: actual_sa.to_string(),
            asked: req.service_account.to_string(),
        });
    }
    if !req.pod_uid.is_empty() && req.pod_uid != facts.uid {
        let (namespace, pod) = pod();
        return Err(Refusal::OtherUid {
            namespace,
            pod,
            actual: facts.uid.clone(),
            asked: req.pod_uid.to_string(),
        });
    }
    if facts.finished {
        let (namespace, pod) = pod();
        return Err(Refusal::Finished { namespace, pod });
    }
    Ok(())
}

/// Whether `caller` may get a certificate for `req` under the operator's static scope.
pub fn decide_scope(caller: &str, req: &Request<'_>, scope: &Scope) -> Result<(), Refusal> {
    let allowed = scope.nodes.get(caller).is_some_and(|accounts| {
        accounts.contains(&(req.namespace.to_string(), req.service_account.to_string()))
    });
    if allowed || crate::reintroduced!("issuance-any-node") {
        return Ok(());
    }
    Err(Refusal::OutOfScope {
        node: caller.to_string(),
        namespace: req.namespace.to_string(),
        service_account: req.service_account.to_string(),
    })
}

/// Most bytes of a scope file.
pub const MAX_SCOPE_BYTES: usize = 1 << 20;

/// Parses a scope file: one line per node, `<node>: <ns>/<sa> <ns>/<sa> ...`; blank
/// lines and lines starting with `#` are ignored. A node may appear on several lines.
/// Errors name the line.
pub fn parse_scope(text: &str) -> Result<Scope, String> {
    if text.len() > MAX_SCOPE_BYTES {
        return Err(format!(
            "scope file is {} bytes, at most {MAX_SCOPE_BYTES} allowed",
            text.len()
        ));
    }
    let mut scope = Scope::default();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (node, accounts) = line
            .split_once(':')
            .ok_or_else(|| format!("line {n}: expected `<node>: <ns>/<sa> ...`"))?;
        let node = node.trim();
        crate::pod::check_node_name(node).map_err(|e| format!("line {n}: node {node:?}: {e}"))?;
        let set = scope.nodes.entry(node.to_string()).or_default();
        for account in accounts.split_whitespace() {
            let (ns, sa) = account
                .split_once('/')
                .ok_or_else(|| format!("line {n}: {account:?} is not `<ns>/<sa>`"))?;
            crate::pod::check_label(ns).map_err(|e| format!("line {n}: namespace {ns:?}: {e}"))?;
            crate::pod::check_subdomain(sa)
                .map_err(|e| format!("line {n}: service account {sa:?}: {e}"))?;
            set.insert((ns.to_string(), sa.to_string()));
        }
    }
    Ok(scope)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req<'a>(pod: &'a str, sa: &'a str) -> Request<'a> {
        Request {
            namespace: "pay",
            pod_name: pod,
            pod_uid: "u1",
            service_account: sa,
        }
    }

    fn facts(node: &str, sa: &str) -> PodFacts {
        PodFacts {
            node_name: node.into(),
            service_account: sa.into(),
            uid: "u1".into(),
            finished: false,
        }
    }

    #[test]
    fn a_node_gets_only_its_own_pods_identities() {
        assert_eq!(
            decide_kube("a", &req("api-1", "api"), Some(&facts("a", "api"))),
            Ok(())
        );
        let e = decide_kube("a", &req("api-1", "api"), Some(&facts("b", "api"))).unwrap_err();
        assert!(matches!(e, Refusal::OtherNode { .. }), "{e}");
        assert_eq!(
            e.to_string(),
            "pod pay/api-1 runs on node \"b\", not on \"a\", the node that asked"
        );
        // Unscheduled pods belong to no node yet.
        assert!(decide_kube("a", &req("api-1", "api"), Some(&facts("", "api"))).is_err());
    }

    #[test]
    fn the_account_uid_and_phase_must_match_the_api() {
        let e = decide_kube("a", &req("api-1", "admin"), Some(&facts("a", "api"))).unwrap_err();
        assert!(matches!(e, Refusal::OtherServiceAccount { .. }), "{e}");
        // An empty account in the spec is Kubernetes' default.
        assert_eq!(
            decide_kube("a", &req("api-1", "default"), Some(&facts("a", ""))),
            Ok(())
        );
        let mut f = facts("a", "api");
        f.uid = "u2".into();
        assert!(matches!(
            decide_kube("a", &req("api-1", "api"), Some(&f)),
            Err(Refusal::OtherUid { .. })
        ));
        f.uid = "u1".into();
        f.finished = true;
        assert!(matches!(
            decide_kube("a", &req("api-1", "api"), Some(&f)),
            Err(Refusal::Finished { .. })
        ));
        assert!(matches!(
            decide_kube("a", &req("api-1", "api"), None),
            Err(Refusal::NoSuchPod { .. })
        ));
    }

    #[test]
    fn node_credentials_name_nodes_only() {
        assert_eq!(
            node_of("td", &node_id("td", "node-a")).as_deref(),
            Some("node-a")
        );
        for id in [
            "spiffe://other/flock/node/node-a",
            "spiffe://td/ns/pay/sa/api",
            "spiffe://td/flock/node/",
            "spiffe://td/flock/node/a/b",
            "spiffe://td/flock/node/A",
            "spiffe://td/flock/nodes/a",
        ] {
            assert_eq!(node_of("td", id), None, "{id}");
        }
    }

    #[test]
    fn scope_files_parse_and_confine() {
        let s = parse_scope("# comment\nnode-a: pay/api pay/web\n\nnode-b: shop/cart\n").unwrap();
        assert_eq!(decide_scope("node-a", &req("x", "api"), &s), Ok(()));
        assert!(matches!(
            decide_scope("node-b", &req("x", "api"), &s),
            Err(Refusal::OutOfScope { .. })
        ));
        assert!(decide_scope("node-c", &req("x", "api"), &s).is_err());
        for (bad, needle) in [
            ("node-a pay/api", "line 1: expected"),
            ("node-a: payapi", "line 1: \"payapi\" is not"),
            ("Node_A: pay/api", "line 1: node"),
            ("a: pay/API", "line 1: service account"),
        ] {
            let e = parse_scope(bad).unwrap_err();
            assert!(e.contains(needle), "{bad}: {e}");
        }
        assert!(parse_scope(&"#".repeat(MAX_SCOPE_BYTES + 1)).is_err());
    }

    proptest::proptest! {
        /// Whatever the request and the API's facts, a certificate is allowed only for
        /// a pod on the asking node, as its own account, with a matching UID, running.
        #[test]
        fn allowed_only_for_the_callers_running_pod_as_its_account(
            caller in "[ab]", node in "[ab]?", asked_sa in "(default|api|web)", sa in "(|api|web)",
            asked_uid in "(|u1|u2)", uid in "u[12]", finished: bool,
        ) {
            let req = Request { namespace: "pay", pod_name: "p", pod_uid: &asked_uid, service_account: &asked_sa };
            let facts = PodFacts { node_name: node.clone(), service_account: sa.clone(), uid: uid.clone(), finished };
            if decide_kube(&caller, &req, Some(&facts)).is_ok() {
                proptest::prop_assert_eq!(&node, &caller);
                let effective = if sa.is_empty() { "default" } else { sa.as_str() };
                proptest::prop_assert_eq!(effective, asked_sa.as_str());
                proptest::prop_assert!(asked_uid.is_empty() || asked_uid == uid);
                proptest::prop_assert!(!finished);
            }
        }
    }
}
