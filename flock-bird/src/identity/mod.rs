//! Workload identity: pods subscribe to X.509-SVIDs and trust bundles.
//!
//! An [`IdentityProvider`] maps each subscribed pod (by its [`PodKey`]) to a SPIFFE ID
//! and keeps exactly one SVID per SPIFFE ID that has at least one subscriber: pods
//! sharing a service account share one secret, so Envoy gets one SDS secret per
//! identity rather than per pod. The current state is an [`IdentityView`] published
//! through a `tokio::sync::watch` channel; the agent republishes SDS whenever it changes
//! (a new subscriber's identity, a rotation, the last subscriber leaving).
//!
//! The subscribe/unsubscribe calls are the `IdentitySubscribe` / `IdentityUnsubscribe`
//! steps of `flock_core::lifecycle::steps`: subscribe returns only once the SVID is in
//! the view, so the xDS config that references it is never published before it.
//!
//! # Secrets
//! Private keys live only in memory, wrapped in [`SecretPem`], whose `Debug` and
//! `Display` print `<redacted N bytes>` and which has no `Serialize`: deriving `Debug`
//! or logging any identity type (for `/debug/*` output, say) cannot leak key material.
//! Error messages carry names and reasons, never PEM. Key bytes are held in
//! [`zeroize::Zeroizing`] buffers from the moment they reach this module (rcgen's PEM,
//! SPIRE's PKCS#8 DER and its PEM re-encoding), so they are wiped when dropped. An
//! issuer key read from a CA directory ([`ca_dir`]) is read into a zeroizing buffer and
//! held by a key pair whose DER copy is wiped when the issuer is replaced.
//!
//! Providers: [`BuiltinCa`] (a node-local CA, or an issuer under a shared root read
//! from a CA directory: [`ca_dir`]) and [`spire::SpireBridge`] (a SPIRE
//! agent's Delegated Identity API, subscribing pods by [`PodIdentity::selectors`]).

mod builtin;
pub mod ca_dir;
pub mod remote;
pub mod signer;
pub mod spire;
mod subscriptions;

pub use builtin::{BuiltinCa, CA_LIFETIME, CLOCK_SKEW, CaReload, MAX_TTL, MIN_TTL, SignedLeaf};
use flock_core::rotation::Issued;
use flock_core::{MonoMs, UnixMs};
pub use remote::{RemoteCa, RemoteCaOptions};
pub use spire::{SpireBridge, SpireOptions};

use crate::model::PodRecord;
use flock_core::pod::PodKey;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use zeroize::Zeroizing;

/// The service account a pod runs as when its record names none (Kubernetes' default).
pub const DEFAULT_SERVICE_ACCOUNT: &str = "default";

/// What the agent knows of a pod for identity (from its [`PodRecord`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodIdentity {
    /// The CNI attachment the subscription is keyed on.
    pub key: PodKey,
    /// Kubernetes namespace.
    pub namespace: String,
    /// Kubernetes service account ([`DEFAULT_SERVICE_ACCOUNT`] if the record has none).
    pub service_account: String,
    /// Kubernetes pod name.
    pub pod_name: String,
    /// Kubernetes pod UID (may be empty).
    pub pod_uid: String,
}

impl PodIdentity {
    /// SPIRE-style workload selectors of the pod (for a future SPIRE bridge).
    pub fn selectors(&self) -> Vec<(String, String)> {
        [
            format!("ns:{}", self.namespace),
            format!("sa:{}", self.service_account),
            format!("pod-name:{}", self.pod_name),
            format!("pod-uid:{}", self.pod_uid),
        ]
        .into_iter()
        .map(|v| ("k8s".to_string(), v))
        .collect()
    }
}

impl From<&PodRecord> for PodIdentity {
    fn from(r: &PodRecord) -> Self {
        // An empty service account means the annotation was absent, and Kubernetes runs
        // such a pod as "default": the identity must say what the pod really is.
        let service_account = if r.service_account.is_empty() {
            DEFAULT_SERVICE_ACCOUNT.to_string()
        } else {
            r.service_account.clone()
        };
        Self {
            key: r.key.clone(),
            namespace: r.namespace.clone(),
            service_account,
            pod_name: r.name.clone(),
            pod_uid: r.uid.clone(),
        }
    }
}

/// A PEM-encoded private key. `Debug` and `Display` print only its length, and it has
/// no `Serialize`, so it cannot reach logs or `/debug/*` output by accident; read it
/// with [`SecretPem::expose`] where it is really needed (the SDS response).
///
/// The text is held in a [`Zeroizing`] buffer: it is overwritten, spare capacity
/// included, when the last copy is dropped (a rotated or unsubscribed SVID), so a later
/// heap dump or a reuse of the allocation does not hold an old key.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretPem(Zeroizing<String>);

impl SecretPem {
    /// Wraps a PEM string. Pass the string the key was first written into: a copy
    /// made before wrapping is not wiped.
    pub fn new(pem: String) -> Self {
        Self(Zeroizing::new(pem))
    }

    /// Wraps PEM text already held in a zeroizing buffer.
    pub fn from_zeroizing(pem: Zeroizing<String>) -> Self {
        Self(pem)
    }

    /// The PEM text. The name is loud on purpose: every call site is a place the key
    /// leaves the wrapper.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Length of the PEM in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the PEM is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for SecretPem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "<redacted {} bytes>", self.0.len())
    }
}

impl fmt::Display for SecretPem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// An X.509-SVID: a leaf certificate whose only URI SAN is the SPIFFE ID, and its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Svid {
    /// The SPIFFE ID (`spiffe://<trust-domain>/ns/<ns>/sa/<sa>`).
    pub spiffe_id: String,
    /// The certificate chain in PEM, leaf first (the root is in the [`Bundle`]).
    pub cert_chain_pem: String,
    /// The leaf's private key (PKCS#8 PEM), redacted when formatted.
    pub private_key_pem: SecretPem,
    /// When the leaf expires (ms since the Unix epoch).
    pub not_after_ms: UnixMs,
    /// When it was issued (ms since the Unix epoch), from the same clock read as
    /// `not_after_ms`: their difference is the lifetime written into the certificate.
    pub issued_ms: UnixMs,
    /// When it was issued on this process's monotonic clock: rotation is scheduled from
    /// it ([`Svid::issued`]), so a step of the wall clock neither makes every SVID due at
    /// once nor postpones rotation by the size of the step.
    pub issued_mono: MonoMs,
    /// The leaf's serial number, lowercase hex.
    pub serial: String,
}

impl Svid {
    /// This issuance as the rotation schedule sees it: due at half the written
    /// lifetime after [`Svid::issued_mono`] ([`flock_core::rotation`]).
    pub fn issued(&self) -> Issued {
        Issued::new(self.issued_mono, self.issued_ms, self.not_after_ms)
    }
}

/// The roots of one trust domain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bundle {
    /// The trust domain (no `spiffe://`).
    pub trust_domain: String,
    /// Its CA certificates in PEM.
    pub ca_pem: String,
}

/// The current identity state, published through a `tokio::sync::watch` channel.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IdentityView {
    /// One SVID per SPIFFE ID that has at least one subscriber. The maps are
    /// persistent: a provider publishes each change as a new view sharing the
    /// unchanged entries, not a copy of every subscription (one per pod).
    pub svids: imbl::OrdMap<String, Arc<Svid>>,
    /// Trust bundles by trust domain.
    pub bundles: BTreeMap<String, Bundle>,
    /// Which SPIFFE ID each subscribed pod has; its journal names the pods whose
    /// subscription changed since an earlier view.
    pub subscriptions: flock_core::journal::Snapshot<PodKey, String>,
    /// Increases on every change of the view, so consumers can tell views apart cheaply.
    pub generation: u64,
}

impl IdentityView {
    /// The SVID of a subscribed pod.
    pub fn svid_of(&self, key: &PodKey) -> Option<&Arc<Svid>> {
        self.subscriptions
            .get(key)
            .and_then(|id| self.svids.get(id))
    }
}

/// Why an identity operation failed. Messages name what was wrong, never key material.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// The trust domain is not a valid SPIFFE trust domain.
    #[error("invalid trust domain {domain:?}: {reason}")]
    InvalidTrustDomain {
        /// The rejected trust domain.
        domain: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A namespace or service account cannot be a SPIFFE ID path segment.
    #[error("invalid {field} {value:?} for a SPIFFE ID: {reason}")]
    InvalidName {
        /// `namespace` or `service account`.
        field: &'static str,
        /// The rejected value.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The SVID lifetime is out of range.
    #[error("invalid SVID ttl: {0}")]
    InvalidTtl(String),
    /// Generating a key or signing a certificate failed.
    #[error("certificate issuance failed: {0}")]
    Issue(String),
    /// The CA directory (`--ca-dir`) was refused: which file, and why.
    #[error("CA directory refused: {0}")]
    CaDir(String),
}

/// A source of workload identities for subscribed pods.
#[async_trait::async_trait]
pub trait IdentityProvider: Send + Sync + 'static {
    /// Subscribes the pod; returns its SPIFFE ID once an SVID for it is in the view.
    /// Subscribing a pod again with a different SPIFFE ID moves its subscription.
    async fn subscribe(&self, pod: &PodIdentity) -> Result<String, IdentityError>;
    /// Drops the pod's subscription; the SVID is dropped when no pod uses it any more.
    /// Idempotent.
    async fn unsubscribe(&self, key: &PodKey);
    /// The current view and its changes.
    fn view(&self) -> tokio::sync::watch::Receiver<Arc<IdentityView>>;
    /// How many SVIDs this provider has signed itself since it started (`None`: it
    /// signs none; SPIRE's are signed by SPIRE). A rotation burst shows here first.
    fn svids_issued(&self) -> Option<u64> {
        None
    }
    /// One line for logs and `/debug`, e.g. `builtin (trust domain X, ttl Ys)`.
    fn describe(&self) -> String;
}

/// `spiffe://<trust_domain>/ns/<namespace>/sa/<service_account>`.
pub fn spiffe_id(trust_domain: &str, namespace: &str, service_account: &str) -> String {
    format!("spiffe://{trust_domain}/ns/{namespace}/sa/{service_account}")
}

/// Checks a trust domain against the SPIFFE spec: lowercase letters, digits, `.`, `-`,
/// `_`; not empty; at most 255 bytes.
pub fn validate_trust_domain(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("empty".to_string());
    }
    if s.len() > 255 {
        return Err(format!("{} bytes long, at most 255 allowed", s.len()));
    }
    match s
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '-' | '_')))
    {
        Some(c) => Err(format!(
            "character {c:?} not allowed (lowercase letters, digits, '.', '-', '_')"
        )),
        None => Ok(()),
    }
}

/// Checks one SPIFFE ID path segment (SPIFFE spec: letters, digits, `.`, `-`, `_`; not
/// empty, `.` or `..`), so a bad name is an error here rather than a bad certificate.
pub fn validate_path_segment(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("empty".to_string());
    }
    if s == "." || s == ".." {
        return Err("a dot segment".to_string());
    }
    match s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_')))
    {
        Some(c) => Err(format!(
            "character {c:?} not allowed (letters, digits, '.', '-', '_')"
        )),
        None => Ok(()),
    }
}
