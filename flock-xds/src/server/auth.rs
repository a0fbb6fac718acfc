//! Authorization of xDS clients: who may open a stream, which snapshot group it is
//! served, and whether it may see secrets.
//!
//! Every RPC (ADS and per-type, stream or fetch, SotW or Delta) asks the server's
//! [`Authorizer`] about its transport [`Peer`] before it reads a request. A refusal
//! ends the RPC at once with the authorizer's status (`UNAUTHENTICATED`: no identity;
//! `PERMISSION_DENIED`: known but not allowed): the client gets no resource of any
//! type. A refusal is counted in `flock_xds_unauthorized_total{reason}` and logged at
//! `warn` once per peer (a client retrying in a loop does not flood the log).
//!
//! The [`Principal`] an authorizer returns decides what the stream sees: its snapshot
//! group is the principal's ([`GroupChoice::Fixed`]) or the cache's grouping of the
//! client's `Node` ([`GroupChoice::ByNode`] — for peers the authorizer trusts to name
//! their own node), and only a principal with `secrets: true` may subscribe to the
//! SDS type: for any other, an SDS request (the per-type SDS service, or an ADS
//! request with the secret type URL, SotW or Delta, named or wildcard) ends the
//! stream with `PERMISSION_DENIED` before a secret is looked up.

use super::peer::Peer;
use flock_core::sync::Mutex;
use prometheus_client::metrics::counter::Counter;
use std::collections::HashSet;
use tonic::Status;

/// What an authenticated client may see.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// A name for logs (e.g. `"uid 101"`, a SPIFFE ID).
    pub name: String,
    /// Which snapshot group its streams are served.
    pub group: GroupChoice,
    /// Whether it may subscribe to secrets (SDS).
    pub secrets: bool,
}

/// How a principal's snapshot group is chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupChoice {
    /// Always this group, whatever `Node` the client sends.
    Fixed(String),
    /// The cache's `NodeHash` of the client's `Node` (the client names its own group:
    /// only for peers trusted to do so).
    ByNode,
}

/// Decides whether a transport peer may use the xDS server, and as whom.
pub trait Authorizer: Send + Sync {
    /// The principal of `peer`, or the status the RPC ends with: `UNAUTHENTICATED`
    /// when the peer has no usable identity, `PERMISSION_DENIED` when it is known but
    /// not allowed.
    fn authorize(&self, peer: &Peer) -> Result<Principal, Status>;
}

/// Allows every peer, grouped by its node, with secrets. Only behind another
/// authentication layer (a socket only trusted processes can reach, a proxy that
/// authenticates): by itself it hands every client every secret it asks for. The
/// default of [`ServerBuilder`](super::ServerBuilder), for embedding and tests.
#[derive(Debug, Clone, Copy, Default)]
pub struct AllowAll;

impl Authorizer for AllowAll {
    fn authorize(&self, peer: &Peer) -> Result<Principal, Status> {
        Ok(Principal {
            name: peer.to_string(),
            group: GroupChoice::ByNode,
            secrets: true,
        })
    }
}

impl<F> Authorizer for F
where
    F: Fn(&Peer) -> Result<Principal, Status> + Send + Sync,
{
    fn authorize(&self, peer: &Peer) -> Result<Principal, Status> {
        self(peer)
    }
}

/// Why an RPC was refused: the closed label set of `flock_xds_unauthorized_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalReason {
    /// The peer had no usable identity (`UNAUTHENTICATED`).
    Unauthenticated,
    /// The peer was known but not allowed (`PERMISSION_DENIED`, or any other status an
    /// authorizer returns).
    PermissionDenied,
    /// The principal may not see secrets and asked for them.
    Secrets,
}

impl RefusalReason {
    /// Every value, in rendering order.
    pub const ALL: [RefusalReason; 3] = [
        RefusalReason::Unauthenticated,
        RefusalReason::PermissionDenied,
        RefusalReason::Secrets,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalReason::Unauthenticated => "unauthenticated",
            RefusalReason::PermissionDenied => "permission_denied",
            RefusalReason::Secrets => "secrets",
        }
    }
}

/// How many distinct refused peers are remembered for "log once" before the memory
/// is cleared (a bound on what a flood of peers, e.g. a port scan, can make us hold).
const MAX_REMEMBERED_PEERS: usize = 4096;

/// Refusal counters and the log-once memory.
#[derive(Debug)]
pub(crate) struct Refusals {
    counters: [Counter; RefusalReason::ALL.len()],
    warned: Mutex<HashSet<String>>,
}

impl Default for Refusals {
    fn default() -> Self {
        Self {
            counters: Default::default(),
            warned: Mutex::new(HashSet::new()),
        }
    }
}

impl Refusals {
    /// Counts a refusal, and logs it at `warn` the first time for this peer.
    pub(crate) fn refuse(&self, peer: &Peer, reason: RefusalReason, status: &Status) {
        self.counters[reason as usize].inc();
        let first = {
            let mut warned = self.warned.lock();
            if warned.len() >= MAX_REMEMBERED_PEERS {
                warned.clear();
            }
            warned.insert(format!("{}:{}", reason.as_str(), peer.log_key()))
        };
        if first {
            tracing::warn!(%peer, reason = reason.as_str(), status = %status.message(), "xDS client refused");
        } else {
            tracing::debug!(%peer, reason = reason.as_str(), status = %status.message(), "xDS client refused");
        }
    }

    /// Counts an SDS request of a principal without `secrets`, and logs it at `warn`
    /// the first time for this principal.
    pub(crate) fn refuse_secrets(&self, principal: &Principal, status: &Status) {
        self.counters[RefusalReason::Secrets as usize].inc();
        let first = {
            let mut warned = self.warned.lock();
            if warned.len() >= MAX_REMEMBERED_PEERS {
                warned.clear();
            }
            warned.insert(format!("secrets:{}", principal.name))
        };
        if first {
            tracing::warn!(principal = %principal.name, status = %status.message(), "xDS client refused secrets");
        }
    }

    pub(crate) fn count(&self, reason: RefusalReason) -> u64 {
        self.counters[reason as usize].get()
    }

    pub(crate) fn counter(&self, reason: RefusalReason) -> &Counter {
        &self.counters[reason as usize]
    }
}

/// The reason label of a status an authorizer refused with.
pub(crate) fn reason_of(status: &Status) -> RefusalReason {
    if status.code() == tonic::Code::Unauthenticated {
        RefusalReason::Unauthenticated
    } else {
        RefusalReason::PermissionDenied
    }
}

/// The status a principal without `secrets` gets for an SDS request.
pub(crate) fn secrets_denied(principal: &Principal) -> Status {
    Status::permission_denied(format!(
        "{} may not subscribe to secrets (SDS)",
        principal.name
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_is_counted_every_time_and_remembered_per_peer() {
        let r = Refusals::default();
        let peer = Peer::Unix {
            uid: 65534,
            gid: 65534,
            pid: Some(9),
        };
        let status = Status::permission_denied("no");
        r.refuse(&peer, RefusalReason::PermissionDenied, &status);
        r.refuse(&peer, RefusalReason::PermissionDenied, &status);
        assert_eq!(r.count(RefusalReason::PermissionDenied), 2);
        assert_eq!(r.count(RefusalReason::Unauthenticated), 0);
        assert_eq!(r.warned.lock().len(), 1, "logged once");
    }

    #[test]
    fn the_log_once_memory_is_bounded() {
        let r = Refusals::default();
        let status = Status::unauthenticated("no");
        for port in 0..(MAX_REMEMBERED_PEERS as u16 + 10) {
            let peer = Peer::Tcp {
                addr: std::net::SocketAddr::from(([10, 0, 0, 1], port)),
            };
            r.refuse(&peer, RefusalReason::Unauthenticated, &status);
        }
        assert!(r.warned.lock().len() <= MAX_REMEMBERED_PEERS);
        assert_eq!(
            r.count(RefusalReason::Unauthenticated),
            MAX_REMEMBERED_PEERS as u64 + 10
        );
    }

    #[test]
    fn status_codes_map_to_the_closed_reason_set() {
        assert_eq!(
            reason_of(&Status::unauthenticated("x")),
            RefusalReason::Unauthenticated
        );
        assert_eq!(
            reason_of(&Status::permission_denied("x")),
            RefusalReason::PermissionDenied
        );
        assert_eq!(
            reason_of(&Status::internal("x")),
            RefusalReason::PermissionDenied
        );
    }
}
