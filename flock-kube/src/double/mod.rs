//! A Kubernetes API-server double for tests (feature `testing`).
//!
//! It is a test double because no API server (nor etcd-backed control plane) can run on
//! the machines this suite runs on. It is a real HTTP/1.1 server on 127.0.0.1 (hyper),
//! so `kube::Client`, kube's watcher and the agent binary talk to it over TCP exactly
//! as to a cluster; objects are stored as JSON in the k8s-openapi shapes.
//!
//! Behaviours implemented (and only these), for `pods`, `services` (core v1),
//! `endpointslices` (discovery.k8s.io/v1), `namespaces`, `nodes`, flock's own
//! `authorizationpolicies` (flock.io/v1alpha1) and the Gateway API's `httproutes`
//! (gateway.networking.k8s.io/v1), custom resources stored as given (the double does
//! not apply a CRD's schema; [`ApiServer::set_policy_crd_installed`] removes flock's):
//! * **Authentication**: every request must carry `Authorization: Bearer <token>` with
//!   the server's random token, else `401 Unauthorized` (a Status object).
//! * **GET one** (`…/{name}`), 404 NotFound Status when absent.
//! * **LIST** (cluster-wide and per namespace) answering `<Kind>List` with
//!   `metadata.resourceVersion`; `labelSelector` (equality-based: `k=v`, `k==v`,
//!   `k!=v`, `k`, `!k`, comma-joined; set-based forms are refused with 400);
//!   `fieldSelector` (`metadata.name`, `metadata.namespace`, and `spec.nodeName` on
//!   pods, with `=`, `==`, `!=`; others 400 as the real server does); `limit` and
//!   `continue` (kube's watcher sends `limit=500`; a continue token older than the
//!   compaction point answers 410 Expired). `resourceVersion`/`resourceVersionMatch`
//!   on a list are accepted and the current state is served.
//! * **WATCH** (`watch=true`): chunked JSON lines `{"type","object"}` of ADDED,
//!   MODIFIED, DELETED, BOOKMARK and ERROR; from `resourceVersion=N` it replays the
//!   logged changes after N, from `0`/unset it first sends every current object as
//!   ADDED; selectors filter events as the real server does (an object that starts
//!   matching is ADDED to the watch, one that stops matching is DELETED);
//!   `allowWatchBookmarks=true` gets a BOOKMARK at the current resourceVersion every
//!   [`BOOKMARK_INTERVAL`]; `sendInitialEvents=true` ends the initial ADDED events with
//!   a BOOKMARK annotated `k8s.io/initial-events-end`; `timeoutSeconds` ends the stream
//!   cleanly (optionally capped by [`ApiServer::set_watch_timeout_cap`]); a
//!   `resourceVersion` older than the compaction point gets one ERROR event carrying a
//!   Status with code 410, reason Expired (as the watch cache sends it), then the
//!   stream ends.
//! * **status subresource** of HTTPRoutes (get, merge patch): a write of the object
//!   keeps its stored status and a write of `…/status` changes only the status, as for
//!   a CRD with `subresources.status`; `metadata.generation` counts spec changes;
//! * **PATCH** with `application/merge-patch+json` (RFC 7386) on any of the resources;
//!   a `metadata.resourceVersion` in the patch that is not the stored one answers
//!   `409 Conflict`; other patch types answer 415.
//! * **create** (POST), **update** (PUT, 409 on a stale resourceVersion) and
//!   **delete** (DELETE), and `GET /version`.
//! * Faults: [`ApiServer::set_unreachable`] (connections closed, new ones dropped on
//!   accept), [`ApiServer::compact`] (older resourceVersions answer 410),
//!   [`ApiServer::drop_watches`] (every watch connection cut mid-stream),
//!   [`ApiServer::end_watches`] (every watch ended cleanly, as a server timeout),
//!   [`ApiServer::write_before_next_patch`] (a concurrent writer between a client's
//!   read and its PATCH),
//!   [`ApiServer::pause_watch_delivery`] (watch events held back: a lagging watch).
//! * Audit: [`ApiServer::requests`], and with env `FLOCK_KUBE_AUDIT_DIR` one JSON line
//!   per request (`verb`, `group`, `resource`, `namespace`, `subresource`, verbs named
//!   as RBAC names them) appended to `$FLOCK_KUBE_AUDIT_DIR/<pid>-<server#>.jsonl`.
//!
//! Not implemented: other resources, set-based selectors, strategic-merge, JSON and
//! server-side-apply patches, admission, defaulting and validation beyond
//! `metadata.name`, generateName, finalizers and graceful deletion, consistent
//! snapshots across list pages (a later page is read from the current state).

mod store;

use std::convert::Infallible;
use std::hash::BuildHasher;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::StreamExt;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Bytes, Frame, Incoming};
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use store::{Kind, Selector, Store, Subscription, WatchMsg, WriteError, event_line};

/// How often a watch that asked for bookmarks gets one.
pub const BOOKMARK_INTERVAL: Duration = Duration::from_secs(1);
/// The largest request body the double reads.
const MAX_BODY: usize = 1 << 20;
/// The stream length when a watch sends no `timeoutSeconds`.
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);

static SERVERS: AtomicU64 = AtomicU64::new(0);

/// One request, as the RBAC rule that would authorise it names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ApiRequest {
    /// get, list, watch, create, update, patch or delete.
    pub verb: String,
    /// API group (`""` for core).
    pub group: String,
    /// Resource plural, e.g. `pods`.
    pub resource: String,
    /// Namespace of a namespaced request.
    pub namespace: Option<String>,
    /// Subresource, e.g. `status`.
    pub subresource: Option<String>,
}

type Body = UnsyncBoxBody<Bytes, std::io::Error>;

struct Shared {
    store: Mutex<Store>,
    token: String,
    down: AtomicBool,
    /// The `flock.io` CRD is not installed: its paths answer 404.
    no_policy_crd: AtomicBool,
    /// Bumped to close every open connection.
    kill: watch::Sender<u64>,
    /// True while watch streams hold their events back.
    paused: watch::Sender<bool>,
    /// Bumped to end every open watch stream cleanly.
    end: watch::Sender<u64>,
    /// Watches answered with 410 Gone.
    gone: AtomicU64,
    /// Objects written (as by another client) just before the next PATCHes, one each.
    before_patch: Mutex<std::collections::VecDeque<(Kind, Value)>>,
    watch_cap: Mutex<Option<Duration>>,
    audit: Mutex<Vec<ApiRequest>>,
    audit_file: Option<PathBuf>,
    /// The suffix of the next `generateName` name.
    generated: AtomicU64,
}

impl Shared {
    fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn record(&self, req: ApiRequest) {
        if let Some(path) = &self.audit_file {
            // One write(2) per record: `writeln!` on an unbuffered file issues the
            // line and its newline as separate writes, and two connections' records
            // then interleave into one unparseable line (O_APPEND makes each single
            // write atomic, not a pair of them).
            let mut line = serde_json::to_string(&req).unwrap_or_default();
            line.push('\n');
            let written = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .and_then(|mut f| f.write_all(line.as_bytes()));
            if let Err(e) = written {
                tracing::warn!(path = %path.display(), error = %e, "API double: audit line not written");
            }
        }
        self.audit
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(req);
    }
}

/// The API-server double. Dropping it stops the server and closes its connections.
pub struct ApiServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        self.shared.kill.send_modify(|n| *n += 1);
    }
}

fn random_token() -> String {
    let s = std::collections::hash_map::RandomState::new();
    format!("{:016x}{:016x}", s.hash_one(1u8), s.hash_one(2u8))
}

fn kind_of<K: k8s_openapi::Resource>() -> Kind {
    Kind::from_group_plural(K::GROUP, K::URL_PATH_SEGMENT).unwrap_or_else(|| {
        panic!(
            "the API-server double does not serve {} (group {:?})",
            K::URL_PATH_SEGMENT,
            K::GROUP
        )
    })
}

impl ApiServer {
    /// Starts the double on an ephemeral port of 127.0.0.1.
    pub async fn start() -> ApiServer {
        Self::start_on(std::net::Ipv4Addr::LOCALHOST.into()).await
    }

    /// Starts the double on an ephemeral port of `ip` (an address agents in other
    /// network namespaces reach, such as a test underlay's bridge).
    pub async fn start_on(ip: std::net::IpAddr) -> ApiServer {
        let listener = TcpListener::bind((ip, 0))
            .await
            .unwrap_or_else(|e| panic!("API double: bind {ip}:0: {e}"));
        let addr = listener.local_addr().expect("API double: local address");
        let n = SERVERS.fetch_add(1, Ordering::Relaxed);
        let audit_file = std::env::var_os("FLOCK_KUBE_AUDIT_DIR")
            .map(|d| PathBuf::from(d).join(format!("{}-{n}.jsonl", std::process::id())));
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::default()),
            token: random_token(),
            down: AtomicBool::new(false),
            no_policy_crd: AtomicBool::new(false),
            kill: watch::Sender::new(0),
            paused: watch::Sender::new(false),
            end: watch::Sender::new(0),
            gone: AtomicU64::new(0),
            before_patch: Mutex::new(std::collections::VecDeque::new()),
            watch_cap: Mutex::new(None),
            audit: Mutex::new(Vec::new()),
            audit_file,
            generated: AtomicU64::new(0),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        let ticker = {
            let shared = shared.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(BOOKMARK_INTERVAL);
                loop {
                    tick.tick().await;
                    shared.store().bookmark_all();
                }
            })
        };
        ApiServer {
            shared,
            addr,
            tasks: vec![accept, ticker],
        }
    }

    /// `http://<address>:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bearer token the double requires.
    pub fn token(&self) -> &str {
        &self.shared.token
    }

    /// A client for in-process tests (needs a tokio runtime).
    pub fn client(&self) -> kube::Client {
        let mut config = kube::Config::new(self.url().parse().expect("API double: URL"));
        config.headers.push((
            AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {}", self.shared.token))
                .expect("API double: token is a header value"),
        ));
        kube::Client::try_from(config).expect("API double: kube client")
    }

    /// Writes a kubeconfig (plain-http cluster, bearer token) the agent binary can
    /// load with `--kubeconfig`; mode 0600 as it holds the token.
    pub fn write_kubeconfig(&self, path: &Path) {
        use std::os::unix::fs::OpenOptionsExt;
        // JSON is YAML: kube reads it as any kubeconfig.
        let config = json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{ "name": "flock-double", "cluster": { "server": self.url() } }],
            "users": [{ "name": "flock-agent", "user": { "token": self.shared.token } }],
            "contexts": [{ "name": "flock-double",
                "context": { "cluster": "flock-double", "user": "flock-agent", "namespace": "default" } }],
            "current-context": "flock-double",
        });
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .mode(0o600)
            .open(path)
            .unwrap_or_else(|e| panic!("API double: write {}: {e}", path.display()));
        file.write_all(config.to_string().as_bytes())
            .unwrap_or_else(|e| panic!("API double: write {}: {e}", path.display()));
    }

    /// Creates or replaces an object (resourceVersion bumped; ADDED or MODIFIED sent
    /// to the watches). A namespaced object without a namespace goes to `default`.
    pub fn apply<K: Serialize + k8s_openapi::Resource>(&self, obj: &K) {
        let mut value = serde_json::to_value(obj).expect("API double: serialize object");
        // Unconditional: a test re-applying an object it read earlier means "this
        // content", not "only if still at that version".
        if let Some(m) = value.get_mut("metadata").and_then(Value::as_object_mut) {
            m.remove("resourceVersion");
        }
        if let Err(e) = self
            .shared
            .store()
            .put(kind_of::<K>(), value, false, false, false)
        {
            panic!("API double: apply refused: {e:?}");
        }
    }

    /// Serves flock's `AuthorizationPolicy` resource (as if its CRD were installed:
    /// the default) or answers 404 for it, as a cluster without the CRD does.
    pub fn set_policy_crd_installed(&self, installed: bool) {
        self.shared
            .no_policy_crd
            .store(!installed, Ordering::Relaxed);
    }

    /// Deletes an object (DELETED sent to the watches); false when it was absent.
    pub fn delete<K: k8s_openapi::Resource>(&self, namespace: Option<&str>, name: &str) -> bool {
        self.shared
            .store()
            .remove(kind_of::<K>(), namespace.unwrap_or_default(), name)
            .is_some()
    }

    /// The stored object.
    pub fn get<K: DeserializeOwned + k8s_openapi::Resource>(
        &self,
        namespace: Option<&str>,
        name: &str,
    ) -> Option<K> {
        let obj = self
            .shared
            .store()
            .get(kind_of::<K>(), namespace.unwrap_or_default(), name)
            .cloned()?;
        Some(serde_json::from_value(obj).expect("API double: stored object deserializes"))
    }

    /// Every stored object of `K` in `namespace` (all namespaces: `None`), read in
    /// process: not an API request, so not in the audit.
    pub fn list<K: DeserializeOwned + k8s_openapi::Resource>(
        &self,
        namespace: Option<&str>,
    ) -> Vec<K> {
        self.shared
            .store()
            .list(kind_of::<K>(), namespace, None)
            .map(|(_, obj)| {
                serde_json::from_value(obj.clone()).expect("API double: stored object deserializes")
            })
            .collect()
    }

    /// While `down`, every open connection (watches included) is closed and new ones
    /// are closed on accept: the API is unreachable.
    pub fn set_unreachable(&self, down: bool) {
        self.shared.down.store(down, Ordering::SeqCst);
        if down {
            self.shared.store().drop_watches();
            self.shared.kill.send_modify(|n| *n += 1);
        }
    }

    /// Forgets the change log: a watch from an older resourceVersion (or a continue
    /// token from before) answers 410 Gone, forcing the client to re-list.
    pub fn compact(&self) {
        self.shared.store().compact();
    }

    /// Cuts every open watch connection mid-stream (no clean end of the chunked body).
    pub fn drop_watches(&self) {
        self.shared.store().drop_watches();
    }

    /// Ends every open watch stream cleanly (the chunked body completes), as a
    /// server-side watch timeout does, even while delivery is paused: events held back
    /// are not delivered on that stream, so the client resumes from the older
    /// resourceVersion it last saw.
    pub fn end_watches(&self) {
        self.shared.end.send_modify(|n| *n += 1);
    }

    /// Watches answered with 410 Gone so far.
    pub fn gone_answers(&self) -> u64 {
        self.shared.gone.load(Ordering::SeqCst)
    }

    /// Queues `obj` to be written (as by another client) just before the next PATCH
    /// is processed, one queued object per PATCH: a concurrent modification between
    /// the patcher's read and its write.
    pub fn write_before_next_patch<K: Serialize + k8s_openapi::Resource>(&self, obj: &K) {
        let mut value = serde_json::to_value(obj).expect("API double: serialize object");
        if let Some(m) = value.get_mut("metadata").and_then(Value::as_object_mut) {
            m.remove("resourceVersion");
        }
        self.shared
            .before_patch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back((kind_of::<K>(), value));
    }

    /// While `paused`, watch streams hold their events back (delivered in order when
    /// resumed): a watcher that lags behind the stored state.
    pub fn pause_watch_delivery(&self, paused: bool) {
        self.shared.paused.send_replace(paused);
    }

    /// Caps the length of every watch started from now on (a server-side watch
    /// timeout shorter than the client's `timeoutSeconds`).
    pub fn set_watch_timeout_cap(&self, cap: Option<Duration>) {
        *self
            .shared
            .watch_cap
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = cap;
    }

    /// Watches open now.
    pub fn open_watches(&self) -> usize {
        self.shared.store().open_watches()
    }

    /// The current resourceVersion (the last write's).
    pub fn resource_version(&self) -> u64 {
        self.shared.store().resource_version()
    }

    /// Every authenticated request so far, in arrival order.
    pub fn requests(&self) -> Vec<ApiRequest> {
        self.shared
            .audit
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        // Subscribed before the check: `set_unreachable` sets `down` and then bumps
        // `kill`, so a connection accepted as the API goes down is closed either way.
        let mut kill = shared.kill.subscribe();
        if shared.down.load(Ordering::SeqCst) {
            drop(stream);
            continue;
        }
        let shared = shared.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| handle(shared.clone(), req));
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            tokio::select! {
                _ = conn => {}
                _ = kill.changed() => {}
            }
        });
    }
}

fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

fn json_response(code: StatusCode, body: &Value) -> Response<Body> {
    let mut resp = Response::new(full(body.to_string()));
    *resp.status_mut() = code;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

fn status_object(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code,
    })
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    json_response(code, &status_object(code.as_u16(), reason, message))
}

fn not_found(kind: Kind, name: &str) -> Response<Body> {
    let mut body = status_object(
        404,
        "NotFound",
        &format!("{} \"{name}\" not found", kind.plural()),
    );
    body["details"] = json!({ "name": name, "kind": kind.plural(), "group": kind.group() });
    json_response(StatusCode::NOT_FOUND, &body)
}

/// `%XX` and `+` decoding of one query component (a bad escape stays as it is).
fn percent_decode(s: &str) -> String {
    fn hex(b: u8) -> Option<u8> {
        (b as char).to_digit(16).and_then(|d| u8::try_from(d).ok())
    }
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => match (
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            ) {
                (Some(hi), Some(lo)) => {
                    out.push(hi * 16 + lo);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query_params(query: Option<&str>) -> Vec<(String, String)> {
    query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

/// A request path resolved to a resource.
struct Target {
    kind: Kind,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
}

fn route(path: &str) -> Option<Target> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segs.as_slice() {
        ["api", "v1", rest @ ..] => ("", "v1", rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => return None,
    };
    let resolve = |plural: &str| Kind::from_path(group, version, plural);
    let target = |kind: Kind, namespace: Option<&str>, name: Option<&str>, sub: Option<&str>| {
        Some(Target {
            kind,
            namespace: namespace.map(str::to_string),
            name: name.map(str::to_string),
            subresource: sub.map(str::to_string),
        })
    };
    match rest {
        ["namespaces", ns, plural, tail @ ..] if resolve(plural).is_some_and(Kind::namespaced) => {
            let kind = resolve(plural)?;
            match tail {
                [] => target(kind, Some(ns), None, None),
                [name] => target(kind, Some(ns), Some(name), None),
                [name, sub] => target(kind, Some(ns), Some(name), Some(sub)),
                _ => None,
            }
        }
        [plural, tail @ ..] => {
            let kind = resolve(plural)?;
            match tail {
                [] => target(kind, None, None, None),
                [name] if !kind.namespaced() => target(kind, None, Some(name), None),
                [name, sub] if !kind.namespaced() => target(kind, None, Some(name), Some(sub)),
                _ => None,
            }
        }
        [] => None,
    }
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let authorised = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|t| t == shared.token);
    if !authorised {
        return Ok(status(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            "Unauthorized",
        ));
    }
    if req.uri().path() == "/version" && req.method() == Method::GET {
        return Ok(json_response(
            StatusCode::OK,
            &json!({ "major": "1", "minor": "33", "gitVersion": "v1.33.0-flock-double",
                "platform": "linux/amd64" }),
        ));
    }
    let crd_missing = |t: &Target| {
        t.kind == Kind::AuthorizationPolicies && shared.no_policy_crd.load(Ordering::Relaxed)
    };
    let Some(target) = route(req.uri().path()).filter(|t| !crd_missing(t)) else {
        return Ok(status(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("the API-server double does not serve {}", req.uri().path()),
        ));
    };
    let params = query_params(req.uri().query());
    let param = |k: &str| params.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let watching = param("watch").is_some_and(|v| v == "true" || v == "1");
    let verb = match (req.method().clone(), &target.name) {
        (Method::GET, Some(_)) => "get",
        (Method::GET, None) if watching => "watch",
        (Method::GET, None) => "list",
        (Method::POST, None) => "create",
        (Method::PUT, Some(_)) => "update",
        (Method::PATCH, Some(_)) => "patch",
        (Method::DELETE, Some(_)) => "delete",
        _ => {
            return Ok(status(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                &format!("{} is not allowed on {}", req.method(), req.uri().path()),
            ));
        }
    };
    shared.record(ApiRequest {
        verb: verb.into(),
        group: target.kind.group().into(),
        resource: target.kind.plural().into(),
        namespace: target.namespace.clone(),
        subresource: target.subresource.clone(),
    });
    if let Some(sub) = target
        .subresource
        .as_ref()
        .filter(|sub| !(*sub == "status" && target.kind.has_status_subresource()))
    {
        return Ok(status(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("the API-server double does not serve subresource {sub}"),
        ));
    }
    if target.subresource.is_some() && !matches!(verb, "get" | "patch") {
        return Ok(status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            &format!(
                "the API-server double serves only get and patch on {}",
                req.uri().path()
            ),
        ));
    }
    let labels = match Selector::labels(param("labelSelector").unwrap_or_default()) {
        Ok(s) => s,
        Err(e) => return Ok(status(StatusCode::BAD_REQUEST, "BadRequest", &e)),
    };
    let fields = match Selector::fields(param("fieldSelector").unwrap_or_default(), target.kind) {
        Ok(s) => s,
        Err(e) => return Ok(status(StatusCode::BAD_REQUEST, "BadRequest", &e)),
    };
    let resp = match verb {
        "get" => get_one(&shared, &target),
        "list" => list(
            &shared,
            &target,
            &labels,
            &fields,
            param("limit"),
            param("continue"),
        ),
        "watch" => {
            let rv = param("resourceVersion").unwrap_or_default();
            let timeout = param("timeoutSeconds").and_then(|t| t.parse::<u64>().ok());
            watch_stream(
                &shared,
                target,
                WatchQuery {
                    labels,
                    fields,
                    resource_version: rv,
                    timeout_seconds: timeout,
                    bookmarks: param("allowWatchBookmarks") == Some("true"),
                    send_initial_events: param("sendInitialEvents") == Some("true"),
                },
            )
        }
        _ => {
            let content_type = req
                .headers()
                .get(CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            let method = req.method().clone();
            let delete = method == Method::DELETE;
            let body = match read_json(req.into_body()).await {
                Ok(v) => v,
                // A DELETE may come without DeleteOptions.
                Err(_) if delete => Value::Null,
                Err(e) => return Ok(status(StatusCode::BAD_REQUEST, "BadRequest", &e)),
            };
            write(&shared, verb, &target, &content_type, body)
        }
    };
    Ok(resp)
}

async fn read_json(body: Incoming) -> Result<Value, String> {
    let bytes = Limited::new(body, MAX_BODY)
        .collect()
        .await
        .map_err(|e| format!("request body: {e}"))?
        .to_bytes();
    serde_json::from_slice(&bytes).map_err(|e| format!("request body is not JSON: {e}"))
}

fn get_one(shared: &Shared, target: &Target) -> Response<Body> {
    let name = target.name.as_deref().unwrap_or_default();
    match shared.store().get(
        target.kind,
        target.namespace.as_deref().unwrap_or_default(),
        name,
    ) {
        Some(obj) => json_response(StatusCode::OK, obj),
        None => not_found(target.kind, name),
    }
}

fn list(
    shared: &Shared,
    target: &Target,
    labels: &Selector,
    fields: &Selector,
    limit: Option<&str>,
    continue_token: Option<&str>,
) -> Response<Body> {
    let store = shared.store();
    let limit = limit
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0);
    // Continue token: "<rv>/<namespace>/<name>" of the last item sent.
    let (list_rv, after) = match continue_token.filter(|t| !t.is_empty()) {
        Some(token) => {
            let mut parts = token.splitn(3, '/');
            let rv = parts.next().and_then(|r| r.parse::<u64>().ok());
            let (Some(rv), Some(ns), Some(name)) = (rv, parts.next(), parts.next()) else {
                return status(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    "invalid continue token",
                );
            };
            if rv < store.compacted() {
                return status(
                    StatusCode::GONE,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list result. \
                     You can start a new list without the continue parameter.",
                );
            }
            (rv, Some((ns.to_string(), name.to_string())))
        }
        None => (store.resource_version(), None),
    };
    let mut items = Vec::new();
    let mut last = None;
    let mut more = None;
    for ((_, ns, name), obj) in store.list(target.kind, target.namespace.as_deref(), after.as_ref())
    {
        if !(labels.matches(obj) && fields.matches(obj)) {
            continue;
        }
        if limit.is_some_and(|l| items.len() == l) {
            more = last.map(|(ns, name): (&String, &String)| format!("{list_rv}/{ns}/{name}"));
            break;
        }
        items.push(obj.clone());
        last = Some((ns, name));
    }
    let mut metadata = json!({ "resourceVersion": list_rv.to_string() });
    if let Some(token) = more {
        metadata["continue"] = json!(token);
    }
    json_response(
        StatusCode::OK,
        &json!({
            "kind": format!("{}List", target.kind.kind()),
            "apiVersion": target.kind.api_version(),
            "metadata": metadata,
            "items": items,
        }),
    )
}

/// The query of a watch request.
struct WatchQuery<'a> {
    labels: Selector,
    fields: Selector,
    resource_version: &'a str,
    timeout_seconds: Option<u64>,
    bookmarks: bool,
    send_initial_events: bool,
}

fn watch_stream(shared: &Arc<Shared>, target: Target, query: WatchQuery<'_>) -> Response<Body> {
    let WatchQuery {
        labels,
        fields,
        resource_version,
        timeout_seconds,
        bookmarks,
        send_initial_events,
    } = query;
    let from = match resource_version {
        "" | "0" => None,
        n => match n.parse::<u64>() {
            Ok(n) => Some(n),
            Err(_) => {
                return status(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    &format!("invalid resourceVersion {n:?}"),
                );
            }
        },
    };
    let mut length = timeout_seconds.map_or(DEFAULT_WATCH_TIMEOUT, Duration::from_secs);
    if let Some(cap) = *shared.watch_cap.lock().unwrap_or_else(|p| p.into_inner()) {
        length = length.min(cap);
    }
    let deadline = tokio::time::Instant::now() + length;
    let (tx, rx) = mpsc::unbounded_channel();
    {
        let mut store = shared.store();
        let sub = Subscription {
            kind: target.kind,
            namespace: target.namespace,
            labels,
            fields,
            bookmarks,
            tx: tx.clone(),
        };
        match store.subscribe(sub, from) {
            Ok(()) => {
                if send_initial_events && from.is_none() {
                    let obj = json!({
                        "kind": target.kind.kind(), "apiVersion": target.kind.api_version(),
                        "metadata": { "resourceVersion": store.resource_version().to_string(),
                            "annotations": { "k8s.io/initial-events-end": "true" } }
                    });
                    let _ = tx.send(WatchMsg::Line(event_line("BOOKMARK", &obj)));
                }
            }
            Err(compacted) => {
                shared.gone.fetch_add(1, Ordering::SeqCst);
                let status = status_object(
                    410,
                    "Expired",
                    &format!(
                        "too old resource version: {} ({compacted})",
                        from.unwrap_or_default()
                    ),
                );
                let _ = tx.send(WatchMsg::Line(event_line("ERROR", &status)));
            }
        }
    }
    // Only the subscription (if any) holds a sender now: the stream ends when it is
    // dropped, and a refused (410) watch ends after its ERROR event.
    drop(tx);
    let paused = shared.paused.subscribe();
    let end = shared.end.subscribe();
    let stream = futures::stream::unfold(
        (rx, paused, end, false),
        move |(mut rx, mut paused, mut end, done)| async move {
            if done {
                return None;
            }
            let next = async {
                let msg = rx.recv().await;
                // A paused double holds events back (the watcher lags), checked after
                // the receive so an event that arrives just as the pause begins is
                // held too.
                while *paused.borrow_and_update() {
                    if paused.changed().await.is_err() {
                        break;
                    }
                }
                msg
            };
            // Biased: once the watch is ended (or past its deadline) nothing more is
            // delivered on it, even if events are queued.
            tokio::select! {
                biased;
                _ = end.changed() => None,
                () = tokio::time::sleep_until(deadline) => None,
                msg = next => match msg {
                    Some(WatchMsg::Line(line)) => Some((Ok(Frame::data(line)), (rx, paused, end, false))),
                    Some(WatchMsg::Drop) => Some((
                        Err(std::io::Error::new(
                            std::io::ErrorKind::ConnectionAborted,
                            "watch dropped by the API-server double",
                        )),
                        (rx, paused, end, true),
                    )),
                    None => None,
                },
            }
        },
    );
    let mut resp = Response::new(BodyExt::boxed_unsync(StreamBody::new(stream.boxed())));
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

fn write(
    shared: &Shared,
    verb: &str,
    target: &Target,
    content_type: &str,
    body: Value,
) -> Response<Body> {
    let kind = target.kind;
    let ns = target.namespace.clone().unwrap_or_default();
    let name = target.name.clone().unwrap_or_default();
    let mut store = shared.store();
    let result = match verb {
        "delete" => {
            // DeleteOptions.preconditions.uid: the real server refuses to delete an
            // object of another UID (one re-created under the same name) with 409.
            if let (Some(want), Some(obj)) = (
                body.pointer("/preconditions/uid").and_then(Value::as_str),
                store.get(kind, &ns, &name),
            ) {
                let have = obj
                    .pointer("/metadata/uid")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                if want != have {
                    return status(
                        StatusCode::CONFLICT,
                        "Conflict",
                        &format!(
                            "Precondition failed: UID in precondition: {want}, UID in object meta: {have}"
                        ),
                    );
                }
            }
            return match store.remove(kind, &ns, &name) {
                Some(obj) => json_response(StatusCode::OK, &obj),
                None => not_found(kind, &name),
            };
        }
        "create" => {
            let mut body = body;
            if kind.namespaced() && body.is_object() {
                body["metadata"]["namespace"] = json!(ns);
            }
            // metadata.generateName: the server picks the name (prefix + a suffix).
            if store::name_of(&body).is_none()
                && let Some(prefix) = body
                    .pointer("/metadata/generateName")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            {
                let n = shared
                    .generated
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                body["metadata"]["name"] = json!(format!("{prefix}{n:05x}"));
            }
            store
                .put(kind, body, false, false, true)
                .map(|o| (StatusCode::CREATED, o))
        }
        "update" => {
            if store::name_of(&body) != Some(name.as_str()) {
                return status(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    "metadata.name in the body does not match the URL",
                );
            }
            let mut body = body;
            if kind.namespaced() && body.is_object() {
                body["metadata"]["namespace"] = json!(ns);
            }
            store
                .put(kind, body, true, true, false)
                .map(|o| (StatusCode::OK, o))
        }
        _ => {
            let media = content_type.split(';').next().unwrap_or_default().trim();
            if media != "application/merge-patch+json" {
                return status(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "UnsupportedMediaType",
                    &format!(
                        "the API-server double accepts only application/merge-patch+json patches, not {media:?}"
                    ),
                );
            }
            let interposed = shared
                .before_patch
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop_front();
            if let Some((k, obj)) = interposed {
                // An object with a status subresource: its status is written too, as
                // its controller would (a write of the object alone keeps the stored
                // status).
                let status_too = k.has_status_subresource() && obj.get("status").is_some();
                let written = store
                    .put(k, obj.clone(), false, false, false)
                    .and_then(|_| {
                        if status_too {
                            store.put_status(k, obj, false)
                        } else {
                            Ok(Value::Null)
                        }
                    });
                if let Err(e) = written {
                    tracing::warn!(error = ?e, "API double: interposed write refused");
                }
            }
            let Some(current) = store.get(kind, &ns, &name).cloned() else {
                return not_found(kind, &name);
            };
            let mut patched = current.clone();
            store::merge_patch(&mut patched, &body);
            // The URL names the object: a patch cannot rename or move it.
            patched["metadata"]["name"] = json!(name);
            if kind.namespaced() {
                patched["metadata"]["namespace"] = json!(ns);
            }
            // A resourceVersion in the patch is a precondition (409 when stale);
            // without one the patch applies to whatever is stored.
            if store::rv_of(&body).is_none() {
                patched["metadata"]["resourceVersion"] =
                    current["metadata"]["resourceVersion"].clone();
            }
            if target.subresource.is_some() {
                store
                    .put_status(kind, patched, true)
                    .map(|o| (StatusCode::OK, o))
            } else {
                store
                    .put(kind, patched, true, true, false)
                    .map(|o| (StatusCode::OK, o))
            }
        }
    };
    match result {
        Ok((code, obj)) => json_response(code, &obj),
        Err(WriteError::NotFound) => not_found(kind, &name),
        Err(WriteError::AlreadyExists) => status(
            StatusCode::CONFLICT,
            "AlreadyExists",
            &format!("{} \"{name}\" already exists", kind.plural()),
        ),
        Err(WriteError::Conflict(m)) => status(StatusCode::CONFLICT, "Conflict", &m),
        Err(WriteError::Invalid(m)) => status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", &m),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_decoding() {
        assert_eq!(
            percent_decode("spec.nodeName%3Dnode-a"),
            "spec.nodeName=node-a"
        );
        assert_eq!(percent_decode("a%2Cb+c%"), "a,b c%");
        assert_eq!(percent_decode("%zz"), "%zz");
    }
}
