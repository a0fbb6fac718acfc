//! A throwaway certificate authority for TLS tests (rcgen): the mTLS xDS listener, the
//! agent's TLS flags and etcd with client-certificate auth all need a CA, a server
//! certificate for `localhost`/`127.0.0.1` and client certificates, made fresh per test.

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

/// A CA that lives as long as the test: its certificate (PEM) and what signs leaves.
pub struct TestCa {
    /// The CA certificate, PEM: what a peer is told to trust.
    pub ca_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// A certificate the CA issued and its private key, both PEM.
pub struct Leaf {
    /// The certificate.
    pub cert_pem: String,
    /// Its private key (PKCS#8).
    pub key_pem: String,
}

/// What a leaf may be used for (its extended key usage).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Usage {
    /// A TLS server.
    Server,
    /// A TLS client.
    Client,
    /// Both (an etcd member talks to clients and is one).
    Both,
}

impl TestCa {
    /// A new CA named `<name> CA` (path length 0: it signs leaves only).
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} CA"));
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().expect("generating the test CA key");
        let cert = params
            .self_signed(&key)
            .expect("self-signing the test CA certificate");
        Self {
            ca_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A leaf with common name `cn` (if any), these SANs and this usage.
    pub fn issue(&self, cn: Option<&str>, sans: Vec<SanType>, usage: Usage) -> Leaf {
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::OrganizationName, "flock test");
        if let Some(cn) = cn {
            params.distinguished_name.push(DnType::CommonName, cn);
        }
        params.subject_alt_names = sans;
        params.extended_key_usages = match usage {
            Usage::Server => vec![ExtendedKeyUsagePurpose::ServerAuth],
            Usage::Client => vec![ExtendedKeyUsagePurpose::ClientAuth],
            Usage::Both => vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        };
        let key = KeyPair::generate().expect("generating a test leaf key");
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("signing a test leaf certificate");
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }

    /// A server certificate for `localhost` and `127.0.0.1`.
    pub fn server(&self) -> Leaf {
        self.issue(None, loopback_sans(), Usage::Server)
    }

    /// A client certificate whose only URI SAN is `spiffe_id`.
    pub fn client(&self, spiffe_id: &str) -> Leaf {
        let uri = spiffe_id.try_into().expect("a SPIFFE ID is an IA5 string");
        self.issue(None, vec![SanType::URI(uri)], Usage::Client)
    }

    /// A certificate with common name `cn` for `localhost`/`127.0.0.1`, good for a
    /// server and a client (etcd authenticates a client-certificate user by its CN).
    pub fn named(&self, cn: &str) -> Leaf {
        self.issue(Some(cn), loopback_sans(), Usage::Both)
    }
}

fn loopback_sans() -> Vec<SanType> {
    vec![
        SanType::DnsName("localhost".try_into().expect("an IA5 name")),
        SanType::IpAddress([127, 0, 0, 1].into()),
    ]
}
