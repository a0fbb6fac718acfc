//! The node's side: its credential directory and the signer client.
//!
//! The credential is read from its directory at every [`Client::connect`], so a
//! credential renewed on disk (by [`Client::renew_node`], or by an operator) is used
//! from the next connection on, with no restart.

use crate::proto::signer_client::SignerClient;
use crate::proto::{RenewNodeRequest, SignResponse, SignWorkloadRequest};
use crate::{MAX_CSR_BYTES, files};
use rcgen::{CertificateParams, KeyPair, SanType};
use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
use zeroize::Zeroizing;

/// Most bytes of one credential file.
pub const MAX_FILE_BYTES: u64 = 64 * 1024;

/// Why the client failed. Messages name the file or the signer's answer, never key
/// material.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// A credential file is missing, too large or unsafe.
    #[error("node credential {path}: {reason}")]
    Credential {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The signer could not be reached.
    #[error("cannot reach the signer at {url}: {reason}")]
    Connect {
        /// The signer's URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// The signer answered with an error (its code and message).
    #[error("the signer refused: {code:?}: {message}")]
    Refused {
        /// The gRPC code (PERMISSION_DENIED: the check failed).
        code: tonic::Code,
        /// The signer's message (which check).
        message: String,
    },
    /// Making a key or a CSR failed.
    #[error("key or CSR: {0}")]
    Key(String),
}

/// Where the signer is and how to verify it.
#[derive(Debug, Clone)]
pub struct SignerAddress {
    /// `https://host:port`.
    pub url: String,
    /// The DNS name its certificate must carry ([`crate::DEFAULT_SERVER_NAME`]).
    pub server_name: String,
    /// Connect and request time limit.
    pub timeout: Duration,
}

/// A connected signer client, authenticated with the node credential of `dir`.
pub struct Client {
    inner: SignerClient<Channel>,
    dir: PathBuf,
}

fn read_file(dir: &Path, name: &str) -> Result<Zeroizing<String>, ClientError> {
    let path = dir.join(name);
    let err = |reason: String| ClientError::Credential {
        path: path.clone(),
        reason,
    };
    // O_NOFOLLOW: a credential is never read through a link someone else planted.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&path)
        .map_err(|e| err(e.to_string()))?;
    let mut text = Zeroizing::new(String::new());
    use std::io::Read as _;
    file.take(MAX_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| err(e.to_string()))?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(err(format!("larger than {MAX_FILE_BYTES} bytes")));
    }
    Ok(text)
}

impl Client {
    /// Connects to the signer with the credential in `dir` ([`files`]).
    pub async fn connect(addr: &SignerAddress, dir: &Path) -> Result<Self, ClientError> {
        let cert = read_file(dir, files::NODE_CERT)?;
        let key = read_file(dir, files::NODE_KEY)?;
        let bundle = read_file(dir, files::BUNDLE)?;
        let connect_err = |reason: String| ClientError::Connect {
            url: addr.url.clone(),
            reason,
        };
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(bundle.as_bytes()))
            .identity(Identity::from_pem(cert.as_bytes(), key.as_bytes()))
            .domain_name(addr.server_name.clone());
        let channel = Channel::from_shared(addr.url.clone())
            .map_err(|e| connect_err(e.to_string()))?
            .tls_config(tls)
            .map_err(|e| connect_err(e.to_string()))?
            .connect_timeout(addr.timeout)
            .timeout(addr.timeout)
            .connect()
            .await
            .map_err(|e| connect_err(format!("{e}: {}", source_chain(&e))))?;
        Ok(Self {
            inner: SignerClient::new(channel),
            dir: dir.to_path_buf(),
        })
    }

    /// Asks for the workload certificate of pod `namespace/pod_name` (UID `pod_uid`,
    /// may be empty) running as `service_account`, over `key`'s public key.
    pub async fn sign_workload(
        &mut self,
        key: &KeyPair,
        namespace: &str,
        pod_name: &str,
        pod_uid: &str,
        service_account: &str,
    ) -> Result<SignResponse, ClientError> {
        let csr_der = csr(key)?;
        let answer = self
            .inner
            .sign_workload(SignWorkloadRequest {
                csr_der,
                namespace: namespace.to_string(),
                pod_name: pod_name.to_string(),
                pod_uid: pod_uid.to_string(),
                service_account: service_account.to_string(),
            })
            .await
            .map_err(refused)?;
        Ok(answer.into_inner())
    }

    /// Renews this node's credential: a new key, signed by the signer, written over
    /// the directory's files (each replaced atomically, 0600). Returns the new
    /// credential's notAfter (ms since the Unix epoch).
    pub async fn renew_node(&mut self) -> Result<u64, ClientError> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
            .map_err(|e| ClientError::Key(e.to_string()))?;
        let csr_der = csr(&key)?;
        let answer = self
            .inner
            .renew_node(RenewNodeRequest { csr_der })
            .await
            .map_err(refused)?
            .into_inner();
        let key_pem = Zeroizing::new(key.serialize_pem());
        // The key first: a crash between the two leaves the old certificate with the
        // new key, which fails the next TLS handshake loudly (and the operator's
        // `flock-ca node-credential` restores it) rather than silently using a stale
        // pair; the bundle last, as it rarely changes.
        write_private(&self.dir, files::NODE_KEY, key_pem.as_bytes())?;
        write_private(
            &self.dir,
            files::NODE_CERT,
            answer.cert_chain_pem.as_bytes(),
        )?;
        write_private(&self.dir, files::BUNDLE, answer.bundle_pem.as_bytes())?;
        Ok(answer.not_after_ms)
    }
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut out = Vec::new();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push(s.to_string());
        cur = s.source();
    }
    out.join(": ")
}

fn refused(s: tonic::Status) -> ClientError {
    ClientError::Refused {
        code: s.code(),
        message: s.message().to_string(),
    }
}

/// A CSR (DER) over `key`, naming nothing: the signer decides the names.
pub fn csr(key: &KeyPair) -> Result<Vec<u8>, ClientError> {
    let mut params = CertificateParams::default();
    params.subject_alt_names = Vec::<SanType>::new();
    let der = params
        .serialize_request(key)
        .map_err(|e| ClientError::Key(e.to_string()))?
        .der()
        .to_vec();
    if der.len() > MAX_CSR_BYTES {
        return Err(ClientError::Key(format!("CSR is {} bytes", der.len())));
    }
    Ok(der)
}

/// Writes `name` in `dir` as a new 0600 file renamed over the old one, never through a
/// symlink (the temporary name is created exclusively, the rename replaces the
/// directory entry itself).
pub fn write_private(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), ClientError> {
    let path = dir.join(name);
    let tmp = dir.join(format!(".{name}.tmp"));
    let err = |reason: String| ClientError::Credential {
        path: path.clone(),
        reason,
    };
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&tmp)
        .map_err(|e| err(e.to_string()))?;
    f.write_all(bytes).map_err(|e| err(e.to_string()))?;
    f.sync_all().map_err(|e| err(e.to_string()))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| err(e.to_string()))?;
    std::fs::rename(&tmp, &path).map_err(|e| err(e.to_string()))
}
