//! The endpoint registry: where every agent publishes its pods' [`Endpoint`]s and
//! learns everyone else's.
//!
//! One trait, [`Registry`], three backends chosen by a spec string ([`parse_spec`]):
//!
//! | spec | backend | scope |
//! |------|---------|-------|
//! | `memory` (default) | [`local::LocalRegistry`] without a file | this process only |
//! | `file:PATH` | [`local::LocalRegistry`] persisting to `PATH` | this node, survives restarts |
//! | `etcd://H:P[,H:P]` | [`etcd::EtcdRegistry`] | the whole mesh |
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

pub mod etcd;
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
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Everything in the registry (all nodes), as the backend currently knows it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct View {
    /// The endpoints by [`Endpoint::key`].
    pub endpoints: BTreeMap<String, Endpoint>,
    /// The mod revision of each endpoint's last write, by key (etcd: the key's
    /// `mod_revision`; memory/file: the counter at the write), for deletes that must
    /// not take a newer registration than the one seen ([`Registry::delete_if_revision`]).
    pub revisions: BTreeMap<String, u64>,
    /// The revision of the view: for etcd the store revision of the last change seen,
    /// for memory/file a counter incremented by every change.
    pub revision: u64,
    /// True once the initial list is loaded and, for etcd, while the watch is connected.
    /// While false, the view may be stale.
    pub synced: bool,
    /// Increments on every (re)connect + resync. The agent runs orphan GC when it
    /// changes, because changes may have been missed in between.
    pub generation: u64,
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
}

/// A parsed registry spec (see [`parse_spec`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegistrySpec {
    /// `memory`: embedded, single node, nothing persisted.
    Memory,
    /// `file:PATH`: embedded, persisted to `PATH`.
    File(PathBuf),
    /// `etcd://HOST:PORT[,HOST:PORT]`: the etcd cluster's client endpoints (`HOST:PORT`).
    Etcd(Vec<String>),
}

impl std::fmt::Display for RegistrySpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegistrySpec::Memory => f.write_str("memory"),
            RegistrySpec::File(p) => write!(f, "file:{}", p.display()),
            RegistrySpec::Etcd(eps) => write!(f, "etcd://{}", eps.join(",")),
        }
    }
}

/// Parses `memory`, `file:PATH` or `etcd://HOST:PORT[,HOST:PORT]`.
///
/// Errors say what was expected; IPv6 hosts go in brackets (`etcd://[::1]:2379`).
pub fn parse_spec(spec: &str) -> Result<RegistrySpec, String> {
    const EXPECTED: &str = "expected \"memory\", \"file:PATH\" or \"etcd://HOST:PORT[,HOST:PORT]\"";
    let spec = spec.trim();
    if spec == "memory" {
        return Ok(RegistrySpec::Memory);
    }
    if let Some(path) = spec.strip_prefix("file:") {
        if path.is_empty() {
            return Err(format!(
                "registry spec {spec:?}: empty file path; {EXPECTED}"
            ));
        }
        return Ok(RegistrySpec::File(PathBuf::from(path)));
    }
    if let Some(rest) = spec.strip_prefix("etcd://") {
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
        return Ok(RegistrySpec::Etcd(endpoints));
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
    Ok(match spec {
        RegistrySpec::Memory => Arc::new(local::LocalRegistry::memory()),
        RegistrySpec::File(path) => Arc::new(local::LocalRegistry::open_file(path, &opts).await?),
        RegistrySpec::Etcd(endpoints) => {
            Arc::new(etcd::EtcdRegistry::connect(endpoints, opts).await?)
        }
    })
}
