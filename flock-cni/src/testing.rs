//! A test double of the agent's `flock.cni.v1.CniService` on a unix socket (feature
//! `testing`). It is NOT the agent (that is flock-bird's CNI server): it keeps the pods
//! it was told about in memory, answers like the real one should, records every call,
//! and can be told to fail, stall or report itself unavailable.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use flock_core::sync::{Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

use crate::proto::v1::cni_service_server::{CniService, CniServiceServer};
use crate::proto::v1::{
    AddPodRequest, Availability, CheckRequest, GarbageCollectRequest, GarbageCollectResponse,
    Outcome, PodResponse, Refusal, RemovePodRequest, StatusRequest, StatusResponse,
};

/// A call the double received.
#[derive(Debug, Clone, PartialEq)]
pub enum Call {
    /// AddPod.
    Add(AddPodRequest),
    /// RemovePod.
    Remove(RemovePodRequest),
    /// Check.
    Check(CheckRequest),
    /// GarbageCollect.
    Gc(GarbageCollectRequest),
    /// Status.
    Status(StatusRequest),
}

/// How the double answers.
#[derive(Debug, Clone)]
pub struct Behavior {
    /// AddPod's answer (default SUCCESS).
    pub add_outcome: Outcome,
    /// The message with it.
    pub add_message: String,
    /// The refusal kind with an ERROR (default UNSPECIFIED).
    pub add_refusal: Refusal,
    /// Status's answer (default AVAILABLE).
    pub availability: Availability,
    /// Sleep this long before answering any call (to test timeouts).
    pub delay: Duration,
    /// GC reports these errors (and still removes what it can).
    pub gc_errors: Vec<String>,
}

impl Default for Behavior {
    fn default() -> Self {
        Self {
            add_outcome: Outcome::Success,
            add_message: String::new(),
            add_refusal: Refusal::Unspecified,
            availability: Availability::Available,
            delay: Duration::ZERO,
            gc_errors: Vec::new(),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    behavior: Behavior,
    calls: Vec<Call>,
    /// (container_id, ifname) → network name.
    pods: BTreeMap<(String, String), String>,
}

#[derive(Clone)]
struct Service(Arc<Mutex<State>>);

impl Service {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.0.lock()
    }

    async fn enter(&self, call: Call) -> Behavior {
        let behavior = {
            let mut s = self.lock();
            s.calls.push(call);
            s.behavior.clone()
        };
        if !behavior.delay.is_zero() {
            tokio::time::sleep(behavior.delay).await;
        }
        behavior
    }
}

fn pod(outcome: Outcome, message: impl Into<String>) -> Response<PodResponse> {
    refused(outcome, message, Refusal::Unspecified)
}

fn refused(
    outcome: Outcome,
    message: impl Into<String>,
    refusal: Refusal,
) -> Response<PodResponse> {
    Response::new(PodResponse {
        outcome: outcome as i32,
        message: message.into(),
        refusal: refusal as i32,
    })
}

#[tonic::async_trait]
impl CniService for Service {
    async fn add_pod(&self, req: Request<AddPodRequest>) -> Result<Response<PodResponse>, Status> {
        let req = req.into_inner();
        let b = self.enter(Call::Add(req.clone())).await;
        if b.add_outcome == Outcome::Success {
            self.lock().pods.insert(
                (req.container_id.clone(), req.ifname.clone()),
                req.network_name.clone(),
            );
        }
        Ok(refused(b.add_outcome, b.add_message, b.add_refusal))
    }

    async fn remove_pod(
        &self,
        req: Request<RemovePodRequest>,
    ) -> Result<Response<PodResponse>, Status> {
        let req = req.into_inner();
        self.enter(Call::Remove(req.clone())).await;
        let removed = self
            .lock()
            .pods
            .remove(&(req.container_id.clone(), req.ifname.clone()));
        Ok(match removed {
            Some(_) => pod(Outcome::Success, ""),
            None => pod(Outcome::Ignored, "unknown pod"),
        })
    }

    async fn check(&self, req: Request<CheckRequest>) -> Result<Response<PodResponse>, Status> {
        let req = req.into_inner();
        self.enter(Call::Check(req.clone())).await;
        let known = self
            .lock()
            .pods
            .contains_key(&(req.container_id.clone(), req.ifname.clone()));
        Ok(if known {
            pod(Outcome::Success, "")
        } else {
            pod(
                Outcome::Error,
                format!("container {} is not known to the agent", req.container_id),
            )
        })
    }

    async fn garbage_collect(
        &self,
        req: Request<GarbageCollectRequest>,
    ) -> Result<Response<GarbageCollectResponse>, Status> {
        let req = req.into_inner();
        let b = self.enter(Call::Gc(req.clone())).await;
        let mut s = self.lock();
        let before = s.pods.len();
        s.pods.retain(|(id, ifname), net| {
            *net != req.network_name
                || req
                    .valid_attachments
                    .iter()
                    .any(|a| &a.container_id == id && &a.ifname == ifname)
        });
        let removed = u32::try_from(before - s.pods.len()).unwrap_or(u32::MAX);
        Ok(Response::new(GarbageCollectResponse {
            outcome: Outcome::Success as i32,
            message: String::new(),
            removed,
            errors: b.gc_errors,
        }))
    }

    async fn status(
        &self,
        req: Request<StatusRequest>,
    ) -> Result<Response<StatusResponse>, Status> {
        let b = self.enter(Call::Status(req.into_inner())).await;
        Ok(Response::new(StatusResponse {
            availability: b.availability as i32,
            message: format!("test agent: {:?}", b.availability),
        }))
    }
}

/// A running double; stops (and removes its socket) when dropped.
pub struct TestAgent {
    socket: PathBuf,
    state: Arc<Mutex<State>>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl TestAgent {
    /// Binds `socket` (which must not exist) and serves on a thread of its own.
    pub fn start(socket: &Path) -> std::io::Result<Self> {
        let listener = std::os::unix::net::UnixListener::bind(socket)?;
        listener.set_nonblocking(true)?;
        let state = Arc::new(Mutex::new(State::default()));
        let service = Service(state.clone());
        let (stop, stopped) = oneshot::channel::<()>();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let thread = std::thread::Builder::new()
            .name("test-agent".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let Ok(listener) = tokio::net::UnixListener::from_std(listener) else {
                        return;
                    };
                    let _ = tonic::transport::Server::builder()
                        .add_service(CniServiceServer::new(service))
                        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                            let _ = stopped.await;
                        })
                        .await;
                });
            })?;
        Ok(Self {
            socket: socket.to_owned(),
            state,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The socket path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Changes how it answers from now on.
    pub fn set(&self, f: impl FnOnce(&mut Behavior)) {
        f(&mut self.lock().behavior);
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<Call> {
        self.lock().calls.clone()
    }

    /// The pods it holds: (container ID, ifname).
    pub fn pods(&self) -> Vec<(String, String)> {
        self.lock().pods.keys().cloned().collect()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }
}

impl Drop for TestAgent {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}
