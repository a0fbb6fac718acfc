//! The `flock-ca` provider: SVIDs signed by the node-scoped signer, keys made here.
//!
//! The node holds no issuer key. For each SPIFFE ID with a subscriber it generates a
//! key (in memory only), sends a CSR naming one of that identity's pods to the signer
//! (`flock-ca`), authenticated by its node credential, and gets the certificate only if
//! the signer finds the pod on this node, running as that account. Rotation at half
//! the written lifetime (on the monotonic clock) asks again with a pod that still
//! holds the identity; the node credential itself is renewed through the signer at
//! half its life. What this node's root can steal is its own pods' identities and its
//! own node credential, nothing else.

use super::subscriptions::Subscriptions;
use super::{
    Bundle, IdentityError, IdentityProvider, IdentityView, PodIdentity, SecretPem, Svid, spiffe_id,
    validate_path_segment,
};
use flock_ca::client::{Client, SignerAddress};
use flock_core::pod::PodKey;
use flock_core::sync::Mutex;
use flock_core::{MonoMs, UnixMs};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::watch;

/// Where the signer is and the node credential that authenticates this node.
#[derive(Debug, Clone)]
pub struct RemoteCaOptions {
    /// The trust domain of the SVIDs.
    pub trust_domain: String,
    /// The signer.
    pub signer: SignerAddress,
    /// The node credential directory (node-cert.pem, node-key.pem, bundle.pem).
    pub credential_dir: PathBuf,
}

/// The `flock-ca` identity provider (see the module docs).
pub struct RemoteCa {
    opts: RemoteCaOptions,
    state: Mutex<State>,
    tx: watch::Sender<Arc<IdentityView>>,
    signed: AtomicU64,
}

struct State {
    subscriptions: Subscriptions,
    /// Each subscribed pod's facts: a rotation asks with one of the identity's pods.
    pods: HashMap<PodKey, PodIdentity>,
    svids: imbl::OrdMap<String, Arc<Svid>>,
    bundle: Option<Bundle>,
    generation: u64,
}

fn remote_error(e: impl std::fmt::Display) -> IdentityError {
    IdentityError::Issue(format!("flock-ca: {e}"))
}

impl RemoteCa {
    /// A provider asking the signer in `opts`; checks that the node credential is
    /// readable now (the agent refuses to start without one).
    pub fn new(opts: RemoteCaOptions) -> Result<Arc<Self>, IdentityError> {
        super::validate_trust_domain(&opts.trust_domain).map_err(|reason| {
            IdentityError::InvalidTrustDomain {
                domain: opts.trust_domain.clone(),
                reason,
            }
        })?;
        for f in [
            flock_ca::files::NODE_CERT,
            flock_ca::files::NODE_KEY,
            flock_ca::files::BUNDLE,
        ] {
            let path = opts.credential_dir.join(f);
            if let Err(e) = std::fs::metadata(&path) {
                return Err(remote_error(format!(
                    "node credential {}: {e} (make one with `flock-ca node-credential`)",
                    path.display()
                )));
            }
        }
        let (tx, _) = watch::channel(Arc::new(IdentityView::default()));
        Ok(Arc::new(Self {
            opts,
            state: Mutex::new(State {
                subscriptions: Subscriptions::new(),
                pods: HashMap::new(),
                svids: imbl::OrdMap::new(),
                bundle: None,
                generation: 0,
            }),
            tx,
            signed: AtomicU64::new(0),
        }))
    }

    /// Asks the signer for `pod`'s identity over a new key.
    async fn sign(&self, id: &str, pod: &PodIdentity) -> Result<(Svid, Bundle), IdentityError> {
        let key =
            rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(remote_error)?;
        let mut client = Client::connect(&self.opts.signer, &self.opts.credential_dir)
            .await
            .map_err(remote_error)?;
        let issued_mono: MonoMs = flock_clock::mono_now();
        let issued_ms: UnixMs = flock_clock::unix_now();
        let answer = client
            .sign_workload(
                &key,
                &pod.namespace,
                &pod.pod_name,
                &pod.pod_uid,
                &pod.service_account,
            )
            .await
            .map_err(remote_error)?;
        // The signer is trusted to sign, not to choose the name: the leaf must name
        // exactly the identity asked for.
        let leaf = first_cert(&answer.cert_chain_pem)
            .ok_or_else(|| remote_error("the answer holds no certificate"))?;
        match flock_ca::server::uri_san(&leaf) {
            Some(uri) if uri == id => {}
            other => {
                return Err(remote_error(format!(
                    "the signer returned a certificate for {other:?}, not {id}"
                )));
            }
        }
        super::ca_dir::verify_svid_chain(&answer.cert_chain_pem, &answer.bundle_pem, issued_ms)
            .map_err(|e| remote_error(format!("the signed certificate does not verify: {e}")))?;
        self.signed.fetch_add(1, Ordering::Relaxed);
        let svid = Svid {
            spiffe_id: id.to_string(),
            cert_chain_pem: answer.cert_chain_pem,
            private_key_pem: SecretPem::new(key.serialize_pem()),
            not_after_ms: UnixMs(answer.not_after_ms),
            issued_ms,
            issued_mono,
            serial: serial_of(&leaf),
        };
        let bundle = Bundle {
            trust_domain: self.opts.trust_domain.clone(),
            ca_pem: answer.bundle_pem,
        };
        Ok((svid, bundle))
    }

    fn publish(&self, state: &mut State) {
        state.generation += 1;
        let mut bundles = BTreeMap::new();
        if let Some(b) = &state.bundle {
            bundles.insert(b.trust_domain.clone(), b.clone());
        }
        self.tx.send_replace(Arc::new(IdentityView {
            svids: state.svids.clone(),
            bundles,
            subscriptions: state.subscriptions.snapshot(),
            generation: state.generation,
        }));
    }

    /// Keeps `svid` for `id` if a pod still holds the identity (a pod that left while
    /// the signer answered must not leave its SVID behind).
    fn keep(&self, id: &str, svid: Svid, bundle: Bundle) -> bool {
        let mut state = self.state.lock();
        if !state.subscriptions.has_subscribers(id) {
            return false;
        }
        state.svids.insert(id.to_string(), Arc::new(svid));
        state.bundle = Some(bundle);
        self.publish(&mut state);
        true
    }

    /// Rotates every SVID past half its lifetime, asking with one of its pods; returns
    /// how many were rotated. A failure keeps the old SVID (valid for the other half of
    /// its life) and is retried next round.
    pub async fn rotate_due(&self) -> usize {
        let now = flock_clock::mono_now();
        let due: Vec<(String, PodIdentity)> = {
            let state = self.state.lock();
            state
                .svids
                .values()
                .filter(|s| s.issued().due(now))
                .filter_map(|s| {
                    let pod = state
                        .pods
                        .iter()
                        .find(|(k, _)| state.subscriptions.get(k) == Some(&s.spiffe_id))?;
                    Some((s.spiffe_id.clone(), pod.1.clone()))
                })
                .collect()
        };
        let mut rotated = 0;
        for (id, pod) in due {
            match self.sign(&id, &pod).await {
                Ok((svid, bundle)) => {
                    tracing::info!(spiffe_id = %id, serial = %svid.serial, "rotated SVID (flock-ca)");
                    rotated += usize::from(self.keep(&id, svid, bundle));
                }
                Err(e) => {
                    tracing::warn!(spiffe_id = %id, error = %e, "SVID rotation failed; the current SVID stays")
                }
            }
        }
        rotated
    }

    /// When the next SVID is due, on the monotonic clock.
    pub fn next_rotation(&self) -> Option<MonoMs> {
        self.state
            .lock()
            .svids
            .values()
            .map(|s| s.issued().rotation_at())
            .min()
    }

    /// Renews the node credential if it is past half its life; `Ok(true)` if renewed.
    pub async fn renew_node_if_due(&self) -> Result<bool, IdentityError> {
        let path = self.opts.credential_dir.join(flock_ca::files::NODE_CERT);
        let pem = std::fs::read_to_string(&path)
            .map_err(|e| remote_error(format!("{}: {e}", path.display())))?;
        let (from, to) = validity(&pem)
            .ok_or_else(|| remote_error(format!("{}: not a certificate", path.display())))?;
        let now = flock_clock::unix_now().as_millis();
        if now < from + (to.saturating_sub(from)) / 2 {
            return Ok(false);
        }
        let mut client = Client::connect(&self.opts.signer, &self.opts.credential_dir)
            .await
            .map_err(remote_error)?;
        let until = client.renew_node().await.map_err(remote_error)?;
        tracing::info!(not_after_ms = until, "renewed the node credential");
        Ok(true)
    }

    /// Rotates SVIDs and renews the node credential forever (sleeping at most
    /// `max_sleep` between rounds). Spawn it; abort the task to stop it.
    pub async fn run_rotation(self: Arc<Self>, max_sleep: Duration) {
        let max_ms = u64::try_from(max_sleep.as_millis()).unwrap_or(u64::MAX);
        loop {
            let rotated = self.rotate_due().await;
            if let Err(e) = self.renew_node_if_due().await {
                tracing::warn!(error = %e, "node credential renewal failed; retrying");
            }
            let wait = flock_core::rotation::next_wake_ms(
                self.next_rotation(),
                flock_clock::mono_now(),
                rotated,
                max_ms,
                1000,
            );
            tokio::time::sleep(Duration::from_millis(wait)).await;
        }
    }
}

fn first_cert(chain_pem: &str) -> Option<Vec<u8>> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(chain_pem.as_bytes()).ok()?;
    Some(pem.contents)
}

fn serial_of(der: &[u8]) -> String {
    use x509_parser::prelude::{FromDer as _, X509Certificate};
    X509Certificate::from_der(der)
        .map(|(_, c)| c.raw_serial().iter().map(|b| format!("{b:02x}")).collect())
        .unwrap_or_default()
}

/// A certificate's (notBefore, notAfter) in ms since the Unix epoch.
fn validity(pem: &str) -> Option<(u64, u64)> {
    use x509_parser::prelude::{FromDer as _, X509Certificate};
    let der = first_cert(pem)?;
    let (_, c) = X509Certificate::from_der(&der).ok()?;
    let ms = |t: x509_parser::time::ASN1Time| u64::try_from(t.timestamp()).ok().map(|s| s * 1000);
    Some((ms(c.validity().not_before)?, ms(c.validity().not_after)?))
}

#[async_trait::async_trait]
impl IdentityProvider for RemoteCa {
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
        let id = spiffe_id(
            &self.opts.trust_domain,
            &pod.namespace,
            &pod.service_account,
        );
        {
            let mut state = self.state.lock();
            if state.svids.contains_key(&id) {
                state.pods.insert(pod.key.clone(), pod.clone());
                if state.subscriptions.get(&pod.key) != Some(&id) {
                    if let Some(left) = state.subscriptions.insert(pod.key.clone(), id.clone())
                        && left.last
                    {
                        state.svids.remove(&left.id);
                    }
                    self.publish(&mut state);
                }
                return Ok(id);
            }
        }
        // Sign outside the lock (a network round trip), then subscribe and keep it in
        // one step: a pod that failed to get an identity is not subscribed.
        let (svid, bundle) = self.sign(&id, pod).await?;
        tracing::info!(spiffe_id = %id, serial = %svid.serial, not_after_ms = svid.not_after_ms.as_millis(), "issued SVID (flock-ca)");
        let mut state = self.state.lock();
        state.pods.insert(pod.key.clone(), pod.clone());
        // Two pods of one identity may both have asked; the first answer stays.
        if !state.svids.contains_key(&id) {
            state.svids.insert(id.clone(), Arc::new(svid));
        }
        state.bundle = Some(bundle);
        if let Some(left) = state.subscriptions.insert(pod.key.clone(), id.clone())
            && left.last
        {
            state.svids.remove(&left.id);
        }
        self.publish(&mut state);
        Ok(id)
    }

    async fn unsubscribe(&self, key: &PodKey) {
        let mut state = self.state.lock();
        state.pods.remove(key);
        let Some(left) = state.subscriptions.remove(key) else {
            return;
        };
        if left.last {
            state.svids.remove(&left.id);
            tracing::info!(spiffe_id = %left.id, "dropped SVID (no subscriber left)");
        }
        self.publish(&mut state);
    }

    fn view(&self) -> watch::Receiver<Arc<IdentityView>> {
        self.tx.subscribe()
    }

    fn describe(&self) -> String {
        format!(
            "flock-ca (signer {}, trust domain {}, node credential {})",
            self.opts.signer.url,
            self.opts.trust_domain,
            self.opts.credential_dir.display()
        )
    }
}
