//! Which shared-registry entries an agent believes: the key layout that lets etcd RBAC
//! confine each node to its own prefix, and the check every entry written by another
//! node passes on its own before it can reach the translation.
//!
//! The registry is written by every node of the mesh, so an entry is outside input: a
//! buggy or compromised node (or anything else that can write to etcd) must not be able
//! to take a whole service down with one invalid entry (the translation refuses a
//! service whose endpoints are inconsistent, so one `0.0.0.0` address used to drop
//! every endpoint of its service on every node), nor widen the set of SPIFFE IDs a
//! caller accepts beyond the agent's trust domain and the service's namespace. The
//! agent applies [`check_entry`] to each entry alone and drops only the ones that fail,
//! with a [`Reject`] reason from a closed set (the metric's label).
//!
//! # Key layout
//!
//! `<prefix><node>/<namespace>/<service>/<container_id>/<ifname>/<service_port>`
//! ([`endpoint_key`]). The node comes first so that one etcd role per node can grant
//! `readwrite` on `<prefix><node>/` alone (and `read` on `<prefix>`): a node then cannot
//! write under another node's prefix at all, and [`check_entry`] refuses an entry whose
//! `node` field names another node than its key, so a node cannot pass its entries off
//! as another's either.

use crate::issuance::Scope;
use crate::pod;
use std::collections::BTreeMap;
use std::net::IpAddr;

/// The largest encoded entry an agent decodes (16 KiB). A real entry is a few hundred
/// bytes; the limit bounds what one hostile entry costs every agent that watches it.
pub const MAX_ENTRY_BYTES: usize = 16 << 10;

/// Longest region or zone name (a DNS subdomain's limit).
pub const MAX_LOCALITY_LEN: usize = pod::MAX_NAME_LEN;

/// Longest SPIFFE ID accepted (the SPIFFE spec's URI limit).
pub const MAX_SPIFFE_ID_LEN: usize = 2048;
/// Most further IDs an endpoint may carry besides its identity ([`EntryFields::also_accept`]):
/// enough for the accounts of one Kubernetes Service annotation.
pub const MAX_ALSO_ACCEPT: usize = 32;

/// Why an entry was dropped: a closed set, the `reason` label of the rejection metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reject {
    /// Larger than [`MAX_ENTRY_BYTES`].
    Oversized,
    /// Not UTF-8 / not JSON / not an endpoint.
    Undecodable,
    /// The key is not `<node>/<namespace>/<service>/<container_id>/<ifname>/<port>` or
    /// does not match the entry's fields.
    Key,
    /// The entry's `node` differs from its key's node segment.
    Node,
    /// A namespace, service, pod, container ID or interface name breaks its rule.
    Name,
    /// The address is unspecified, multicast, or loopback on another node.
    Address,
    /// The service port or the endpoint port is 0.
    Port,
    /// Region or zone too long or with control characters.
    Locality,
    /// The identity (or a further accepted ID) is not a SPIFFE ID, or further IDs
    /// come without an identity or beyond [`MAX_ALSO_ACCEPT`].
    Identity,
    /// The identity (or a further accepted ID) is outside the agent's trust domain.
    TrustDomain,
    /// The `/ns/<namespace>/` of the identity (or of a further accepted ID) is not the
    /// endpoint's namespace.
    IdentityNamespace,
    /// An endpoint without an identity in a service port whose other endpoints have
    /// one: excluded rather than turning the port's callers to plaintext.
    Downgrade,
    /// An endpoint of a service port beyond the most ports a service may have
    /// ([`crate::pod::MAX_PORTS`]): excluded rather than the whole service refused.
    TooManyPorts,
    /// The identity (or a further accepted ID) names a service account the operator's
    /// scope does not let the writing node host ([`Trust::scope`]).
    Scope,
    /// The writing node already has the most entries a reader loads from one node
    /// ([`NodeCap`]).
    NodeCap,
    /// The endpoint's labels break the label rules ([`crate::labels::check`]).
    Labels,
}

impl Reject {
    /// Every reason, in label order.
    pub const ALL: [Reject; 16] = [
        Reject::Oversized,
        Reject::Undecodable,
        Reject::Key,
        Reject::Node,
        Reject::Name,
        Reject::Address,
        Reject::Port,
        Reject::Locality,
        Reject::Identity,
        Reject::TrustDomain,
        Reject::IdentityNamespace,
        Reject::Downgrade,
        Reject::TooManyPorts,
        Reject::Scope,
        Reject::NodeCap,
        Reject::Labels,
    ];

    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Reject::Oversized => "oversized",
            Reject::Undecodable => "undecodable",
            Reject::Key => "key",
            Reject::Node => "node",
            Reject::Name => "name",
            Reject::Address => "address",
            Reject::Port => "port",
            Reject::Locality => "locality",
            Reject::Identity => "identity",
            Reject::TrustDomain => "trust_domain",
            Reject::IdentityNamespace => "identity_namespace",
            Reject::Downgrade => "downgrade",
            Reject::TooManyPorts => "too_many_ports",
            Reject::Scope => "node_scope",
            Reject::NodeCap => "node_cap",
            Reject::Labels => "labels",
        }
    }

    /// The position of this reason in [`Reject::ALL`] (an index into a counter array).
    pub fn index(self) -> usize {
        Reject::ALL
            .iter()
            .position(|r| *r == self)
            .unwrap_or_default()
    }
}

/// A dropped entry: the reason (label) and what exactly is wrong (for the log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// The closed-set reason.
    pub reason: Reject,
    /// What is wrong, with the offending value bounded and escaped.
    pub detail: String,
}

impl Rejected {
    /// A rejection for `reason` with `detail`.
    pub fn new(reason: Reject, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
        }
    }
}

impl std::fmt::Display for Rejected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.detail, self.reason.as_str())
    }
}

/// The registry key of an endpoint, relative to the prefix (see the module docs).
pub fn endpoint_key(
    node: &str,
    namespace: &str,
    service: &str,
    container_id: &str,
    ifname: &str,
    service_port: u16,
) -> String {
    format!("{node}/{namespace}/{service}/{container_id}/{ifname}/{service_port}")
}

/// The key prefix (relative to the registry prefix) under which `node` writes: the
/// path an etcd role grants `readwrite` on.
pub fn node_prefix(node: &str) -> String {
    format!("{node}/")
}

/// The node segment of a key (relative to the prefix), if the key has the six
/// segments of [`endpoint_key`].
pub fn key_node(key: &str) -> Option<&str> {
    let parts: Vec<&str> = key.split('/').collect();
    (parts.len() == 6).then_some(parts[0])
}

/// The fields of an entry [`check_entry`] looks at.
#[derive(Debug, Clone, Copy)]
pub struct EntryFields<'a> {
    /// The key it was found under, relative to the registry prefix.
    pub key: &'a str,
    /// The node that claims it.
    pub node: &'a str,
    /// Service namespace.
    pub namespace: &'a str,
    /// Service name.
    pub service: &'a str,
    /// The service port.
    pub service_port: u16,
    /// The address to connect to.
    pub address: IpAddr,
    /// The port to connect to.
    pub port: u16,
    /// The pod, `<namespace>/<name>`.
    pub pod: &'a str,
    /// The pod's container ID.
    pub container_id: &'a str,
    /// The pod's interface name.
    pub ifname: &'a str,
    /// Region.
    pub region: &'a str,
    /// Zone.
    pub zone: &'a str,
    /// The SPIFFE ID, if the endpoint serves mTLS.
    pub identity: Option<&'a str>,
    /// Further SPIFFE IDs callers accept from the endpoint (only with `identity`).
    pub also_accept: &'a [String],
    /// The pod's labels a route subset may select on.
    pub labels: &'a crate::labels::Labels,
}

/// What the agent trusts: who it is and its trust domain.
#[derive(Debug, Clone, Copy)]
pub struct Trust<'a> {
    /// This agent's node name (its own entries may be loopback; no other node's may).
    pub local_node: &'a str,
    /// The agent's trust domain. `Some`: a remote identity must be in it. `None` (the
    /// agent has no identity source, so its pods call plaintext and verify nobody): any
    /// well-formed SPIFFE ID whose namespace matches is kept, so a service port that has
    /// identities still counts as mTLS and is never downgraded.
    pub trust_domain: Option<&'a str>,
    /// The operator's scope (`--registry-scope`, the file the node-scoped signer's
    /// `--scope` reads): `Some`, an entry written by node N may carry only identities
    /// of accounts N may host, as the signer would issue them to N. Without it a node
    /// that can write the registry can claim any account of the trust domain for its
    /// endpoints; with per-endpoint pinning that claim only lets callers reach an
    /// endpoint that presents that account's certificate, which N's own pods never
    /// get from the signer, but the entry still steals traffic until the handshake
    /// fails.
    pub scope: Option<&'a Scope>,
}

/// `s` bounded to 64 characters and escaped, for messages about outside input.
pub fn bounded(s: &str) -> String {
    let cut: String = s.chars().take(64).collect();
    let mut out = cut.escape_debug().to_string();
    if s.chars().count() > 64 {
        out.push('…');
    }
    out
}

/// Checks one entry on its own (see the module docs); `Ok` if the agent may serve it.
pub fn check_entry(e: &EntryFields<'_>, trust: &Trust<'_>) -> Result<(), Rejected> {
    let parts: Vec<&str> = e.key.split('/').collect();
    if parts.len() != 6 {
        return Err(Rejected::new(
            Reject::Key,
            format!(
                "key \"{}\" is not <node>/<namespace>/<service>/<container_id>/<ifname>/<port>",
                bounded(e.key)
            ),
        ));
    }
    if parts[0] != e.node {
        return Err(Rejected::new(
            Reject::Node,
            format!(
                "entry claims node \"{}\" but is under node \"{}\"'s prefix",
                bounded(e.node),
                bounded(parts[0])
            ),
        ));
    }
    let name = |what: &str, r: Result<(), String>| {
        r.map_err(|why| Rejected::new(Reject::Name, format!("{what} {why}")))
    };
    name("node", pod::check_subdomain(e.node))?;
    name("namespace", pod::check_label(e.namespace))?;
    name("service", pod::check_label(e.service))?;
    name("container ID", pod::check_container_id(e.container_id))?;
    name("interface", pod::check_ifname(e.ifname))?;
    match e.pod.split_once('/') {
        Some((ns, pod_name)) if ns == e.namespace => {
            name("pod name", pod::check_subdomain(pod_name))?;
        }
        _ => {
            return Err(Rejected::new(
                Reject::Name,
                format!(
                    "pod \"{}\" is not <namespace>/<name> in namespace {}",
                    bounded(e.pod),
                    e.namespace
                ),
            ));
        }
    }
    if e.service_port == 0 || e.port == 0 {
        return Err(Rejected::new(
            Reject::Port,
            format!(
                "port {} / service port {}: ports must be 1-65535",
                e.port, e.service_port
            ),
        ));
    }
    let expected = endpoint_key(
        e.node,
        e.namespace,
        e.service,
        e.container_id,
        e.ifname,
        e.service_port,
    );
    if expected != e.key {
        return Err(Rejected::new(
            Reject::Key,
            format!(
                "key \"{}\" does not match the entry (expected \"{}\")",
                bounded(e.key),
                bounded(&expected)
            ),
        ));
    }
    pod::check_ip(e.address).map_err(|why| Rejected::new(Reject::Address, why))?;
    // On the canonical form: `::ffff:127.0.0.1` is 127.0.0.1 to the connecting socket.
    if pod::canonical_ip(e.address).is_loopback() && e.node != trust.local_node {
        return Err(Rejected::new(
            Reject::Address,
            format!(
                "loopback address {} from node {}: only reachable on that node",
                e.address, e.node
            ),
        ));
    }
    for (what, v) in [("region", e.region), ("zone", e.zone)] {
        if v.len() > MAX_LOCALITY_LEN || v.chars().any(char::is_control) {
            return Err(Rejected::new(
                Reject::Locality,
                format!(
                    "{what} must be at most {MAX_LOCALITY_LEN} bytes without control characters"
                ),
            ));
        }
    }
    // Labels end up in cluster names (a subset's): one that breaks the syntax is
    // refused here, alone, not by the translation for the whole service.
    crate::labels::check(e.labels).map_err(|why| Rejected::new(Reject::Labels, why))?;
    if let Some(id) = e.identity {
        check_identity(id, e.namespace, trust.trust_domain)?;
    }
    if !e.also_accept.is_empty() {
        if e.identity.is_none() {
            // Without an identity the entry is served as identity-less: the extra IDs
            // would be silently ignored, so the entry is not what its writer meant.
            return Err(Rejected::new(
                Reject::Identity,
                "also_accept without an identity",
            ));
        }
        if e.also_accept.len() > MAX_ALSO_ACCEPT {
            return Err(Rejected::new(
                Reject::Identity,
                format!(
                    "{} further identities, more than {MAX_ALSO_ACCEPT}",
                    e.also_accept.len()
                ),
            ));
        }
        for id in e.also_accept {
            check_identity(id, e.namespace, trust.trust_domain)?;
        }
    }
    if let Some(scope) = trust.scope {
        for id in e
            .identity
            .into_iter()
            .chain(e.also_accept.iter().map(String::as_str))
        {
            check_scope(e.node, id, scope)?;
        }
    }
    Ok(())
}

/// Whether `node` may carry the identity `id` (an exact workload ID, as
/// [`check_entry`] requires it before) under the operator's `scope`: the account
/// `<ns>/<sa>` it names is one the scope lets `node` host, the same rule the signer
/// applies to `node`'s certificate requests ([`crate::issuance::decide_scope`]).
pub fn check_scope(node: &str, id: &str, scope: &Scope) -> Result<(), Rejected> {
    // The mutant trusts every writer with every account, as readers did before they
    // knew the scope.
    if crate::reintroduced!("registry-any-scope") {
        return Ok(());
    }
    let allowed = identity_account(id).is_some_and(|(ns, sa)| {
        scope
            .nodes
            .get(node)
            .is_some_and(|accounts| accounts.contains(&(ns.to_string(), sa.to_string())))
    });
    if allowed {
        return Ok(());
    }
    Err(Rejected::new(
        Reject::Scope,
        format!(
            "node {} may not host the account of identity \"{}\" (not in its line of the scope file)",
            bounded(node),
            bounded(id)
        ),
    ))
}

/// The default of [`NodeCap`]: far more than one node's pods times their ports (a
/// node runs about a hundred pods), far less than what would exhaust a reader.
pub const DEFAULT_MAX_ENTRIES_PER_NODE: usize = 4096;

/// How many entries of each writer node a reader holds, and the limit: a node that
/// writes more (a bug, or a compromised node filling the registry) costs every
/// reader at most `max` entries, and the other nodes' entries keep serving.
///
/// Which entries are kept is decided by arrival: an entry of a node already holding
/// `max` is refused until one of that node's entries goes. A full list arrives in key
/// order, so after a (re)list the kept ones are the node's `max` smallest keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeCap {
    max: usize,
    held: BTreeMap<String, usize>,
}

/// A cap of [`DEFAULT_MAX_ENTRIES_PER_NODE`].
impl Default for NodeCap {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_ENTRIES_PER_NODE)
    }
}

impl NodeCap {
    /// A cap of `max` entries per node (`max` 0: none is ever admitted).
    pub fn new(max: usize) -> Self {
        Self {
            max,
            held: BTreeMap::new(),
        }
    }

    /// The limit.
    pub fn max(&self) -> usize {
        self.max
    }

    /// How many entries of `node` are held.
    pub fn held(&self, node: &str) -> usize {
        self.held.get(node).copied().unwrap_or(0)
    }

    /// Admits one more (new) entry of `node`, or refuses it when `node` holds `max`.
    pub fn admit(&mut self, node: &str) -> Result<(), Rejected> {
        let held = self.held(node);
        if held >= self.max && !crate::reintroduced!("registry-uncapped-node") {
            return Err(Rejected::new(
                Reject::NodeCap,
                format!(
                    "node {} already has {held} entries, the most a reader loads from one node",
                    bounded(node)
                ),
            ));
        }
        *self.held.entry(node.to_string()).or_default() += 1;
        Ok(())
    }

    /// One held entry of `node` went away.
    pub fn release(&mut self, node: &str) {
        if let Some(n) = self.held.get_mut(node) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.held.remove(node);
            }
        }
    }

    /// Forgets every held entry.
    pub fn clear(&mut self) {
        self.held.clear();
    }
}

/// A remote endpoint's identity: exactly `spiffe://<td>/ns/<namespace>/sa/<account>`,
/// in the agent's trust domain (when it has one), naming the endpoint's own namespace
/// and one service account (a DNS subdomain).
///
/// Never a prefix (`.../sa/*`) or any other `*` form, nor a longer or shorter path: a
/// caller accepts from an endpoint exactly what its entry names, so an ID prefix
/// written by one node would make every caller accept any account of the namespace
/// (any pod of it, on any node) as that endpoint.
fn check_identity(id: &str, namespace: &str, trust_domain: Option<&str>) -> Result<(), Rejected> {
    let malformed = || {
        Rejected::new(
            Reject::Identity,
            format!(
                "identity \"{}\" is not an exact SPIFFE ID spiffe://<trust-domain>/ns/<namespace>/sa/<service-account> (no `*`, no prefix)",
                bounded(id)
            ),
        )
    };
    if id.len() > MAX_SPIFFE_ID_LEN
        || id
            .chars()
            .any(|c| c.is_control() || c.is_whitespace() || c == '|')
    {
        return Err(malformed());
    }
    let rest = id.strip_prefix("spiffe://").ok_or_else(malformed)?;
    let (td, path) = rest.split_once('/').ok_or_else(malformed)?;
    // The mutant accepts the old ID prefixes (`spiffe://td/ns/<ns>/...` ending in `/*`)
    // and any path under the namespace, as the check did before entries were pinned to
    // exact identities.
    let wildcard = crate::reintroduced!("registry-wildcard-identity");
    let exact = if wildcard {
        id.strip_suffix("/*").unwrap_or(id)
    } else {
        id
    };
    if td.is_empty() || path.is_empty() || exact.contains('*') || exact.ends_with('/') {
        return Err(malformed());
    }
    if let Some(ours) = trust_domain
        && td != ours
    {
        return Err(Rejected::new(
            Reject::TrustDomain,
            format!(
                "identity \"{}\" is outside the trust domain {ours}",
                bounded(id)
            ),
        ));
    }
    let mut segs = path.split('/');
    if segs.next() != Some("ns") || segs.next() != Some(namespace) {
        return Err(Rejected::new(
            Reject::IdentityNamespace,
            format!(
                "identity \"{}\" does not name the endpoint's namespace {namespace} (spiffe://{td}/ns/{namespace}/...)",
                bounded(id)
            ),
        ));
    }
    if wildcard {
        return Ok(());
    }
    match (segs.next(), segs.next(), segs.next()) {
        (Some("sa"), Some(sa), None) if pod::check_subdomain(sa).is_ok() => Ok(()),
        _ => Err(malformed()),
    }
}

/// The service account of an exact workload ID `spiffe://<td>/ns/<ns>/sa/<sa>` (as
/// [`check_entry`] requires it) with its namespace: `Some((ns, sa))`, else `None`.
pub fn identity_account(id: &str) -> Option<(&str, &str)> {
    let rest = id.strip_prefix("spiffe://")?;
    let (_td, path) = rest.split_once('/')?;
    let mut segs = path.split('/');
    match (
        segs.next(),
        segs.next(),
        segs.next(),
        segs.next(),
        segs.next(),
    ) {
        (Some("ns"), Some(ns), Some("sa"), Some(sa), None) if !ns.is_empty() && !sa.is_empty() => {
            Some((ns, sa))
        }
        _ => None,
    }
}

/// One service's exclusions (key, why) before and after a change.
pub type ExclusionChange<R> = (Vec<(String, R)>, Vec<(String, R)>);

/// Applies a batch of changes to the map of registry entries left out of the mesh
/// (key → why), each change one service's exclusions before and after: every old
/// exclusion of the batch is dropped before any new one is added. A key that moved
/// between two services of one batch may be excluded by the one it moved to and have
/// been by the one it left; applied service by service, in one pass, the second
/// service's drop of its old exclusion would remove the first one's new exclusion of
/// the same key, and the key would be served.
pub fn apply_exclusions<R>(
    all: &mut std::collections::BTreeMap<String, R>,
    changes: Vec<ExclusionChange<R>>,
) {
    if crate::reintroduced!("service-table-exclusions-in-one-pass") {
        for (old, new) in changes {
            for (key, _) in old {
                all.remove(&key);
            }
            all.extend(new);
        }
        return;
    }
    let mut added = Vec::new();
    for (old, new) in changes {
        for (key, _) in old {
            all.remove(&key);
        }
        added.extend(new);
    }
    all.extend(added);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_moving_between_two_services_of_a_batch_stays_excluded() {
        let mut all = std::collections::BTreeMap::from([("k".to_string(), "old")]);
        // Service A newly excludes k (it moved there); service B, which excluded it
        // before, no longer does.
        let changes = vec![
            (vec![], vec![("k".to_string(), "new")]),
            (vec![("k".to_string(), "old")], vec![]),
        ];
        apply_exclusions(&mut all, changes);
        assert_eq!(all.get("k"), Some(&"new"));
    }

    fn good<'a>() -> EntryFields<'a> {
        EntryFields {
            key: "node-b/default/web/c1/eth0/8080",
            node: "node-b",
            namespace: "default",
            service: "web",
            service_port: 8080,
            address: "10.0.0.7".parse().unwrap(),
            port: 15006,
            pod: "default/web-0",
            container_id: "c1",
            ifname: "eth0",
            region: "eu",
            zone: "eu-1",
            identity: Some("spiffe://cluster.local/ns/default/sa/web"),
            also_accept: &[],
            labels: &crate::labels::NONE,
        }
    }

    const TRUST: Trust<'static> = Trust {
        local_node: "node-a",
        trust_domain: Some("cluster.local"),
        scope: None,
    };

    fn reason(e: EntryFields<'_>) -> Option<Reject> {
        check_entry(&e, &TRUST).err().map(|r| r.reason)
    }

    #[test]
    fn a_well_formed_entry_passes() {
        assert_eq!(check_entry(&good(), &TRUST), Ok(()));
        let labels = crate::labels::parse("version=v2,app.kubernetes.io/name=web").unwrap();
        assert_eq!(
            check_entry(
                &EntryFields {
                    labels: &labels,
                    ..good()
                },
                &TRUST
            ),
            Ok(())
        );
        assert_eq!(
            check_entry(
                &EntryFields {
                    identity: None,
                    ..good()
                },
                &TRUST
            ),
            Ok(())
        );
    }

    #[test]
    fn each_bad_field_is_named_by_its_reason() {
        let bad_labels =
            crate::labels::Labels::from([("version".to_string(), "v2/../x".to_string())]);
        let too_many_labels: crate::labels::Labels = (0..=crate::labels::MAX_LABELS)
            .map(|i| (format!("k{i}"), "v".to_string()))
            .collect();
        let cases: Vec<(EntryFields<'_>, Reject)> = vec![
            (
                EntryFields {
                    key: "default/web/node-b/c1/eth0/8080/x",
                    ..good()
                },
                Reject::Key,
            ),
            (
                EntryFields {
                    node: "node-c",
                    ..good()
                },
                Reject::Node,
            ),
            (
                EntryFields {
                    service: "Web",
                    key: "node-b/default/Web/c1/eth0/8080",
                    ..good()
                },
                Reject::Name,
            ),
            (
                EntryFields {
                    pod: "other/web-0",
                    ..good()
                },
                Reject::Name,
            ),
            (
                EntryFields {
                    address: "0.0.0.0".parse().unwrap(),
                    ..good()
                },
                Reject::Address,
            ),
            (
                EntryFields {
                    address: "224.0.0.1".parse().unwrap(),
                    ..good()
                },
                Reject::Address,
            ),
            (
                EntryFields {
                    address: "127.0.0.1".parse().unwrap(),
                    ..good()
                },
                Reject::Address,
            ),
            (EntryFields { port: 0, ..good() }, Reject::Port),
            (
                EntryFields {
                    labels: &bad_labels,
                    ..good()
                },
                Reject::Labels,
            ),
            (
                EntryFields {
                    labels: &too_many_labels,
                    ..good()
                },
                Reject::Labels,
            ),
            (
                EntryFields {
                    key: "node-b/default/web/c1/eth0/9090",
                    ..good()
                },
                Reject::Key,
            ),
            (
                EntryFields {
                    zone: "a\nb",
                    ..good()
                },
                Reject::Locality,
            ),
            (
                EntryFields {
                    identity: Some("http://x/ns/default"),
                    ..good()
                },
                Reject::Identity,
            ),
            (
                EntryFields {
                    identity: Some("spiffe://evil.example/ns/default/sa/web"),
                    ..good()
                },
                Reject::TrustDomain,
            ),
            (
                EntryFields {
                    identity: Some("spiffe://cluster.local/ns/kube-system/sa/admin"),
                    ..good()
                },
                Reject::IdentityNamespace,
            ),
            (
                EntryFields {
                    identity: Some("spiffe://cluster.local/sa/web"),
                    ..good()
                },
                Reject::IdentityNamespace,
            ),
        ];
        for (e, want) in cases {
            assert_eq!(reason(e), Some(want), "{e:?}");
        }
    }

    #[test]
    fn each_further_identity_is_checked_like_the_identity() {
        let canary = ["spiffe://cluster.local/ns/default/sa/web-canary".to_string()];
        assert_eq!(
            check_entry(
                &EntryFields {
                    also_accept: &canary,
                    ..good()
                },
                &TRUST
            ),
            Ok(())
        );
        let bad = |extra: &str| {
            let list = [canary[0].clone(), extra.to_string()];
            reason(EntryFields {
                also_accept: &list,
                ..good()
            })
        };
        assert_eq!(bad("http://x/ns/default"), Some(Reject::Identity));
        assert_eq!(
            bad("spiffe://cluster.local/ns/default/sa/a*"),
            Some(Reject::Identity)
        );
        assert_eq!(
            bad("spiffe://cluster.local/ns/default/sa/"),
            Some(Reject::Identity)
        );
        let any = ["spiffe://cluster.local/ns/default/sa/*".to_string()];
        assert_eq!(
            reason(EntryFields {
                also_accept: &any,
                ..good()
            }),
            Some(Reject::Identity)
        );
        assert_eq!(
            bad("spiffe://evil.example/ns/default/sa/web"),
            Some(Reject::TrustDomain)
        );
        assert_eq!(
            bad("spiffe://cluster.local/ns/kube-system/sa/admin"),
            Some(Reject::IdentityNamespace)
        );
        assert_eq!(
            reason(EntryFields {
                identity: None,
                also_accept: &canary,
                ..good()
            }),
            Some(Reject::Identity)
        );
        let many: Vec<String> = (0..=MAX_ALSO_ACCEPT)
            .map(|i| format!("spiffe://cluster.local/ns/default/sa/web-{i}"))
            .collect();
        assert_eq!(
            reason(EntryFields {
                also_accept: &many,
                ..good()
            }),
            Some(Reject::Identity)
        );
        assert_eq!(
            reason(EntryFields {
                also_accept: &many[..MAX_ALSO_ACCEPT],
                ..good()
            }),
            None
        );
    }

    #[test]
    fn own_loopback_entries_and_foreign_domains_without_a_trust_domain_pass() {
        let own = EntryFields {
            key: "node-a/default/web/c1/eth0/8080",
            node: "node-a",
            address: "127.0.0.1".parse().unwrap(),
            ..good()
        };
        assert_eq!(check_entry(&own, &TRUST), Ok(()));
        let no_td = Trust {
            local_node: "node-a",
            trust_domain: None,
            scope: None,
        };
        let foreign = EntryFields {
            identity: Some("spiffe://other.example/ns/default/sa/web"),
            ..good()
        };
        assert_eq!(check_entry(&foreign, &no_td), Ok(()));
    }

    #[test]
    fn messages_bound_and_escape_the_offending_value() {
        let long = format!("{}\n\"", "x".repeat(500));
        let e = EntryFields {
            key: &long,
            ..good()
        };
        let r = check_entry(&e, &TRUST).unwrap_err();
        assert!(r.detail.len() < 200, "{}", r.detail);
        assert!(!r.detail.contains('\n'), "{}", r.detail);
    }

    #[test]
    fn reasons_are_a_closed_set_with_distinct_labels() {
        let labels: std::collections::BTreeSet<_> =
            Reject::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(labels.len(), Reject::ALL.len());
        for (i, r) in Reject::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
        }
        assert_eq!(key_node("n/a/b/c/d/1"), Some("n"));
        assert_eq!(key_node("a/b/c"), None);
    }
}
