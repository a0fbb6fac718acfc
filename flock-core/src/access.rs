//! Who may talk to the agent's xDS server, and on which listeners it may listen.
//!
//! The xDS server hands out every workload's private key over SDS. Client-supplied
//! `Node` fields (`user_agent_name: "envoy"`, any node id) prove nothing, so what a
//! stream may see is decided here from what the *transport* authenticated: the unix
//! socket's peer credentials (`SO_PEERCRED`, set by the kernel) or the SPIFFE ID of a
//! client certificate the TLS layer verified against the configured CA.
//!
//! * [`decide`]: a peer → [`Access`] (Envoy with secrets, proxyless gRPC without, or a
//!   refusal that is either "not allowed" or "no identity").
//! * [`check_listen_addr`]: a TCP listener address against the non-loopback opt-in.

use std::collections::BTreeSet;
use std::net::SocketAddr;

/// What the transport authenticated about a connection's peer (mapped from the xDS
/// server's own peer type by the I/O crate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerFacts<'a> {
    /// A unix-socket peer: its credentials as the kernel reported them.
    Unix {
        /// Effective uid.
        uid: u32,
        /// Effective gid.
        gid: u32,
    },
    /// A TCP peer that completed the TLS handshake; `spiffe_id` is the URI SAN of
    /// its verified client certificate.
    Tls {
        /// The verified SPIFFE ID, if any.
        spiffe_id: Option<&'a str>,
        /// Whether it presented a (verified) client certificate at all.
        certificate: bool,
    },
    /// Plain TCP: nothing authenticated.
    PlainTcp,
    /// A transport the server could not identify.
    Unknown,
}

/// Who is trusted with what.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AccessPolicy {
    /// Unix peers with one of these uids are the node's Envoy (or the agent itself).
    pub allow_uids: BTreeSet<u32>,
    /// Unix peers with one of these gids are too.
    pub allow_gids: BTreeSet<u32>,
    /// The agent's SPIFFE trust domain: an mTLS peer whose SPIFFE ID is in it is a
    /// proxyless gRPC client of the mesh (no secrets).
    pub trust_domain: String,
    /// mTLS peers with exactly one of these SPIFFE IDs are an Envoy of this node
    /// (secrets allowed).
    pub envoy_spiffe_ids: BTreeSet<String>,
}

/// The decision for one peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    /// A trusted local process (allowed uid/gid on the unix socket): its node group is
    /// chosen from its `Node` (Envoy or proxyless gRPC translation), secrets allowed.
    /// Safe because only the allow-listed uids can reach the socket at all.
    Local {
        /// For logs: `uid 101` or `gid 101`.
        who: String,
    },
    /// An Envoy authenticated by a listed SPIFFE ID: the Envoy group, secrets allowed.
    Envoy {
        /// Its SPIFFE ID.
        spiffe_id: String,
    },
    /// A proxyless gRPC client with a SPIFFE ID of the trust domain: the gRPC group,
    /// never secrets (it gets its own SVID from its own identity provider, not from a
    /// node agent that serves every pod of the node).
    Grpc {
        /// Its SPIFFE ID.
        spiffe_id: String,
    },
    /// Authenticated but not allowed (`PERMISSION_DENIED`).
    Denied(DenyReason),
    /// No identity (`UNAUTHENTICATED`).
    Unauthenticated(UnauthReason),
}

/// Why an authenticated peer was refused (a closed set: metric labels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenyReason {
    /// A unix peer whose uid and gid are not allowed.
    UnixPeerNotAllowed,
    /// A certificate whose SPIFFE ID is neither listed nor in the trust domain.
    ForeignSpiffeId,
    /// A verified certificate without a SPIFFE ID.
    NoSpiffeId,
}

/// Why a peer has no identity (a closed set: metric labels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnauthReason {
    /// TCP without TLS.
    PlainTcp,
    /// TLS without a client certificate.
    NoClientCertificate,
    /// The transport is unknown.
    UnknownTransport,
}

impl DenyReason {
    /// A short label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::UnixPeerNotAllowed => "unix_peer_not_allowed",
            Self::ForeignSpiffeId => "foreign_spiffe_id",
            Self::NoSpiffeId => "no_spiffe_id",
        }
    }
}

impl UnauthReason {
    /// A short label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PlainTcp => "plain_tcp",
            Self::NoClientCertificate => "no_client_certificate",
            Self::UnknownTransport => "unknown_transport",
        }
    }
}

/// The trust domain of a SPIFFE ID (`spiffe://<trust-domain>/<path>`): `None` unless
/// both parts are non-empty and the ID is at most 2048 bytes (the SPIFFE limit).
pub fn spiffe_trust_domain(id: &str) -> Option<&str> {
    let rest = id.strip_prefix("spiffe://")?;
    let (td, path) = rest.split_once('/')?;
    (!td.is_empty() && !path.is_empty() && id.len() <= 2048).then_some(td)
}

/// Decides what `peer` may see. The listed Envoy SPIFFE IDs win over the trust domain
/// (an Envoy's ID is normally in the trust domain too); a unix peer is allowed by
/// uid or gid.
pub fn decide(policy: &AccessPolicy, peer: PeerFacts<'_>) -> Access {
    match peer {
        PeerFacts::Unix { uid, gid } => {
            if policy.allow_uids.contains(&uid) {
                Access::Local {
                    who: format!("uid {uid}"),
                }
            } else if policy.allow_gids.contains(&gid) {
                Access::Local {
                    who: format!("gid {gid}"),
                }
            } else {
                Access::Denied(DenyReason::UnixPeerNotAllowed)
            }
        }
        PeerFacts::Tls {
            spiffe_id: Some(id),
            ..
        } => {
            if policy.envoy_spiffe_ids.contains(id) {
                Access::Envoy {
                    spiffe_id: id.to_string(),
                }
            } else if !policy.trust_domain.is_empty()
                && spiffe_trust_domain(id) == Some(policy.trust_domain.as_str())
            {
                Access::Grpc {
                    spiffe_id: id.to_string(),
                }
            } else {
                Access::Denied(DenyReason::ForeignSpiffeId)
            }
        }
        PeerFacts::Tls {
            spiffe_id: None,
            certificate: true,
        } => Access::Denied(DenyReason::NoSpiffeId),
        PeerFacts::Tls {
            spiffe_id: None,
            certificate: false,
        } => Access::Unauthenticated(UnauthReason::NoClientCertificate),
        PeerFacts::PlainTcp => Access::Unauthenticated(UnauthReason::PlainTcp),
        PeerFacts::Unknown => Access::Unauthenticated(UnauthReason::UnknownTransport),
    }
}

/// Checks a TCP listener address (`what`: the flag, for the message): a non-loopback
/// address is refused unless `allow_non_loopback` (the operator's explicit opt-in),
/// since an address like `0.0.0.0` exposes the listener to every hostNetwork pod and
/// to the network.
pub fn check_listen_addr(
    what: &str,
    addr: SocketAddr,
    allow_non_loopback: bool,
) -> Result<(), String> {
    if crate::pod::canonical_ip(addr.ip()).is_loopback() || allow_non_loopback {
        return Ok(());
    }
    Err(format!(
        "{what} {addr} is not a loopback address: it would be reachable from other \
         hosts and hostNetwork pods; pass --allow-non-loopback to listen there anyway"
    ))
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn policy() -> AccessPolicy {
        AccessPolicy {
            allow_uids: [0, 101].into(),
            allow_gids: [1337].into(),
            trust_domain: "cluster.local".into(),
            envoy_spiffe_ids: ["spiffe://cluster.local/ns/flock/sa/envoy".to_string()].into(),
        }
    }

    #[test]
    fn unix_peers_are_allowed_by_uid_or_gid_only() {
        let p = policy();
        assert!(matches!(
            decide(&p, PeerFacts::Unix { uid: 101, gid: 5 }),
            Access::Local { who } if who == "uid 101"
        ));
        assert!(matches!(
            decide(&p, PeerFacts::Unix { uid: 7, gid: 1337 }),
            Access::Local { who } if who == "gid 1337"
        ));
        assert_eq!(
            decide(
                &p,
                PeerFacts::Unix {
                    uid: 65534,
                    gid: 65534
                }
            ),
            Access::Denied(DenyReason::UnixPeerNotAllowed)
        );
    }

    #[test]
    fn tls_peers_are_envoy_only_when_listed_and_grpc_only_in_the_trust_domain() {
        let p = policy();
        assert!(matches!(
            decide(
                &p,
                PeerFacts::Tls {
                    certificate: true,
                    spiffe_id: Some("spiffe://cluster.local/ns/flock/sa/envoy")
                }
            ),
            Access::Envoy { .. }
        ));
        assert!(matches!(
            decide(
                &p,
                PeerFacts::Tls {
                    certificate: true,
                    spiffe_id: Some("spiffe://cluster.local/ns/a/sa/b")
                }
            ),
            Access::Grpc { .. }
        ));
        for foreign in [
            "spiffe://evil.local/ns/a/sa/b",
            "spiffe://cluster.local.evil/ns/a/sa/b",
            "spiffe://cluster.local",
            "spiffe://cluster.local/",
            "https://cluster.local/ns/a",
            "",
        ] {
            assert_eq!(
                decide(
                    &p,
                    PeerFacts::Tls {
                        certificate: true,
                        spiffe_id: Some(foreign)
                    }
                ),
                Access::Denied(DenyReason::ForeignSpiffeId),
                "{foreign:?}"
            );
        }
    }

    #[test]
    fn no_identity_is_unauthenticated() {
        let p = policy();
        for (peer, reason) in [
            (
                PeerFacts::Tls {
                    spiffe_id: None,
                    certificate: false,
                },
                UnauthReason::NoClientCertificate,
            ),
            (PeerFacts::PlainTcp, UnauthReason::PlainTcp),
            (PeerFacts::Unknown, UnauthReason::UnknownTransport),
        ] {
            assert_eq!(decide(&p, peer), Access::Unauthenticated(reason));
        }
    }

    #[test]
    fn a_certificate_without_a_spiffe_id_is_denied() {
        assert_eq!(
            decide(
                &policy(),
                PeerFacts::Tls {
                    spiffe_id: None,
                    certificate: true
                }
            ),
            Access::Denied(DenyReason::NoSpiffeId)
        );
    }

    #[test]
    fn an_empty_trust_domain_admits_no_grpc_client() {
        let p = AccessPolicy {
            trust_domain: String::new(),
            ..policy()
        };
        assert_eq!(
            decide(
                &p,
                PeerFacts::Tls {
                    certificate: true,
                    spiffe_id: Some("spiffe:///ns/a/sa/b")
                }
            ),
            Access::Denied(DenyReason::ForeignSpiffeId)
        );
    }

    #[test]
    fn non_loopback_listeners_need_the_opt_in() {
        let lo: SocketAddr = "127.0.0.1:18000".parse().unwrap();
        let lo6: SocketAddr = "[::1]:18000".parse().unwrap();
        let any: SocketAddr = "0.0.0.0:18000".parse().unwrap();
        assert!(check_listen_addr("--xds-address", lo, false).is_ok());
        assert!(check_listen_addr("--xds-address", lo6, false).is_ok());
        let err = check_listen_addr("--admin-address", any, false).unwrap_err();
        assert!(err.contains("--admin-address 0.0.0.0:18000"), "{err}");
        assert!(err.contains("--allow-non-loopback"), "{err}");
        assert!(check_listen_addr("--admin-address", any, true).is_ok());
    }
}
