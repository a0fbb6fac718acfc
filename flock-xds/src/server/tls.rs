//! The mTLS listener's certificates as a value that can be replaced while it serves.
//!
//! The serving certificate, its key and the client CA bundle are rotated by whoever
//! issues them; a listener that read them once would serve an expired certificate, or
//! refuse clients of a new CA, until restarted. [`ServerTls`] holds the current rustls
//! configuration; every handshake takes the one current when its connection was
//! accepted, so [`ServerTls::replace`] changes what new connections see at once and
//! leaves established ones alone. A replacement that does not build (bad PEM, a key
//! that is not the certificate's, no CA) is refused and the current one kept.

use super::listen::TlsSettings;
use flock_core::sync::Mutex;
use std::io;
use std::sync::Arc;
use tokio_rustls::rustls;

/// The TLS configuration of [`Server::serve_tls_reloadable`](super::Server::serve_tls_reloadable),
/// replaceable while it serves.
pub struct ServerTls {
    current: Mutex<Arc<rustls::ServerConfig>>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls").finish_non_exhaustive()
    }
}

impl ServerTls {
    /// A configuration from `settings`; `InvalidInput` naming what is wrong with them.
    pub fn new(settings: &TlsSettings) -> io::Result<Self> {
        Ok(Self {
            current: Mutex::new(settings.rustls_config()?),
        })
    }

    /// Replaces the configuration new handshakes use; on error the current one stays.
    pub fn replace(&self, settings: &TlsSettings) -> io::Result<()> {
        let config = settings.rustls_config()?;
        if flock_core::reintroduced!("xds-tls-no-reload") {
            // The bug: the material read at start is served until the restart.
            return Ok(());
        }
        *self.current.lock() = config;
        Ok(())
    }

    pub(crate) fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(Arc::clone(&*self.current.lock()))
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

impl TlsSettings {
    /// The rustls server configuration: the chain and key, client certificates
    /// verified against the CA bundle but optional (a client without one completes the
    /// handshake and is refused by the authorizer, `UNAUTHENTICATED`, logged and
    /// counted, instead of failing the handshake with an error no client surfaces
    /// well), HTTP/2 by ALPN.
    pub(crate) fn rustls_config(&self) -> io::Result<Arc<rustls::ServerConfig>> {
        use rustls::pki_types::pem::PemObject as _;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        self.check()?;
        let certs = CertificateDer::pem_slice_iter(self.cert_chain_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| invalid(format!("TLS settings: cert_chain_pem: {e}")))?;
        if certs.is_empty() {
            return Err(invalid(
                "TLS settings: cert_chain_pem holds no certificate".into(),
            ));
        }
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes())
            .map_err(|e| invalid(format!("TLS settings: key_pem: {e}")))?;
        let mut roots = rustls::RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(self.client_ca_pem.as_bytes()) {
            let ca = ca.map_err(|e| invalid(format!("TLS settings: client_ca_pem: {e}")))?;
            roots
                .add(ca)
                .map_err(|e| invalid(format!("TLS settings: client_ca_pem: {e}")))?;
        }
        if roots.is_empty() {
            return Err(invalid(
                "TLS settings: client_ca_pem holds no CA certificate".into(),
            ));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::clone(&provider),
        )
        .allow_unauthenticated()
        .build()
        .map_err(|e| invalid(format!("TLS settings: client_ca_pem: {e}")))?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| invalid(format!("TLS settings: {e}")))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs, key)
            .map_err(|e| {
                invalid(format!(
                    "TLS settings: the certificate chain and key do not go together: {e}"
                ))
            })?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    }
}
