//! The signer's gRPC service: authenticate the node, check the request, sign.
//!
//! The node is the URI SAN of the client certificate the TLS layer verified against
//! the trust domain's roots ([`node_of_peer`]); a request without one, or with a
//! workload SVID instead of a node credential, is refused before anything is read.
//! What the pod is comes from a [`PodSource`] (the Kubernetes API, or the operator's
//! scope file), never from the node. The signing itself is an [`Issuer`]'s (the
//! flock-ca binary uses flock-bird's built-in CA over a CA directory, which it
//! re-reads when the directory changes: issuer rotation).

use crate::MAX_CSR_BYTES;
use crate::proto::signer_server::{Signer, SignerServer};
use crate::proto::{RenewNodeRequest, SignResponse, SignWorkloadRequest};
use flock_core::issuance::{self, Refusal, Request};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tonic::{Response, Status};

/// A signed certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signed {
    /// Leaf first, up to (not including) the root, PEM.
    pub cert_chain_pem: String,
    /// The roots, PEM.
    pub bundle_pem: String,
    /// The leaf's notAfter, ms since the Unix epoch.
    pub not_after_ms: u64,
}

/// Signs certificates over a CSR's public key.
pub trait Issuer: Send + Sync + 'static {
    /// Signs `csr_der`'s public key (after checking its signature) into a certificate
    /// whose only URI SAN is `spiffe_id`, for the issuer's usual lifetime, or for a
    /// node credential's (`node: true`). The CSR's names are ignored.
    fn sign(&self, csr_der: &[u8], spiffe_id: &str, node: bool) -> Result<Signed, String>;
}

/// Why a pod source could not answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    /// The check failed: the node may not have the certificate.
    #[error("{0}")]
    Refused(#[from] Refusal),
    /// The source is unreachable (the API server is down): retry later.
    #[error("{0}")]
    Unavailable(String),
}

/// Where the signer learns whether a node hosts a pod.
#[async_trait::async_trait]
pub trait PodSource: Send + Sync + 'static {
    /// Whether `node` may have a certificate for `req` ([`flock_core::issuance`]'s
    /// decisions over what the source knows).
    async fn check(&self, node: &str, req: &Request<'_>) -> Result<(), SourceError>;
    /// One line for logs.
    fn describe(&self) -> String;
}

/// The operator's static scope ([`issuance::Scope`]): for nodes without a Kubernetes
/// API.
pub struct ScopeSource(pub issuance::Scope);

#[async_trait::async_trait]
impl PodSource for ScopeSource {
    async fn check(&self, node: &str, req: &Request<'_>) -> Result<(), SourceError> {
        issuance::decide_scope(node, req, &self.0).map_err(SourceError::Refused)
    }

    fn describe(&self) -> String {
        format!("scope file ({} nodes)", self.0.nodes.len())
    }
}

/// Counters of the signer, for its metrics and tests.
#[derive(Debug, Default)]
pub struct Counters {
    /// Workload certificates signed.
    pub signed: AtomicU64,
    /// Node credentials renewed.
    pub renewed: AtomicU64,
    /// Requests refused (unauthenticated, invalid or not allowed).
    pub refused: AtomicU64,
}

/// The signer service.
pub struct SignerService {
    trust_domain: String,
    issuer: Arc<dyn Issuer>,
    pods: Arc<dyn PodSource>,
    counters: Arc<Counters>,
}

impl SignerService {
    /// A service for `trust_domain` signing with `issuer` after asking `pods`.
    pub fn new(trust_domain: &str, issuer: Arc<dyn Issuer>, pods: Arc<dyn PodSource>) -> Self {
        Self {
            trust_domain: trust_domain.to_string(),
            issuer,
            pods,
            counters: Arc::default(),
        }
    }

    /// Its counters.
    pub fn counters(&self) -> Arc<Counters> {
        Arc::clone(&self.counters)
    }

    /// The tonic service, with its message size limit.
    pub fn into_server(self) -> SignerServer<Self> {
        SignerServer::new(self).max_decoding_message_size(MAX_CSR_BYTES + 4096)
    }

    fn refuse(&self, status: Status) -> Status {
        self.counters.refused.fetch_add(1, Ordering::Relaxed);
        status
    }

    fn node<T>(&self, req: &tonic::Request<T>) -> Result<String, Status> {
        let certs = req.peer_certs();
        let leaf = certs.as_ref().and_then(|c| c.first());
        node_of_peer(&self.trust_domain, leaf.map(|c| c.as_ref())).map_err(|e| self.refuse(e))
    }
}

/// The node a verified client certificate (DER) names; `UNAUTHENTICATED` without one,
/// `PERMISSION_DENIED` for a certificate that is not a node credential of the trust
/// domain (a workload SVID cannot ask for certificates).
pub fn node_of_peer(trust_domain: &str, leaf_der: Option<&[u8]>) -> Result<String, Status> {
    let der = leaf_der.ok_or_else(|| {
        Status::unauthenticated(
            "no client certificate: the signer serves only nodes with a node credential",
        )
    })?;
    let uri = uri_san(der)
        .ok_or_else(|| Status::permission_denied("the client certificate has no URI SAN"))?;
    issuance::node_of(trust_domain, &uri).ok_or_else(|| {
        Status::permission_denied(format!(
            "{uri} is not a node credential of trust domain {trust_domain} \
             (spiffe://{trust_domain}/flock/node/<node>)"
        ))
    })
}

/// The one URI SAN of a certificate (DER).
pub fn uri_san(der: &[u8]) -> Option<String> {
    use x509_parser::prelude::{FromDer as _, GeneralName, X509Certificate};
    let (_, cert) = X509Certificate::from_der(der).ok()?;
    let san = cert.subject_alternative_name().ok()??;
    let mut uris = san.value.general_names.iter().filter_map(|n| match n {
        GeneralName::URI(u) => Some(u.to_string()),
        _ => None,
    });
    let first = uris.next()?;
    // X509-SVID: exactly one URI SAN.
    uris.next().is_none().then_some(first)
}

fn check_csr(csr: &[u8]) -> Result<(), Status> {
    if csr.is_empty() || csr.len() > MAX_CSR_BYTES {
        return Err(Status::invalid_argument(format!(
            "csr_der is {} bytes; expected 1 to {MAX_CSR_BYTES}",
            csr.len()
        )));
    }
    Ok(())
}

fn check_names(r: &SignWorkloadRequest) -> Result<(), Status> {
    use flock_core::pod::{check_label, check_subdomain, check_uid};
    let bad =
        |what: &str, v: &str, e: String| Status::invalid_argument(format!("{what} {v:?}: {e}"));
    check_label(&r.namespace).map_err(|e| bad("namespace", &r.namespace, e))?;
    check_subdomain(&r.pod_name).map_err(|e| bad("pod_name", &r.pod_name, e))?;
    check_subdomain(&r.service_account)
        .map_err(|e| bad("service_account", &r.service_account, e))?;
    if !r.pod_uid.is_empty() {
        check_uid(&r.pod_uid).map_err(|e| bad("pod_uid", &r.pod_uid, e))?;
    }
    Ok(())
}

fn response(s: Signed) -> Response<SignResponse> {
    Response::new(SignResponse {
        cert_chain_pem: s.cert_chain_pem,
        bundle_pem: s.bundle_pem,
        not_after_ms: s.not_after_ms,
    })
}

#[tonic::async_trait]
impl Signer for SignerService {
    async fn sign_workload(
        &self,
        req: tonic::Request<SignWorkloadRequest>,
    ) -> Result<Response<SignResponse>, Status> {
        let node = self.node(&req)?;
        let r = req.into_inner();
        check_csr(&r.csr_der).map_err(|e| self.refuse(e))?;
        check_names(&r).map_err(|e| self.refuse(e))?;
        let ask = Request {
            namespace: &r.namespace,
            pod_name: &r.pod_name,
            pod_uid: &r.pod_uid,
            service_account: &r.service_account,
        };
        match self.pods.check(&node, &ask).await {
            Ok(()) => {}
            Err(SourceError::Refused(why)) => {
                tracing::warn!(%node, namespace = %r.namespace, pod = %r.pod_name, reason = %why, "refused a workload certificate");
                return Err(self.refuse(Status::permission_denied(why.to_string())));
            }
            Err(SourceError::Unavailable(why)) => {
                return Err(Status::unavailable(format!(
                    "cannot check pod {}/{}: {why}",
                    r.namespace, r.pod_name
                )));
            }
        }
        let id = format!(
            "spiffe://{}/ns/{}/sa/{}",
            self.trust_domain, r.namespace, r.service_account
        );
        let signed = self
            .issuer
            .sign(&r.csr_der, &id, false)
            .map_err(|e| self.refuse(Status::invalid_argument(e)))?;
        self.counters.signed.fetch_add(1, Ordering::Relaxed);
        tracing::info!(%node, spiffe_id = %id, pod = %format!("{}/{}", r.namespace, r.pod_name), "signed a workload certificate");
        Ok(response(signed))
    }

    async fn renew_node(
        &self,
        req: tonic::Request<RenewNodeRequest>,
    ) -> Result<Response<SignResponse>, Status> {
        let node = self.node(&req)?;
        let r = req.into_inner();
        check_csr(&r.csr_der).map_err(|e| self.refuse(e))?;
        let id = issuance::node_id(&self.trust_domain, &node);
        let signed = self
            .issuer
            .sign(&r.csr_der, &id, true)
            .map_err(|e| self.refuse(Status::invalid_argument(e)))?;
        self.counters.renewed.fetch_add(1, Ordering::Relaxed);
        tracing::info!(%node, "renewed a node credential");
        Ok(response(signed))
    }
}
