//! The `spire` provider: a bridge to a SPIRE agent's Delegated Identity API.
//!
//! The flock agent is a trusted delegate of the SPIRE agent on its node: over the SPIRE
//! agent's admin socket it calls `SubscribeToX509SVIDs` with each pod's selectors
//! ([`PodIdentity::selectors`]: `k8s:ns:…`, `k8s:sa:…`, `k8s:pod-name:…`,
//! `k8s:pod-uid:…`) and keeps one `SubscribeToX509Bundles` stream for the trust bundles.
//! SPIRE decides the SPIFFE IDs (its registration entries) and rotates the SVIDs; every
//! message on a pod's stream replaces the pod's SVID in the [`IdentityView`].
//!
//! # Connection (R5)
//! One supervisor task owns the connection: it connects (retrying with
//! [`Backoff`] and jitter), then *publishes* the client handle as a whole, with its
//! connection epoch, in a `watch` slot; every stream reads the handle through that
//! slot. A reconnect publishes a new handle, it never mutates the published one in
//! place: a stream holding the old handle keeps a consistent (if dead) client and
//! reports its failure by epoch, so failures of an old connection never tear down a
//! new one, and a stream is never opened on a half-replaced client. After every
//! (re)connect every current subscription is opened again on the new connection (a
//! restarted SPIRE agent has forgotten all streams).
//!
//! # Withdrawal (R6)
//! Opening a pod's stream is asynchronous (a resubscription after a reconnect, or a
//! subscribe, waits for SPIRE to answer). A pod may be unsubscribed meanwhile; its
//! unsubscribe then finds no stream to cancel. So once the stream is open the bridge
//! re-checks, under the state lock, that the same subscription (its token) is still
//! wanted, and otherwise drops the stream (which cancels the RPC). The agent's orphan
//! GC removes any subscription that slips through anyway.
//!
//! # Secrets
//! Keys arrive as PKCS#8 DER; the DER is moved out of the message into a
//! [`Zeroizing`] buffer at once, re-encoded as PEM into another one, and kept only as
//! [`SecretPem`]; nothing here logs or formats a response message (they carry keys).
//! The copies tonic and prost make while decoding the response are outside our reach.

use super::{Bundle, IdentityError, IdentityProvider, IdentityView, PodIdentity, SecretPem, Svid};
use flock_core::UnixMs;
use flock_core::backoff::Backoff;
use flock_core::pod::PodKey;
use flock_core::sync::Mutex;
use hyper_util::rt::TokioIo;
use spire_api::pb::spire::api::agent::delegatedidentity::v1 as pb;
use spire_api::pb::spire::api::types::Selector;
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::net::UnixStream;
use tokio::sync::watch;
use tokio::task::AbortHandle;
use tonic::transport::{Channel, Endpoint, Uri};
use zeroize::Zeroizing;

type Client = pb::delegated_identity_client::DelegatedIdentityClient<Channel>;

/// Settings of a [`SpireBridge`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpireOptions {
    /// How long [`IdentityProvider::subscribe`] waits for the pod's first SVID.
    pub subscribe_timeout: Duration,
    /// First reconnect delay ceiling (the delay is jittered in its upper half).
    pub backoff_initial: Duration,
    /// Largest reconnect delay ceiling.
    pub backoff_max: Duration,
    /// A connection that stayed up this long resets the backoff.
    pub stable_after: Duration,
    /// Timeout of one connection attempt.
    pub connect_timeout: Duration,
}

impl Default for SpireOptions {
    fn default() -> Self {
        Self {
            subscribe_timeout: Duration::from_secs(10),
            backoff_initial: Duration::from_millis(200),
            backoff_max: Duration::from_secs(10),
            stable_after: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
        }
    }
}

/// One connection to the admin socket, published as a whole (R5).
struct Conn {
    epoch: u64,
    client: Client,
}

/// A pod the bridge is asked to keep an SVID for.
struct Sub {
    pod: PodIdentity,
    /// Distinguishes this subscription from an earlier or later one of the same pod.
    token: u64,
    /// The reader of the pod's stream, and the connection epoch it was opened on.
    task: Option<(u64, AbortHandle)>,
}

struct State {
    subs: BTreeMap<PodKey, Sub>,
    subscriptions: super::subscriptions::Subscriptions,
    svids: imbl::OrdMap<String, Arc<Svid>>,
    bundles: BTreeMap<String, Bundle>,
    bundles_task: Option<AbortHandle>,
    generation: u64,
    next_token: u64,
}

struct Inner {
    socket: PathBuf,
    opts: SpireOptions,
    /// The published client (R5): replaced as a whole on reconnect, `None` while down.
    conn: watch::Sender<Option<Arc<Conn>>>,
    /// The highest connection epoch a stream failed on.
    failed: watch::Sender<u64>,
    /// Set when the bridge is dropped: in-flight opens give up.
    closed: watch::Sender<bool>,
    state: Mutex<State>,
    tx: watch::Sender<Arc<IdentityView>>,
    withdrawn: AtomicU64,
}

/// The SPIRE bridge: an [`IdentityProvider`] backed by a SPIRE agent's Delegated
/// Identity API on a unix socket (see the module docs).
pub struct SpireBridge {
    inner: Arc<Inner>,
    supervisor: AbortHandle,
}

impl fmt::Debug for SpireBridge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SpireBridge")
            .field("socket", &self.inner.socket)
            .field("epoch", &self.epoch())
            .finish_non_exhaustive()
    }
}

impl SpireBridge {
    /// Starts the bridge to the SPIRE agent admin socket at `socket` with default
    /// options. It returns at once: the connection is made (and remade) in the
    /// background, and subscriptions wait for it. Needs a Tokio runtime.
    pub fn connect(socket: impl Into<PathBuf>) -> Arc<Self> {
        Self::with_options(socket, SpireOptions::default())
    }

    /// [`SpireBridge::connect`] with explicit options.
    pub fn with_options(socket: impl Into<PathBuf>, opts: SpireOptions) -> Arc<Self> {
        let (tx, _) = watch::channel(Arc::new(IdentityView::default()));
        let inner = Arc::new(Inner {
            socket: socket.into(),
            opts,
            conn: watch::channel(None).0,
            failed: watch::channel(0).0,
            closed: watch::channel(false).0,
            state: Mutex::new(State {
                subs: BTreeMap::new(),
                subscriptions: super::subscriptions::Subscriptions::new(),
                svids: imbl::OrdMap::new(),
                bundles: BTreeMap::new(),
                bundles_task: None,
                generation: 0,
                next_token: 0,
            }),
            tx,
            withdrawn: AtomicU64::new(0),
        });
        let supervisor = tokio::spawn(Arc::clone(&inner).supervise()).abort_handle();
        Arc::new(Self { inner, supervisor })
    }

    /// The admin socket.
    pub fn socket(&self) -> &Path {
        &self.inner.socket
    }

    /// The epoch of the published connection (1 for the first, +1 per reconnect), or
    /// 0 while disconnected.
    pub fn epoch(&self) -> u64 {
        self.inner.conn.borrow().as_ref().map_or(0, |c| c.epoch)
    }

    /// How many streams were withdrawn because their pod was unsubscribed while they
    /// were being opened (the R6 re-check).
    pub fn withdrawn(&self) -> u64 {
        self.inner.withdrawn.load(Ordering::Relaxed)
    }
}

impl Drop for SpireBridge {
    fn drop(&mut self) {
        self.supervisor.abort();
        self.inner.closed.send_replace(true);
        let mut st = self.inner.state.lock();
        // With no subscription left, any open still in flight is withdrawn (R6).
        for (_, sub) in std::mem::take(&mut st.subs) {
            if let Some((_, task)) = sub.task {
                task.abort();
            }
        }
        if let Some(task) = st.bundles_task.take() {
            task.abort();
        }
    }
}

impl Inner {
    fn publish(&self, st: &mut State) {
        st.generation += 1;
        self.tx.send_replace(Arc::new(IdentityView {
            svids: st.svids.clone(),
            bundles: st.bundles.clone(),
            subscriptions: st.subscriptions.snapshot(),
            generation: st.generation,
        }));
    }

    fn wanted(st: &State, key: &PodKey, token: u64) -> bool {
        st.subs.get(key).is_some_and(|s| s.token == token)
    }

    /// Removes `key` from the view (and its SVID when no other pod uses it).
    fn drop_from_view(st: &mut State, key: &PodKey) -> bool {
        let Some(left) = st.subscriptions.remove(key) else {
            return false;
        };
        if left.last {
            st.svids.remove(&left.id);
        }
        true
    }

    fn report_failure(&self, epoch: u64) {
        self.failed.send_if_modified(|f| {
            if *f < epoch {
                *f = epoch;
                true
            } else {
                false
            }
        });
    }

    /// Connects, publishes, resubscribes, waits for a failure, backs off; forever.
    async fn supervise(self: Arc<Self>) {
        let mut backoff = Backoff::new(self.opts.backoff_initial, self.opts.backoff_max);
        let mut epoch = 0;
        let mut failed = self.failed.subscribe();
        loop {
            let client = match connect(&self.socket, self.opts.connect_timeout).await {
                Ok(client) => client,
                Err(e) => {
                    let delay = backoff.next_delay(flock_clock::jitter());
                    tracing::warn!(socket = %self.socket.display(), retry_in_ms = delay.as_millis() as u64, "cannot connect to the SPIRE agent: {e}");
                    tokio::time::sleep(delay).await;
                    continue;
                }
            };
            epoch += 1;
            let conn = Arc::new(Conn { epoch, client });
            // R5: the handle is published whole; readers clone the Arc out of the slot.
            self.conn.send_replace(Some(Arc::clone(&conn)));
            let up = tokio::time::Instant::now();
            tracing::info!(socket = %self.socket.display(), epoch, "connected to the SPIRE agent");
            self.start_bundles(&conn);
            self.resubscribe_all(&conn);
            let _ = failed.wait_for(|f| *f >= epoch).await;
            self.conn.send_replace(None);
            if up.elapsed() >= self.opts.stable_after {
                backoff.reset();
            }
            let delay = backoff.next_delay(flock_clock::jitter());
            tracing::warn!(
                epoch,
                retry_in_ms = delay.as_millis() as u64,
                "SPIRE connection lost; reconnecting"
            );
            tokio::time::sleep(delay).await;
        }
    }

    /// Opens every current subscription that has no stream on `conn` yet.
    fn resubscribe_all(self: &Arc<Self>, conn: &Arc<Conn>) {
        let todo: Vec<(PodIdentity, u64)> = self
            .state
            .lock()
            .subs
            .values()
            .filter(|s| s.task.as_ref().is_none_or(|(e, _)| *e < conn.epoch))
            .map(|s| (s.pod.clone(), s.token))
            .collect();
        if !todo.is_empty() {
            tracing::info!(
                pods = todo.len(),
                epoch = conn.epoch,
                "resubscribing pods to SPIRE"
            );
        }
        for (pod, token) in todo {
            tokio::spawn(Arc::clone(self).open(pod, token, Arc::clone(conn)));
        }
    }

    /// Opens the pod's `SubscribeToX509SVIDs` stream on `conn` and starts its reader,
    /// unless the subscription is gone by then (R6).
    async fn open(self: Arc<Self>, pod: PodIdentity, token: u64, conn: Arc<Conn>) {
        let request = pb::SubscribeToX509sviDsRequest {
            selectors: pod
                .selectors()
                .into_iter()
                .map(|(r#type, value)| Selector { r#type, value })
                .collect(),
            pid: 0,
        };
        let mut client = conn.client.clone();
        let mut closed = self.closed.subscribe();
        let response = tokio::select! {
            r = client.subscribe_to_x509svi_ds(request) => r,
            _ = closed.wait_for(|c| *c) => return,
        };
        let stream = match response {
            Ok(r) => r.into_inner(),
            Err(status) => {
                tracing::warn!(pod = %pod.key, code = ?status.code(), "SPIRE SubscribeToX509SVIDs failed: {}", status.message());
                self.report_failure(conn.epoch);
                return;
            }
        };
        let key = pod.key.clone();
        let mut st = self.state.lock();
        // The re-check (R6): the pod may have been unsubscribed (or subscribed anew)
        // while the stream was opening, and its unsubscribe found nothing to cancel.
        if !flock_core::reintroduced!("r6-spire") && !Self::wanted(&st, &key, token) {
            drop(st);
            // Dropping the stream cancels the RPC: SPIRE sees it close.
            drop(stream);
            self.withdrawn.fetch_add(1, Ordering::Relaxed);
            tracing::info!(pod = %key, "pod unsubscribed while its SPIRE stream was opening; withdrawn");
            return;
        }
        // The entry exists (just checked); only without the re-check does this put a
        // removed pod back, the leak the `identity_spire` test catches.
        let sub = st.subs.entry(key.clone()).or_insert_with(|| Sub {
            pod: pod.clone(),
            token,
            task: None,
        });
        if sub.task.as_ref().is_some_and(|(e, _)| *e >= conn.epoch) {
            // subscribe() and a resubscription raced: one stream per connection.
            return;
        }
        if let Some((_, old)) = sub.task.take() {
            old.abort();
        }
        let reader = tokio::spawn(Arc::clone(&self).read(key, token, conn.epoch, stream));
        sub.task = Some((conn.epoch, reader.abort_handle()));
    }

    /// Reads a pod's stream into the view until it ends or fails.
    async fn read(
        self: Arc<Self>,
        key: PodKey,
        token: u64,
        epoch: u64,
        mut stream: tonic::Streaming<pb::SubscribeToX509sviDsResponse>,
    ) {
        loop {
            match stream.message().await {
                Ok(Some(resp)) => {
                    if !self.accept_svid(&key, token, resp) {
                        return;
                    }
                }
                Ok(None) => {
                    tracing::warn!(pod = %key, epoch, "SPIRE closed the SVID stream");
                    break;
                }
                Err(status) => {
                    tracing::warn!(pod = %key, epoch, code = ?status.code(), "SPIRE SVID stream failed: {}", status.message());
                    break;
                }
            }
        }
        self.report_failure(epoch);
    }

    /// Puts the response's first SVID in the view; false when the subscription is gone.
    fn accept_svid(
        &self,
        key: &PodKey,
        token: u64,
        resp: pb::SubscribeToX509sviDsResponse,
    ) -> bool {
        let svid = match svid_of_response(resp) {
            Ok(svid) => svid,
            Err(e) => {
                tracing::warn!(pod = %key, "ignoring an SVID from SPIRE: {e}");
                return true;
            }
        };
        let mut st = self.state.lock();
        if !Self::wanted(&st, key, token) {
            return false;
        }
        match svid {
            Some(svid) => {
                tracing::info!(pod = %key, spiffe_id = %svid.spiffe_id, serial = %svid.serial, not_after_ms = svid.not_after_ms.as_millis(), "SVID from SPIRE");
                let id = svid.spiffe_id.clone();
                // A pod whose SPIFFE ID changed leaves its old one (dropped if it
                // was that SVID's last subscriber).
                if let Some(left) = st.subscriptions.insert(key.clone(), id.clone())
                    && left.last
                {
                    st.svids.remove(&left.id);
                }
                st.svids.insert(id, Arc::new(svid));
            }
            None => {
                // No registration entry matches the pod (any more).
                tracing::warn!(pod = %key, "SPIRE has no SVID for the pod's selectors");
                if !Self::drop_from_view(&mut st, key) {
                    return true;
                }
            }
        }
        self.publish(&mut st);
        true
    }

    fn start_bundles(self: &Arc<Self>, conn: &Arc<Conn>) {
        let task = tokio::spawn(Arc::clone(self).read_bundles(Arc::clone(conn))).abort_handle();
        if let Some(old) = self.state.lock().bundles_task.replace(task) {
            old.abort();
        }
    }

    async fn read_bundles(self: Arc<Self>, conn: Arc<Conn>) {
        let mut client = conn.client.clone();
        match client
            .subscribe_to_x509_bundles(pb::SubscribeToX509BundlesRequest {})
            .await
        {
            Ok(r) => {
                let mut stream = r.into_inner();
                loop {
                    match stream.message().await {
                        Ok(Some(resp)) => self.accept_bundles(resp),
                        Ok(None) => {
                            tracing::warn!(epoch = conn.epoch, "SPIRE closed the bundle stream");
                            break;
                        }
                        Err(status) => {
                            tracing::warn!(epoch = conn.epoch, code = ?status.code(), "SPIRE bundle stream failed: {}", status.message());
                            break;
                        }
                    }
                }
            }
            Err(status) => {
                tracing::warn!(code = ?status.code(), "SPIRE SubscribeToX509Bundles failed: {}", status.message());
            }
        }
        self.report_failure(conn.epoch);
    }

    fn accept_bundles(&self, resp: pb::SubscribeToX509BundlesResponse) {
        let (bundles, refused) = bundles_of_response(resp);
        for (td, e) in refused {
            tracing::warn!(trust_domain = %td, "ignoring a malformed bundle from SPIRE: {e}");
        }
        let mut st = self.state.lock();
        if st.bundles != bundles {
            tracing::info!(trust_domains = bundles.len(), "trust bundles from SPIRE");
            st.bundles = bundles;
            self.publish(&mut st);
        }
    }
}

#[async_trait::async_trait]
impl IdentityProvider for SpireBridge {
    async fn subscribe(&self, pod: &PodIdentity) -> Result<String, IdentityError> {
        let inner = &self.inner;
        let key = pod.key.clone();
        let (token, conn) = {
            let mut st = inner.state.lock();
            let existing = st.subs.get(&key).map(|s| (s.pod == *pod, s.token));
            match existing {
                Some((true, token)) => (token, None),
                other => {
                    if other.is_some() {
                        // Moved (say, its service account changed): leave the old one.
                        if let Some((_, task)) = st.subs.remove(&key).and_then(|s| s.task) {
                            task.abort();
                        }
                        if Inner::drop_from_view(&mut st, &key) {
                            inner.publish(&mut st);
                        }
                    }
                    st.next_token += 1;
                    let token = st.next_token;
                    st.subs.insert(
                        key.clone(),
                        Sub {
                            pod: pod.clone(),
                            token,
                            task: None,
                        },
                    );
                    // R5: read the published handle; none means the supervisor will
                    // open the stream when it connects.
                    (token, inner.conn.borrow().clone())
                }
            }
        };
        if let Some(conn) = conn {
            tokio::spawn(Arc::clone(inner).open(pod.clone(), token, conn));
        }
        let mut rx = inner.tx.subscribe();
        let deadline = tokio::time::Instant::now() + inner.opts.subscribe_timeout;
        loop {
            // Seen before reading the state: a change after the read wakes `changed`.
            rx.borrow_and_update();
            {
                let st = inner.state.lock();
                if !Inner::wanted(&st, &key, token) {
                    return Err(IdentityError::Issue(format!(
                        "pod {key} was unsubscribed while waiting for its SVID from SPIRE"
                    )));
                }
                if let Some(id) = st.subscriptions.get(&key) {
                    return Ok(id.clone());
                }
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => break,
            }
        }
        // Failed: the caller does not consider the pod subscribed, so neither do we.
        {
            let mut st = inner.state.lock();
            if Inner::wanted(&st, &key, token) {
                if let Some((_, task)) = st.subs.remove(&key).and_then(|s| s.task) {
                    task.abort();
                }
                inner.publish(&mut st);
            }
        }
        Err(IdentityError::Issue(format!(
            "no SVID from SPIRE ({}) for pod {key} within {:?} (is the SPIRE agent up, and is there a registration entry for the pod's selectors?)",
            inner.socket.display(),
            inner.opts.subscribe_timeout
        )))
    }

    async fn unsubscribe(&self, key: &PodKey) {
        let mut st = self.inner.state.lock();
        if let Some(sub) = st.subs.remove(key) {
            // Cancels the stream if it is open; one still opening is withdrawn by the
            // re-check in `open` (R6).
            if let Some((_, task)) = sub.task {
                task.abort();
            }
            Inner::drop_from_view(&mut st, key);
            // Published even when the view is unchanged: a subscribe() waiting for
            // this pod wakes up and sees it is gone.
            self.inner.publish(&mut st);
        }
    }

    fn view(&self) -> watch::Receiver<Arc<IdentityView>> {
        self.inner.tx.subscribe()
    }

    fn describe(&self) -> String {
        let epoch = self.epoch();
        format!(
            "spire (admin socket {}, {})",
            self.inner.socket.display(),
            if epoch == 0 {
                "disconnected".to_string()
            } else {
                format!("connected, epoch {epoch}")
            }
        )
    }
}

async fn connect(socket: &Path, timeout: Duration) -> Result<Client, String> {
    let path = socket.to_owned();
    // The URI is required by tonic and ignored by the connector.
    let channel = Endpoint::from_static("http://spire-agent.invalid")
        .connect_timeout(timeout)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
        .map_err(|e| {
            let mut msg = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                msg.push_str(": ");
                msg.push_str(&s.to_string());
                source = s.source();
            }
            msg
        })?;
    Ok(Client::new(channel))
}

/// Most certificates in an SVID's chain (the leaf and its intermediates; SPIRE sends
/// two or three). The whole message is bounded by tonic's decoding limit (4 MiB).
const MAX_CHAIN_CERTS: usize = 16;

/// The SVID of a `SubscribeToX509SVIDs` message: its first one converted (see
/// `convert_svid`), `Ok(None)` when it has none (no registration entry matches the
/// pod's selectors). A pure function of the message.
pub fn svid_of_response(resp: pb::SubscribeToX509sviDsResponse) -> Result<Option<Svid>, String> {
    resp.x509_svids
        .into_iter()
        .next()
        .map(convert_svid)
        .transpose()
}

/// The trust bundles of a `SubscribeToX509Bundles` message by trust domain, and the
/// entries refused (the name as sent, cut to 64 characters, and why). A pure function
/// of the message.
pub fn bundles_of_response(
    resp: pb::SubscribeToX509BundlesResponse,
) -> (BTreeMap<String, Bundle>, Vec<(String, String)>) {
    let mut bundles = BTreeMap::new();
    let mut refused = Vec::new();
    for (name, der) in resp.ca_certificates {
        // The proto says bare names; released SPIRE agents send `spiffe://<td>`.
        let td = name.strip_prefix("spiffe://").unwrap_or(&name);
        let certs = super::validate_trust_domain(td)
            .map_err(|e| format!("trust domain: {e}"))
            .and_then(|()| split_der(&der))
            .and_then(|certs| {
                if certs.is_empty() {
                    return Err("no certificate".to_string());
                }
                certs.iter().try_for_each(|c| one_certificate(c))?;
                Ok(certs)
            });
        match certs {
            Ok(certs) => {
                let ca_pem = certs
                    .iter()
                    .map(|c| pem("CERTIFICATE", c).as_str().to_owned())
                    .collect();
                bundles.insert(
                    td.to_string(),
                    Bundle {
                        trust_domain: td.to_string(),
                        ca_pem,
                    },
                );
            }
            Err(e) => refused.push((name.chars().take(64).collect(), e)),
        }
    }
    (bundles, refused)
}

/// Converts SPIRE's SVID (DER chain, PKCS#8 DER key) into an [`Svid`] (PEM). Refused:
/// no SVID, ID or key; a SPIFFE ID the spec does not allow (its trust domain, a path
/// segment, or over 2048 bytes: the translation would not find its trust domain); an
/// empty chain or one over [`MAX_CHAIN_CERTS`]; a chain entry that is not one DER
/// certificate.
fn convert_svid(mut s: pb::X509svidWithKey) -> Result<Svid, String> {
    // Copied out of the message first, so our copy of the DER key is wiped on every
    // return path. The message's own bytes are wiped too when this is their only
    // owner; when they are a view into tonic's receive buffer, they are not ours to
    // write.
    let received = std::mem::take(&mut s.x509_svid_key);
    let key_der = Zeroizing::new(received.to_vec());
    if let Ok(mut own) = received.try_into_mut() {
        own.fill(0);
    }
    let x = s.x509_svid.ok_or("response without an SVID")?;
    let id = x.id.ok_or("SVID without a SPIFFE ID")?;
    super::validate_trust_domain(&id.trust_domain)
        .map_err(|e| format!("SVID with a bad trust domain: {e}"))?;
    let leaf = x.cert_chain.first().ok_or("SVID with an empty chain")?;
    if x.cert_chain.len() > MAX_CHAIN_CERTS {
        return Err(format!(
            "SVID with {} certificates in its chain, more than {MAX_CHAIN_CERTS}",
            x.cert_chain.len()
        ));
    }
    if key_der.is_empty() {
        return Err("SVID without a private key".to_string());
    }
    for cert in &x.cert_chain {
        one_certificate(cert)?;
    }
    let serial = leaf_serial(leaf)?;
    // SPIRE sends the path with its leading slash; tolerate one without.
    let path = id.path.strip_prefix('/').unwrap_or(&id.path);
    if path.is_empty() {
        // An ID without a path names the trust domain itself, no workload; the
        // translation would find no trust domain in it either.
        return Err("SVID whose SPIFFE ID has no path".to_string());
    }
    for segment in path.split('/') {
        super::validate_path_segment(segment)
            .map_err(|e| format!("SVID with a bad SPIFFE ID path segment: {e}"))?;
    }
    let spiffe_id = format!("spiffe://{}/{path}", id.trust_domain);
    if spiffe_id.len() > MAX_SPIFFE_ID_BYTES {
        return Err(format!(
            "SVID whose SPIFFE ID is {} bytes long, more than {MAX_SPIFFE_ID_BYTES}",
            spiffe_id.len()
        ));
    }
    Ok(Svid {
        spiffe_id,
        cert_chain_pem: x
            .cert_chain
            .iter()
            .map(|c| pem("CERTIFICATE", c).as_str().to_owned())
            .collect(),
        private_key_pem: SecretPem::from_zeroizing(pem("PRIVATE KEY", &key_der)),
        not_after_ms: UnixMs(
            u64::try_from(x.expires_at)
                .unwrap_or(0)
                .saturating_mul(1000),
        ),
        issued_ms: flock_clock::unix_now(),
        issued_mono: flock_clock::mono_now(),
        serial,
    })
}

/// One DER TLV at the start of `b`: (tag, content, rest).
fn der_tlv(b: &[u8]) -> Result<(u8, &[u8], &[u8]), String> {
    let (&tag, rest) = b.split_first().ok_or("truncated DER")?;
    let (&len0, mut rest) = rest.split_first().ok_or("truncated DER")?;
    let len = if len0 < 0x80 {
        usize::from(len0)
    } else {
        let n = usize::from(len0 & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return Err("bad DER length".to_string());
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |a, &d| (a << 8) | usize::from(d));
        rest = &rest[n..];
        len
    };
    if rest.len() < len {
        return Err("truncated DER".to_string());
    }
    Ok((tag, &rest[..len], &rest[len..]))
}

/// Longest SPIFFE ID (the SPIFFE ID spec's limit; the translation ignores longer ones).
const MAX_SPIFFE_ID_BYTES: usize = 2048;

/// Checks that `b` is one DER SEQUENCE and nothing after it: the outline of a
/// certificate (what is inside is for Envoy's verifier to judge).
fn one_certificate(b: &[u8]) -> Result<(), String> {
    let (tag, _, rest) = der_tlv(b)?;
    if tag != 0x30 {
        return Err(format!(
            "not a DER certificate (tag {tag:#04x}, not a SEQUENCE)"
        ));
    }
    if !rest.is_empty() {
        return Err(format!("{} bytes after a DER certificate", rest.len()));
    }
    Ok(())
}

/// Splits concatenated DER certificates.
fn split_der(mut b: &[u8]) -> Result<Vec<&[u8]>, String> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let (_, _, rest) = der_tlv(b)?;
        let whole = b.len() - rest.len();
        out.push(&b[..whole]);
        b = rest;
    }
    Ok(out)
}

/// The serial number of a DER certificate, lowercase hex.
fn leaf_serial(cert: &[u8]) -> Result<String, String> {
    let (_, cert, _) = der_tlv(cert)?;
    let (_, tbs, _) = der_tlv(cert)?;
    let (mut tag, mut content, rest) = der_tlv(tbs)?;
    if tag == 0xa0 {
        // [0] version
        (tag, content, _) = der_tlv(rest)?;
    }
    // An INTEGER has at least one content octet (X.690 8.3.1): an empty one is no
    // serial number, and an SVID is named by its serial in logs and rotation.
    if tag != 0x02 || content.is_empty() {
        return Err("certificate without a serial number".to_string());
    }
    Ok(content.iter().map(|b| format!("{b:02x}")).collect())
}

/// PEM: base64 in 64-character lines between BEGIN/END lines.
///
/// Used for private keys too, so the text is built in one buffer allocated at its final
/// size (a growing `String` would leave copies of earlier, smaller buffers in freed
/// memory) and returned in a [`Zeroizing`] wrapper; the base64 scratch buffer is wiped
/// before it is freed.
fn pem(label: &str, der: &[u8]) -> Zeroizing<String> {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut b64 = Zeroizing::new(Vec::with_capacity(der.len().div_ceil(3) * 4));
    for chunk in der.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |a, (i, &b)| a | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                b64.push(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]);
            } else {
                b64.push(b'=');
            }
        }
    }
    let (begin, end) = (
        format!("-----BEGIN {label}-----\n"),
        format!("-----END {label}-----\n"),
    );
    let lines = b64.len().div_ceil(64);
    let mut out = Zeroizing::new(String::with_capacity(
        begin.len() + b64.len() + lines + end.len(),
    ));
    out.push_str(&begin);
    for line in b64.chunks(64) {
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(&end);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pem_matches_rcgen() {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["a.test".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        assert_eq!(
            pem("CERTIFICATE", cert.der())
                .as_str()
                .replace("\r\n", "\n"),
            cert.pem().replace("\r\n", "\n")
        );
        assert_eq!(
            pem("PRIVATE KEY", &key.serialize_der())
                .as_str()
                .replace("\r\n", "\n"),
            key.serialize_pem().replace("\r\n", "\n")
        );
        assert_eq!(
            split_der(&[cert.der().to_vec(), cert.der().to_vec()].concat())
                .unwrap()
                .len(),
            2
        );
        assert!(!leaf_serial(cert.der()).unwrap().is_empty());
        // A serial INTEGER without content octets, as a fuzzed SPIRE reply carried
        // one: refused, not read as an empty serial. (Certificate { TBSCertificate {
        // [0] { v3 }, serial } }, the rest left out: the serial is read first.)
        let with_serial = |serial: &[u8]| {
            let mut tbs = vec![0xa0, 0x03, 0x02, 0x01, 0x02];
            tbs.extend_from_slice(serial);
            let mut cert = vec![0x30, u8::try_from(tbs.len()).unwrap()];
            cert.extend(tbs);
            let mut outer = vec![0x30, u8::try_from(cert.len()).unwrap()];
            outer.extend(cert);
            outer
        };
        assert_eq!(
            leaf_serial(&with_serial(&[0x02, 0x01, 0x07])),
            Ok("07".into())
        );
        assert_eq!(
            leaf_serial(&with_serial(&[0x02, 0x00])),
            Err("certificate without a serial number".into())
        );
    }

    fn svid_message(td: &str, path: &str, chain: Vec<Vec<u8>>) -> pb::X509svidWithKey {
        use spire_api::pb::spire::api::types::{Spiffeid, X509svid};
        pb::X509svidWithKey {
            x509_svid: Some(X509svid {
                cert_chain: chain.into_iter().map(Into::into).collect(),
                id: Some(Spiffeid {
                    trust_domain: td.to_string(),
                    path: path.to_string(),
                }),
                expires_at: 1_900_000_000,
                hint: String::new(),
            }),
            x509_svid_key: vec![0x30, 0x00].into(),
        }
    }

    fn cert_der() -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["a.test".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        cert.der().to_vec()
    }

    #[test]
    fn an_svid_is_converted_with_its_id_chain_and_serial() {
        let der = cert_der();
        let resp = pb::SubscribeToX509sviDsResponse {
            x509_svids: vec![svid_message("example.org", "/ns/a/sa/b", vec![der.clone()])],
            federates_with: Vec::new(),
        };
        let svid = svid_of_response(resp).unwrap().unwrap();
        assert_eq!(svid.spiffe_id, "spiffe://example.org/ns/a/sa/b");
        assert_eq!(svid.cert_chain_pem, *pem("CERTIFICATE", &der));
        assert_eq!(svid.serial, leaf_serial(&der).unwrap());
        assert_eq!(svid.not_after_ms, UnixMs(1_900_000_000_000));
        // No SVID in the message: no registration entry matches.
        assert!(svid_of_response(Default::default()).unwrap().is_none());
    }

    #[test]
    fn an_svid_with_a_bad_id_or_chain_is_refused_precisely() {
        let der = cert_der();
        let refusal = |td: &str, path: &str, chain: Vec<Vec<u8>>| {
            convert_svid(svid_message(td, path, chain))
                .map(|s| s.spiffe_id)
                .unwrap_err()
        };
        let ok = || vec![der.clone()];
        assert!(refusal("Example.org", "/a", ok()).starts_with("SVID with a bad trust domain"));
        assert!(refusal("a/b", "/a", ok()).starts_with("SVID with a bad trust domain"));
        assert_eq!(
            refusal("example.org", "", ok()),
            "SVID whose SPIFFE ID has no path"
        );
        assert_eq!(
            refusal("example.org", "/", ok()),
            "SVID whose SPIFFE ID has no path"
        );
        for path in ["/a//b", "/a/../b", "/a?x", "/a/"] {
            assert!(
                refusal("example.org", path, ok())
                    .starts_with("SVID with a bad SPIFFE ID path segment"),
                "{path}"
            );
        }
        let long = format!("/{}", ["s"; 1100].join("/"));
        assert!(refusal("example.org", &long, ok()).contains("more than 2048"));
        assert_eq!(
            refusal("example.org", "/a", vec![]),
            "SVID with an empty chain"
        );
        assert!(refusal("example.org", "/a", vec![der.clone(); 17]).contains("more than 16"));
        let mut trailing = der.clone();
        trailing.push(0);
        assert_eq!(
            refusal("example.org", "/a", vec![der.clone(), trailing]),
            "1 bytes after a DER certificate"
        );
        assert!(
            refusal("example.org", "/a", vec![vec![0x04, 0x00]])
                .starts_with("not a DER certificate")
        );
        // A path without its leading slash is SPIRE's too.
        assert_eq!(
            convert_svid(svid_message("example.org", "ns/a", ok()))
                .unwrap()
                .spiffe_id,
            "spiffe://example.org/ns/a"
        );
    }

    #[test]
    fn bundles_are_read_by_trust_domain_and_bad_ones_refused() {
        let (a, b) = (cert_der(), cert_der());
        let resp = pb::SubscribeToX509BundlesResponse {
            ca_certificates: [
                (
                    "spiffe://example.org".to_string(),
                    [a.clone(), b.clone()].concat(),
                ),
                ("other.org".to_string(), a.clone()),
                ("spiffe://Bad".to_string(), a.clone()),
                ("empty.org".to_string(), Vec::new()),
                ("cut.org".to_string(), a[..a.len() - 1].to_vec()),
            ]
            .into_iter()
            .map(|(name, der)| (name, der.into()))
            .collect(),
        };
        let (bundles, mut refused) = bundles_of_response(resp);
        assert_eq!(
            bundles.keys().collect::<Vec<_>>(),
            ["example.org", "other.org"]
        );
        assert_eq!(
            bundles["example.org"].ca_pem,
            format!("{}{}", *pem("CERTIFICATE", &a), *pem("CERTIFICATE", &b))
        );
        refused.sort();
        assert_eq!(
            refused,
            [
                ("cut.org".to_string(), "truncated DER".to_string()),
                ("empty.org".to_string(), "no certificate".to_string()),
                (
                    "spiffe://Bad".to_string(),
                    "trust domain: character 'B' not allowed (lowercase letters, digits, '.', '-', '_')"
                        .to_string()
                ),
            ]
        );
    }

    /// The PEM buffer is allocated once at its final size: had it grown, the key's
    /// first lines would be left behind, unwiped, in the freed smaller buffers.
    #[test]
    fn pem_is_built_without_reallocating() {
        for len in [0, 1, 2, 3, 47, 48, 49, 138, 1000] {
            let der = vec![0xa5u8; len];
            let out = pem("PRIVATE KEY", &der);
            assert_eq!(out.capacity(), out.len(), "DER of {len} bytes");
        }
    }
}
