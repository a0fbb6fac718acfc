//! A shared trust root for the built-in CA: the issuer, its chain and the trust anchors
//! read from a directory (`--ca-dir`), in the layout of a Kubernetes Secret like
//! Istio's `cacerts`:
//!
//! | file | what |
//! |---|---|
//! | `ca-cert.pem` | this node's issuer (usually an intermediate) |
//! | `ca-key.pem` | its private key (PKCS#8 PEM) |
//! | `cert-chain.pem` | optional: issuer → … → root; what is not a root is sent after each leaf |
//! | `root-cert.pem` | the trust anchors: one or more roots (old and new during a rotation) |
//!
//! A set is accepted only whole: the key matches the issuer's certificate, the issuer is
//! a CA allowed to sign certificates, it and the chain sent after each leaf are valid
//! now, and a leaf it signs verifies —
//! with webpki, as a TLS peer verifies it — against the roots of `root-cert.pem`
//! through the chain. [`IssuerSet`] is the accepted set; [`BuiltinCa`] signs with it
//! and serves `root-cert.pem` as the trust bundle.
//!
//! [`BuiltinCa`]: super::BuiltinCa

use super::{IdentityError, SecretPem};
use flock_core::UnixMs;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, PKCS_ECDSA_P256_SHA256, PublicKeyData, SanType, SignatureAlgorithm,
    SigningKey,
};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use sha2::{Digest, Sha256};
use std::fmt;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use x509_parser::prelude::{FromDer as _, X509Certificate};
use zeroize::Zeroizing;

/// This node's issuer certificate.
pub const CA_CERT_FILE: &str = "ca-cert.pem";
/// The issuer's private key (PKCS#8).
pub const CA_KEY_FILE: &str = "ca-key.pem";
/// The issuer's chain up to (and maybe including) a root.
pub const CERT_CHAIN_FILE: &str = "cert-chain.pem";
/// The trust anchors.
pub const ROOT_CERT_FILE: &str = "root-cert.pem";
/// The root's private key, in a directory `flock-agent ca init` writes (never in a
/// `--ca-dir`).
pub const ROOT_KEY_FILE: &str = "root-key.pem";

/// Largest file read from a CA directory: a chain of a few certificates is a few KiB.
const MAX_FILE_BYTES: u64 = 256 * 1024;
/// Most certificates read from one file.
const MAX_CERTS_PER_FILE: usize = 16;

/// Why a CA directory (or a file in it) was refused. Names the file and the reason,
/// never key material.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {reason}", path.display())]
pub struct CaDirError {
    /// The directory or file at fault.
    pub path: PathBuf,
    /// What is wrong.
    pub reason: String,
}

fn err(path: &Path, reason: impl Into<String>) -> CaDirError {
    CaDirError {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// A CA private key: rcgen's key pair, whose DER copy is wiped when it is dropped (a
/// replaced issuer's key does not linger in freed memory). ring's own expanded key
/// inside it is out of our reach.
pub(crate) struct CaKey(KeyPair);

impl CaKey {
    pub(crate) fn generate() -> Result<Self, IdentityError> {
        KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)
            .map(Self)
            .map_err(|e| IdentityError::Issue(e.to_string()))
    }

    /// The key's PKCS#8 PEM, straight into a wiping buffer.
    pub(crate) fn pem(&self) -> SecretPem {
        SecretPem::new(self.0.serialize_pem())
    }
}

impl Drop for CaKey {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.0);
    }
}

impl PublicKeyData for CaKey {
    fn der_bytes(&self) -> &[u8] {
        self.0.der_bytes()
    }
    fn algorithm(&self) -> &'static SignatureAlgorithm {
        self.0.algorithm()
    }
}

impl SigningKey for CaKey {
    fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, rcgen::Error> {
        self.0.sign(msg)
    }
}

/// An accepted issuer: what the built-in CA signs with and serves as its bundle.
pub struct IssuerSet {
    pub(crate) issuer: Issuer<'static, CaKey>,
    /// PEM sent after every leaf: the issuer and its intermediates, never a root (a
    /// peer has the roots; an issuer that is itself a root sends nothing).
    pub(crate) chain_pem: String,
    /// The trust anchors in PEM, one or more.
    pub(crate) roots_pem: String,
    /// No leaf outlives the first certificate of its chain to expire.
    pub(crate) not_after_ms: UnixMs,
    /// SHA-256 over the files it was read from (`None`: generated in memory).
    pub(crate) fingerprint: Option<[u8; 32]>,
    description: String,
}

impl fmt::Debug for IssuerSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // By hand: the issuer holds the CA key.
        f.debug_struct("IssuerSet")
            .field("description", &self.description)
            .field("not_after_ms", &self.not_after_ms)
            .finish_non_exhaustive()
    }
}

impl IssuerSet {
    /// One line for logs: the issuer's subject, how many roots, when it expires.
    pub fn describe(&self) -> &str {
        &self.description
    }

    /// The trust anchors (PEM), as served in the trust bundle.
    pub fn roots_pem(&self) -> &str {
        &self.roots_pem
    }

    /// The certificates sent after each leaf (PEM; empty when the issuer is a root).
    pub fn chain_pem(&self) -> &str {
        &self.chain_pem
    }

    /// When the issuer (or an intermediate above it) expires.
    pub fn not_after_ms(&self) -> UnixMs {
        self.not_after_ms
    }

    /// A node-local self-signed CA (the default without `--ca-dir`): the issuer is its
    /// own root, valid `[now - skew, not_after]`.
    pub(crate) fn self_signed(
        trust_domain: &str,
        now: UnixMs,
        skew: Duration,
        not_after: UnixMs,
    ) -> Result<Self, IdentityError> {
        let key = CaKey::generate()?;
        // The key's hash in the name: two nodes' CAs never share a subject, so a peer
        // of another node fails with "unknown issuer", not a confusing bad signature.
        let mut params = ca_params(
            format!("flock node CA {trust_domain} {}", key_tag(&key)),
            Some(0),
        );
        set_validity(
            &mut params,
            UnixMs(now.as_millis().saturating_sub(skew.as_millis() as u64)),
            not_after,
        );
        let cert = params
            .self_signed(&key)
            .map_err(|e| IdentityError::Issue(e.to_string()))?;
        Ok(Self {
            issuer: Issuer::new(params, key),
            chain_pem: String::new(),
            roots_pem: cert.pem(),
            not_after_ms: not_after,
            fingerprint: None,
            description: format!("node-local CA {trust_domain} (self-signed, in memory)"),
        })
    }
}

/// Parameters of a CA certificate: `O=flock, CN=<cn>`, signing certificates and CRLs,
/// `path_len` CAs below it at most (`None`: unconstrained).
pub(crate) fn ca_params(cn: String, path_len: Option<u8>) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::OrganizationName, "flock");
    params.distinguished_name.push(DnType::CommonName, cn);
    params.is_ca = IsCa::Ca(match path_len {
        Some(n) => BasicConstraints::Constrained(n),
        None => BasicConstraints::Unconstrained,
    });
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params.use_authority_key_identifier_extension = true;
    params
}

/// Sets a certificate's validity to `[from, to]`.
///
/// rcgen takes `time::OffsetDateTime`; building it from rcgen's own epoch value (and
/// `+ std::time::Duration`) keeps this crate free of a direct `time` dependency and of
/// any version skew with rcgen's.
pub(crate) fn set_validity(params: &mut CertificateParams, from: UnixMs, to: UnixMs) {
    let epoch = rcgen::date_time_ymd(1970, 1, 1);
    params.not_before = epoch + Duration::from_millis(from.as_millis());
    params.not_after = epoch + Duration::from_millis(to.as_millis());
}

/// The raw files of a CA directory, the key in a wiping buffer: what [`validate`]
/// judges. [`CaDirFiles::read`] reads them from the directory;
/// [`CaDirFiles::from_contents`] takes them as bytes (the fuzz target's way in).
pub struct CaDirFiles {
    dir: PathBuf,
    ca_cert: Vec<u8>,
    ca_key: Zeroizing<Vec<u8>>,
    cert_chain: Option<Vec<u8>>,
    root_cert: Vec<u8>,
}

impl CaDirFiles {
    /// The files' contents as given; `dir` only names the files in errors. Nothing is
    /// checked here: [`validate`] checks everything, the sizes included.
    pub fn from_contents(
        dir: &Path,
        ca_cert: Vec<u8>,
        ca_key: Zeroizing<Vec<u8>>,
        cert_chain: Option<Vec<u8>>,
        root_cert: Vec<u8>,
    ) -> Self {
        Self {
            dir: dir.to_path_buf(),
            ca_cert,
            ca_key,
            cert_chain,
            root_cert,
        }
    }

    /// Reads the four files (following symlinks: a mounted Secret's files are symlinks
    /// into its `..data` directory). `cert-chain.pem` may be absent.
    pub fn read(dir: &Path) -> Result<Self, CaDirError> {
        let ca_key = Zeroizing::new(read_limited(&dir.join(CA_KEY_FILE))?);
        let chain_path = dir.join(CERT_CHAIN_FILE);
        let cert_chain = match std::fs::symlink_metadata(&chain_path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            _ => Some(read_limited(&chain_path)?),
        };
        Ok(Self {
            dir: dir.to_path_buf(),
            ca_cert: read_limited(&dir.join(CA_CERT_FILE))?,
            ca_key,
            cert_chain,
            root_cert: read_limited(&dir.join(ROOT_CERT_FILE))?,
        })
    }

    /// SHA-256 over every file, to tell a changed set from a re-read of the same one.
    pub(crate) fn fingerprint(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        for part in [
            Some(&self.ca_cert),
            Some(&*self.ca_key),
            self.cert_chain.as_ref(),
            Some(&self.root_cert),
        ] {
            // Length-prefixed, so moving bytes from one file to the next changes it.
            let bytes = part.map_or(&[][..], |b| b.as_slice());
            h.update((part.is_some() as u8).to_be_bytes());
            h.update((bytes.len() as u64).to_be_bytes());
            h.update(bytes);
        }
        h.finalize().into()
    }
}

fn read_limited(path: &Path) -> Result<Vec<u8>, CaDirError> {
    let file = std::fs::File::open(path).map_err(|e| err(path, format!("cannot read: {e}")))?;
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| err(path, format!("cannot read: {e}")))?;
    check_size(path, &bytes)?;
    Ok(bytes)
}

fn check_size(path: &Path, bytes: &[u8]) -> Result<(), CaDirError> {
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(err(
            path,
            format!("larger than {MAX_FILE_BYTES} bytes: not a certificate or key file"),
        ));
    }
    Ok(())
}

/// Most characters of a certificate subject quoted in an error or a description: a
/// subject is as long as its file lets it be, and a log line needs far less.
const MAX_SUBJECT_CHARS: usize = 256;

/// A certificate's subject (RFC 4514), cut at [`MAX_SUBJECT_CHARS`] with `...`.
fn subject_of(cert: &X509Certificate<'_>) -> String {
    let full = cert.subject().to_string();
    if full.chars().count() <= MAX_SUBJECT_CHARS {
        return full;
    }
    let mut out: String = full.chars().take(MAX_SUBJECT_CHARS - 3).collect();
    out.push_str("...");
    out
}

fn parse_certs(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, CaDirError> {
    let mut certs = Vec::new();
    for cert in CertificateDer::pem_slice_iter(pem) {
        let cert = cert.map_err(|e| err(path, format!("not valid PEM: {e}")))?;
        if certs.len() == MAX_CERTS_PER_FILE {
            return Err(err(
                path,
                format!("more than {MAX_CERTS_PER_FILE} certificates"),
            ));
        }
        certs.push(cert);
    }
    if certs.is_empty() {
        return Err(err(path, "no CERTIFICATE block"));
    }
    Ok(certs)
}

/// Loads a CA private key from PEM (PKCS#8 only: ring, rustls' crypto provider here,
/// signs with nothing else).
pub(crate) fn parse_key(path: &Path, pem: &[u8]) -> Result<CaKey, CaDirError> {
    let key = Zeroizing::new(PrivateKeyDer::from_pem_slice(pem).map_err(|e| {
        err(
            path,
            format!("no private key: {e} (expected a PKCS#8 `BEGIN PRIVATE KEY` block)"),
        )
    })?);
    let PrivateKeyDer::Pkcs8(pkcs8) = &*key else {
        return Err(err(
            path,
            "only PKCS#8 keys (`BEGIN PRIVATE KEY`) are supported; convert with \
             `openssl pkcs8 -topk8 -nocrypt -in KEY -out KEY.pk8`",
        ));
    };
    KeyPair::try_from(pkcs8)
        .map(CaKey)
        .map_err(|e| err(path, format!("unusable key: {e}")))
}

fn parse_x509<'a>(path: &Path, der: &'a [u8]) -> Result<X509Certificate<'a>, CaDirError> {
    let cert = X509Certificate::from_der(der)
        .map(|(_, c)| c)
        .map_err(|e| err(path, format!("not an X.509 certificate: {e}")))?;
    // Signing writes the issuer's subject into every certificate it signs, and the DER
    // writer panics on an attribute type OID it cannot encode (a first arc above 2, a
    // second arc of 40 or more under arc 0 or 1, an arc beyond 64 bits) — which BER
    // parsing accepts. Refused here, for every certificate the directory holds.
    for attr in cert.subject().iter_attributes() {
        let oid = attr.attr_type();
        let arcs: Option<Vec<u64>> = oid.iter().map(Iterator::collect);
        let encodable = arcs.is_some_and(|a| {
            a.len() >= 2 && a[0] < 3 && (a[0] == 2 || a[1] < 40) && a[1] < u64::MAX - 80
        });
        if !encodable {
            return Err(err(
                path,
                format!("its subject has an attribute type {oid} that DER cannot encode"),
            ));
        }
    }
    Ok(cert)
}

fn unix_ms_of(t: x509_parser::time::ASN1Time) -> UnixMs {
    UnixMs(
        u64::try_from(t.timestamp())
            .unwrap_or(0)
            .saturating_mul(1000),
    )
}

/// The PEM of a DER certificate.
pub fn cert_pem(der: &[u8]) -> String {
    // LF line ends, like openssl and every PEM file a Secret is made from.
    pem::encode_config(
        &pem::Pem::new("CERTIFICATE", der.to_vec()),
        pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF),
    )
}

/// Reads and fully validates a CA directory at `now` (see the module docs), for SVIDs
/// in `trust_domain`.
pub fn load_ca_dir(dir: &Path, trust_domain: &str, now: UnixMs) -> Result<IssuerSet, CaDirError> {
    validate(CaDirFiles::read(dir)?, trust_domain, now)
}

/// Validates a CA directory's files at `now` (see the module docs), for SVIDs in
/// `trust_domain`: the set whole, or the first problem, naming its file.
pub fn validate(
    files: CaDirFiles,
    trust_domain: &str,
    now: UnixMs,
) -> Result<IssuerSet, CaDirError> {
    let dir = &files.dir;
    let cert_path = dir.join(CA_CERT_FILE);
    let key_path = dir.join(CA_KEY_FILE);
    let chain_path = dir.join(CERT_CHAIN_FILE);
    let root_path = dir.join(ROOT_CERT_FILE);
    for (path, bytes) in [
        (&cert_path, Some(&files.ca_cert)),
        (&key_path, Some(&*files.ca_key)),
        (&chain_path, files.cert_chain.as_ref()),
        (&root_path, Some(&files.root_cert)),
    ] {
        if let Some(bytes) = bytes {
            check_size(path, bytes)?;
        }
    }
    let fingerprint = files.fingerprint();

    let issuer_certs = parse_certs(&cert_path, &files.ca_cert)?;
    let issuer_der = &issuer_certs[0];
    let issuer = parse_x509(&cert_path, issuer_der)?;
    let roots = parse_certs(&root_path, &files.root_cert)?;
    for root in &roots {
        let parsed = parse_x509(&root_path, root)?;
        if !parsed.is_ca() {
            return Err(err(
                &root_path,
                format!("{} is not a CA certificate", subject_of(&parsed)),
            ));
        }
    }
    let key = parse_key(&key_path, &files.ca_key)?;

    // The key must be the issuer certificate's: otherwise every leaf would carry a
    // signature no peer can verify.
    if key.der_bytes() != &*issuer.public_key().subject_public_key.data {
        return Err(err(
            &key_path,
            format!(
                "does not match the public key of {CA_CERT_FILE} ({})",
                subject_of(&issuer)
            ),
        ));
    }
    if !issuer.is_ca() {
        return Err(err(
            &cert_path,
            format!(
                "{} is not a CA certificate (basicConstraints cA is not set): it cannot issue SVIDs",
                subject_of(&issuer)
            ),
        ));
    }
    match issuer.key_usage() {
        Ok(Some(ku)) if !ku.value.key_cert_sign() => {
            return Err(err(
                &cert_path,
                format!(
                    "{} may not sign certificates (keyUsage lacks keyCertSign)",
                    subject_of(&issuer)
                ),
            ));
        }
        Err(e) => return Err(err(&cert_path, format!("unreadable keyUsage: {e}"))),
        // No keyUsage extension: any use, keyCertSign included (RFC 5280 4.2.1.3).
        Ok(_) => {}
    }
    let now_secs = i64::try_from(now.as_millis() / 1000).unwrap_or(i64::MAX);
    let at_now = x509_parser::time::ASN1Time::from_timestamp(now_secs)
        .map_err(|e| err(dir, format!("bad clock: {e}")))?;
    if !issuer.validity().is_valid_at(at_now) {
        return Err(err(
            &cert_path,
            format!(
                "{} is not valid now (valid {} to {})",
                subject_of(&issuer),
                issuer.validity().not_before,
                issuer.validity().not_after
            ),
        ));
    }

    // What follows each leaf: the issuer, then cert-chain.pem's certificates that are
    // neither the issuer again nor a root (Istio's cert-chain.pem is issuer → root).
    let mut chain: Vec<CertificateDer<'static>> = Vec::new();
    let issuer_is_root = roots.iter().any(|r| r == issuer_der);
    if !issuer_is_root {
        chain.push(issuer_der.clone());
    }
    if let Some(bytes) = &files.cert_chain {
        for cert in parse_certs(&chain_path, bytes)? {
            if cert != *issuer_der && !roots.contains(&cert) && !chain.contains(&cert) {
                chain.push(cert);
            }
        }
    }
    let mut not_after = unix_ms_of(issuer.validity().not_after);
    for cert in &chain {
        let parsed = parse_x509(&chain_path, cert)?;
        // Checked here, not left to the probe below: path building skips a certificate
        // it does not need, so an expired one would pass the probe, be sent after
        // every leaf, and end every leaf at its own past expiry.
        if !parsed.validity().is_valid_at(at_now) {
            return Err(err(
                &chain_path,
                format!(
                    "{} is not valid now (valid {} to {})",
                    subject_of(&parsed),
                    parsed.validity().not_before,
                    parsed.validity().not_after
                ),
            ));
        }
        not_after = not_after.min(unix_ms_of(parsed.validity().not_after));
    }

    let set = IssuerSet {
        issuer: Issuer::from_ca_cert_der(issuer_der, key)
            .map_err(|e| err(&cert_path, format!("unusable as an issuer: {e}")))?,
        chain_pem: chain.iter().map(|c| cert_pem(c)).collect(),
        roots_pem: roots.iter().map(|c| cert_pem(c)).collect(),
        not_after_ms: not_after,
        fingerprint: Some(fingerprint),
        description: format!(
            "issuer {} ({} CA certificate(s) sent after each leaf, {} root(s) trusted), until {}",
            subject_of(&issuer),
            chain.len(),
            roots.len(),
            issuer.validity().not_after
        ),
    };

    // The proof: a leaf this set signs verifies against its roots the way a TLS peer
    // checks a client certificate (webpki path building, signatures, validity, CA
    // constraints, key usage).
    let probe_id = format!("spiffe://{trust_domain}/flock/ca-probe");
    let probe_key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)
        .map_err(|e| err(dir, format!("cannot generate a key: {e}")))?;
    let probe = sign_leaf(
        &set,
        &probe_key,
        &probe_id,
        &[],
        (now, now.plus(60_000)),
        &[0x40; 16],
    )
    .map_err(|e| err(dir, format!("cannot sign with this issuer: {e}")))?;
    verify_chain(&probe, &set.chain_pem, &set.roots_pem, now).map_err(|reason| {
        err(
            dir,
            format!(
                "a certificate signed by {CA_CERT_FILE} does not verify against {ROOT_CERT_FILE} \
                 through {CERT_CHAIN_FILE}: {reason}"
            ),
        )
    })?;
    Ok(set)
}

/// Signs a leaf (X.509-SVID: one URI SAN, digital signature, server and client auth)
/// for `spiffe_id` and `key`, valid `[from, to]`; returns its DER.
pub(crate) fn sign_leaf(
    set: &IssuerSet,
    key: &impl rcgen::PublicKeyData,
    spiffe_id: &str,
    dns_names: &[String],
    (from, to): (UnixMs, UnixMs),
    serial: &[u8],
) -> Result<Vec<u8>, IdentityError> {
    let issue_error = |e: rcgen::Error| IdentityError::Issue(e.to_string());
    let uri = spiffe_id.to_string().try_into().map_err(issue_error)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::OrganizationName, "flock");
    // X509-SVID spec: exactly one URI SAN, the SPIFFE ID.
    params.subject_alt_names = vec![SanType::URI(uri)];
    // A serving certificate also names the DNS names a TLS client verifies (the
    // SVID spec allows DNS SANs beside the one URI SAN).
    for name in dns_names {
        params.subject_alt_names.push(SanType::DnsName(
            name.clone().try_into().map_err(issue_error)?,
        ));
    }
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    params.serial_number = Some(rcgen::SerialNumber::from_slice(serial));
    set_validity(&mut params, from, to);
    let cert = params.signed_by(key, &set.issuer).map_err(issue_error)?;
    Ok(cert.der().to_vec())
}

/// Verifies a leaf (DER) with its chain (PEM) against roots (PEM) at `now`, as a TLS
/// server verifies a client certificate (rustls' webpki verifier on ring).
pub fn verify_chain(
    leaf_der: &[u8],
    chain_pem: &str,
    roots_pem: &str,
    now: UnixMs,
) -> Result<(), String> {
    let mut roots = rustls::RootCertStore::empty();
    for root in CertificateDer::pem_slice_iter(roots_pem.as_bytes()) {
        let root = root.map_err(|e| format!("roots: {e}"))?;
        roots.add(root).map_err(|e| format!("root: {e}"))?;
    }
    let intermediates = CertificateDer::pem_slice_iter(chain_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("chain: {e}"))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .map_err(|e| e.to_string())?;
    verifier
        .verify_client_cert(
            &CertificateDer::from(leaf_der),
            &intermediates,
            UnixTime::since_unix_epoch(Duration::from_millis(now.as_millis())),
        )
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// 8 hex digits of the public key's SHA-256: tells CA certificates of one name apart.
fn key_tag(key: &CaKey) -> String {
    Sha256::digest(key.der_bytes())[..4]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Verifies an SVID's certificate chain (PEM, leaf first, as in
/// [`Svid::cert_chain_pem`](super::Svid)) against roots (PEM) at `now`, as
/// [`verify_chain`] does.
pub fn verify_svid_chain(cert_chain_pem: &str, roots_pem: &str, now: UnixMs) -> Result<(), String> {
    let certs = CertificateDer::pem_slice_iter(cert_chain_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("chain: {e}"))?;
    let Some((leaf, rest)) = certs.split_first() else {
        return Err("chain: no certificate".to_string());
    };
    let rest_pem: String = rest.iter().map(|c| cert_pem(c)).collect();
    verify_chain(leaf, &rest_pem, roots_pem, now)
}

/// A new root CA for `flock-agent ca init`: self-signed, `CN=flock root CA
/// <trust_domain>`, valid `[now - skew, now + validity]`; its certificate PEM and key.
pub fn generate_root(
    trust_domain: &str,
    now: UnixMs,
    skew: Duration,
    validity: Duration,
) -> Result<(String, SecretPem), IdentityError> {
    super::validate_trust_domain(trust_domain).map_err(|reason| {
        IdentityError::InvalidTrustDomain {
            domain: trust_domain.to_string(),
            reason,
        }
    })?;
    let key = CaKey::generate()?;
    // Path length 1: the root signs node issuers, which sign leaves only. The key's
    // hash in the name: two roots (old and new, during a rotation) never share a
    // subject, so no verifier tries the wrong one by name.
    let mut params = ca_params(
        format!("flock root CA {trust_domain} {}", key_tag(&key)),
        Some(1),
    );
    set_validity(
        &mut params,
        UnixMs(now.as_millis().saturating_sub(skew.as_millis() as u64)),
        now.plus(validity.as_millis() as u64),
    );
    let cert = params
        .self_signed(&key)
        .map_err(|e| IdentityError::Issue(e.to_string()))?;
    Ok((cert.pem(), key.pem()))
}

/// A node issuer (intermediate) signed by the root in `root_dir` (`root-cert.pem`, its
/// first certificate, and `root-key.pem`) for `flock-agent ca issue`: `CN=flock issuer
/// <name>`, path length 0, valid `[now - skew, min(now + validity, root's end)]`.
/// Returns the issuer's certificate PEM, its key, and the root certificates (PEM).
pub fn generate_issuer(
    root_dir: &Path,
    name: &str,
    now: UnixMs,
    skew: Duration,
    validity: Duration,
) -> Result<(String, SecretPem, String), CaDirError> {
    let root_path = root_dir.join(ROOT_CERT_FILE);
    let key_path = root_dir.join(ROOT_KEY_FILE);
    let root_bytes = read_limited(&root_path)?;
    let roots = parse_certs(&root_path, &root_bytes)?;
    let root = parse_x509(&root_path, &roots[0])?;
    let key = parse_key(&key_path, &Zeroizing::new(read_limited(&key_path)?))?;
    if key.der_bytes() != &*root.public_key().subject_public_key.data {
        return Err(err(
            &key_path,
            format!("does not match the first certificate of {ROOT_CERT_FILE}"),
        ));
    }
    if !root.is_ca() {
        return Err(err(&root_path, "the first certificate is not a CA"));
    }
    let root_end = unix_ms_of(root.validity().not_after);
    let issuer = Issuer::from_ca_cert_der(&roots[0], key)
        .map_err(|e| err(&root_path, format!("unusable as an issuer: {e}")))?;
    let ca_key = CaKey::generate().map_err(|e| err(root_dir, e.to_string()))?;
    let mut params = ca_params(format!("flock issuer {name} {}", key_tag(&ca_key)), Some(0));
    set_validity(
        &mut params,
        UnixMs(now.as_millis().saturating_sub(skew.as_millis() as u64)),
        now.plus(validity.as_millis() as u64).min(root_end),
    );
    let cert = params
        .signed_by(&ca_key, &issuer)
        .map_err(|e| err(root_dir, format!("signing the issuer: {e}")))?;
    let roots_pem = roots.iter().map(|c| cert_pem(c)).collect();
    Ok((cert.pem(), ca_key.pem(), roots_pem))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2027-01-01, the time the `ca_dir` fuzz target validates at.
    const FUZZ_NOW: UnixMs = UnixMs(1_798_761_600_000);

    /// A fuzz input of the `ca_dir` target: the files NUL-separated (`ca-cert.pem`,
    /// `ca-key.pem`, `root-cert.pem`, then `cert-chain.pem` if present).
    fn fuzz_input(data: &[u8]) -> CaDirFiles {
        let mut parts = data.splitn(4, |b| *b == 0).map(<[u8]>::to_vec);
        let ca_cert = parts.next().unwrap_or_default();
        let ca_key = Zeroizing::new(parts.next().unwrap_or_default());
        let root_cert = parts.next().unwrap_or_default();
        let dir = Path::new("/etc/flock/ca");
        CaDirFiles::from_contents(dir, ca_cert, ca_key, parts.next(), root_cert)
    }

    #[test]
    fn an_expired_certificate_in_the_chain_is_refused_naming_it() {
        // Found by the fuzz target: an intermediate of 2020 appended to an otherwise
        // good cert-chain.pem was accepted, and the set's end was 2021.
        let input = include_bytes!("../../../fuzz/seeds/ca_dir/expired-cert-in-chain");
        let e = validate(fuzz_input(input), "cluster.local", FUZZ_NOW).unwrap_err();
        assert_eq!(e.path, Path::new("/etc/flock/ca").join(CERT_CHAIN_FILE));
        assert!(
            e.reason
                .starts_with("O=flock, CN=old intermediate is not valid now"),
            "{e}"
        );
        // The same set without it is accepted (the refusal is for that certificate).
        let good = include_bytes!("../../../fuzz/seeds/ca_dir/istio-intermediate");
        let set = validate(fuzz_input(good), "cluster.local", FUZZ_NOW).unwrap();
        assert!(set.not_after_ms() > FUZZ_NOW);
    }

    #[test]
    fn contents_over_the_size_limit_are_refused_like_a_file_read() {
        let big = vec![b'a'; MAX_FILE_BYTES as usize + 1];
        let files = CaDirFiles::from_contents(
            Path::new("/ca"),
            big,
            Zeroizing::new(Vec::new()),
            None,
            Vec::new(),
        );
        let e = validate(files, "cluster.local", FUZZ_NOW).unwrap_err();
        assert_eq!(e.path, Path::new("/ca").join(CA_CERT_FILE));
        assert!(e.reason.starts_with("larger than 262144 bytes"), "{e}");
    }
}
