//! The endpoint registry: where every agent publishes its pods' [`Endpoint`]s and
//! learns everyone else's.
//!
//! One trait, [`Registry`], three backends chosen by a spec string ([`parse_spec`]):
//!
//! | spec | backend | scope |
//! |------|---------|-------|
//! | `memory` (default) | [`local::LocalRegistry`] without a file | this process only |
//! | `file:PATH` | [`local::LocalRegistry`] persisting to `PATH` | this node, survives restarts |
//! | `etcd://H:P[,H:P]` | [`etcd::EtcdRegistry`] over plaintext | the whole mesh |
//! | `etcds://H:P[,H:P]` | [`etcd::EtcdRegistry`] over TLS ([`RegistryOptions::tls`]) | the whole mesh |
//! | `kubernetes` | [`kube::KubeRegistry`]: EndpointSlices, read only (needs `--kube`) | the cluster |
//!
//! The scheme says whether the connection is TLS, and the options must agree: TLS
//! options with `etcd://`, or `etcds://` without a CA, is an error at start, never a
//! silent plaintext connection.
//!
//! Every backend keeps a [`View`] (all endpoints of all nodes as it currently knows
//! them) in a `tokio::sync::watch` channel; the agent's refresher watches it, debounces,
//! and turns it into mesh-model updates. Revisions make conditional deletes safe:
//! [`Registry::delete_if_revision`] undoes one registration without removing a newer
//! registration of the same key.
//!
//! # etcd and dead agents
//!
//! The etcd backend attaches every key it writes to this agent's lease (TTL
//! [`RegistryOptions::lease_ttl_secs`], kept alive every TTL/3). If the agent dies
//! (SIGKILL, node loss), keep-alives stop and etcd deletes its endpoints by itself
//! after at most the TTL since the last keep-alive, plus etcd's lease-expiry check
//! granularity (its lessor scans every 500 ms). A graceful stop can revoke the lease
//! ([`etcd::EtcdRegistry::close`]) to remove them at once.
//!
//! # Entries from other nodes are outside input
//!
//! Keys are `<prefix><node>/<namespace>/<service>/<container_id>/<ifname>/<port>`
//! ([`flock_core::registry`]), so etcd RBAC can let each agent write only under its own
//! node's prefix (docs/registry-security.md has the etcd role setup). The etcd backend
//! checks every entry on its own as it decodes it ([`flock_core::registry::check_entry`]:
//! size, names, ports, address, the SPIFFE ID's trust domain and namespace); a bad
//! entry is left out of the [`View`] alone, warned about once per key and counted in
//! [`Rejections`] (`flock_registry_entries_rejected_total{reason}`), so the rest of its
//! service keeps serving.

pub mod etcd;
pub mod kube;
pub mod local;
mod persist;

/// Parses the bytes of a `file:` registry (no I/O): the number of endpoints and the
/// revision, or why the bytes are not a registry file. For the fuzz target; the
/// backend itself applies the size limit before and moves corrupt files aside.
pub fn decode_file(bytes: &[u8]) -> Result<(usize, u64), String> {
    match persist::decode(bytes) {
        Ok(l) => Ok((l.entries.len(), l.revision)),
        Err(persist::Decoded::UnsupportedSchema(s)) => Err(format!("unsupported schema {s}")),
        Err(persist::Decoded::Corrupt(why)) => Err(why),
    }
}

use crate::model::Endpoint;
use flock_core::registry::{MAX_ENTRY_BYTES, Reject, Rejected, Trust};
use flock_core::sync::lock;
use flock_telemetry::prometheus_client;
pub use imbl::{OrdMap, Vector};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Decodes one registry entry written by any node (no I/O): `value` found under `key`
/// (relative to the registry prefix). Applies the size limit
/// ([`flock_core::registry::MAX_ENTRY_BYTES`]) before parsing, then the JSON decode,
/// then [`flock_core::registry::check_entry`]. Never panics; the error's detail bounds
/// and escapes what it quotes.
pub fn decode_entry(key: &str, value: &[u8], trust: &Trust<'_>) -> Result<Endpoint, Rejected> {
    if value.len() > MAX_ENTRY_BYTES {
        return Err(Rejected::new(
            Reject::Oversized,
            format!(
                "{} bytes, more than the limit of {MAX_ENTRY_BYTES}",
                value.len()
            ),
        ));
    }
    let ep = serde_json::from_slice::<Endpoint>(value).map_err(|e| {
        Rejected::new(
            Reject::Undecodable,
            format!(
                "not an endpoint: {}",
                flock_core::registry::bounded(&e.to_string())
            ),
        )
    })?;
    // The mutant trusts every decodable entry, as the registry did before entries were
    // checked one by one: one bad entry then reaches the translation, which refuses its
    // whole service.
    if !flock_core::reintroduced!("registry-trust-all") {
        flock_core::registry::check_entry(&ep.entry_fields(key), trust)?;
    }
    Ok(ep)
}

/// Everything in the registry (all nodes), as the backend currently knows it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct View {
    /// The endpoints by [`Endpoint::key`]. A persistent map: a backend publishes each
    /// change as a new view sharing all unchanged entries with the last one, so a view
    /// costs O(log n) per change instead of a copy of the registry.
    /// Each with the mod revision of its last write ([`Registered::revision`]): one
    /// map, not a second one of revisions by key (a second copy of every key and its
    /// tree cost about 160 bytes per endpoint at 50,000).
    pub endpoints: OrdMap<String, Registered>,
    /// The revision of the view: for etcd the store revision of the last change seen,
    /// for memory/file a counter incremented by every change.
    pub revision: u64,
    /// True once the initial list is loaded and, for etcd, while the watch is connected.
    /// While false, the view may be stale.
    pub synced: bool,
    /// Increments on every (re)connect + resync. The agent runs orphan GC when it
    /// changes, because changes may have been missed in between.
    pub generation: u64,
    /// Counts the views whose [`View::endpoints`] differ from the view before (etcd,
    /// memory, file; 0 for backends that do not report changes). Unchanged by a publish that only
    /// moves the revision or the sync state.
    pub seq: u64,
    /// The keys whose endpoint differs between the view of `seq - 1` and this one
    /// (etcd, memory, file; empty for backends that do not report changes). The watch channel keeps
    /// only the newest view: a subscriber that last saw `seq - 1` applies this delta,
    /// one that missed views applies [`View::recent`].
    pub delta: Arc<Delta>,
    /// The deltas of the last views, oldest first, ending with [`View::delta`] (etcd,
    /// memory, file: up to [`RECENT_DELTAS`] naming up to [`RECENT_KEYS`] keys in all,
    /// but always the last; empty for backends that do not report changes). A
    /// subscriber that last saw `seq - k` applies the last `k` in order if there are
    /// that many, else compares the whole [`View::endpoints`]. Under churn (hundreds
    /// of changes a second, one publish per debounce) nearly every publish follows
    /// missed views; without these it would re-read the whole registry each time.
    pub recent: Vector<Arc<Delta>>,
}

/// One endpoint of a [`View`], and the revision of its last write. Dereferences to
/// the endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    /// The endpoint (shared: views share unchanged entries).
    pub endpoint: Arc<Endpoint>,
    /// The mod revision of the endpoint's last write (etcd: the key's `mod_revision`;
    /// memory/file: the counter at the write; kubernetes: the slice's), for deletes
    /// that must not take a newer registration than the one seen
    /// ([`Registry::delete_if_revision`]).
    pub revision: u64,
}

impl Registered {
    /// `endpoint`, written at `revision`.
    pub fn new(endpoint: Endpoint, revision: u64) -> Self {
        Self {
            endpoint: Arc::new(endpoint),
            revision,
        }
    }
}

/// An endpoint at revision 0 (none known): for views built by hand.
impl From<Endpoint> for Registered {
    fn from(endpoint: Endpoint) -> Self {
        Self::new(endpoint, 0)
    }
}

impl std::ops::Deref for Registered {
    type Target = Endpoint;
    fn deref(&self) -> &Endpoint {
        &self.endpoint
    }
}

/// How many deltas a counting backend keeps in [`View::recent`]: at 200 changes a
/// second, five seconds of missed views.
pub const RECENT_DELTAS: usize = 1024;

/// How many keys the deltas of [`View::recent`] before the last may name in all. The
/// first list of a large registry is one delta naming every key (50,000 keys, about
/// 6 MB): kept among the recent deltas it would stay until 1,024 more changes pushed it
/// out. A subscriber further behind than the kept deltas re-reads the whole view,
/// which is what such a delta would have cost it anyway.
pub const RECENT_KEYS: usize = 16_384;

/// How a view's endpoints differ from the view before it ([`View::delta`]), by key.
/// A key is in at most one list; a re-list after a lost watch reports only the keys
/// that changed while the watch was down.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Delta {
    /// Keys new in this view.
    pub added: Vec<String>,
    /// Keys whose endpoint changed.
    pub changed: Vec<String>,
    /// Keys gone from this view.
    pub removed: Vec<String>,
}

impl Delta {
    /// How many keys the delta names.
    pub fn len(&self) -> usize {
        self.added.len() + self.changed.len() + self.removed.len()
    }

    /// True if no key changed.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.changed.is_empty() && self.removed.is_empty()
    }

    /// Every key the delta names: added, changed, then removed.
    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.added.iter().chain(&self.changed).chain(&self.removed)
    }
}

/// The change count and recent deltas of a backend that reports its changes: what it
/// stamps on each view as [`View::seq`], [`View::delta`] and [`View::recent`].
#[derive(Debug, Clone, Default)]
pub(crate) struct DeltaLog {
    seq: u64,
    last: Arc<Delta>,
    recent: Vector<Arc<Delta>>,
    /// The keys `recent` names in all.
    recent_keys: usize,
}

impl DeltaLog {
    /// Records the next change (a non-empty delta), keeping the last
    /// [`RECENT_DELTAS`] and, before the last, [`RECENT_KEYS`] keys.
    pub(crate) fn push(&mut self, delta: Delta) {
        self.seq += 1;
        self.recent_keys += delta.len();
        self.last = Arc::new(delta);
        self.recent.push_back(Arc::clone(&self.last));
        while self.recent.len() > RECENT_DELTAS
            || (self.recent.len() > 1 && self.recent_keys - self.last.len() > RECENT_KEYS)
        {
            if let Some(old) = self.recent.pop_front() {
                self.recent_keys -= old.len();
            }
        }
    }

    /// Sets `view`'s change fields to this log's (O(1): the deltas are shared).
    pub(crate) fn stamp(&self, view: &mut View) {
        view.seq = self.seq;
        view.delta = Arc::clone(&self.last);
        view.recent = self.recent.clone();
    }
}

impl View {
    /// The mod revision of the last write of `key`'s endpoint, if the view holds it.
    pub fn revision_of(&self, key: &str) -> Option<u64> {
        self.endpoints.get(key).map(|r| r.revision)
    }

    /// The deltas from the view of `seq` `since` to this one, oldest first; `None`
    /// when they are not all known: a backend that does not count its changes
    /// (`since` or `seq` 0), a `since` ahead of this view, or more missed views than
    /// [`View::recent`] keeps.
    pub fn deltas_since(&self, since: u64) -> Option<impl Iterator<Item = &Delta>> {
        let missed = usize::try_from(self.seq.checked_sub(since)?).ok()?;
        if since == 0 || missed > self.recent.len() {
            return None;
        }
        Some(
            self.recent
                .iter()
                .skip(self.recent.len() - missed)
                .map(|d| &**d),
        )
    }
}

/// An endpoint registry backend (see the module docs).
#[async_trait::async_trait]
pub trait Registry: Send + Sync + 'static {
    /// Upserts `ep` under its key; for etcd attached to this agent's lease. Returns the
    /// mod revision of the write.
    async fn put(&self, ep: &Endpoint) -> Result<u64, RegistryError>;
    /// Deletes a key (`Ok(false)` if absent).
    async fn delete(&self, key: &str) -> Result<bool, RegistryError>;
    /// Deletes `key` only if its mod revision is still `revision` (the undo of a guarded
    /// registration must not delete a newer registration of the same key). `Ok(true)`
    /// if deleted.
    async fn delete_if_revision(&self, key: &str, revision: u64) -> Result<bool, RegistryError>;
    /// A receiver of the current view; the backend keeps it up to date (put/delete by
    /// this agent and changes by others).
    fn view(&self) -> tokio::sync::watch::Receiver<Arc<View>>;
    /// `memory`, `file:/path`, `etcd://h:p,h:p`: for logs and `/debug/registry`.
    fn describe(&self) -> String;
    /// The entries this backend refused to put in its view, if it reads entries
    /// written by others (etcd). `None` for backends that hold only this agent's own.
    fn rejections(&self) -> Option<Arc<Rejections>> {
        None
    }
    /// True for a backend someone else writes (`kubernetes`: the EndpointSlice
    /// controller): its `put`/`delete` write nothing, so the agent keeps no
    /// bookkeeping of its own keys and its orphan GC does not judge the view's
    /// entries, which are not the agent's to remove.
    fn read_only(&self) -> bool {
        false
    }
}

/// The registry entries left out of the view, by key, and how many were refused per
/// reason. An entry is warned about and counted when it is first refused (or refused
/// for another reason than before), not on every watch event or re-list that
/// delivers it again: a bad entry sitting in etcd must not flood the log.
#[derive(Debug)]
pub struct Rejections {
    counts: [AtomicU64; Reject::ALL.len()],
    by_key: flock_core::sync::Mutex<BTreeMap<String, Reject>>,
    /// Keys the agent excluded at the last publish by a rule over the whole view
    /// (never-downgrade, the port cap), with the reason.
    excluded: flock_core::sync::Mutex<BTreeMap<String, Reject>>,
}

impl Default for Rejections {
    fn default() -> Self {
        Self {
            counts: Default::default(),
            by_key: flock_core::sync::Mutex::new(BTreeMap::new()),
            excluded: flock_core::sync::Mutex::new(BTreeMap::new()),
        }
    }
}

impl Rejections {
    /// Records that the entry under `key` was refused: warns and counts if this is
    /// news for the key.
    pub fn reject(&self, backend: &str, key: &str, why: &Rejected) {
        let fresh = lock(&self.by_key).insert(key.to_string(), why.reason) != Some(why.reason);
        if fresh {
            self.counts[why.reason.index()].fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                registry = %backend,
                key = %flock_core::registry::bounded(key),
                reason = why.reason.as_str(),
                "ignoring registry entry: {}",
                why.detail
            );
        }
    }

    /// The entry under `key` is gone or valid again: a later refusal is news.
    pub fn clear(&self, key: &str) {
        lock(&self.by_key).remove(key);
    }

    /// Keeps only the refused keys for which `keep` holds (after a re-list: the keys
    /// still refused); counts stay.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        lock(&self.by_key).retain(|k, _| keep(k));
    }

    /// Records the keys the agent currently leaves out by a rule over the whole view
    /// ([`Reject::Downgrade`]: no identity in a service port whose other endpoints have
    /// one; [`Reject::TooManyPorts`]): warns about and counts the ones not left out
    /// (for that reason) at the last publish, so a publish loop does not flood the log.
    pub fn set_excluded(&self, backend: &str, keys: BTreeMap<String, Reject>) {
        let mut current = lock(&self.excluded);
        for (key, reason) in &keys {
            if current.get(key) == Some(reason) {
                continue;
            }
            self.counts[reason.index()].fetch_add(1, Ordering::Relaxed);
            let why = match reason {
                Reject::Downgrade => {
                    "it has no identity but its service port's other endpoints do; the port \
                     stays mTLS without it"
                }
                _ => "its service has more ports than a service may have",
            };
            tracing::warn!(
                registry = %backend,
                key = %flock_core::registry::bounded(key),
                reason = reason.as_str(),
                "not serving registry entry: {why}"
            );
        }
        *current = keys;
    }

    /// The keys left out at the last publish ([`Rejections::set_excluded`]).
    pub fn excluded(&self) -> BTreeMap<String, Reject> {
        lock(&self.excluded).clone()
    }

    /// How many entries were refused for `reason`.
    pub fn count(&self, reason: Reject) -> u64 {
        self.counts[reason.index()].load(Ordering::Relaxed)
    }

    /// The keys currently refused, with their reason.
    pub fn refused(&self) -> BTreeMap<String, Reject> {
        lock(&self.by_key).clone()
    }
}

/// `/metrics` collector of a backend's [`Rejections`]:
/// `flock_registry_entries_rejected_total{reason}`, one series per reason (a closed set).
#[derive(Debug)]
pub struct RejectionsCollector(pub Arc<Rejections>);

impl prometheus_client::collector::Collector for RejectionsCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric as _;
        use prometheus_client::metrics::counter::ConstCounter;
        let mut family = encoder.encode_descriptor(
            "flock_registry_entries_rejected",
            "Registry entries of other nodes left out of the view, by reason.",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for r in Reject::ALL {
            let c = ConstCounter::new(self.0.count(r));
            c.encode(family.encode_family(&[("reason", r.as_str())])?)?;
        }
        Ok(())
    }
}

/// A parsed registry spec (see [`parse_spec`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegistrySpec {
    /// `memory`: embedded, single node, nothing persisted.
    Memory,
    /// `file:PATH`: embedded, persisted to `PATH`.
    File(PathBuf),
    /// `etcd://HOST:PORT[,HOST:PORT]`: the etcd cluster's client endpoints (`HOST:PORT`),
    /// plaintext.
    Etcd(Vec<String>),
    /// `etcds://HOST:PORT[,HOST:PORT]`: the same over TLS.
    EtcdTls(Vec<String>),
    /// `kubernetes`: EndpointSlices through the `--kube` reflectors
    /// ([`kube::KubeRegistry`]; built by the runtime, which holds the watch).
    Kubernetes,
}

impl std::fmt::Display for RegistrySpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegistrySpec::Memory => f.write_str("memory"),
            RegistrySpec::File(p) => write!(f, "file:{}", p.display()),
            RegistrySpec::Etcd(eps) => write!(f, "etcd://{}", eps.join(",")),
            RegistrySpec::EtcdTls(eps) => write!(f, "etcds://{}", eps.join(",")),
            RegistrySpec::Kubernetes => f.write_str(kube::DESCRIBE),
        }
    }
}

/// Parses `memory`, `file:PATH`, `etcd://HOST:PORT[,HOST:PORT]`,
/// `etcds://HOST:PORT[,HOST:PORT]` (TLS) or `kubernetes`.
///
/// Errors say what was expected; IPv6 hosts go in brackets (`etcd://[::1]:2379`).
pub fn parse_spec(spec: &str) -> Result<RegistrySpec, String> {
    const EXPECTED: &str = "expected \"memory\", \"file:PATH\", \"etcd://HOST:PORT[,HOST:PORT]\", \"etcds://HOST:PORT[,HOST:PORT]\" (TLS) or \"kubernetes\"";
    let spec = spec.trim();
    if spec == "memory" {
        return Ok(RegistrySpec::Memory);
    }
    if spec == kube::DESCRIBE {
        return Ok(RegistrySpec::Kubernetes);
    }
    if let Some(path) = spec.strip_prefix("file:") {
        if path.is_empty() {
            return Err(format!(
                "registry spec {spec:?}: empty file path; {EXPECTED}"
            ));
        }
        return Ok(RegistrySpec::File(PathBuf::from(path)));
    }
    let etcd = spec
        .strip_prefix("etcd://")
        .map(|r| (r, false))
        .or_else(|| spec.strip_prefix("etcds://").map(|r| (r, true)));
    if let Some((rest, tls)) = etcd {
        let rest = rest.trim_end_matches('/');
        if rest.is_empty() {
            return Err(format!(
                "registry spec {spec:?}: no etcd endpoint; {EXPECTED}"
            ));
        }
        let mut endpoints = Vec::new();
        for hp in rest.split(',') {
            endpoints
                .push(parse_host_port(hp).map_err(|e| format!("registry spec {spec:?}: {e}"))?);
        }
        return Ok(if tls {
            RegistrySpec::EtcdTls(endpoints)
        } else {
            RegistrySpec::Etcd(endpoints)
        });
    }
    Err(format!(
        "registry spec {spec:?}: unknown backend; {EXPECTED}"
    ))
}

fn parse_host_port(hp: &str) -> Result<String, String> {
    let hp = hp.trim();
    let (host, port) = if let Some(rest) = hp.strip_prefix('[') {
        let (host, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("etcd endpoint {hp:?}: unclosed '[' in IPv6 host"))?;
        let port = after
            .strip_prefix(':')
            .ok_or_else(|| format!("etcd endpoint {hp:?}: expected HOST:PORT"))?;
        host.parse::<std::net::Ipv6Addr>()
            .map_err(|_| format!("etcd endpoint {hp:?}: {host:?} is not an IPv6 address"))?;
        (format!("[{host}]"), port)
    } else {
        let (host, port) = hp
            .rsplit_once(':')
            .ok_or_else(|| format!("etcd endpoint {hp:?}: expected HOST:PORT"))?;
        if host.contains(':') {
            return Err(format!(
                "etcd endpoint {hp:?}: put IPv6 hosts in brackets, [::1]:2379"
            ));
        }
        (host.to_string(), port)
    };
    if host.is_empty() || host.contains('/') || host.contains('@') {
        return Err(format!("etcd endpoint {hp:?}: invalid host"));
    }
    match port.parse::<u16>() {
        Ok(p) if p != 0 => Ok(format!("{host}:{p}")),
        _ => Err(format!(
            "etcd endpoint {hp:?}: port {port:?} is not in 1..=65535"
        )),
    }
}

/// TLS to etcd: the CA that signed etcd's server certificate, and this agent's client
/// certificate and key (etcd's `--client-cert-auth`; with etcd auth enabled and no
/// user, etcd takes the certificate's CN as the user name).
#[derive(Clone)]
pub struct EtcdTls {
    /// PEM CA bundle that verifies etcd's server certificate.
    pub ca_pem: String,
    /// PEM client certificate chain (optional: server-only TLS without it).
    pub cert_pem: Option<String>,
    /// PEM private key of the client certificate; zeroed on drop, never printed.
    pub key_pem: Option<zeroize::Zeroizing<String>>,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTls")
            .field("ca_pem", &format_args!("<{} bytes>", self.ca_pem.len()))
            .field("cert_pem", &self.cert_pem.as_ref().map(|c| c.len()))
            .field("key_pem", &self.key_pem.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// etcd user authentication (etcd's `auth enable`): the user and its password.
#[derive(Clone)]
pub struct EtcdAuth {
    /// The etcd user.
    pub user: String,
    /// Its password; zeroed on drop, never printed (`Debug` shows `<redacted>`).
    pub password: zeroize::Zeroizing<String>,
}

impl std::fmt::Debug for EtcdAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdAuth")
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// Largest PEM file or password file read for the registry (1 MiB).
pub const MAX_CREDENTIAL_FILE_BYTES: u64 = 1 << 20;

fn read_credential(what: &str, path: &std::path::Path) -> Result<String, String> {
    use std::io::Read as _;
    let f = std::fs::File::open(path).map_err(|e| format!("{what} {}: {e}", path.display()))?;
    let mut s = String::new();
    f.take(MAX_CREDENTIAL_FILE_BYTES + 1)
        .read_to_string(&mut s)
        .map_err(|e| format!("{what} {}: {e}", path.display()))?;
    if s.len() as u64 > MAX_CREDENTIAL_FILE_BYTES {
        return Err(format!(
            "{what} {}: larger than {MAX_CREDENTIAL_FILE_BYTES} bytes",
            path.display()
        ));
    }
    Ok(s)
}

/// Reads the registry TLS files: `ca` (PEM CA bundle of etcd's server certificate) and
/// optionally `cert` + `key` (this agent's client certificate). Errors name the flag
/// and the file.
pub fn load_tls(
    ca: &std::path::Path,
    cert: Option<&std::path::Path>,
    key: Option<&std::path::Path>,
) -> Result<EtcdTls, String> {
    let ca_pem = read_credential("--registry-ca", ca)?;
    let (cert_pem, key_pem) = match (cert, key) {
        (Some(c), Some(k)) => (
            Some(read_credential("--registry-cert", c)?),
            Some(zeroize::Zeroizing::new(read_credential(
                "--registry-key",
                k,
            )?)),
        ),
        (None, None) => (None, None),
        _ => {
            return Err(
                "--registry-cert and --registry-key go together (a client certificate needs its key)"
                    .to_string(),
            );
        }
    };
    Ok(EtcdTls {
        ca_pem,
        cert_pem,
        key_pem,
    })
}

/// Reads the etcd password of `user` from `password_file` (one line; a final newline
/// is dropped). A file, not a flag value: command lines are visible in `ps`.
pub fn load_auth(user: &str, password_file: &std::path::Path) -> Result<EtcdAuth, String> {
    if user.is_empty() {
        return Err("--registry-user is empty".to_string());
    }
    let mut password =
        zeroize::Zeroizing::new(read_credential("--registry-password-file", password_file)?);
    while password.ends_with('\n') || password.ends_with('\r') {
        password.pop();
    }
    if password.is_empty() {
        return Err(format!(
            "--registry-password-file {}: empty password",
            password_file.display()
        ));
    }
    Ok(EtcdAuth {
        user: user.to_string(),
        password,
    })
}

/// Settings shared by the backends.
#[derive(Debug, Clone)]
pub struct RegistryOptions {
    /// etcd key prefix of the endpoints (default `/flock/endpoints/`).
    pub prefix: String,
    /// etcd lease TTL in seconds (default 10): how long a dead agent's endpoints live on.
    pub lease_ttl_secs: i64,
    /// This agent's node name (for logs).
    pub node: String,
    /// `file` backend: the largest file loaded at start (default 64 MiB).
    pub file_max_bytes: u64,
    /// etcd: first reconnect delay ceiling (default 200 ms; doubles, equal jitter).
    pub reconnect_initial: Duration,
    /// etcd: largest reconnect delay (default 5 s).
    pub reconnect_max: Duration,
    /// etcd: timeout of one request (connect, put, delete, list, grant; default 5 s).
    pub op_timeout: Duration,
    /// etcd: TLS (required by `etcds://`, refused with `etcd://`).
    pub tls: Option<EtcdTls>,
    /// etcd: user authentication.
    pub auth: Option<EtcdAuth>,
    /// The agent's trust domain: a remote endpoint's SPIFFE ID must be in it. `None`
    /// when the agent has no identity source of its own trust domain (see
    /// [`flock_core::registry::Trust`]).
    pub trust_domain: Option<String>,
    /// etcd: the operator's scope (`--registry-scope`): an entry of node N may carry
    /// only identities of accounts the scope lets N host
    /// ([`flock_core::registry::Trust::scope`]). `None`: not checked.
    pub scope: Option<Arc<flock_core::issuance::Scope>>,
    /// etcd: the most entries of one other node the view holds
    /// ([`flock_core::registry::NodeCap`]; default
    /// [`flock_core::registry::DEFAULT_MAX_ENTRIES_PER_NODE`]).
    pub max_entries_per_node: usize,
}

impl Default for RegistryOptions {
    fn default() -> Self {
        Self {
            prefix: "/flock/endpoints/".to_string(),
            lease_ttl_secs: 10,
            node: String::new(),
            file_max_bytes: 64 << 20,
            reconnect_initial: Duration::from_millis(200),
            reconnect_max: Duration::from_secs(5),
            op_timeout: Duration::from_secs(5),
            tls: None,
            auth: None,
            trust_domain: None,
            scope: None,
            max_entries_per_node: flock_core::registry::DEFAULT_MAX_ENTRIES_PER_NODE,
        }
    }
}

/// A registry operation failed; the message names the backend, the key or file, and why.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// A local file operation failed.
    #[error("registry {backend}: {what}: {source}")]
    Io {
        /// The backend (`file:/path`).
        backend: String,
        /// What was being done, with the path.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The registry file is larger than [`RegistryOptions::file_max_bytes`].
    #[error(
        "registry file {path}: {size} bytes is larger than the limit of {limit} bytes; refusing to load it"
    )]
    FileTooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// The registry file has a schema this version does not know (written by a newer flock?).
    #[error(
        "registry file {path}: unsupported schema {schema} (this flock reads schema {supported}); not touching it"
    )]
    UnsupportedSchema {
        /// The file.
        path: PathBuf,
        /// The schema found.
        schema: u64,
        /// The schema this version writes.
        supported: u64,
    },
    /// The backend cannot serve the request now (etcd disconnected, no lease); retry later.
    #[error("registry {backend}: {op} {key:?}: unavailable: {reason}")]
    Unavailable {
        /// The backend.
        backend: String,
        /// The operation.
        op: &'static str,
        /// The key (empty if none).
        key: String,
        /// Why.
        reason: String,
    },
    /// An etcd request failed.
    #[error("registry {backend}: {op} {key:?}: {source}")]
    Etcd {
        /// The backend.
        backend: String,
        /// The operation.
        op: &'static str,
        /// The key (empty if none).
        key: String,
        /// The cause.
        #[source]
        source: etcd_client::Error,
    },
    /// etcd refused the request for lack of permission: with per-node RBAC, a write
    /// outside this node's prefix, or credentials without the role.
    #[error(
        "registry {backend}: {op} {key:?}: etcd refused it (permission denied: {reason}); \
         this agent's etcd user may write only under {allowed} and read the registry prefix \
         (see docs/registry-security.md)"
    )]
    Denied {
        /// The backend.
        backend: String,
        /// The operation.
        op: &'static str,
        /// The full etcd key (empty if none).
        key: String,
        /// etcd's message.
        reason: String,
        /// The prefix this node's role should grant `readwrite` on.
        allowed: String,
    },
    /// An etcd request did not complete in [`RegistryOptions::op_timeout`].
    #[error("registry {backend}: {op} {key:?}: no answer within {timeout:?}")]
    Timeout {
        /// The backend.
        backend: String,
        /// The operation.
        op: &'static str,
        /// The key (empty if none).
        key: String,
        /// The timeout.
        timeout: Duration,
    },
    /// An endpoint could not be encoded.
    #[error("registry {backend}: encoding endpoint {key:?}: {source}")]
    Encode {
        /// The backend.
        backend: String,
        /// The key.
        key: String,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// Invalid options or arguments.
    #[error("registry {backend}: {reason}")]
    Invalid {
        /// The backend.
        backend: String,
        /// Why.
        reason: String,
    },
}

/// Opens the backend `spec` describes. For etcd this connects, grants the lease and
/// loads the initial view before returning (an unreachable etcd is an error here;
/// later disconnects are retried in the background).
pub async fn connect(
    spec: &RegistrySpec,
    opts: RegistryOptions,
) -> Result<Arc<dyn Registry>, RegistryError> {
    let local = matches!(spec, RegistrySpec::Memory | RegistrySpec::File(_));
    if local && (opts.tls.is_some() || opts.auth.is_some()) {
        return Err(RegistryError::Invalid {
            backend: spec.to_string(),
            reason: "registry TLS and user options apply to etcds:// only".to_string(),
        });
    }
    if matches!(spec, RegistrySpec::Etcd(_)) && opts.auth.is_some() {
        return Err(RegistryError::Invalid {
            backend: spec.to_string(),
            reason: "an etcd user and password over plaintext etcd:// would cross the \
                     network in clear; use etcds://"
                .to_string(),
        });
    }
    Ok(match spec {
        RegistrySpec::Kubernetes => {
            return Err(RegistryError::Invalid {
                backend: spec.to_string(),
                reason: "--registry kubernetes reads EndpointSlices through the Kubernetes \
                         API watch: it needs --kube"
                    .to_string(),
            });
        }
        RegistrySpec::Memory => Arc::new(local::LocalRegistry::memory()),
        RegistrySpec::File(path) => Arc::new(local::LocalRegistry::open_file(path, &opts).await?),
        RegistrySpec::Etcd(endpoints) => {
            if opts.tls.is_some() {
                return Err(RegistryError::Invalid {
                    backend: spec.to_string(),
                    reason: "TLS options (--registry-ca/--registry-cert/--registry-key) given \
                             for a plaintext etcd:// registry; write etcds:// to use TLS"
                        .to_string(),
                });
            }
            Arc::new(etcd::EtcdRegistry::connect(endpoints, opts).await?)
        }
        RegistrySpec::EtcdTls(endpoints) => {
            if opts.tls.is_none() {
                return Err(RegistryError::Invalid {
                    backend: spec.to_string(),
                    reason: "etcds:// needs the CA that signed etcd's certificate \
                             (--registry-ca)"
                        .to_string(),
                });
            }
            Arc::new(etcd::EtcdRegistry::connect(endpoints, opts).await?)
        }
    })
}
