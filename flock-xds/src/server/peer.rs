//! Who is on the other end of a connection, as the transport authenticated it.
//!
//! The identity comes from the transport only — the kernel's `SO_PEERCRED` on a unix
//! socket, the verified client certificate on mTLS — never from anything the client
//! writes into a request (`Node.id`, `user_agent_name`), which any client can forge.

use super::conn::ConnInfo;
use std::fmt;
use std::net::SocketAddr;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo, UdsConnectInfo};

/// The most characters of a certificate subject kept (a subject is the client's text,
/// bounded only by the certificate size; logs and authorizers need far less).
const MAX_SUBJECT_CHARS: usize = 512;

/// The peer of one connection, as the transport authenticated it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// A unix socket peer: the credentials the kernel recorded when it connected.
    Unix {
        /// Its effective uid.
        uid: u32,
        /// Its effective gid.
        gid: u32,
        /// Its process id, when the kernel reports one.
        pid: Option<i32>,
    },
    /// A plain TCP peer: an address, which authenticates nothing.
    Tcp {
        /// Its address.
        addr: SocketAddr,
    },
    /// A TLS peer. `spiffe_id` and `subject` come from the client certificate that the
    /// handshake verified against the configured client CA; both are empty when the
    /// client presented no certificate (the listener accepts that, so that such a
    /// client gets `UNAUTHENTICATED` from the authorizer rather than a bare handshake
    /// failure).
    Tls {
        /// Its address.
        addr: SocketAddr,
        /// The certificate's one `spiffe://` URI SAN; `None` without a certificate,
        /// without such a SAN, or with more than one (ambiguous, so none is trusted).
        spiffe_id: Option<String>,
        /// The certificate's subject (RFC 4514 form, at most 512 characters); empty
        /// without a certificate.
        subject: String,
    },
    /// A connection of a kind this module does not know (a caller's own listener), or a
    /// unix socket whose credentials the kernel did not report.
    Unknown,
}

impl Peer {
    /// The peer of the connection `req` arrived on, from the connect info tonic put in
    /// its extensions.
    pub fn of<T>(req: &tonic::Request<T>) -> Peer {
        let ext = req.extensions();
        // This crate's listeners wrap the transport's connect info in `ConnInfo`; a
        // caller's own listener (through `Server::router`) gives tonic's types.
        if let Some(info) = ext.get::<ConnInfo<UdsConnectInfo>>() {
            return Self::unix(info.get_ref());
        }
        if let Some(info) = ext.get::<UdsConnectInfo>() {
            return Self::unix(info);
        }
        if let Some(info) = ext.get::<TlsConnectInfo<ConnInfo<TcpConnectInfo>>>() {
            return Self::tls(info.get_ref().get_ref(), info.peer_certs());
        }
        if let Some(info) = ext.get::<TlsConnectInfo<TcpConnectInfo>>() {
            return Self::tls(info.get_ref(), info.peer_certs());
        }
        if let Some(info) = ext.get::<ConnInfo<TcpConnectInfo>>() {
            return Self::tcp(info.get_ref());
        }
        if let Some(info) = ext.get::<TcpConnectInfo>() {
            return Self::tcp(info);
        }
        Peer::Unknown
    }

    fn unix(info: &UdsConnectInfo) -> Peer {
        match info.peer_cred {
            Some(cred) => Peer::Unix {
                uid: cred.uid(),
                gid: cred.gid(),
                pid: cred.pid(),
            },
            None => Peer::Unknown,
        }
    }

    fn tls(
        info: &TcpConnectInfo,
        certs: Option<std::sync::Arc<Vec<tonic::transport::CertificateDer<'static>>>>,
    ) -> Peer {
        let Some(addr) = info.remote_addr() else {
            return Peer::Unknown;
        };
        let leaf = certs.and_then(|certs| certs.first().cloned());
        let (spiffe_id, subject) = match leaf {
            Some(der) => identity_of(der.as_ref()),
            None => (None, String::new()),
        };
        Peer::Tls {
            addr,
            spiffe_id,
            subject,
        }
    }

    fn tcp(info: &TcpConnectInfo) -> Peer {
        match info.remote_addr() {
            Some(addr) => Peer::Tcp { addr },
            None => Peer::Unknown,
        }
    }

    /// Whether the peer presented a verified client certificate (TLS only).
    pub fn has_certificate(&self) -> bool {
        matches!(self, Peer::Tls { spiffe_id, subject, .. } if spiffe_id.is_some() || !subject.is_empty())
    }

    /// A key identifying this peer's connection (or process, on a unix socket) for
    /// "log once" bookkeeping.
    pub(crate) fn log_key(&self) -> String {
        self.to_string()
    }
}

/// The SPIFFE ID and subject of a DER certificate the TLS layer already verified. A
/// certificate x509-parser cannot read yields neither (so it authenticates nothing).
/// Public for the fuzz target: the certificate's bytes are the client's.
pub fn identity_of(der: &[u8]) -> (Option<String>, String) {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return (None, String::new());
    };
    let subject: String = cert
        .subject()
        .to_string()
        .chars()
        .take(MAX_SUBJECT_CHARS)
        .collect();
    let mut spiffe = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::URI(uri) = name
                && uri.starts_with("spiffe://")
            {
                spiffe.push(uri.to_string());
            }
        }
    }
    // An X.509-SVID carries exactly one URI SAN (SPIFFE X509-SVID §2); two SPIFFE IDs
    // would let a certificate claim to be either, so it is neither.
    let spiffe_id = if spiffe.len() == 1 {
        spiffe.pop()
    } else {
        None
    };
    (spiffe_id, subject)
}

impl fmt::Display for Peer {
    /// For logs: uid/gid/pid or address and certificate identity; never key material
    /// (a peer holds none), with client-chosen text escaped.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::Unix { uid, gid, pid } => {
                write!(f, "unix peer uid={uid} gid={gid}")?;
                match pid {
                    Some(pid) => write!(f, " pid={pid}"),
                    None => Ok(()),
                }
            }
            Peer::Tcp { addr } => write!(f, "tcp peer {addr}"),
            Peer::Tls {
                addr,
                spiffe_id,
                subject,
            } => {
                write!(f, "tls peer {addr}")?;
                match spiffe_id {
                    Some(id) => write!(f, " spiffe_id={id:?}")?,
                    None if subject.is_empty() => f.write_str(" (no client certificate)")?,
                    None => {}
                }
                if !subject.is_empty() {
                    write!(f, " subject={subject:?}")?;
                }
                Ok(())
            }
            Peer::Unknown => f.write_str("unknown peer"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_the_identity_and_escapes_client_text() {
        let unix = Peer::Unix {
            uid: 1337,
            gid: 7,
            pid: Some(42),
        };
        assert_eq!(unix.to_string(), "unix peer uid=1337 gid=7 pid=42");
        let tls = Peer::Tls {
            addr: "10.0.0.1:5000".parse().unwrap(),
            spiffe_id: None,
            subject: "CN=a\nforged line".into(),
        };
        assert_eq!(
            tls.to_string(),
            "tls peer 10.0.0.1:5000 subject=\"CN=a\\nforged line\""
        );
        let anonymous = Peer::Tls {
            addr: "10.0.0.1:5000".parse().unwrap(),
            spiffe_id: None,
            subject: String::new(),
        };
        assert!(!anonymous.has_certificate());
        assert_eq!(
            anonymous.to_string(),
            "tls peer 10.0.0.1:5000 (no client certificate)"
        );
    }

    #[test]
    fn a_request_without_connect_info_is_an_unknown_peer() {
        assert_eq!(Peer::of(&tonic::Request::new(())), Peer::Unknown);
    }

    #[test]
    fn garbage_der_yields_no_identity() {
        assert_eq!(identity_of(b"not a certificate"), (None, String::new()));
    }
}
