//! The `builtin` provider: a node-local CA that issues SPIFFE SVIDs itself.

use super::{
    Bundle, IdentityError, IdentityProvider, IdentityView, PodIdentity, SecretPem, Svid, due,
    rotation_at, spiffe_id, validate_path_segment, validate_trust_domain,
};
use flock_core::UnixMs;
use flock_core::pod::PodKey;
use flock_core::sync::Mutex;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PKCS_ECDSA_P256_SHA256, SanType, SerialNumber,
};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fmt;
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

/// A node-local CA (ECDSA P-256, in memory only) issuing
/// `spiffe://<trust-domain>/ns/<ns>/sa/<sa>` SVIDs, rotated at half their lifetime.
pub struct BuiltinCa {
    trust_domain: String,
    ttl: Duration,
    clock: Clock,
    issuer: Issuer<'static, KeyPair>,
    ca_not_after_ms: UnixMs,
    bundle: Bundle,
    /// Mixed into serials so two leaves never share one, even with equal keys' hashes.
    serials: AtomicU64,
    /// Subscriptions and SVIDs; every change is published under this lock, so views
    /// are sent in generation order.
    state: Mutex<State>,
    tx: watch::Sender<Arc<IdentityView>>,
}

struct State {
    subscriptions: BTreeMap<PodKey, String>,
    svids: BTreeMap<String, Arc<Svid>>,
    generation: u64,
}

impl fmt::Debug for BuiltinCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Hand-written so the CA key can never be printed, whatever rcgen's Debug does.
        f.debug_struct("BuiltinCa")
            .field("trust_domain", &self.trust_domain)
            .field("ttl", &self.ttl)
            .field("ca_not_after_ms", &self.ca_not_after_ms)
            .finish_non_exhaustive()
    }
}

/// Sets a certificate's validity to `[from, to]`.
///
/// rcgen takes `time::OffsetDateTime`; building it from rcgen's own epoch value (and
/// `+ std::time::Duration`) keeps this crate free of a direct `time` dependency and of
/// any version skew with rcgen's.
fn set_validity(params: &mut CertificateParams, from: UnixMs, to: UnixMs) {
    let epoch = rcgen::date_time_ymd(1970, 1, 1);
    params.not_before = epoch + Duration::from_millis(from.as_millis());
    params.not_after = epoch + Duration::from_millis(to.as_millis());
}

impl BuiltinCa {
    /// Creates the CA (a new key pair, never written anywhere) for `trust_domain`,
    /// issuing SVIDs valid for `svid_ttl`, with `clock` giving wall-clock time
    /// (certificate validity is read by other processes: Unix time; tests pass a fake
    /// clock, the agent `flock_clock::unix_now`).
    pub fn new(
        trust_domain: &str,
        svid_ttl: Duration,
        clock: impl Fn() -> UnixMs + Send + Sync + 'static,
    ) -> Result<Arc<Self>, IdentityError> {
        validate_trust_domain(trust_domain).map_err(|reason| {
            IdentityError::InvalidTrustDomain {
                domain: trust_domain.to_string(),
                reason,
            }
        })?;
        if !(MIN_TTL..=MAX_TTL).contains(&svid_ttl) {
            return Err(IdentityError::InvalidTtl(format!(
                "{svid_ttl:?} not within {MIN_TTL:?}..={MAX_TTL:?}"
            )));
        }
        let now = clock();
        let ca_not_after_ms = now.plus(CA_LIFETIME.as_millis() as u64);
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::OrganizationName, "flock");
        params
            .distinguished_name
            .push(DnType::CommonName, format!("flock node CA {trust_domain}"));
        // Path length 0: this CA signs leaves only.
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        set_validity(
            &mut params,
            UnixMs(
                now.as_millis()
                    .saturating_sub(CLOCK_SKEW.as_millis() as u64),
            ),
            ca_not_after_ms,
        );
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(issue_error)?;
        let cert = params.self_signed(&key).map_err(issue_error)?;
        let bundle = Bundle {
            trust_domain: trust_domain.to_string(),
            ca_pem: cert.pem(),
        };
        let mut bundles = BTreeMap::new();
        bundles.insert(trust_domain.to_string(), bundle.clone());
        let (tx, _) = watch::channel(Arc::new(IdentityView {
            bundles,
            ..IdentityView::default()
        }));
        Ok(Arc::new(Self {
            trust_domain: trust_domain.to_string(),
            ttl: svid_ttl,
            clock: Box::new(clock),
            issuer: Issuer::new(params, key),
            ca_not_after_ms,
            bundle,
            serials: AtomicU64::new(0),
            state: Mutex::new(State {
                subscriptions: BTreeMap::new(),
                svids: BTreeMap::new(),
                generation: 0,
            }),
            tx,
        }))
    }

    /// The trust domain.
    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    /// The SVID lifetime.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The CA's bundle.
    pub fn bundle(&self) -> &Bundle {
        &self.bundle
    }

    /// Issues a fresh SVID (new key, new serial) for `spiffe_id` at the clock's now.
    /// It is *not* tracked in the view: subscriptions do that; this is the unit of work
    /// they (and the issuance benchmark) share.
    pub fn issue(&self, spiffe_id: &str) -> Result<Svid, IdentityError> {
        let now = (self.clock)();
        // A leaf never outlives its CA (a chain with an expired root fails anyway).
        let not_after_ms = now
            .plus(self.ttl.as_millis() as u64)
            .min(self.ca_not_after_ms);
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(issue_error)?;
        let serial = self.serial_for(&key);
        let uri = spiffe_id.to_string().try_into().map_err(issue_error)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::OrganizationName, "flock");
        // X509-SVID spec: exactly one URI SAN, the SPIFFE ID.
        params.subject_alt_names = vec![SanType::URI(uri)];
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        params.serial_number = Some(SerialNumber::from_slice(&serial));
        set_validity(
            &mut params,
            UnixMs(
                now.as_millis()
                    .saturating_sub(CLOCK_SKEW.as_millis() as u64),
            ),
            not_after_ms,
        );
        let cert = params.signed_by(&key, &self.issuer).map_err(issue_error)?;
        // rcgen's PEM string is moved into the zeroizing wrapper as it is (no copy). The
        // `KeyPair` itself keeps a DER copy that rcgen does not wipe when it is dropped
        // at the end of this call; that copy is out of our reach.
        let private_key_pem = SecretPem::new(key.serialize_pem());
        Ok(Svid {
            spiffe_id: spiffe_id.to_string(),
            cert_chain_pem: cert.pem(),
            private_key_pem,
            not_after_ms,
            issued_ms: now,
            serial: serial.iter().map(|b| format!("{b:02x}")).collect(),
        })
    }

    /// 16 bytes: a hash of a per-CA counter and the new public key (unique per CA, as
    /// RFC 5280 requires), first byte `01xxxxxx` so the DER INTEGER is positive and
    /// never shortened by a leading zero (always 16 bytes, within RFC 5280's 20).
    fn serial_for(&self, key: &KeyPair) -> [u8; 16] {
        let n = self.serials.fetch_add(1, Ordering::Relaxed);
        let mut h = Sha256::new();
        h.update(n.to_be_bytes());
        h.update(key.public_key_raw());
        let digest = h.finalize();
        let mut serial = [0u8; 16];
        serial.copy_from_slice(&digest[..16]);
        serial[0] = (serial[0] & 0x7f) | 0x40;
        serial
    }

    /// Rotates every SVID past half its lifetime; returns how many. Call it from a loop
    /// (see [`BuiltinCa::next_rotation_ms`] for when next).
    pub fn rotate_due(&self) -> usize {
        let now = (self.clock)();
        let mut state = self.state.lock();
        let ids: Vec<String> = state
            .svids
            .values()
            .filter(|s| due(s.issued_ms, s.not_after_ms, now))
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

    /// When the next SVID is due for rotation; `None` when there is no SVID.
    pub fn next_rotation_ms(&self) -> Option<UnixMs> {
        self.state
            .lock()
            .svids
            .values()
            .map(|s| rotation_at(s.issued_ms, s.not_after_ms))
            .min()
    }

    /// Rotates forever: sleeps until the next rotation is due (at most `max_sleep`, so
    /// new subscriptions and clock jumps are noticed), then [`BuiltinCa::rotate_due`].
    /// Spawn it with the system clock; abort the task to stop it.
    pub async fn run_rotation(self: Arc<Self>, max_sleep: Duration) {
        loop {
            self.rotate_due();
            let now = (self.clock)();
            let wait = self
                .next_rotation_ms()
                .map_or(max_sleep, |at| Duration::from_millis(at.since(now)))
                .min(max_sleep)
                // A failing issuance must not turn this into a busy loop.
                .max(Duration::from_millis(100));
            tokio::time::sleep(wait).await;
        }
    }

    fn publish(&self, state: &mut State) {
        state.generation += 1;
        let mut bundles = BTreeMap::new();
        bundles.insert(self.trust_domain.clone(), self.bundle.clone());
        self.tx.send_replace(Arc::new(IdentityView {
            svids: state.svids.clone(),
            bundles,
            subscriptions: state.subscriptions.clone(),
            generation: state.generation,
        }));
    }

    /// Removes `key`'s subscription from `state`, and its SVID when it was the last
    /// subscriber of it. Returns whether anything changed.
    fn drop_subscription(state: &mut State, key: &PodKey) -> bool {
        let Some(id) = state.subscriptions.remove(key) else {
            return false;
        };
        if !state.subscriptions.values().any(|other| *other == id) {
            state.svids.remove(&id);
            tracing::info!(spiffe_id = %id, "dropped SVID (no subscriber left)");
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
        // leaves its old one first.
        Self::drop_subscription(&mut state, &pod.key);
        state.subscriptions.insert(pod.key.clone(), id.clone());
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

    fn describe(&self) -> String {
        format!(
            "builtin (trust domain {}, ttl {}s)",
            self.trust_domain,
            self.ttl.as_secs()
        )
    }
}

fn issue_error(e: impl fmt::Display) -> IdentityError {
    // rcgen's errors name what failed (algorithm, encoding), never key bytes.
    IdentityError::Issue(e.to_string())
}
