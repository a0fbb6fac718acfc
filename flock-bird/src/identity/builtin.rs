//! The `builtin` provider: a node-local CA that issues SPIFFE SVIDs itself.

use super::ca_dir::{self, CaDirError, CaDirFiles, IssuerSet};
use super::{
    Bundle, IdentityError, IdentityProvider, IdentityView, PodIdentity, SecretPem, Svid, spiffe_id,
    validate_path_segment, validate_trust_domain,
};
use flock_core::pod::PodKey;
use flock_core::sync::Mutex;
use flock_core::{MonoMs, UnixMs};
use rcgen::KeyPair;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::watch;

/// Lifetime of the node CA. The CA is re-created at every agent start (it is never
/// stored), so a year is far beyond any agent's uptime in practice.
pub const CA_LIFETIME: Duration = Duration::from_secs(365 * 24 * 3600);
/// SVIDs are valid from this long before issuance, so a peer whose clock is a little
/// behind does not reject a fresh certificate.
pub const CLOCK_SKEW: Duration = Duration::from_secs(60);
/// Shortest SVID lifetime accepted (rotation at half-life must not become a busy loop).
pub const MIN_TTL: Duration = Duration::from_secs(2);
/// Longest SVID lifetime accepted: short-lived SVIDs are the point of rotation, and a
/// leaf must not outlive the CA.
pub const MAX_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

type Clock = Box<dyn Fn() -> UnixMs + Send + Sync>;

/// A leaf signed over a public key the signer did not generate ([`BuiltinCa::sign_csr`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedLeaf {
    /// The leaf and its issuer chain, PEM, leaf first (the root is in the bundle).
    pub cert_chain_pem: String,
    /// The leaf's notAfter.
    pub not_after_ms: UnixMs,
    /// When it was signed (the clock read its validity was written from).
    pub issued_ms: UnixMs,
    /// Its serial number, lowercase hex.
    pub serial: String,
}

/// The built-in CA issuing `spiffe://<trust-domain>/ns/<ns>/sa/<sa>` SVIDs, rotated at
/// half their lifetime on the monotonic clock ([`flock_core::rotation`]: validity is
/// written from the wall clock, which peers check; the schedule ignores its steps).
/// Its issuer is either node-local (ECDSA P-256, generated at start,
/// in memory only: [`BuiltinCa::new`]) or read from a CA directory under a shared root
/// ([`BuiltinCa::from_ca_dir`], re-read by [`BuiltinCa::watch_ca_dir`]).
pub struct BuiltinCa {
    trust_domain: String,
    ttl: Duration,
    clock: Clock,
    /// The current issuer; replaced whole when the CA directory changes. Lock order:
    /// `state` before `issuer`.
    issuer: Mutex<Arc<IssuerSet>>,
    /// Mixed into serials so two leaves never share one, even with equal keys' hashes.
    serials: AtomicU64,
    /// Leaves signed (the `flock_identity_svids_issued` metric).
    issued: AtomicU64,
    /// Subscriptions and SVIDs; every change is published under this lock, so views
    /// are sent in generation order.
    state: Mutex<State>,
    tx: watch::Sender<Arc<IdentityView>>,
}

struct State {
    subscriptions: super::subscriptions::Subscriptions,
    svids: imbl::OrdMap<String, Arc<Svid>>,
    generation: u64,
}

impl fmt::Debug for BuiltinCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Hand-written so the CA key can never be printed, whatever rcgen's Debug does.
        f.debug_struct("BuiltinCa")
            .field("trust_domain", &self.trust_domain)
            .field("ttl", &self.ttl)
            .field("issuer", &self.issuer.lock().describe())
            .finish_non_exhaustive()
    }
}

impl BuiltinCa {
    /// Creates the CA (a new key pair, never written anywhere) for `trust_domain`,
    /// issuing SVIDs valid for `svid_ttl`, with `clock` giving wall-clock time
    /// (certificate validity is read by other processes: Unix time; tests pass a fake
    /// clock, the agent `flock_clock::unix_now`). Rotation is scheduled on
    /// `flock_clock::mono_now` (tokio's clock: a paused-time test drives it).
    pub fn new(
        trust_domain: &str,
        svid_ttl: Duration,
        clock: impl Fn() -> UnixMs + Send + Sync + 'static,
    ) -> Result<Arc<Self>, IdentityError> {
        check_params(trust_domain, svid_ttl)?;
        let now = clock();
        let issuer = IssuerSet::self_signed(
            trust_domain,
            now,
            CLOCK_SKEW,
            now.plus(CA_LIFETIME.as_millis() as u64),
        )?;
        Ok(Self::with_issuer(
            trust_domain,
            svid_ttl,
            Box::new(clock),
            issuer,
        ))
    }

    /// Creates the CA with the issuer, chain and roots of `dir` (see
    /// [`ca_dir`](super::ca_dir)), validated at the clock's now: SVIDs are signed by
    /// `ca-cert.pem` and carry its chain; the bundle is `root-cert.pem`. Keep it current
    /// with [`BuiltinCa::watch_ca_dir`].
    pub fn from_ca_dir(
        trust_domain: &str,
        svid_ttl: Duration,
        clock: impl Fn() -> UnixMs + Send + Sync + 'static,
        dir: &Path,
    ) -> Result<Arc<Self>, IdentityError> {
        check_params(trust_domain, svid_ttl)?;
        let issuer = ca_dir::load_ca_dir(dir, trust_domain, clock())
            .map_err(|e| IdentityError::CaDir(e.to_string()))?;
        Ok(Self::with_issuer(
            trust_domain,
            svid_ttl,
            Box::new(clock),
            issuer,
        ))
    }

    fn with_issuer(
        trust_domain: &str,
        ttl: Duration,
        clock: Clock,
        issuer: IssuerSet,
    ) -> Arc<Self> {
        let mut bundles = BTreeMap::new();
        bundles.insert(
            trust_domain.to_string(),
            Bundle {
                trust_domain: trust_domain.to_string(),
                ca_pem: issuer.roots_pem().to_string(),
            },
        );
        let (tx, _) = watch::channel(Arc::new(IdentityView {
            bundles,
            ..IdentityView::default()
        }));
        Arc::new(Self {
            trust_domain: trust_domain.to_string(),
            ttl,
            clock,
            issuer: Mutex::new(Arc::new(issuer)),
            serials: AtomicU64::new(0),
            issued: AtomicU64::new(0),
            state: Mutex::new(State {
                subscriptions: super::subscriptions::Subscriptions::new(),
                svids: imbl::OrdMap::new(),
                generation: 0,
            }),
            tx,
        })
    }

    /// The trust domain.
    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    /// The SVID lifetime.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The CA's bundle: its trust anchors (`root-cert.pem` with a CA directory).
    pub fn bundle(&self) -> Bundle {
        Bundle {
            trust_domain: self.trust_domain.clone(),
            ca_pem: self.issuer.lock().roots_pem().to_string(),
        }
    }

    /// One line about the current issuer (subject, roots, expiry).
    pub fn describe_issuer(&self) -> String {
        self.issuer.lock().describe().to_string()
    }

    /// How many leaves this CA has signed since it was created (first issuances,
    /// rotations, re-issues under a new issuer, and [`BuiltinCa::issue`] calls).
    pub fn issued_count(&self) -> u64 {
        self.issued.load(Ordering::Relaxed)
    }

    /// Issues a fresh SVID (new key, new serial) for `spiffe_id` at the clock's now.
    /// It is *not* tracked in the view: subscriptions do that; this is the unit of work
    /// they (and the issuance benchmark) share.
    pub fn issue(&self, spiffe_id: &str) -> Result<Svid, IdentityError> {
        let issuer = Arc::clone(&self.issuer.lock());
        self.issue_with(&issuer, spiffe_id)
    }

    fn issue_with(&self, issuer: &IssuerSet, spiffe_id: &str) -> Result<Svid, IdentityError> {
        let now_mono = flock_clock::mono_now();
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(issue_error)?;
        let leaf = self.sign_key(issuer, &key, spiffe_id, &[], self.ttl)?;
        // rcgen's PEM string is moved into the zeroizing wrapper as it is (no copy). The
        // `KeyPair` itself keeps a DER copy that rcgen does not wipe when it is dropped
        // at the end of this call; that copy is out of our reach.
        let private_key_pem = SecretPem::new(key.serialize_pem());
        Ok(Svid {
            spiffe_id: spiffe_id.to_string(),
            cert_chain_pem: leaf.cert_chain_pem,
            private_key_pem,
            not_after_ms: leaf.not_after_ms,
            issued_ms: leaf.issued_ms,
            issued_mono: now_mono,
            serial: leaf.serial,
        })
    }

    /// Signs the public key of `csr_der` into a leaf for `spiffe_id` valid for `ttl`
    /// (at most until the issuer chain's end), under the current issuer. The CSR's
    /// signature is checked first (proof that the asker holds the key); its names are
    /// ignored: the leaf names `spiffe_id` only. The node-scoped signer's unit of work
    /// (`flock-ca`): the key never leaves the node that asked.
    pub fn sign_csr(
        &self,
        csr_der: &[u8],
        spiffe_id: &str,
        ttl: Duration,
    ) -> Result<SignedLeaf, IdentityError> {
        let csr = rcgen::CertificateSigningRequestParams::from_der(&csr_der.to_vec().into())
            .map_err(|e| {
                IdentityError::Issue(format!(
                    "the CSR is not a valid, self-signed PKCS#10 request: {e}"
                ))
            })?;
        let issuer = Arc::clone(&self.issuer.lock());
        self.sign_key(&issuer, &csr.public_key, spiffe_id, &[], ttl)
    }

    /// A serving certificate for `spiffe_id` that also names `dns_names`, with its
    /// new key, valid for `ttl` (the signer's own TLS certificate).
    pub fn issue_serving(
        &self,
        spiffe_id: &str,
        dns_names: &[String],
        ttl: Duration,
    ) -> Result<(SignedLeaf, SecretPem), IdentityError> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(issue_error)?;
        let issuer = Arc::clone(&self.issuer.lock());
        let leaf = self.sign_key(&issuer, &key, spiffe_id, dns_names, ttl)?;
        Ok((leaf, SecretPem::new(key.serialize_pem())))
    }

    fn sign_key(
        &self,
        issuer: &IssuerSet,
        key: &impl rcgen::PublicKeyData,
        spiffe_id: &str,
        dns_names: &[String],
        ttl: Duration,
    ) -> Result<SignedLeaf, IdentityError> {
        let now = (self.clock)();
        // A leaf never outlives its issuer's chain (a peer would reject it anyway).
        let not_after_ms = now.plus(ttl.as_millis() as u64).min(issuer.not_after_ms());
        // An issuer at its end would sign leaves that are dead on arrival (and rotate
        // at half of nothing): refuse, naming what to do.
        if not_after_ms < now.plus(MIN_TTL.as_millis() as u64) {
            return Err(IdentityError::Issue(format!(
                "the issuer's chain expires at {} ms: {}; replace the CA directory's set",
                issuer.not_after_ms().as_millis(),
                issuer.describe()
            )));
        }
        let from = UnixMs(
            now.as_millis()
                .saturating_sub(CLOCK_SKEW.as_millis() as u64),
        );
        let serial = self.serial_for(key.der_bytes());
        let der = ca_dir::sign_leaf(
            issuer,
            key,
            spiffe_id,
            dns_names,
            (from, not_after_ms),
            &serial,
        )?;
        self.issued.fetch_add(1, Ordering::Relaxed);
        let mut cert_chain_pem = ca_dir::cert_pem(&der);
        cert_chain_pem.push_str(issuer.chain_pem());
        Ok(SignedLeaf {
            cert_chain_pem,
            not_after_ms,
            issued_ms: now,
            serial: serial.iter().map(|b| format!("{b:02x}")).collect(),
        })
    }

    /// 16 bytes: a hash of a per-CA counter and the new public key (unique per CA, as
    /// RFC 5280 requires), first byte `01xxxxxx` so the DER INTEGER is positive and
    /// never shortened by a leading zero (always 16 bytes, within RFC 5280's 20).
    fn serial_for(&self, public_key: &[u8]) -> [u8; 16] {
        let n = self.serials.fetch_add(1, Ordering::Relaxed);
        let mut h = Sha256::new();
        h.update(n.to_be_bytes());
        h.update(public_key);
        let digest = h.finalize();
        let mut serial = [0u8; 16];
        serial.copy_from_slice(&digest[..16]);
        serial[0] = (serial[0] & 0x7f) | 0x40;
        serial
    }

    /// Rotates every SVID past half its lifetime (monotonic time since its issuance);
    /// returns how many. Call it from a loop (see [`BuiltinCa::next_rotation`] for when
    /// next).
    pub fn rotate_due(&self) -> usize {
        let now = flock_clock::mono_now();
        let wall = flock_core::reintroduced!("svid-wall-rotation").then(|| (self.clock)());
        let due = |s: &Svid| match wall {
            None => s.issued().due(now),
            // The mutant's schedule on the wall clock: a step forward makes every SVID
            // due at once, a step back postpones every rotation by the size of the step.
            Some(wall) => wall >= s.issued_ms.plus(s.not_after_ms.since(s.issued_ms) / 2),
        };
        let mut state = self.state.lock();
        let ids: Vec<String> = state
            .svids
            .values()
            .filter(|s| due(s))
            .map(|s| s.spiffe_id.clone())
            .collect();
        let mut rotated = 0;
        for id in ids {
            match self.issue(&id) {
                Ok(svid) => {
                    tracing::info!(spiffe_id = %id, serial = %svid.serial, not_after_ms = svid.not_after_ms.as_millis(), "rotated SVID");
                    state.svids.insert(id, Arc::new(svid));
                    rotated += 1;
                }
                // The old SVID stays valid for the other half of its life; the next
                // round retries.
                Err(e) => tracing::warn!(spiffe_id = %id, error = %e, "SVID rotation failed"),
            }
        }
        if rotated > 0 {
            self.publish(&mut state);
        }
        rotated
    }

    /// When the next SVID is due for rotation, on the monotonic clock
    /// (`flock_clock::mono_now`); `None` when there is no SVID.
    pub fn next_rotation(&self) -> Option<MonoMs> {
        self.state
            .lock()
            .svids
            .values()
            .map(|s| s.issued().rotation_at())
            .min()
    }

    /// Rotates forever: sleeps until the next rotation is due (at most `max_sleep`, so
    /// new subscriptions are noticed), then [`BuiltinCa::rotate_due`]. Both the sleep and
    /// the schedule are monotonic, so a wall-clock step changes neither. Abort the task
    /// to stop it.
    pub async fn run_rotation(self: Arc<Self>, max_sleep: Duration) {
        let max_ms = u64::try_from(max_sleep.as_millis()).unwrap_or(u64::MAX);
        loop {
            let rotated = self.rotate_due();
            let wait = flock_core::rotation::next_wake_ms(
                self.next_rotation(),
                flock_clock::mono_now(),
                rotated,
                max_ms,
                100,
            );
            tokio::time::sleep(Duration::from_millis(wait)).await;
        }
    }

    fn publish(&self, state: &mut State) {
        state.generation += 1;
        let mut bundles = BTreeMap::new();
        bundles.insert(self.trust_domain.clone(), self.bundle());
        self.tx.send_replace(Arc::new(IdentityView {
            svids: state.svids.clone(),
            bundles,
            subscriptions: state.subscriptions.snapshot(),
            generation: state.generation,
        }));
    }

    /// Re-reads the CA directory `dir`. An unchanged set (same file contents) is left
    /// alone; a changed one is validated whole first — a refused set changes nothing and
    /// the error says why — then becomes the issuer: every SVID is re-issued under it and
    /// the view is published with the new bundle (`root-cert.pem`, which lists old and
    /// new roots during a root rotation, so peers holding either keep verifying).
    pub fn reload_ca_dir(&self, dir: &Path) -> Result<CaReload, CaDirError> {
        self.reload_files(dir, CaDirFiles::read(dir)?)
    }

    fn reload_files(&self, dir: &Path, files: CaDirFiles) -> Result<CaReload, CaDirError> {
        let current = self.issuer.lock().fingerprint;
        if current == Some(files.fingerprint()) {
            return Ok(CaReload::Unchanged);
        }
        let new = ca_dir::validate(files, &self.trust_domain, (self.clock)())?;
        let description = new.describe().to_string();
        let reissued = self.replace_issuer(new);
        tracing::info!(issuer = %description, reissued, dir = %dir.display(), "CA directory changed: new issuer in use, SVIDs re-issued");
        Ok(CaReload::Replaced { reissued })
    }

    /// Makes `new` the issuer and re-issues every SVID under it; publishes once.
    /// Returns how many SVIDs were re-issued.
    fn replace_issuer(&self, new: IssuerSet) -> usize {
        let new = Arc::new(new);
        let mut state = self.state.lock();
        *self.issuer.lock() = Arc::clone(&new);
        let ids: Vec<String> = state.svids.keys().cloned().collect();
        let mut reissued = 0;
        for id in ids {
            match self.issue_with(&new, &id) {
                Ok(svid) => {
                    tracing::info!(spiffe_id = %id, serial = %svid.serial, "re-issued SVID under the new issuer");
                    state.svids.insert(id, Arc::new(svid));
                    reissued += 1;
                }
                // The old SVID verifies as long as its root is in the bundle; the next
                // rotation round issues it under the new issuer.
                Err(e) => {
                    tracing::warn!(spiffe_id = %id, error = %e, "re-issuing an SVID under the new issuer failed")
                }
            }
        }
        self.publish(&mut state);
        reissued
    }

    /// Follows the CA directory `dir` forever: an inotify watch on the directory (a
    /// mounted Secret changes by an atomic swap of its `..data` symlink, an event on the
    /// directory itself, not on the file symlinks), each burst of events followed by
    /// `debounce` of quiet, then [`BuiltinCa::reload_ca_dir`]; also every `poll`, in
    /// case the watch is lost (the directory replaced) or was never armed. A refused set
    /// is logged once per distinct content, at `warn`, and the old issuer stays.
    /// Spawn it; abort the task to stop it.
    pub async fn watch_ca_dir(self: Arc<Self>, dir: PathBuf, debounce: Duration, poll: Duration) {
        use tokio_stream::StreamExt as _;
        let mut warned = None;
        let mut events = arm_watch(&dir);
        // A change between the first load and the arming of the watch raised no event.
        self.reload_logged(&dir, debounce, &mut warned).await;
        loop {
            let event = async {
                match events.as_mut() {
                    Some(stream) => stream.next().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                ev = event => {
                    if !crate::dirwatch::alive(ev.as_ref()) {
                        // The directory was removed or moved away (or the watch broke):
                        // watch whatever is at the path now, and read it.
                        tracing::warn!(dir = %dir.display(), "CA directory watch lost; re-arming it");
                        // Paced, so a watch that keeps failing is not a busy loop.
                        tokio::time::sleep(debounce).await;
                        events = arm_watch(&dir);
                        self.reload_logged(&dir, debounce, &mut warned).await;
                        continue;
                    }
                    // Debounce: a Secret update is several events (new data directory,
                    // `..data_tmp` symlink, rename, old directory removed); read once
                    // they have stopped.
                    loop {
                        let more = async {
                            match events.as_mut() {
                                Some(stream) => stream.next().await,
                                None => std::future::pending().await,
                            }
                        };
                        tokio::select! {
                            ev = more => if !crate::dirwatch::alive(ev.as_ref()) {
                                // No more events from this watch: stop waiting on it
                                // (an ended stream would answer at once, forever).
                                events = None;
                                break;
                            },
                            () = tokio::time::sleep(debounce) => break,
                        }
                    }
                }
                () = tokio::time::sleep(poll) => {
                    if events.is_none() {
                        events = arm_watch(&dir);
                    }
                }
            }
            self.reload_logged(&dir, debounce, &mut warned).await;
        }
    }

    /// [`BuiltinCa::reload_ca_dir`], logged; re-read a few times, `debounce` apart,
    /// while the files change under the read (a read straddling a swap sees files of
    /// two versions, which is no reason to warn).
    async fn reload_logged(
        &self,
        dir: &Path,
        debounce: Duration,
        warned: &mut Option<Option<[u8; 32]>>,
    ) {
        for attempt in 1..=RELOAD_ATTEMPTS {
            let (result, read) = match CaDirFiles::read(dir) {
                Ok(files) => {
                    let print = files.fingerprint();
                    (self.reload_files(dir, files), Some(print))
                }
                Err(e) => (Err(e), None),
            };
            let Err(e) = result else {
                *warned = None;
                self.warn_if_expiring(dir);
                return;
            };
            let reread = CaDirFiles::read(dir).ok().map(|f| f.fingerprint());
            match after_refusal(read, reread, *warned, attempt == RELOAD_ATTEMPTS) {
                Refusal::Retry => tokio::time::sleep(debounce).await,
                Refusal::Quiet => return,
                Refusal::Warn => {
                    tracing::warn!(dir = %dir.display(), error = %e, "CA directory refused; keeping the current issuer");
                    *warned = Some(reread);
                    return;
                }
            }
        }
    }

    /// Warns when the issuer's chain ends before an SVID's full lifetime: leaves are
    /// being cut short, and once it has expired no peer accepts them.
    fn warn_if_expiring(&self, dir: &Path) {
        let now = (self.clock)();
        let issuer = Arc::clone(&self.issuer.lock());
        if issuer.not_after_ms() < now.plus(self.ttl.as_millis() as u64) {
            tracing::warn!(dir = %dir.display(), issuer = %issuer.describe(), "the CA directory's issuer expires within one SVID lifetime: SVIDs are cut short; put a renewed set in the directory");
        }
    }

    /// Removes `key`'s subscription from `state`, and its SVID when it was the last
    /// subscriber of it. Returns whether anything changed.
    fn drop_subscription(state: &mut State, key: &PodKey) -> bool {
        let Some(left) = state.subscriptions.remove(key) else {
            return false;
        };
        if left.last {
            state.svids.remove(&left.id);
            tracing::info!(spiffe_id = %left.id, "dropped SVID (no subscriber left)");
        }
        true
    }
}

#[async_trait::async_trait]
impl IdentityProvider for BuiltinCa {
    async fn subscribe(&self, pod: &PodIdentity) -> Result<String, IdentityError> {
        for (field, value) in [
            ("namespace", &pod.namespace),
            ("service account", &pod.service_account),
        ] {
            validate_path_segment(value).map_err(|reason| IdentityError::InvalidName {
                field,
                value: value.clone(),
                reason,
            })?;
        }
        let id = spiffe_id(&self.trust_domain, &pod.namespace, &pod.service_account);
        let mut state = self.state.lock();
        if state.subscriptions.get(&pod.key) == Some(&id) && state.svids.contains_key(&id) {
            return Ok(id);
        }
        if !state.svids.contains_key(&id) {
            // Issue before touching the subscriptions: on failure nothing changes.
            let svid = self.issue(&id)?;
            tracing::info!(spiffe_id = %id, serial = %svid.serial, not_after_ms = svid.not_after_ms.as_millis(), "issued SVID");
            state.svids.insert(id.clone(), Arc::new(svid));
        }
        // A pod re-subscribing under another identity (its service account changed)
        // leaves its old one: dropped if it was that SVID's last subscriber.
        if let Some(left) = state.subscriptions.insert(pod.key.clone(), id.clone())
            && left.last
        {
            state.svids.remove(&left.id);
            tracing::info!(spiffe_id = %left.id, "dropped SVID (no subscriber left)");
        }
        self.publish(&mut state);
        Ok(id)
    }

    async fn unsubscribe(&self, key: &PodKey) {
        let mut state = self.state.lock();
        if Self::drop_subscription(&mut state, key) {
            self.publish(&mut state);
        }
    }

    fn view(&self) -> watch::Receiver<Arc<IdentityView>> {
        self.tx.subscribe()
    }

    fn svids_issued(&self) -> Option<u64> {
        Some(self.issued_count())
    }

    fn describe(&self) -> String {
        format!(
            "builtin (trust domain {}, ttl {}s)",
            self.trust_domain,
            self.ttl.as_secs()
        )
    }
}

/// Reads of a changing CA directory before a refusal is reported anyway.
const RELOAD_ATTEMPTS: u32 = 5;

/// What the watch does after a refused read of the CA directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// The files changed while being read: read again after the debounce.
    Retry,
    /// Warn (the reason is new, or the directory never settled).
    Warn,
    /// Already warned about exactly this content.
    Quiet,
}

/// `read`: the fingerprint of the refused read (`None`: a file could not be read);
/// `reread`: of a read right after; `warned`: what was last warned about.
fn after_refusal(
    read: Option<[u8; 32]>,
    reread: Option<[u8; 32]>,
    warned: Option<Option<[u8; 32]>>,
    last_attempt: bool,
) -> Refusal {
    if read != reread && !last_attempt {
        Refusal::Retry
    } else if warned == Some(reread) {
        Refusal::Quiet
    } else {
        Refusal::Warn
    }
}

/// What [`BuiltinCa::reload_ca_dir`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaReload {
    /// The files are the ones in use.
    Unchanged,
    /// A new issuer set is in use; this many SVIDs were re-issued under it.
    Replaced {
        /// SVIDs re-issued.
        reissued: usize,
    },
}

/// An inotify watch on the directory itself (not the files: a Secret's files are
/// symlinks through `..data`, which is replaced, not written).
fn arm_watch(dir: &Path) -> Option<crate::dirwatch::EventStream> {
    use inotify::WatchMask;
    crate::dirwatch::arm(
        dir,
        WatchMask::CREATE
            | WatchMask::CLOSE_WRITE
            | WatchMask::MOVED_TO
            | WatchMask::MOVED_FROM
            | WatchMask::DELETE
            | WatchMask::ATTRIB,
        "CA directory",
    )
}

fn check_params(trust_domain: &str, svid_ttl: Duration) -> Result<(), IdentityError> {
    validate_trust_domain(trust_domain).map_err(|reason| IdentityError::InvalidTrustDomain {
        domain: trust_domain.to_string(),
        reason,
    })?;
    if !(MIN_TTL..=MAX_TTL).contains(&svid_ttl) {
        return Err(IdentityError::InvalidTtl(format!(
            "{svid_ttl:?} not within {MIN_TTL:?}..={MAX_TTL:?}"
        )));
    }
    Ok(())
}

fn issue_error(e: impl fmt::Display) -> IdentityError {
    // rcgen's errors name what failed (algorithm, encoding), never key bytes.
    IdentityError::Issue(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::{Refusal, after_refusal};

    #[test]
    fn a_refusal_is_retried_while_the_files_change_and_warned_once_per_content() {
        let (a, b) = (Some([1; 32]), Some([2; 32]));
        // Changed under the read (or appeared/disappeared): read again.
        assert_eq!(after_refusal(a, b, None, false), Refusal::Retry);
        assert_eq!(after_refusal(None, a, None, false), Refusal::Retry);
        // ... unless out of attempts.
        assert_eq!(after_refusal(a, b, None, true), Refusal::Warn);
        // Stable and bad: warn, then stay quiet about the same content.
        assert_eq!(after_refusal(a, a, None, false), Refusal::Warn);
        assert_eq!(after_refusal(a, a, Some(a), false), Refusal::Quiet);
        assert_eq!(after_refusal(b, b, Some(a), false), Refusal::Warn);
        // A missing file is a content of its own.
        assert_eq!(after_refusal(None, None, None, false), Refusal::Warn);
        assert_eq!(after_refusal(None, None, Some(None), false), Refusal::Quiet);
        assert_eq!(after_refusal(a, a, Some(None), false), Refusal::Warn);
    }
}
