//! The agent's side of `flock.cni.v1.CniService`, served on a root-only unix socket.

use crate::agent::{AddPodInput, Agent, PodError, PodOutcome};
use flock_cni::proto::v1::cni_service_server::{CniService, CniServiceServer};
use flock_cni::proto::v1::{
    AddPodRequest, Availability, CheckRequest, GarbageCollectRequest, GarbageCollectResponse,
    Outcome, PodResponse, Refusal, RemovePodRequest, StatusRequest, StatusResponse,
};
use flock_core::pod::PodKey;
use flock_xds::server::Peer;
use std::path::Path;
use std::sync::Arc;
use tonic::{Request, Response, Status};

/// Largest CNI request accepted (prevResult and annotations included).
pub const MAX_REQUEST_BYTES: usize = 1024 * 1024;

/// The service over an [`Agent`].
#[derive(Clone)]
pub struct CniServer {
    agent: Arc<Agent>,
}

fn pod(outcome: Outcome, message: impl Into<String>) -> Response<PodResponse> {
    Response::new(PodResponse {
        outcome: outcome as i32,
        message: message.into(),
        refusal: Refusal::Unspecified as i32,
    })
}

/// An ERROR the plugin reports as CNI error 102: the pod cannot be meshed, and
/// `message` names the field. The agent is the one judge of this: only it knows
/// whether it reads the flock annotations (with `--kube` it ignores them).
fn invalid_pod(message: impl Into<String>) -> Response<PodResponse> {
    Response::new(PodResponse {
        outcome: Outcome::Error as i32,
        message: message.into(),
        refusal: Refusal::InvalidPod as i32,
    })
}

fn key_of(container_id: &str, ifname: &str) -> Result<PodKey, Status> {
    if container_id.is_empty() || container_id.len() > 256 || ifname.len() > 64 {
        return Err(Status::invalid_argument(
            "container_id must be 1 to 256 bytes and ifname at most 64",
        ));
    }
    Ok(PodKey::new(container_id, ifname))
}

impl CniServer {
    /// A service over `agent`.
    pub fn new(agent: Arc<Agent>) -> Self {
        Self { agent }
    }

    /// Serves on the unix socket `path` (mode 0600) until `shutdown` resolves.
    pub async fn serve(
        self,
        path: &Path,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> std::io::Result<()> {
        let listener = Self::bind(path)?;
        self.serve_bound(listener, path, shutdown).await
    }

    /// Binds the unix socket `path` (mode 0600) in a private directory: created 0700
    /// if missing, refused if it is a symlink, owned by another uid, or group/other
    /// writable (anyone who can write there could swap the socket for their own).
    /// Connections wait in the backlog until [`serve_bound`](Self::serve_bound) runs.
    pub fn bind(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            flock_xds::server::ensure_private_dir(dir)?;
        }
        flock_xds::server::bind_unix(path)
    }

    /// Serves on `listener` (bound at `path` by [`bind`](Self::bind)) until `shutdown`
    /// resolves, then removes `path`.
    pub async fn serve_bound(
        self,
        listener: tokio::net::UnixListener,
        path: &Path,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> std::io::Result<()> {
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
        let own_uid = nix::unistd::geteuid().as_raw();
        let service = CniServiceServer::new(self).max_decoding_message_size(MAX_REQUEST_BYTES);
        let result = tonic::transport::Server::builder()
            .add_service(tonic::service::interceptor::InterceptedService::new(
                service,
                move |req: Request<()>| check_peer(&Peer::of(&req), own_uid).map(|()| req),
            ))
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await
            .map_err(std::io::Error::other);
        let _ = std::fs::remove_file(path);
        result
    }
}

/// Pid 1's network namespace, read once: an agent drops the capabilities that let it
/// read another process's namespace links soon after it starts, so it reads this one
/// before ([`remember_host_netns`]).
static HOST_NETNS: std::sync::OnceLock<Option<flock_core::pod::NetnsId>> =
    std::sync::OnceLock::new();

fn netns_id(path: &str) -> Option<flock_core::pod::NetnsId> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path)
        .ok()
        .map(|m| flock_core::pod::NetnsId {
            dev: m.dev(),
            ino: m.ino(),
        })
}

/// Reads pid 1's network namespace now, while this process may (call it before
/// dropping capabilities); the CNI server compares every ADD's namespace with it. `None`
/// when it cannot be read: then only the agent's own namespace is refused.
pub fn remember_host_netns() -> Option<flock_core::pod::NetnsId> {
    *HOST_NETNS.get_or_init(|| netns_id("/proc/1/ns/net"))
}

/// Refuses an ADD naming the host's or the agent's own network namespace
/// ([`flock_core::pod::check_netns_not_the_nodes`]). The namespaces are compared by
/// what `stat` returns (device, inode), so any path to them (`/proc/1/ns/net`,
/// `/proc/self/ns/net`, a bind mount) is caught. A path that cannot be read is left to
/// the later checks (a pod whose namespace is gone is not served, and the GC removes
/// it).
fn check_netns_not_the_nodes(netns: &str) -> Result<(), String> {
    // The bug this check closes: any namespace path was accepted, the node's own too.
    if flock_core::reintroduced!("netns-node-allowed") {
        return Ok(());
    }
    let Some(pod) = netns_id(netns) else {
        return Ok(());
    };
    flock_core::pod::check_netns_not_the_nodes(
        pod,
        remember_host_netns(),
        netns_id("/proc/self/ns/net"),
    )
}

/// Only the agent's own uid (the container runtime that runs the CNI plugin is root,
/// like the agent) may report or remove pods. The socket's mode already keeps other
/// uids out; this check is the second layer, so a socket left reachable by a mistaken
/// mode or directory still serves nobody else: a forged ADD would mesh a pod under any
/// service name and get it that service's identity.
fn check_peer(peer: &Peer, own_uid: u32) -> Result<(), Status> {
    // The bug this check closes: the file mode was the only gate.
    if flock_core::reintroduced!("cni-any-peer") {
        return Ok(());
    }
    match peer {
        Peer::Unix { uid, .. } if *uid == own_uid => Ok(()),
        Peer::Unix { uid, .. } => {
            tracing::warn!(%peer, "CNI call refused: the peer's uid is not the agent's");
            Err(Status::permission_denied(format!(
                "only uid {own_uid} may call the CNI service; this peer is uid {uid}"
            )))
        }
        other => Err(Status::unauthenticated(format!(
            "the CNI service is served on a unix socket only; peer {other} has no credentials"
        ))),
    }
}

#[tonic::async_trait]
impl CniService for CniServer {
    async fn add_pod(&self, req: Request<AddPodRequest>) -> Result<Response<PodResponse>, Status> {
        let req = req.into_inner();
        let pod_ref = req.pod.clone().unwrap_or_default();
        if req.annotations.len() > 256 {
            self.agent
                .metrics
                .pod_errors
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Ok(invalid_pod("more than 256 annotations"));
        }
        if let Err(why) = check_netns_not_the_nodes(&req.netns) {
            self.agent
                .metrics
                .pod_errors
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let container = req.container_id.chars().take(64).collect::<String>();
            tracing::warn!(%container, netns = %req.netns.chars().take(256).collect::<String>(), "AddPod refused: netns {why}");
            return Ok(invalid_pod(format!(
                "netns {:?} {why}",
                req.netns.chars().take(256).collect::<String>()
            )));
        }
        let input = AddPodInput {
            container_id: req.container_id,
            ifname: req.ifname,
            netns: req.netns,
            name: pod_ref.name,
            namespace: pod_ref.namespace,
            uid: pod_ref.uid,
            gateways: req.ips.iter().map(|ip| ip.gateway.clone()).collect(),
            ips: req.ips.into_iter().map(|ip| ip.address).collect(),
            annotations: req.annotations.into_iter().collect(),
            network_name: req.network_name,
        };
        let container = input.container_id.chars().take(64).collect::<String>();
        // Run to completion even if the plugin goes away meanwhile (undone then: the
        // runtime saw the ADD fail).
        Ok(match self.agent.add_pod_to_completion(input).await {
            Ok(PodOutcome::Done(m)) => pod(Outcome::Success, m),
            Ok(PodOutcome::Ignored(m)) => pod(Outcome::Ignored, m),
            Err(e @ PodError::Invalid(_)) => {
                tracing::warn!(%container, "AddPod refused: {e}");
                invalid_pod(e.to_string())
            }
            Err(e) => pod(Outcome::Error, e.to_string()),
        })
    }

    async fn remove_pod(
        &self,
        req: Request<RemovePodRequest>,
    ) -> Result<Response<PodResponse>, Status> {
        let req = req.into_inner();
        let key = key_of(&req.container_id, &req.ifname)?;
        // A DEL always completes, even if the plugin goes away meanwhile.
        Ok(match self.agent.remove_pod_to_completion(key).await {
            Ok(PodOutcome::Done(m)) => pod(Outcome::Success, m),
            Ok(PodOutcome::Ignored(m)) => pod(Outcome::Ignored, m),
            // The plugin reports it as a CNI error: the runtime retries the DEL.
            Err(e) => pod(Outcome::Error, e.to_string()),
        })
    }

    async fn check(&self, req: Request<CheckRequest>) -> Result<Response<PodResponse>, Status> {
        let req = req.into_inner();
        let key = key_of(&req.container_id, &req.ifname)?;
        Ok(match self.agent.check_pod(&key).await {
            Ok(()) => pod(Outcome::Success, format!("pod {key} is meshed")),
            Err(m) => pod(Outcome::Error, m),
        })
    }

    async fn garbage_collect(
        &self,
        req: Request<GarbageCollectRequest>,
    ) -> Result<Response<GarbageCollectResponse>, Status> {
        let req = req.into_inner();
        if req.valid_attachments.len() > 100_000 {
            return Err(Status::invalid_argument(
                "more than 100,000 valid attachments",
            ));
        }
        let mut valid: Vec<PodKey> = req
            .valid_attachments
            .iter()
            .map(|a| PodKey::new(&a.container_id, &a.ifname))
            .collect();
        // The runtime speaks for one network: pods of other networks stay valid.
        valid.extend(
            self.agent
                .pods()
                .into_values()
                .filter(|p| p.network_name != req.network_name)
                .map(|p| p.key),
        );
        let removed = self.agent.gc_sweep(Some(valid)).await;
        Ok(Response::new(GarbageCollectResponse {
            outcome: Outcome::Success as i32,
            message: format!("GC sweep done; removed {removed}"),
            removed: u32::try_from(removed).unwrap_or(u32::MAX),
            errors: Vec::new(),
        }))
    }

    async fn status(
        &self,
        _req: Request<StatusRequest>,
    ) -> Result<Response<StatusResponse>, Status> {
        Ok(Response::new(match self.agent.not_ready() {
            None => StatusResponse {
                availability: Availability::Available as i32,
                message: "flock-agent ready".into(),
            },
            Some(why) => StatusResponse {
                availability: Availability::NotAvailable as i32,
                message: format!("flock-agent not ready: {why}"),
            },
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_agents_own_uid_may_call() {
        let own = Peer::Unix {
            uid: 0,
            gid: 0,
            pid: Some(1),
        };
        assert!(check_peer(&own, 0).is_ok());
        let other = Peer::Unix {
            uid: 65534,
            gid: 65534,
            pid: None,
        };
        let refused = check_peer(&other, 0).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        assert!(
            refused.message().contains("uid 65534"),
            "{}",
            refused.message()
        );
        assert_eq!(
            check_peer(&Peer::Unknown, 0).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
    }
}
