//! The agent's xDS [`Authorizer`]: who may connect to its xDS server and what each
//! stream may see, from what the transport authenticated (never from the client's
//! `Node`, which any process can fill with `user_agent_name: "envoy"`).
//!
//! The decision is `flock_core::access::decide`; this maps flock-xds's [`Peer`] into it
//! and its answer into a [`Principal`] or a gRPC status:
//!
//! | peer | principal |
//! |---|---|
//! | unix socket, uid or gid in the allow-list (default: the agent's euid, `--envoy-uid`, `--xds-allow-uid`, `--xds-allow-gid`) | node group from its `Node` (Envoy or gRPC translation), secrets allowed: the node's Envoy |
//! | unix socket, any other uid | `PERMISSION_DENIED` |
//! | mTLS, SPIFFE ID listed in `--xds-envoy-spiffe-id` | the Envoy group, secrets allowed |
//! | mTLS, SPIFFE ID in the agent's trust domain | the proxyless gRPC group, no secrets |
//! | mTLS, any other SPIFFE ID, or a certificate without one | `PERMISSION_DENIED` |
//! | TLS without a client certificate, plain TCP, unknown | `UNAUTHENTICATED` |
//!
//! Why a trusted unix peer may choose its group from its `Node`: only the allow-listed
//! uids can reach the socket, and they are the node's own Envoy or the agent itself,
//! which already holds every key. Only the Envoy group's snapshots carry secrets, and a
//! gRPC-group stream gets no secrets whatever it asks.

use crate::agent::{ENVOY_GROUP, GRPC_GROUP};
use flock_core::access::{Access, AccessPolicy, PeerFacts, decide};
use flock_xds::server::Peer;
use flock_xds::server::auth::{Authorizer, GroupChoice, Principal};

/// The agent's authorizer (see the module docs).
#[derive(Debug, Clone)]
pub struct AgentAuthorizer {
    policy: AccessPolicy,
}

impl AgentAuthorizer {
    /// An authorizer enforcing `policy`.
    pub fn new(policy: AccessPolicy) -> Self {
        Self { policy }
    }

    /// The policy it enforces.
    pub fn policy(&self) -> &AccessPolicy {
        &self.policy
    }
}

/// What the transport authenticated about `peer`, in flock-core's terms.
fn facts(peer: &Peer) -> PeerFacts<'_> {
    match peer {
        Peer::Unix { uid, gid, .. } => PeerFacts::Unix {
            uid: *uid,
            gid: *gid,
        },
        Peer::Tls { spiffe_id, .. } => PeerFacts::Tls {
            spiffe_id: spiffe_id.as_deref(),
            certificate: peer.has_certificate(),
        },
        Peer::Tcp { .. } => PeerFacts::PlainTcp,
        Peer::Unknown => PeerFacts::Unknown,
    }
}

impl Authorizer for AgentAuthorizer {
    fn authorize(&self, peer: &Peer) -> Result<Principal, tonic::Status> {
        // The bug this type exists to prevent: every peer trusted, its own `Node`
        // choosing the group, so any client claiming `user_agent_name: "envoy"` got
        // every workload key.
        if flock_core::reintroduced!("agent-xds-trust-node") {
            return Ok(Principal {
                name: peer.to_string(),
                group: GroupChoice::ByNode,
                secrets: true,
            });
        }
        match decide(&self.policy, facts(peer)) {
            Access::Local { who } => Ok(Principal {
                name: format!("local {who}"),
                group: GroupChoice::ByNode,
                secrets: true,
            }),
            Access::Envoy { spiffe_id } => Ok(Principal {
                name: spiffe_id,
                group: GroupChoice::Fixed(ENVOY_GROUP.to_string()),
                secrets: true,
            }),
            Access::Grpc { spiffe_id } => Ok(Principal {
                name: spiffe_id,
                group: GroupChoice::Fixed(GRPC_GROUP.to_string()),
                secrets: false,
            }),
            Access::Denied(reason) => Err(tonic::Status::permission_denied(format!(
                "this xDS server does not serve {peer} ({})",
                reason.as_str()
            ))),
            Access::Unauthenticated(reason) => Err(tonic::Status::unauthenticated(format!(
                "xDS needs an authenticated peer: a client certificate on TCP, or an \
                 allowed uid on the unix socket ({})",
                reason.as_str()
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    fn authorizer() -> AgentAuthorizer {
        AgentAuthorizer::new(AccessPolicy {
            allow_uids: [0, 101].into(),
            allow_gids: [1337].into(),
            trust_domain: "cluster.local".into(),
            envoy_spiffe_ids: ["spiffe://cluster.local/ns/flock/sa/envoy".to_string()].into(),
        })
    }

    fn tls(spiffe_id: Option<&str>, subject: &str) -> Peer {
        Peer::Tls {
            addr: "127.0.0.1:4000".parse().unwrap(),
            spiffe_id: spiffe_id.map(str::to_string),
            subject: subject.into(),
        }
    }

    #[test]
    fn allowed_unix_peers_choose_their_group_and_may_see_secrets() {
        let p = authorizer()
            .authorize(&Peer::Unix {
                uid: 101,
                gid: 101,
                pid: Some(7),
            })
            .unwrap();
        assert_eq!((p.group, p.secrets), (GroupChoice::ByNode, true));
        let p = authorizer()
            .authorize(&Peer::Unix {
                uid: 5,
                gid: 1337,
                pid: None,
            })
            .unwrap();
        assert!(p.secrets);
    }

    #[test]
    fn other_unix_peers_are_denied() {
        let err = authorizer()
            .authorize(&Peer::Unix {
                uid: 65534,
                gid: 65534,
                pid: Some(9),
            })
            .unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied);
    }

    #[test]
    fn mtls_peers_get_the_group_of_their_spiffe_id_never_of_their_node() {
        let envoy = authorizer()
            .authorize(&tls(
                Some("spiffe://cluster.local/ns/flock/sa/envoy"),
                "O=flock",
            ))
            .unwrap();
        assert_eq!(
            (envoy.group, envoy.secrets),
            (GroupChoice::Fixed(ENVOY_GROUP.into()), true)
        );
        let grpc = authorizer()
            .authorize(&tls(
                Some("spiffe://cluster.local/ns/default/sa/greeter"),
                "O=flock",
            ))
            .unwrap();
        assert_eq!(
            (grpc.group, grpc.secrets),
            (GroupChoice::Fixed(GRPC_GROUP.into()), false)
        );
        let foreign = authorizer()
            .authorize(&tls(Some("spiffe://evil.example/ns/a/sa/b"), "O=x"))
            .unwrap_err();
        assert_eq!(foreign.code(), Code::PermissionDenied);
        let no_id = authorizer()
            .authorize(&tls(None, "CN=someone"))
            .unwrap_err();
        assert_eq!(no_id.code(), Code::PermissionDenied);
    }

    #[test]
    fn peers_without_an_identity_are_unauthenticated() {
        for peer in [
            tls(None, ""),
            Peer::Tcp {
                addr: "127.0.0.1:4000".parse().unwrap(),
            },
            Peer::Unknown,
        ] {
            let err = authorizer().authorize(&peer).unwrap_err();
            assert_eq!(err.code(), Code::Unauthenticated, "{peer}");
        }
    }
}
