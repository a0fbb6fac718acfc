//! A test DOUBLE of a SPIRE agent's Delegated Identity API, not a SPIRE agent.
//!
//! The gRPC server is generated (by `flock-bird/build.rs`, with protoc) from the
//! `delegatedidentity.proto` that the `spire-api` crate ships (copied, with the
//! `spire/api/types` files it imports, under `proto/`), with the messages mapped to
//! `spire-api`'s own types: the bridge's real client talks to it over a unix socket.
//!
//! What it does: every `SubscribeToX509SVIDs` request with `k8s:ns:<ns>` and
//! `k8s:sa:<sa>` selectors gets `spiffe://<td>/ns/<ns>/sa/<sa>` (as if SPIRE had one
//! registration entry per service account), issued by an rcgen CA; `rotate` sends every
//! open stream a new SVID; `restart` fails all streams and serves again on the same
//! socket; `hold`/`release` delay the answer to a pod's subscribe (to interleave an
//! unsubscribe with it); it counts requests and open streams per pod name.

#![allow(dead_code)]

use spire_api::pb::spire::api::agent::delegatedidentity::v1 as pb;
use spire_api::pb::spire::api::types::{Spiffeid, X509svid};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

#[allow(clippy::all, missing_docs)]
mod generated {
    include!(concat!(
        env!("OUT_DIR"),
        "/spire.api.agent.delegatedidentity.v1.rs"
    ));
}
use generated::delegated_identity_server::{DelegatedIdentity, DelegatedIdentityServer};

type SvidTx = mpsc::Sender<Result<pb::SubscribeToX509sviDsResponse, Status>>;

struct Stream1 {
    pod_name: String,
    spiffe_path: String,
    tx: SvidTx,
}

#[derive(Default)]
struct Counts {
    requests: BTreeMap<String, usize>,
    open: BTreeMap<String, usize>,
    pending: BTreeMap<String, usize>,
    serials: BTreeMap<String, String>,
}

struct Shared {
    trust_domain: String,
    ca: rcgen::Issuer<'static, rcgen::KeyPair>,
    ca_der: Vec<u8>,
    streams: Mutex<Vec<Stream1>>,
    bundle_txs: Mutex<Vec<mpsc::Sender<Result<pb::SubscribeToX509BundlesResponse, Status>>>>,
    counts: Mutex<Counts>,
    held: Mutex<BTreeMap<String, Arc<Notify>>>,
    changed: watch::Sender<u64>,
}

impl Shared {
    fn bump(&self) {
        self.changed.send_modify(|g| *g += 1);
    }

    fn issue(&self, path: &str) -> (pb::X509svidWithKey, String) {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::default();
        let uri = format!("spiffe://{}{}", self.trust_domain, path);
        params.subject_alt_names = vec![rcgen::SanType::URI(uri.try_into().expect("uri"))];
        let serial: [u8; 8] = rand_bytes();
        let mut serial = serial;
        serial[0] = (serial[0] & 0x7f) | 0x40;
        params.serial_number = Some(rcgen::SerialNumber::from_slice(&serial));
        let expires = std::time::SystemTime::now() + Duration::from_secs(3600);
        params.not_after = expires.into();
        let cert = params.signed_by(&key, &self.ca).expect("sign");
        let hex: String = serial.iter().map(|b| format!("{b:02x}")).collect();
        (
            pb::X509svidWithKey {
                x509_svid: Some(X509svid {
                    cert_chain: vec![cert.der().to_vec().into()],
                    id: Some(Spiffeid {
                        trust_domain: self.trust_domain.clone(),
                        path: path.to_string(),
                    }),
                    expires_at: expires
                        .duration_since(std::time::UNIX_EPOCH)
                        .unwrap()
                        .as_secs() as i64,
                    hint: String::new(),
                }),
                x509_svid_key: key.serialize_der().into(),
            },
            hex,
        )
    }
}

fn rand_bytes() -> [u8; 8] {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(1);
    h.finish().to_be_bytes()
}

fn selector<'a>(req: &'a pb::SubscribeToX509sviDsRequest, prefix: &str) -> Option<&'a str> {
    req.selectors
        .iter()
        .find(|s| s.r#type == "k8s" && s.value.starts_with(prefix))
        .map(|s| &s.value[prefix.len()..])
}

#[derive(Clone)]
struct Service(Arc<Shared>);

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl DelegatedIdentity for Service {
    type SubscribeToX509SVIDsStream = BoxStream<pb::SubscribeToX509sviDsResponse>;
    type SubscribeToX509BundlesStream = BoxStream<pb::SubscribeToX509BundlesResponse>;
    type SubscribeToJWTBundlesStream = BoxStream<pb::SubscribeToJwtBundlesResponse>;

    async fn subscribe_to_x509svi_ds(
        &self,
        request: Request<pb::SubscribeToX509sviDsRequest>,
    ) -> Result<Response<Self::SubscribeToX509SVIDsStream>, Status> {
        let req = request.into_inner();
        let (Some(ns), Some(sa), Some(pod)) = (
            selector(&req, "ns:"),
            selector(&req, "sa:"),
            selector(&req, "pod-name:"),
        ) else {
            return Err(Status::invalid_argument(
                "k8s ns, sa and pod-name selectors required",
            ));
        };
        let pod = pod.to_string();
        let path = format!("/ns/{ns}/sa/{sa}");
        let shared = &self.0;
        *shared
            .counts
            .lock()
            .unwrap()
            .requests
            .entry(pod.clone())
            .or_default() += 1;
        shared.bump();
        let held = shared.held.lock().unwrap().get(&pod).cloned();
        if let Some(gate) = held {
            // Created (so registered for `notify_waiters`) before it is counted.
            let notified = gate.notified();
            *shared
                .counts
                .lock()
                .unwrap()
                .pending
                .entry(pod.clone())
                .or_default() += 1;
            shared.bump();
            notified.await;
            *shared
                .counts
                .lock()
                .unwrap()
                .pending
                .entry(pod.clone())
                .or_default() -= 1;
        }
        let (tx, rx) = mpsc::channel(16);
        let (svid, serial) = shared.issue(&path);
        tx.try_send(Ok(pb::SubscribeToX509sviDsResponse {
            x509_svids: vec![svid],
            federates_with: vec![],
        }))
        .expect("first message");
        {
            let mut c = shared.counts.lock().unwrap();
            *c.open.entry(pod.clone()).or_default() += 1;
            c.serials.insert(pod.clone(), serial);
        }
        shared.bump();
        // Counts the stream as closed once the client (or a restart) drops it.
        let watcher = tx.clone();
        let s2 = Arc::clone(shared);
        let p2 = pod.clone();
        tokio::spawn(async move {
            watcher.closed().await;
            *s2.counts.lock().unwrap().open.entry(p2).or_default() -= 1;
            s2.bump();
        });
        shared.streams.lock().unwrap().push(Stream1 {
            pod_name: pod,
            spiffe_path: path,
            tx,
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn subscribe_to_x509_bundles(
        &self,
        _: Request<pb::SubscribeToX509BundlesRequest>,
    ) -> Result<Response<Self::SubscribeToX509BundlesStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        let mut map = std::collections::HashMap::new();
        map.insert(
            format!("spiffe://{}", self.0.trust_domain),
            self.0.ca_der.clone().into(),
        );
        tx.try_send(Ok(pb::SubscribeToX509BundlesResponse {
            ca_certificates: map,
        }))
        .expect("first bundle");
        self.0.bundle_txs.lock().unwrap().push(tx);
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn fetch_jwtsvi_ds(
        &self,
        _: Request<pb::FetchJwtsviDsRequest>,
    ) -> Result<Response<pb::FetchJwtsviDsResponse>, Status> {
        Err(Status::unimplemented("JWT-SVIDs are not in the double"))
    }

    async fn subscribe_to_jwt_bundles(
        &self,
        _: Request<pb::SubscribeToJwtBundlesRequest>,
    ) -> Result<Response<Self::SubscribeToJWTBundlesStream>, Status> {
        Err(Status::unimplemented("JWT bundles are not in the double"))
    }
}

/// The double, serving on a unix socket.
pub struct SpireDouble {
    socket: PathBuf,
    shared: Arc<Shared>,
    server: Option<(oneshot::Sender<()>, tokio::task::JoinHandle<()>)>,
}

impl SpireDouble {
    /// Starts the double on `socket` for trust domain `td`.
    pub async fn start(socket: &Path, td: &str) -> Self {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::default();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_cert = params.self_signed(&ca_key).unwrap();
        let shared = Arc::new(Shared {
            trust_domain: td.to_string(),
            ca_der: ca_cert.der().to_vec(),
            ca: rcgen::Issuer::new(params, ca_key),
            streams: Mutex::new(Vec::new()),
            bundle_txs: Mutex::new(Vec::new()),
            counts: Mutex::new(Counts::default()),
            held: Mutex::new(BTreeMap::new()),
            changed: watch::channel(0).0,
        });
        let mut d = Self {
            socket: socket.to_owned(),
            shared,
            server: None,
        };
        d.serve();
        d
    }

    fn serve(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
        let listener = tokio::net::UnixListener::bind(&self.socket).unwrap();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let svc = DelegatedIdentityServer::new(Service(Arc::clone(&self.shared)));
        let task = tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stop_rx.await;
                })
                .await;
        });
        self.server = Some((stop_tx, task));
    }

    /// The CA certificate (DER) of the trust domain.
    pub fn ca_der(&self) -> &[u8] {
        &self.shared.ca_der
    }

    /// Stops the server (failing every open stream), then serves again on the same
    /// socket: a SPIRE agent restart, as far as its clients can tell.
    pub async fn restart(&mut self) {
        self.stop().await;
        self.serve();
    }

    /// Stops the server, failing every open stream.
    pub async fn stop(&mut self) {
        for s in self.shared.streams.lock().unwrap().drain(..) {
            let _ =
                s.tx.try_send(Err(Status::unavailable("SPIRE agent restarting")));
        }
        for tx in self.shared.bundle_txs.lock().unwrap().drain(..) {
            let _ = tx.try_send(Err(Status::unavailable("SPIRE agent restarting")));
        }
        if let Some((stop, task)) = self.server.take() {
            let _ = stop.send(());
            let abort = task.abort_handle();
            if tokio::time::timeout(Duration::from_secs(5), task)
                .await
                .is_err()
            {
                abort.abort();
            }
        }
        let _ = std::fs::remove_file(&self.socket);
    }

    /// Sends every open stream a freshly issued SVID; returns how many.
    pub async fn rotate(&self) -> usize {
        let streams: Vec<(String, String, SvidTx)> = self
            .shared
            .streams
            .lock()
            .unwrap()
            .iter()
            .filter(|s| !s.tx.is_closed())
            .map(|s| (s.pod_name.clone(), s.spiffe_path.clone(), s.tx.clone()))
            .collect();
        let mut n = 0;
        for (pod, path, tx) in streams {
            let (svid, serial) = self.shared.issue(&path);
            if tx
                .send(Ok(pb::SubscribeToX509sviDsResponse {
                    x509_svids: vec![svid],
                    federates_with: vec![],
                }))
                .await
                .is_ok()
            {
                self.shared
                    .counts
                    .lock()
                    .unwrap()
                    .serials
                    .insert(pod, serial);
                n += 1;
            }
        }
        self.shared.bump();
        n
    }

    /// Holds the answers to `pod`'s subscribe requests until [`SpireDouble::release`].
    pub fn hold(&self, pod: &str) {
        self.shared
            .held
            .lock()
            .unwrap()
            .insert(pod.to_string(), Arc::new(Notify::new()));
    }

    /// Answers the held subscribe requests of `pod`.
    pub fn release(&self, pod: &str) {
        if let Some(gate) = self.shared.held.lock().unwrap().remove(pod) {
            gate.notify_waiters();
        }
    }

    /// Subscribe requests received for `pod` (over all restarts).
    pub fn requests(&self, pod: &str) -> usize {
        self.count(|c| &c.requests, pod)
    }

    /// Streams of `pod` currently open.
    pub fn open_streams(&self, pod: &str) -> usize {
        self.count(|c| &c.open, pod)
    }

    /// Requests of `pod` being held.
    pub fn pending(&self, pod: &str) -> usize {
        self.count(|c| &c.pending, pod)
    }

    /// Serial (hex) of the last SVID sent for `pod`.
    pub fn last_serial(&self, pod: &str) -> Option<String> {
        self.shared.counts.lock().unwrap().serials.get(pod).cloned()
    }

    fn count(&self, f: impl Fn(&Counts) -> &BTreeMap<String, usize>, pod: &str) -> usize {
        f(&self.shared.counts.lock().unwrap())
            .get(pod)
            .copied()
            .unwrap_or(0)
    }

    /// Waits (up to `timeout`) until `cond` holds of the double; returns whether it did.
    pub async fn wait(&self, timeout: Duration, cond: impl Fn(&Self) -> bool) -> bool {
        let mut rx = self.shared.changed.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            rx.borrow_and_update();
            if cond(self) {
                return true;
            }
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                return cond(self);
            }
        }
    }
}
