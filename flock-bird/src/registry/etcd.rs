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

use super::{
    Delta, DeltaLog, OrdMap, Registered, Registry, RegistryError, RegistryOptions, Rejections, View,
};
use crate::model::Endpoint;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, LeaseKeepAliveStream,
    LeaseKeeper, PutOptions, Txn, TxnOp, WatchOptions, WatchStream,
};
use flock_core::backoff::Backoff;
use flock_core::registry::{MAX_ENTRY_BYTES, NodeCap, Reject, Rejected, Trust};
use flock_core::sync::Mutex as SyncMutex;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{Mutex, watch};
use tokio::task::JoinHandle;

/// Most entries in one page of a list (a ~500-byte entry makes a page of ~250 KB).
const LIST_PAGE_ENTRIES: i64 = 500;

/// Largest list answer the backend decodes (2 MiB): half the client's default limit of
/// 4 MiB, so a page of valid entries (at most [`LIST_PAGE_ENTRIES`] ×
/// [`MAX_ENTRY_BYTES`] is 8 MiB in theory) that does not fit is split, and one oversized
/// value never costs more than this much memory at once.
const LIST_MAX_MESSAGE: usize = 2 << 20;

/// Largest answer of the one-key, keys-only read that skips an entry too large for a
/// page (16 MiB: etcd refuses requests over `--max-request-bytes`, 1.5 MiB by default,
/// and advises against more than 10 MiB, so no key it holds comes near).
const MAX_SKIPPED_KEY_MESSAGE: usize = 16 << 20;

/// How many times a list starts over because etcd compacted its revision between
/// pages before the list fails (and the session retries after a backoff).
const LIST_ATTEMPTS: u32 = 3;

/// At most this many puts per re-put transaction: etcd's default `--max-txn-ops`.
const REPUT_TXN_OPS: usize = 128;

/// A re-put transaction is sent once its keys and values reach this many bytes, well
/// under etcd's default request size limit (1.5 MiB).
const REPUT_TXN_BYTES: usize = 512 << 10;

/// What one paged pass over the prefix gave.
enum ListOutcome {
    /// Every valid entry (relative key → endpoint and mod revision), the revision the
    /// pages were read at, and the refused keys.
    Done(
        BTreeMap<String, (Endpoint, i64)>,
        i64,
        std::collections::BTreeSet<String>,
    ),
    /// The list revision was compacted before the last page (the revision).
    Compacted(i64),
}

/// The end of the key range of every key starting with `prefix` (etcd's range end of
/// a prefix: the last byte below 0xff incremented, the rest dropped; all 0xff: every
/// key after it, `"\0"`).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    match prefix.iter().rposition(|b| *b < 0xff) {
        Some(i) => {
            let mut end = prefix[..=i].to_vec();
            end[i] += 1;
            end
        }
        None => vec![0],
    }
}

/// The smallest key after `key`: where the next page starts.
fn key_after(mut key: Vec<u8>) -> Vec<u8> {
    key.push(0);
    key
}

fn grpc_status(e: &RegistryError) -> Option<&tonic::Status> {
    match e {
        RegistryError::Etcd {
            source: etcd_client::Error::GRpcStatus(status),
            ..
        } => Some(status),
        _ => None,
    }
}

/// The answer was larger than the client decodes (tonic: `OutOfRange`, "decoded
/// message length too large").
fn is_too_large(e: &RegistryError) -> bool {
    grpc_status(e)
        .is_some_and(|s| s.code() == tonic::Code::OutOfRange && s.message().contains("too large"))
}

/// etcd does not have the revision asked for yet (`OutOfRange`, "required revision is
/// a future revision"): it lost revisions this backend saw (restored from an older
/// snapshot).
fn is_future(e: &RegistryError) -> bool {
    grpc_status(e)
        .is_some_and(|s| s.code() == tonic::Code::OutOfRange && s.message().contains("future"))
}

/// etcd compacted the revision asked for (`OutOfRange`, "required revision has been
/// compacted").
fn is_compacted(e: &RegistryError) -> bool {
    grpc_status(e)
        .is_some_and(|s| s.code() == tonic::Code::OutOfRange && s.message().contains("compacted"))
}

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
    /// Endpoints by key: a persistent map, so publishing a view shares it instead of
    /// copying every endpoint (a change then costs O(log n), not O(registry)).
    /// Each with its mod revision.
    entries: OrdMap<String, Registered>,
    /// Own deletes applied before the watch reported them: key → delete revision, so an
    /// older put event replayed by the watch does not resurrect the key.
    tombstones: BTreeMap<String, i64>,
    /// The revision the watch has delivered up to (the resume point is this + 1).
    revision: i64,
    synced: bool,
    generation: u64,
    /// The resume revision was compacted: the next session lists instead of resuming.
    needs_list: bool,
    /// The published endpoint changes ([`View::seq`], [`View::delta`],
    /// [`View::recent`]).
    log: DeltaLog,
    /// Keys changed since the last publish, folded per key.
    pending: BTreeMap<String, Change>,
    /// How many entries of each other node the view holds, and the most it loads
    /// ([`RegistryOptions::max_entries_per_node`]).
    cap: NodeCap,
    /// This agent's node: its own entries are not capped (they are its own pods', and
    /// a refused own entry would only make the registry sync put it again).
    local_node: String,
    /// Entries refused by `cap` since the caller last took them, for [`Rejections`].
    over_cap: Vec<(String, Rejected)>,
}

/// How one key's endpoint changed since the last published view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    Added,
    Changed,
    Removed,
}

impl ViewState {
    /// Folds one more change of `key` into the pending delta: the delta says how the
    /// key differs between the last published view and now, whatever happened in
    /// between (added then removed is nothing, removed then added is a change).
    fn note(&mut self, key: &str, change: Change) {
        use Change::*;
        let folded = match (self.pending.get(key).copied(), change) {
            (None, c) => Some(c),
            (Some(Added), Removed) => None,
            (Some(Added), _) => Some(Added),
            (Some(Removed), Added | Changed) => Some(Changed),
            (Some(Changed), Removed) => Some(Removed),
            (Some(prev), _) => Some(prev),
        };
        match folded {
            Some(c) => {
                self.pending.insert(key.to_string(), c);
            }
            None => {
                self.pending.remove(key);
            }
        }
    }

    /// Puts `ep` at `rev` unless the view holds a newer write of `key` (or a newer own
    /// delete). Returns true if the view changed.
    fn apply_put(&mut self, key: String, ep: Endpoint, rev: i64) -> bool {
        let rev_u = u64::try_from(rev).unwrap_or(0);
        if self.entries.get(&key).is_some_and(|r| r.revision >= rev_u)
            || self.tombstones.get(&key).is_some_and(|r| *r >= rev)
        {
            return false;
        }
        self.tombstones.remove(&key);
        match self.entries.get_mut(&key) {
            // The same endpoint written again: only its revision moves.
            Some(old) if *old.endpoint == ep => old.revision = rev_u,
            Some(old) => {
                *old = Registered::new(ep, rev_u);
                self.note(&key, Change::Changed);
            }
            None => {
                // A node's entries beyond the cap stay out of the view: one node
                // filling the registry must not cost every reader without bound.
                if ep.node != self.local_node
                    && let Err(why) = self.cap.admit(&ep.node)
                {
                    self.over_cap.push((key, why));
                    return false;
                }
                self.note(&key, Change::Added);
                self.entries.insert(key, Registered::new(ep, rev_u));
            }
        }
        true
    }

    /// An entry left the view: its node's count goes down.
    fn released(&mut self, r: &Registered) {
        if r.node != self.local_node {
            self.cap.release(&r.node);
        }
    }

    fn apply_delete(&mut self, key: String, rev: i64) -> bool {
        if self
            .entries
            .get(&key)
            .is_some_and(|r| r.revision > u64::try_from(rev).unwrap_or(0))
        {
            return false;
        }
        let removed = match self.entries.remove(&key) {
            Some(r) => {
                self.released(&r);
                true
            }
            None => false,
        };
        if removed {
            self.note(&key, Change::Removed);
        }
        if rev > self.revision {
            self.tombstones.insert(key, rev);
        }
        removed
    }

    /// Merges a complete list of the prefix at revision `at` into the view: keys the
    /// list lacks are removed, keys whose value differs are changed, new keys are
    /// added, and nothing else moves, so a subscriber sees only what changed while the
    /// watch was down. A key the view holds at a revision newer than the list (an own
    /// write or delete applied after the list's revision) keeps its newer state: the
    /// watch, restarted at `at + 1`, delivers it again.
    fn relist(&mut self, listed: BTreeMap<String, (Endpoint, i64)>, at: i64) {
        // The mutant replaces the view with the list, as the backend did before: every
        // listed key is news to the subscribers.
        if flock_core::reintroduced!("etcd-relist-replace") {
            self.entries.clear();
            self.cap.clear();
        }
        let gone: Vec<String> = self
            .entries
            .iter()
            .filter(|(k, r)| {
                !listed.contains_key(*k) && r.revision <= u64::try_from(at).unwrap_or(0)
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in gone {
            if let Some(r) = self.entries.remove(&key) {
                self.released(&r);
            }
            self.note(&key, Change::Removed);
        }
        for (key, (ep, rev)) in listed {
            if self.tombstones.get(&key).is_some_and(|t| *t > at) {
                continue;
            }
            self.apply_put(key, ep, rev);
        }
        self.tombstones.retain(|_, t| *t > at);
        self.revision = at;
        self.needs_list = false;
    }

    /// The view to publish: takes the pending changes as the next [`View::delta`].
    fn snapshot(&mut self) -> View {
        if !self.pending.is_empty() {
            let mut delta = Delta::default();
            for (key, change) in std::mem::take(&mut self.pending) {
                match change {
                    Change::Added => delta.added.push(key),
                    Change::Changed => delta.changed.push(key),
                    Change::Removed => delta.removed.push(key),
                }
            }
            self.log.push(delta);
        }
        let mut view = View {
            // O(1): the persistent maps are shared, not copied.
            endpoints: self.entries.clone(),
            revision: u64::try_from(self.revision).unwrap_or(0),
            synced: self.synced,
            generation: self.generation,
            ..View::default()
        };
        self.log.stamp(&mut view);
        view
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

    fn publish(&self, state: &mut ViewState) {
        for (key, why) in std::mem::take(&mut state.over_cap) {
            self.rejections.reject(&self.describe, &key, &why);
        }
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
                scope: self.opts.scope.as_deref(),
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
        // In transactions, not one put at a time: each write waits for etcd's disk
        // sync, and every put of one transaction shares it. One at a time, an agent
        // with 95 endpoints took 830 ms to re-put them after a lease loss, with its
        // endpoints missing from every other node meanwhile.
        let mut batches: Vec<Vec<(&String, &Endpoint, Vec<u8>)>> = vec![Vec::new()];
        let mut bytes = 0;
        for (key, ep) in &ops.own {
            let value = serde_json::to_vec(ep).map_err(|e| RegistryError::Encode {
                backend: self.describe.clone(),
                key: key.to_string(),
                source: e,
            })?;
            let size = key.len() + value.len();
            let last = batches.last_mut().expect("one batch at least");
            if !last.is_empty() && (last.len() == REPUT_TXN_OPS || bytes + size > REPUT_TXN_BYTES) {
                batches.push(Vec::new());
                bytes = 0;
            }
            bytes += size;
            batches
                .last_mut()
                .expect("one batch at least")
                .push((key, ep, value));
        }
        for batch in batches.into_iter().filter(|b| !b.is_empty()) {
            let puts: Vec<TxnOp> = batch
                .iter()
                .map(|(key, _, value)| {
                    TxnOp::put(
                        self.full_key(key),
                        value.clone(),
                        Some(PutOptions::new().with_lease(lease)),
                    )
                })
                .collect();
            let mut kv = self.client.kv_client();
            let revs: Vec<i64> = match self
                .call("re-put", batch[0].0, kv.txn(Txn::new().and_then(puts)))
                .await
            {
                // Every put of a transaction is at its revision.
                Ok(resp) => vec![resp.header().map(|h| h.revision()).unwrap_or(0); batch.len()],
                // An etcd with lower limits than its defaults (`--max-txn-ops`,
                // `--max-request-bytes`) refuses the transaction: one put at a time,
                // as before, which also names the key a refusal is about.
                Err(e) => {
                    tracing::debug!(registry = %self.describe, node = %self.node, error = %e, puts = batch.len(), "re-put transaction failed; putting one at a time");
                    let mut revs = Vec::with_capacity(batch.len());
                    for (key, ep, _) in &batch {
                        revs.push(self.put_raw(key, ep, lease).await?);
                    }
                    revs
                }
            };
            let mut view = self.view.lock();
            let mut changed = false;
            for ((key, ep, _), rev) in batch.into_iter().zip(revs) {
                changed |= view.apply_put(key.clone(), ep.clone(), rev);
            }
            if changed {
                self.publish(&mut view);
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

    /// Lists the whole prefix in pages, all at the revision of the first page, and
    /// merges the result into the view ([`ViewState::relist`]: a diff, not a
    /// replacement); returns the list revision, from which the watch continues.
    ///
    /// One answer of the whole prefix can be larger than a gRPC message may be (the
    /// client refuses to decode more than 4 MiB: a registry of ~10,000 endpoints), so
    /// every list is paged: at most [`LIST_PAGE_ENTRIES`] entries and at most
    /// [`LIST_MAX_MESSAGE`] bytes per answer, the next page starting after the last
    /// key of the one before. A page over the byte bound is asked again with half the
    /// entries; an entry over the bound on its own is skipped alone (its key read
    /// without its value), counted and warned about as [`Reject::Oversized`]. If etcd
    /// compacts the first page's revision before the last page is read, the list
    /// starts over at a new revision, a bounded number of times.
    async fn list(&self) -> Result<i64, RegistryError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.list_pages().await {
                Ok(ListOutcome::Done(listed, rev, refused)) => {
                    // Keys refused before and gone since: a later bad value under them
                    // is news.
                    self.rejections.retain(|k| refused.contains(k));
                    let mut view = self.view.lock();
                    view.relist(listed, rev);
                    return Ok(rev);
                }
                Ok(ListOutcome::Compacted(rev)) if attempt < LIST_ATTEMPTS => {
                    tracing::info!(registry = %self.describe, revision = rev, "list revision compacted between pages; listing again");
                }
                Ok(ListOutcome::Compacted(rev)) => {
                    return Err(RegistryError::Unavailable {
                        backend: self.describe.clone(),
                        op: "list",
                        key: self.prefix.clone(),
                        reason: format!(
                            "etcd compacted the list revision before its last page was read, \
                             {LIST_ATTEMPTS} times in a row (last at revision {rev})"
                        ),
                    });
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// One paged pass over the prefix (see [`Shared::list`]).
    async fn list_pages(&self) -> Result<ListOutcome, RegistryError> {
        let end = prefix_end(self.prefix.as_bytes());
        let mut from = self.prefix.as_bytes().to_vec();
        // 0 until the first answer: then every page reads at that revision.
        let mut rev = 0i64;
        let mut limit = LIST_PAGE_ENTRIES;
        let mut listed = BTreeMap::new();
        let mut refused = std::collections::BTreeSet::new();
        let mut pages = 0u32;
        let started = Instant::now();
        loop {
            let mut opts = GetOptions::new().with_range(end.clone()).with_limit(limit);
            if rev > 0 {
                opts = opts.with_revision(rev);
            }
            let mut kv = self
                .client
                .kv_client()
                .max_decoding_message_size(LIST_MAX_MESSAGE);
            let resp = match self
                .call("list", &self.prefix, kv.get(from.clone(), Some(opts)))
                .await
            {
                Ok(resp) => resp,
                Err(e) if is_compacted(&e) => return Ok(ListOutcome::Compacted(rev)),
                Err(e) if is_too_large(&e) && limit > 1 => {
                    limit = (limit / 2).max(1);
                    continue;
                }
                Err(e) if is_too_large(&e) => {
                    let (key, at) = self.oversized_key(&from, &end, rev).await?;
                    if rev == 0 {
                        rev = at;
                    }
                    let Some(key) = key else { break };
                    let rel = String::from_utf8_lossy(
                        key.strip_prefix(self.prefix.as_bytes()).unwrap_or(&key),
                    )
                    .into_owned();
                    self.rejections.reject(
                        &self.describe,
                        &rel,
                        &Rejected::new(
                            Reject::Oversized,
                            format!(
                                "its value does not fit a list answer of {LIST_MAX_MESSAGE} bytes \
                                 on its own (the entry limit is {MAX_ENTRY_BYTES})"
                            ),
                        ),
                    );
                    refused.insert(rel);
                    from = key_after(key);
                    limit = 1;
                    continue;
                }
                Err(e) => return Err(e),
            };
            pages += 1;
            if rev == 0 {
                rev = resp.header().map(|h| h.revision()).unwrap_or(0);
            }
            for kv in resp.kvs() {
                match self.decode(kv.key(), kv.value()) {
                    Decoded::Valid(key, ep) => {
                        listed.insert(key, (*ep, kv.mod_revision()));
                    }
                    Decoded::Refused(key) => {
                        refused.insert(key);
                    }
                    Decoded::Foreign => {}
                }
            }
            match resp.kvs().last() {
                Some(last) if resp.more() => from = key_after(last.key().to_vec()),
                _ => break,
            }
            // Back towards full pages after a split around a large entry.
            limit = (limit * 2).min(LIST_PAGE_ENTRIES);
        }
        tracing::debug!(registry = %self.describe, revision = rev, pages, entries = listed.len(), refused = refused.len(), elapsed = ?started.elapsed(), "listed the registry prefix");
        Ok(ListOutcome::Done(listed, rev, refused))
    }

    /// The first key in `[from, end)` at `rev` (0: the latest), read without its value,
    /// and the revision read at: the entry a one-entry page could not carry.
    async fn oversized_key(
        &self,
        from: &[u8],
        end: &[u8],
        rev: i64,
    ) -> Result<(Option<Vec<u8>>, i64), RegistryError> {
        let mut opts = GetOptions::new()
            .with_range(end.to_vec())
            .with_limit(1)
            .with_keys_only();
        if rev > 0 {
            opts = opts.with_revision(rev);
        }
        // Keys are bounded by etcd's request size limit, not by ours: the one read of a
        // key alone may take a larger answer than a page.
        let mut kv = self
            .client
            .kv_client()
            .max_decoding_message_size(MAX_SKIPPED_KEY_MESSAGE);
        let mut resp = self
            .call("list", &self.prefix, kv.get(from.to_vec(), Some(opts)))
            .await?;
        let at = resp.header().map(|h| h.revision()).unwrap_or(rev);
        Ok((
            resp.take_kvs()
                .into_iter()
                .next()
                .map(|kv| kv.key().to_vec()),
            at,
        ))
    }

    /// Whether etcd still holds revision `rev` (not compacted, not from before a
    /// restore that lost it), so a watch from `rev + 1` replays every change since.
    ///
    /// etcd confirms a watch whose start revision was compacted like any other and
    /// cancels it only afterwards: resuming without this check would mark the old view
    /// synced for a moment before the re-list.
    async fn still_readable(&self, rev: i64) -> Result<bool, RegistryError> {
        let opts = GetOptions::new()
            .with_range(prefix_end(self.prefix.as_bytes()))
            .with_limit(1)
            .with_keys_only()
            .with_revision(rev);
        let mut kv = self
            .client
            .kv_client()
            .max_decoding_message_size(MAX_SKIPPED_KEY_MESSAGE);
        match self
            .call(
                "list",
                &self.prefix,
                kv.get(self.prefix.clone(), Some(opts)),
            )
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if is_compacted(&e) || is_future(&e) => {
                tracing::warn!(registry = %self.describe, revision = rev, reason = %e, "watch resume revision no longer readable; re-listing");
                Ok(false)
            }
            Err(e) => Err(e),
        }
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
        self.publish(&mut view);
    }

    fn mark_unsynced(&self) {
        let mut view = self.view.lock();
        if view.synced {
            view.synced = false;
            self.publish(&mut view);
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
        // The mutant resumes without checking, as the backend did before: the old view
        // is published as synced until etcd cancels the watch.
        let resume_ok = !needs_list
            && (flock_core::reintroduced!("etcd-resume-compacted")
                || self.still_readable(resume).await?);
        let stream = if resume_ok {
            self.watch_from(resume + 1).await?
        } else {
            None
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
        self.publish(&mut view);
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
        let max_entries_per_node = opts.max_entries_per_node;
        let local_node = opts.node.clone();
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
            view: SyncMutex::new(ViewState {
                cap: NodeCap::new(max_entries_per_node),
                local_node,
                ..ViewState::default()
            }),
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
            self.shared.publish(&mut view);
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
                self.shared.publish(&mut view);
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
            self.shared.publish(&mut view);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Health, Protocol};
    use crate::registry::{RECENT_DELTAS, RECENT_KEYS};
    use flock_core::pod::PodKey;

    fn ep(pod: &str, last: u8) -> Endpoint {
        Endpoint {
            service: "web".into(),
            namespace: "default".into(),
            service_port: 8080,
            protocol: Protocol::Http,
            address: std::net::IpAddr::from([10, 0, 0, last]),
            port: 15006,
            node: "n1".into(),
            pod: format!("default/{pod}"),
            pod_key: PodKey::new(pod, "eth0"),
            region: "r".into(),
            zone: "z".into(),
            health: Health::Healthy,
            identity: None,
            also_accept: Vec::new(),
            labels: Default::default(),
        }
    }

    fn listed(entries: &[(&str, u8, i64)]) -> BTreeMap<String, (Endpoint, i64)> {
        entries
            .iter()
            .map(|(k, last, rev)| (k.to_string(), (ep(k, *last), *rev)))
            .collect()
    }

    fn delta(added: &[&str], changed: &[&str], removed: &[&str]) -> Delta {
        let v = |s: &[&str]| s.iter().map(|k| k.to_string()).collect();
        Delta {
            added: v(added),
            changed: v(changed),
            removed: v(removed),
        }
    }

    /// A re-list reports only the keys that differ: removed, changed, added; an entry
    /// re-listed with the same value (even at a new mod revision) is not a change.
    #[test]
    fn relist_is_a_diff() {
        let mut s = ViewState::default();
        s.relist(
            listed(&[("a", 1, 10), ("b", 2, 11), ("c", 3, 12), ("d", 4, 13)]),
            20,
        );
        let v = s.snapshot();
        assert_eq!(v.seq, 1);
        assert_eq!(*v.delta, delta(&["a", "b", "c", "d"], &[], &[]));

        // b gone, c moved, d re-put with the same value, e new.
        s.relist(
            listed(&[("a", 1, 10), ("c", 9, 25), ("d", 4, 26), ("e", 5, 27)]),
            30,
        );
        let v = s.snapshot();
        assert_eq!(v.seq, 2);
        assert_eq!(*v.delta, delta(&["e"], &["c"], &["b"]));
        assert_eq!(v.revision_of("d"), Some(26));
        assert_eq!(v.revision, 30);
        assert_eq!(*v.endpoints["c"], ep("c", 9));

        // The same list again: nothing changed, no new delta.
        s.relist(
            listed(&[("a", 1, 10), ("c", 9, 25), ("d", 4, 26), ("e", 5, 27)]),
            31,
        );
        let v = s.snapshot();
        assert_eq!(v.seq, 2, "an unchanged re-list is not a change");
        // A subscriber that missed views catches up from the recent deltas.
        let recent: Vec<Delta> = v.recent.iter().map(|d| (**d).clone()).collect();
        assert_eq!(
            recent,
            [
                delta(&["a", "b", "c", "d"], &[], &[]),
                delta(&["e"], &["c"], &["b"])
            ]
        );
    }

    /// The recent deltas are bounded: the oldest goes when a new one would exceed
    /// [`RECENT_DELTAS`]; the last is always the view's delta.
    #[test]
    fn recent_deltas_are_bounded() {
        let mut s = ViewState::default();
        for i in 0..RECENT_DELTAS + 3 {
            let rev = i64::try_from(i).unwrap() + 1;
            s.relist(listed(&[("a", (i % 250) as u8, rev)]), rev);
            s.snapshot();
        }
        let v = s.snapshot();
        assert_eq!(v.seq, (RECENT_DELTAS + 3) as u64);
        assert_eq!(v.recent.len(), RECENT_DELTAS);
        assert!(Arc::ptr_eq(v.recent.last().unwrap(), &v.delta));
    }

    /// A delta naming more than [`RECENT_KEYS`] keys (the first list of a large
    /// registry) is the view's delta until the next change, then leaves the recent
    /// deltas: a subscriber that missed it re-reads the whole view.
    /// The per-node cap in the view: a list keeps the first `max` keys of another
    /// node, the rest are reported for [`Rejections`]; a removal makes room for the
    /// next put; this agent's own entries are never capped.
    #[test]
    fn the_view_keeps_at_most_the_cap_of_another_nodes_entries() {
        let mut s = ViewState {
            cap: NodeCap::new(2),
            local_node: "own".into(),
            ..ViewState::default()
        };
        s.relist(listed(&[("a", 1, 1), ("b", 1, 1), ("c", 1, 1)]), 1);
        let keys: Vec<String> = s.entries.keys().cloned().collect();
        assert_eq!(keys, ["a", "b"]);
        let over: Vec<&str> = s.over_cap.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(over, ["c"]);
        assert!(s.over_cap.iter().all(|(_, r)| r.reason == Reject::NodeCap));
        assert!(s.apply_delete("a".into(), 2));
        assert!(s.apply_put("c".into(), ep("c", 1), 3));
        assert!(!s.apply_put("d".into(), ep("d", 1), 4), "still at the cap");
        let mut own = ep("o", 1);
        own.node = "own".into();
        for (i, k) in ["o1", "o2", "o3"].into_iter().enumerate() {
            assert!(
                s.apply_put(k.into(), own.clone(), 5 + i as i64),
                "own entry {k}"
            );
        }
    }

    #[test]
    fn a_huge_delta_leaves_the_recent_deltas_at_the_next_change() {
        // One node's entries, more than the default cap: this is about the deltas.
        let mut s = ViewState {
            cap: NodeCap::new(usize::MAX),
            ..ViewState::default()
        };
        let keys: Vec<String> = (0..=RECENT_KEYS).map(|i| format!("k{i:06}")).collect();
        let big: Vec<(&str, u8, i64)> = keys.iter().map(|k| (k.as_str(), 1, 1)).collect();
        s.relist(listed(&big), 1);
        let v = s.snapshot();
        assert_eq!(v.delta.len(), RECENT_KEYS + 1);
        assert_eq!(v.recent.len(), 1);
        // The next change: the huge delta goes, the small one stays.
        s.apply_put("k000000".into(), ep("k000000", 2), 2);
        let v = s.snapshot();
        assert_eq!(v.recent.len(), 1);
        assert_eq!(v.delta.changed, vec!["k000000".to_string()]);
        assert_eq!(v.deltas_since(v.seq - 1).map(|d| d.count()), Some(1));
        assert!(v.deltas_since(v.seq - 2).is_none());
        // Small deltas accumulate as before.
        s.apply_put("k000001".into(), ep("k000001", 3), 3);
        let v = s.snapshot();
        assert_eq!(v.recent.len(), 2);
    }

    /// State newer than the list (an own put or delete applied after the list's
    /// revision) survives the re-list; the watch from the list revision delivers it.
    #[test]
    fn relist_keeps_newer_state() {
        let mut s = ViewState::default();
        s.relist(listed(&[("a", 1, 10), ("b", 2, 11)]), 20);
        s.snapshot();
        assert!(s.apply_put("own".into(), ep("own", 7), 40));
        assert!(s.apply_delete("b".into(), 41));
        s.relist(listed(&[("a", 1, 10), ("b", 2, 11)]), 35);
        let v = s.snapshot();
        assert!(
            v.endpoints.contains_key("own"),
            "own put at 40 > list at 35"
        );
        assert!(
            !v.endpoints.contains_key("b"),
            "own delete at 41 > list at 35"
        );
        assert_eq!(*v.delta, delta(&["own"], &[], &["b"]));
    }

    /// Changes between two publishes fold per key into how the key differs.
    #[test]
    fn changes_fold_per_key() {
        let mut s = ViewState::default();
        s.relist(listed(&[("a", 1, 10)]), 10);
        s.snapshot();
        assert!(s.apply_put("x".into(), ep("x", 1), 11));
        assert!(s.apply_delete("x".into(), 12));
        assert!(s.apply_delete("a".into(), 13));
        assert!(s.apply_put("a".into(), ep("a", 2), 14));
        let v = s.snapshot();
        assert_eq!(*v.delta, delta(&[], &["a"], &[]));
        assert!(s.apply_delete("a".into(), 15));
        assert!(s.apply_put("a".into(), ep("a", 2), 16));
        let before = v.seq;
        let v = s.snapshot();
        assert_eq!(v.seq, before + 1);
        assert_eq!(
            *v.delta,
            delta(&[], &["a"], &[]),
            "removed then added is a change"
        );
    }

    #[test]
    fn key_ranges() {
        assert_eq!(prefix_end(b"/flock/"), b"/flock0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
        assert_eq!(key_after(b"k".to_vec()), b"k\0".to_vec());
    }
}
