//! The `etcd://` backend.
//!
//! Keys are `<prefix><Endpoint::key()>` with the endpoint as JSON, each attached to this
//! agent's lease. A background task owns the "session": the lease keep-alive (every
//! TTL/3) and a prefix watch. On connect it grants the lease, lists the prefix at
//! revision R, publishes the view (`synced`, generation + 1) and watches from R + 1.
//!
//! When the watch or keep-alive breaks, the view is marked unsynced and the task
//! reconnects with [`flock_core::backoff::Backoff`] (equal jitter, so a fleet of agents
//! does not reconnect in lockstep after an etcd outage). It resumes the watch from the
//! last revision seen + 1, so etcd replays what was missed (within its 100 ms watcher
//! sync loop after the watch is created); if that revision was compacted it re-lists.
//! Every successful reconnect increments `generation`.
//!
//! If the lease is lost (etcd answers a keep-alive with TTL 0, or says "lease not
//! found" on reconnect, e.g. because it expired during a long partition or was
//! revoked), a new lease is granted and every endpoint this instance put (and did not
//! delete since) is put again under it, so the agent does not have to.
//!
//! TTL: a SIGKILLed agent's endpoints vanish at most `lease_ttl_secs` after its last
//! keep-alive, plus etcd's lease-expiry check granularity (500 ms), i.e. between about
//! 2/3 TTL and TTL + 0.5 s after its death.
//!
//! Every entry read from etcd is checked on its own before it enters the view
//! ([`flock_core::registry::check_entry`], after a size limit and the JSON decode): etcd
//! is written by every node, and a node's bad or forged entry must cost only that entry.
//! A refused entry is left out (and, if a valid value of its key was in the view, that
//! value is removed: the view holds what etcd holds now, or nothing), warned about
//! once per key and counted ([`Rejections`]).
//!
//! TLS and user auth come from [`RegistryOptions::tls`] and [`RegistryOptions::auth`];
//! an etcd refusal for lack of permission (RBAC: a node writing outside
//! `<prefix><node>/`) is [`RegistryError::Denied`].
//!
//! Own writes update the view at once (like `memory`), tagged with their revision;
//! watch events for the same or older revisions of a key are then ignored, so the view
//! never moves backwards.

use super::{Registry, RegistryError, RegistryOptions, Rejections, View};
use crate::model::Endpoint;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, LeaseKeepAliveStream,
    LeaseKeeper, PutOptions, Txn, TxnOp, WatchOptions, WatchStream,
};
use flock_core::backoff::Backoff;
use flock_core::registry::{Rejected, Trust};
use flock_core::sync::Mutex as SyncMutex;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{Mutex, watch};
use tokio::task::JoinHandle;

/// The etcd backend (see the module docs).
pub struct EtcdRegistry {
    shared: Arc<Shared>,
    task: SyncMutex<Option<JoinHandle<()>>>,
}

struct Shared {
    client: Client,
    describe: String,
    prefix: String,
    ttl: i64,
    node: String,
    opts: RegistryOptions,
    view_tx: watch::Sender<Arc<View>>,
    /// Serializes this agent's writes with lease replacement, so a re-put after lease
    /// loss sees every successful put and no deleted key.
    ops: Mutex<Ops>,
    view: SyncMutex<ViewState>,
    /// Entries of other nodes left out of the view.
    rejections: Arc<Rejections>,
}

/// What decoding one etcd entry gave.
enum Decoded {
    /// A valid endpoint under its key (relative to the prefix).
    Valid(String, Box<Endpoint>),
    /// A key under the prefix whose value was refused.
    Refused(String),
    /// Not under the prefix at all (cannot happen with a prefix watch).
    Foreign,
}

struct Ops {
    /// The current lease; `None` when lost (a new one is granted on the next session).
    lease: Option<i64>,
    /// Set when a new lease replaced a lost one and not all own endpoints are re-put yet.
    reput_pending: bool,
    /// Endpoints this instance put and did not delete since, by key.
    own: BTreeMap<String, Endpoint>,
}

#[derive(Default)]
struct ViewState {
    /// Endpoints by key, with their mod revision.
    entries: BTreeMap<String, (Endpoint, i64)>,
    /// Own deletes applied before the watch reported them: key → delete revision, so an
    /// older put event replayed by the watch does not resurrect the key.
    tombstones: BTreeMap<String, i64>,
    /// The revision the watch has delivered up to (the resume point is this + 1).
    revision: i64,
    synced: bool,
    generation: u64,
    /// The resume revision was compacted: the next session lists instead of resuming.
    needs_list: bool,
}

impl ViewState {
    fn apply_put(&mut self, key: String, ep: Endpoint, rev: i64) -> bool {
        if self.entries.get(&key).is_some_and(|(_, r)| *r >= rev)
            || self.tombstones.get(&key).is_some_and(|r| *r >= rev)
        {
            return false;
        }
        self.tombstones.remove(&key);
        self.entries.insert(key, (ep, rev));
        true
    }

    fn apply_delete(&mut self, key: String, rev: i64) -> bool {
        if self.entries.get(&key).is_some_and(|(_, r)| *r > rev) {
            return false;
        }
        let removed = self.entries.remove(&key).is_some();
        if rev > self.revision {
            self.tombstones.insert(key, rev);
        }
        removed
    }

    fn snapshot(&self) -> View {
        View {
            endpoints: self
                .entries
                .iter()
                .map(|(k, (e, _))| (k.clone(), e.clone()))
                .collect(),
            revisions: self
                .entries
                .iter()
                .map(|(k, (_, rev))| (k.clone(), u64::try_from(*rev).unwrap_or(0)))
                .collect(),
            revision: u64::try_from(self.revision).unwrap_or(0),
            synced: self.synced,
            generation: self.generation,
        }
    }
}

/// Why a session ended.
enum SessionEnd {
    /// A transport/watch/keep-alive failure: reconnect after a backoff.
    Failed(String),
}

impl Shared {
    fn full_key(&self, key: &str) -> String {
        format!("{}{}", self.prefix, key)
    }

    fn publish(&self, state: &ViewState) {
        self.view_tx.send_replace(Arc::new(state.snapshot()));
    }

    fn err(&self, op: &'static str, key: &str, source: etcd_client::Error) -> RegistryError {
        if let etcd_client::Error::GRpcStatus(status) = &source
            && status.code() == tonic::Code::PermissionDenied
        {
            return RegistryError::Denied {
                backend: self.describe.clone(),
                op,
                key: format!(
                    "{}{key}",
                    if key.starts_with(&self.prefix) {
                        ""
                    } else {
                        &self.prefix
                    }
                ),
                reason: status.message().to_string(),
                allowed: format!(
                    "{}{}",
                    self.prefix,
                    flock_core::registry::node_prefix(&self.node)
                ),
            };
        }
        RegistryError::Etcd {
            backend: self.describe.clone(),
            op,
            key: key.to_string(),
            source,
        }
    }

    /// Runs one etcd request with [`RegistryOptions::op_timeout`]: with no reachable
    /// endpoint the balanced channel waits instead of failing.
    async fn call<T>(
        &self,
        op: &'static str,
        key: &str,
        fut: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, RegistryError> {
        match tokio::time::timeout(self.opts.op_timeout, fut).await {
            Ok(r) => r.map_err(|e| self.err(op, key, e)),
            Err(_) => Err(RegistryError::Timeout {
                backend: self.describe.clone(),
                op,
                key: key.to_string(),
                timeout: self.opts.op_timeout,
            }),
        }
    }

    /// Decodes and checks one entry (see the module docs). A refusal is recorded in
    /// [`Rejections`] (warned about once per key).
    fn decode(&self, full_key: &[u8], value: &[u8]) -> Decoded {
        let Some(key) = std::str::from_utf8(full_key)
            .ok()
            .and_then(|k| k.strip_prefix(&self.prefix))
        else {
            return Decoded::Foreign;
        };
        match self.check(key, value) {
            Ok(ep) => {
                self.rejections.clear(key);
                Decoded::Valid(key.to_string(), Box::new(ep))
            }
            Err(why) => {
                self.rejections.reject(&self.describe, key, &why);
                Decoded::Refused(key.to_string())
            }
        }
    }

    fn check(&self, key: &str, value: &[u8]) -> Result<Endpoint, Rejected> {
        super::decode_entry(
            key,
            value,
            &Trust {
                local_node: &self.node,
                trust_domain: self.opts.trust_domain.as_deref(),
            },
        )
    }

    /// Grants a new lease and puts every own endpoint again under it. Called with the
    /// ops lock held. On a re-put failure `reput_pending` stays set and the next session
    /// finishes the job.
    async fn new_lease(
        &self,
        ops: &mut Ops,
    ) -> Result<(LeaseKeeper, LeaseKeepAliveStream), RegistryError> {
        let mut lease_client = self.client.lease_client();
        let grant = self
            .call("lease grant", "", lease_client.grant(self.ttl, None))
            .await?;
        let id = grant.id();
        tracing::info!(registry = %self.describe, node = %self.node, lease = id, ttl = grant.ttl(), "etcd lease granted");
        let had_lease = ops.lease.is_some() || !ops.own.is_empty();
        ops.lease = Some(id);
        ops.reput_pending = had_lease && !ops.own.is_empty();
        let keep = self
            .call("lease keep-alive", "", lease_client.keep_alive(id))
            .await?;
        self.reput(ops).await?;
        Ok(keep)
    }

    async fn reput(&self, ops: &mut Ops) -> Result<(), RegistryError> {
        if !ops.reput_pending {
            return Ok(());
        }
        let lease = ops.lease.unwrap_or(0);
        for (key, ep) in &ops.own {
            let rev = self.put_raw(key, ep, lease).await?;
            let mut view = self.view.lock();
            if view.apply_put(key.clone(), ep.clone(), rev) {
                self.publish(&view);
            }
        }
        tracing::info!(registry = %self.describe, node = %self.node, lease, endpoints = ops.own.len(), "own endpoints re-put under the new lease");
        ops.reput_pending = false;
        Ok(())
    }

    async fn put_raw(&self, key: &str, ep: &Endpoint, lease: i64) -> Result<i64, RegistryError> {
        let value = serde_json::to_vec(ep).map_err(|e| RegistryError::Encode {
            backend: self.describe.clone(),
            key: key.to_string(),
            source: e,
        })?;
        let mut kv = self.client.kv_client();
        let resp = self
            .call(
                "put",
                key,
                kv.put(
                    self.full_key(key),
                    value,
                    Some(PutOptions::new().with_lease(lease)),
                ),
            )
            .await?;
        Ok(resp.header().map(|h| h.revision()).unwrap_or(0))
    }

    /// Lists the prefix and replaces the view's entries; returns the list revision.
    async fn list(&self) -> Result<i64, RegistryError> {
        let mut kv = self.client.kv_client();
        let resp = self
            .call(
                "list",
                &self.prefix,
                kv.get(self.prefix.clone(), Some(GetOptions::new().with_prefix())),
            )
            .await?;
        let rev = resp.header().map(|h| h.revision()).unwrap_or(0);
        let mut entries = BTreeMap::new();
        let mut refused = std::collections::BTreeSet::new();
        for kv in resp.kvs() {
            match self.decode(kv.key(), kv.value()) {
                Decoded::Valid(key, ep) => {
                    entries.insert(key, (*ep, kv.mod_revision()));
                }
                Decoded::Refused(key) => {
                    refused.insert(key);
                }
                Decoded::Foreign => {}
            }
        }
        // Keys refused before and gone since: a later bad value under them is news.
        self.rejections.retain(|k| refused.contains(k));
        let mut view = self.view.lock();
        view.entries = entries;
        view.tombstones.clear();
        view.revision = rev;
        view.needs_list = false;
        Ok(rev)
    }

    /// Creates the prefix watch from `start` and waits for etcd to confirm it. `Ok(None)`
    /// if `start` was compacted.
    async fn watch_from(&self, start: i64) -> Result<Option<WatchStream>, RegistryError> {
        let mut wc = self.client.watch_client();
        let mut stream = self
            .call(
                "watch",
                &self.prefix,
                wc.watch(
                    self.prefix.clone(),
                    Some(WatchOptions::new().with_prefix().with_start_revision(start)),
                ),
            )
            .await?;
        let first = self.call("watch", &self.prefix, stream.message()).await?;
        match first {
            Some(resp) if resp.canceled() && resp.compact_revision() > 0 => {
                tracing::warn!(registry = %self.describe, start, compacted = resp.compact_revision(), "watch resume revision was compacted; re-listing");
                Ok(None)
            }
            Some(resp) if resp.canceled() => Err(RegistryError::Unavailable {
                backend: self.describe.clone(),
                op: "watch",
                key: self.prefix.clone(),
                reason: format!("etcd canceled the watch: {}", resp.cancel_reason()),
            }),
            Some(resp) => {
                // The created response can carry no events; if it does, apply them.
                self.apply_watch(&resp);
                Ok(Some(stream))
            }
            None => Err(RegistryError::Unavailable {
                backend: self.describe.clone(),
                op: "watch",
                key: self.prefix.clone(),
                reason: "the watch stream closed at once".to_string(),
            }),
        }
    }

    fn apply_watch(&self, resp: &etcd_client::WatchResponse) {
        if resp.events().is_empty() {
            return;
        }
        let mut view = self.view.lock();
        let mut changed = false;
        for ev in resp.events() {
            let Some(kv) = ev.kv() else { continue };
            let rev = kv.mod_revision();
            view.revision = view.revision.max(rev);
            match ev.event_type() {
                EventType::Put => match self.decode(kv.key(), kv.value()) {
                    Decoded::Valid(key, ep) => changed |= view.apply_put(key, *ep, rev),
                    // The key's current value is refused: an older valid value must
                    // not keep serving in its place.
                    Decoded::Refused(key) => changed |= view.apply_delete(key, rev),
                    Decoded::Foreign => {}
                },
                EventType::Delete => {
                    if let Some(key) = std::str::from_utf8(kv.key())
                        .ok()
                        .and_then(|k| k.strip_prefix(&self.prefix))
                    {
                        self.rejections.clear(key);
                        changed |= view.apply_delete(key.to_string(), rev);
                    }
                }
            }
        }
        // Tombstones at or below the delivered revision are no longer needed.
        let upto = view.revision;
        view.tombstones.retain(|_, r| *r > upto);
        // The revision moved even if nothing visible changed; publish anyway.
        let _ = changed;
        self.publish(&view);
    }

    fn mark_unsynced(&self) {
        let mut view = self.view.lock();
        if view.synced {
            view.synced = false;
            self.publish(&view);
        }
    }

    /// Establishes a session: a live lease (new one if lost, re-putting own endpoints)
    /// and a watch (resumed, or after a list). Publishes the view as synced with the
    /// next generation.
    async fn establish(
        &self,
    ) -> Result<(LeaseKeeper, LeaseKeepAliveStream, WatchStream), RegistryError> {
        let (keeper, ka_stream) = {
            let mut ops = self.ops.lock().await;
            let kept = match ops.lease {
                Some(id) => {
                    let mut lease_client = self.client.lease_client();
                    match self
                        .call("lease keep-alive", "", lease_client.keep_alive(id))
                        .await
                    {
                        Ok(k) => Some(k),
                        Err(RegistryError::Etcd {
                            source: etcd_client::Error::LeaseKeepAliveError(msg),
                            ..
                        }) => {
                            tracing::warn!(registry = %self.describe, node = %self.node, lease = id, reason = %msg, "etcd lease lost; granting a new one");
                            ops.lease = None;
                            None
                        }
                        Err(RegistryError::Etcd {
                            source: etcd_client::Error::GRpcStatus(status),
                            ..
                        }) if status.code() == tonic::Code::NotFound => {
                            tracing::warn!(registry = %self.describe, node = %self.node, lease = id, reason = %status.message(), "etcd lease lost; granting a new one");
                            ops.lease = None;
                            None
                        }
                        Err(e) => return Err(e),
                    }
                }
                None => None,
            };
            match kept {
                Some(k) => {
                    self.reput(&mut ops).await?;
                    k
                }
                None => self.new_lease(&mut ops).await?,
            }
        };
        let (resume, needs_list) = {
            let view = self.view.lock();
            (view.revision, view.needs_list || view.revision == 0)
        };
        let stream = if needs_list {
            None
        } else {
            self.watch_from(resume + 1).await?
        };
        let stream = match stream {
            Some(s) => s,
            None => {
                let rev = self.list().await?;
                self.watch_from(rev + 1)
                    .await?
                    .ok_or_else(|| RegistryError::Unavailable {
                        backend: self.describe.clone(),
                        op: "watch",
                        key: self.prefix.clone(),
                        reason: format!("revision {} compacted right after listing it", rev + 1),
                    })?
            }
        };
        let mut view = self.view.lock();
        view.synced = true;
        view.generation += 1;
        tracing::info!(registry = %self.describe, node = %self.node, generation = view.generation, revision = view.revision, endpoints = view.entries.len(), "registry synced");
        self.publish(&view);
        Ok((keeper, ka_stream, stream))
    }

    /// Drives a session until it fails: keep-alives every TTL/3, lease-loss handling,
    /// watch events into the view.
    async fn drive(
        &self,
        mut keeper: LeaseKeeper,
        mut ka_stream: LeaseKeepAliveStream,
        mut watch: WatchStream,
    ) -> SessionEnd {
        let ttl = Duration::from_secs(self.ttl.max(1) as u64);
        let mut tick = tokio::time::interval(ttl / 3);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_ack = Instant::now();
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    if last_ack.elapsed() > ttl {
                        return SessionEnd::Failed(format!("no keep-alive answer for {ttl:?}"));
                    }
                    if let Err(e) = keeper.keep_alive().await {
                        return SessionEnd::Failed(format!("sending keep-alive: {e}"));
                    }
                }
                msg = ka_stream.message() => match msg {
                    Ok(Some(resp)) if resp.ttl() > 0 => last_ack = Instant::now(),
                    Ok(Some(resp)) => {
                        tracing::warn!(registry = %self.describe, node = %self.node, lease = resp.id(), "etcd lease lost (revoked or expired); granting a new one and re-putting own endpoints");
                        let mut ops = self.ops.lock().await;
                        ops.lease = None;
                        match self.new_lease(&mut ops).await {
                            Ok((k, s)) => {
                                keeper = k;
                                ka_stream = s;
                                last_ack = Instant::now();
                            }
                            Err(e) => return SessionEnd::Failed(format!("replacing the lost lease: {e}")),
                        }
                    }
                    Ok(None) => return SessionEnd::Failed("keep-alive stream closed".to_string()),
                    Err(e) => return SessionEnd::Failed(format!("keep-alive stream: {e}")),
                },
                msg = watch.message() => match msg {
                    Ok(Some(resp)) => {
                        if resp.canceled() {
                            if resp.compact_revision() > 0 {
                                self.view.lock().needs_list = true;
                            }
                            return SessionEnd::Failed(format!("watch canceled (compact revision {}): {}", resp.compact_revision(), resp.cancel_reason()));
                        }
                        self.apply_watch(&resp);
                    }
                    Ok(None) => return SessionEnd::Failed("watch stream closed".to_string()),
                    Err(e) => return SessionEnd::Failed(format!("watch stream: {e}")),
                },
            }
        }
    }

    async fn run(self: Arc<Self>, first: (LeaseKeeper, LeaseKeepAliveStream, WatchStream)) {
        let mut backoff = Backoff::new(self.opts.reconnect_initial, self.opts.reconnect_max);
        let mut session = Some(first);
        loop {
            let (keeper, ka, watch) = match session.take() {
                Some(s) => s,
                None => match self.establish().await {
                    Ok(s) => s,
                    Err(e) => {
                        let delay = backoff.next_delay(flock_clock::jitter());
                        tracing::warn!(registry = %self.describe, node = %self.node, error = %e, retry_in = ?delay, "registry reconnect failed");
                        tokio::time::sleep(delay).await;
                        continue;
                    }
                },
            };
            let started = Instant::now();
            let SessionEnd::Failed(why) = self.drive(keeper, ka, watch).await;
            self.mark_unsynced();
            // A session that lasted was a success: start the backoff over. One that
            // failed at once keeps growing it, so a flapping etcd is not hammered.
            if started.elapsed() > Duration::from_secs(10) {
                backoff.reset();
            }
            let delay = backoff.next_delay(flock_clock::jitter());
            tracing::warn!(registry = %self.describe, node = %self.node, reason = %why, retry_in = ?delay, "registry disconnected; reconnecting");
            tokio::time::sleep(delay).await;
        }
    }
}

impl EtcdRegistry {
    /// Connects to the etcd cluster at `endpoints` (`HOST:PORT`), grants the lease,
    /// lists the prefix and starts the session task. Fails if etcd is not reachable
    /// within [`RegistryOptions::op_timeout`].
    pub async fn connect(
        endpoints: &[String],
        opts: RegistryOptions,
    ) -> Result<Self, RegistryError> {
        let describe = format!("etcd://{}", endpoints.join(","));
        if opts.lease_ttl_secs < 1 {
            return Err(RegistryError::Invalid {
                backend: describe,
                reason: format!(
                    "lease TTL must be at least 1 s, got {}",
                    opts.lease_ttl_secs
                ),
            });
        }
        if opts.prefix.is_empty() {
            return Err(RegistryError::Invalid {
                backend: describe,
                reason: "empty key prefix (it would watch the whole keyspace)".to_string(),
            });
        }
        let scheme = if opts.tls.is_some() { "https" } else { "http" };
        let urls: Vec<String> = endpoints
            .iter()
            .map(|e| format!("{scheme}://{e}"))
            .collect();
        // HTTP/2 pings detect a silently dead peer (partition) on the long-lived streams;
        // a killed etcd is detected at once by the connection reset.
        let mut connect_opts = ConnectOptions::new()
            .with_connect_timeout(opts.op_timeout)
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(5))
            .with_keep_alive_while_idle(true);
        if let Some(tls) = &opts.tls {
            connect_opts = connect_opts.with_tls(tls_options(tls, &describe)?);
        }
        if let Some(auth) = &opts.auth {
            // etcd-client keeps its own copy to re-authenticate when the token expires.
            connect_opts = connect_opts.with_user(auth.user.clone(), auth.password.as_str());
        }
        let client =
            match tokio::time::timeout(opts.op_timeout, Client::connect(&urls, Some(connect_opts)))
                .await
            {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    return Err(RegistryError::Etcd {
                        backend: describe,
                        op: "connect",
                        key: String::new(),
                        source: e,
                    });
                }
                Err(_) => {
                    return Err(RegistryError::Timeout {
                        backend: describe,
                        op: "connect",
                        key: String::new(),
                        timeout: opts.op_timeout,
                    });
                }
            };
        let (view_tx, _) = watch::channel(Arc::new(View::default()));
        let shared = Arc::new(Shared {
            client,
            describe,
            prefix: opts.prefix.clone(),
            ttl: opts.lease_ttl_secs,
            node: opts.node.clone(),
            opts,
            view_tx,
            ops: Mutex::new(Ops {
                lease: None,
                reput_pending: false,
                own: BTreeMap::new(),
            }),
            view: SyncMutex::new(ViewState::default()),
            rejections: Arc::new(Rejections::default()),
        });
        let first = shared.establish().await?;
        let task = tokio::spawn(shared.clone().run(first));
        Ok(Self {
            shared,
            task: SyncMutex::new(Some(task)),
        })
    }

    /// The current lease ID (`None` while a lost lease is being replaced).
    pub async fn lease_id(&self) -> Option<i64> {
        self.shared.ops.lock().await.lease
    }

    /// Stops the session task (keep-alive and watch) WITHOUT revoking the lease: this
    /// instance's endpoints expire after the TTL, exactly as if the agent had been
    /// SIGKILLed. For tests, and for a handover where a successor keeps the endpoints
    /// alive. The view is marked unsynced; later puts fail.
    pub fn shutdown_without_revoke(&self) {
        if let Some(task) = self.task.lock().take() {
            task.abort();
        }
        self.shared.mark_unsynced();
    }

    /// Graceful stop: stops the session task and revokes the lease, so this agent's
    /// endpoints disappear from the mesh at once instead of after the TTL.
    pub async fn close(&self) -> Result<(), RegistryError> {
        self.shutdown_without_revoke();
        let mut ops = self.shared.ops.lock().await;
        if let Some(id) = ops.lease.take() {
            let mut lease_client = self.shared.client.lease_client();
            self.shared
                .call("lease revoke", "", lease_client.revoke(id))
                .await?;
        }
        ops.own.clear();
        Ok(())
    }

    fn unavailable(&self, op: &'static str, key: &str, reason: &str) -> RegistryError {
        RegistryError::Unavailable {
            backend: self.shared.describe.clone(),
            op,
            key: key.to_string(),
            reason: reason.to_string(),
        }
    }
}

impl Drop for EtcdRegistry {
    /// Stops the background task; the lease is not revoked (see [`EtcdRegistry::close`]).
    fn drop(&mut self) {
        if let Some(task) = self.task.lock().take() {
            task.abort();
        }
    }
}

#[async_trait::async_trait]
impl Registry for EtcdRegistry {
    async fn put(&self, ep: &Endpoint) -> Result<u64, RegistryError> {
        let key = ep.key();
        if !self.shared.node.is_empty() && ep.node != self.shared.node {
            return Err(RegistryError::Invalid {
                backend: self.shared.describe.clone(),
                reason: format!(
                    "put {key:?}: the endpoint belongs to node {:?}, this agent is node {:?}; \
                     an agent writes only its own node's endpoints",
                    ep.node, self.shared.node
                ),
            });
        }
        let mut ops = self.shared.ops.lock().await;
        if !self.view_tx_synced() {
            return Err(self.unavailable(
                "put",
                &key,
                "not connected to etcd (reconnecting); retry later",
            ));
        }
        let Some(lease) = ops.lease else {
            return Err(self.unavailable(
                "put",
                &key,
                "no etcd lease (being replaced); retry later",
            ));
        };
        let rev = self.shared.put_raw(&key, ep, lease).await?;
        ops.own.insert(key.clone(), ep.clone());
        let mut view = self.shared.view.lock();
        if view.apply_put(key, ep.clone(), rev) {
            self.shared.publish(&view);
        }
        Ok(u64::try_from(rev).unwrap_or(0))
    }

    async fn delete(&self, key: &str) -> Result<bool, RegistryError> {
        let mut ops = self.shared.ops.lock().await;
        let mut kv = self.shared.client.kv_client();
        let resp = self
            .shared
            .call("delete", key, kv.delete(self.shared.full_key(key), None))
            .await?;
        ops.own.remove(key);
        let rev = resp.header().map(|h| h.revision()).unwrap_or(0);
        let deleted = resp.deleted() > 0;
        if deleted {
            let mut view = self.shared.view.lock();
            if view.apply_delete(key.to_string(), rev) {
                self.shared.publish(&view);
            }
        }
        Ok(deleted)
    }

    async fn delete_if_revision(&self, key: &str, revision: u64) -> Result<bool, RegistryError> {
        let rev = i64::try_from(revision).map_err(|_| RegistryError::Invalid {
            backend: self.shared.describe.clone(),
            reason: format!("delete_if_revision {key:?}: revision {revision} is out of range"),
        })?;
        let mut ops = self.shared.ops.lock().await;
        let full = self.shared.full_key(key);
        let txn = Txn::new()
            .when([Compare::mod_revision(full.clone(), CompareOp::Equal, rev)])
            .and_then([TxnOp::delete(full, None)]);
        let mut kv = self.shared.client.kv_client();
        let resp = self
            .shared
            .call("delete_if_revision", key, kv.txn(txn))
            .await?;
        if !resp.succeeded() {
            return Ok(false);
        }
        // The key was at `revision`: if it was ours, that registration is gone now.
        ops.own.remove(key);
        let at = resp.header().map(|h| h.revision()).unwrap_or(0);
        let mut view = self.shared.view.lock();
        if view.apply_delete(key.to_string(), at) {
            self.shared.publish(&view);
        }
        Ok(true)
    }

    fn view(&self) -> watch::Receiver<Arc<View>> {
        self.shared.view_tx.subscribe()
    }

    fn describe(&self) -> String {
        self.shared.describe.clone()
    }

    fn rejections(&self) -> Option<Arc<Rejections>> {
        Some(Arc::clone(&self.shared.rejections))
    }
}

/// tonic's TLS settings for `tls`: etcd's CA, and the client identity if given.
fn tls_options(
    tls: &super::EtcdTls,
    describe: &str,
) -> Result<etcd_client::TlsOptions, RegistryError> {
    let invalid = |reason: String| RegistryError::Invalid {
        backend: describe.to_string(),
        reason,
    };
    if !tls.ca_pem.contains("-----BEGIN CERTIFICATE-----") {
        return Err(invalid(
            "the registry CA (--registry-ca) holds no PEM certificate".to_string(),
        ));
    }
    let mut o = etcd_client::TlsOptions::new()
        .ca_certificate(etcd_client::Certificate::from_pem(tls.ca_pem.as_bytes()));
    match (&tls.cert_pem, &tls.key_pem) {
        (Some(cert), Some(key)) => {
            if !cert.contains("-----BEGIN CERTIFICATE-----") {
                return Err(invalid(
                    "the registry client certificate (--registry-cert) holds no PEM certificate"
                        .to_string(),
                ));
            }
            if !key.contains("PRIVATE KEY-----") {
                return Err(invalid(
                    "the registry client key (--registry-key) holds no PEM private key".to_string(),
                ));
            }
            o = o.identity(etcd_client::Identity::from_pem(
                cert.as_bytes(),
                key.as_bytes(),
            ));
        }
        (None, None) => {}
        _ => {
            return Err(invalid(
                "--registry-cert and --registry-key go together (a client certificate needs \
                 its key)"
                    .to_string(),
            ));
        }
    }
    Ok(o)
}

impl EtcdRegistry {
    fn view_tx_synced(&self) -> bool {
        self.shared.view_tx.borrow().synced
    }
}
