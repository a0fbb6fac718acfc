//! Several flock nodes on one machine: network namespaces on an underlay bridge, one
//! real etcd, and per node the real agent and a real Envoy under `flock-supervisor`,
//! with libcni (`bridge` + `host-local`, then `flock-cni`) giving pods addresses from
//! the node's own pod subnet.
//!
//! Layout for cluster tag `K` (each test uses its own tag, so tests of one binary can
//! run side by side; the names are fixed so that a crashed run's leftovers are found
//! and removed when the next run of the same tag starts):
//!
//! * bridge `flkU<K>` in the root netns with 10.77.K.254/24: the test process reaches
//!   every node's admin endpoints over it;
//! * netns `flk<K>-etcd` (10.77.K.2): etcd, client port 2379;
//! * netns `flk<K>-n<N>` (10.77.K.1N): node N's agent (admin on 10.77.K.1N:18090),
//!   Envoy (admin on 10.77.K.1N:15000) and its CNI bridge `cni0` with pod subnet
//!   10.78.(10K+N).0/24; `ip_forward` on; a static route to every other node's pod
//!   subnet via that node's underlay address (what a flat cloud network or BGP gives);
//! * netns `flk<K>-p-<pod>`: a pod, with an HTTP server on 8080 answering its name.
//!
//! Every process runs inside one of these namespaces, so teardown (on drop, also on a
//! panic) and the start-up sweep are the same: SIGKILL `ip netns pids` of each, delete
//! the namespaces and the bridge, remove the Envoys' `/dev/shm` files.
//!
//! The agents reach etcd over the underlay; n1's Envoy reaches n2's pods through n1's
//! netns routes, the underlay and n2's bridge, where n2's Envoy's inbound listener
//! (bound inside the pod's netns) terminates mTLS.

// Shared by several test binaries (nodes, authz); each uses a part of it.
#![allow(dead_code)]

use crate::common::*;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// The pods' application port (meshed as `8080/http`).
pub const APP_PORT: u16 = 8080;
/// Envoy's outbound listener inside every meshed pod.
pub const OUTBOUND: &str = "127.0.0.1:15001";
/// The agents' SPIFFE trust domain.
pub const TRUST_DOMAIN: &str = "cluster.local";
const AGENT_ADMIN_PORT: u16 = 18090;
const ENVOY_ADMIN_PORT: u16 = 15000;
const ETCD_PORT: u16 = 2379;

/// How the cluster is made.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// 1..=9: picks the names and subnets (one per test function).
    pub tag: u8,
    /// One entry per node: its zone (all nodes are in region `r1`).
    pub zones: Vec<&'static str>,
    /// `true`: one root (`flock-agent ca init`), an issuer per node (`ca issue`) given
    /// as `--ca-dir`; `false`: each agent's own node-local CA (the `--dev` default).
    pub shared_root: bool,
    /// `--registry-ttl`, seconds.
    pub registry_ttl: u64,
    /// More flags for every agent (`--capture strict`, `--authz-dir …`).
    pub agent_args: Vec<String>,
    /// Kube mode: no etcd; flock-kube's API-server DOUBLE (no control plane can run
    /// here) on the underlay bridge's address instead, and every agent started with
    /// `--kube --kubeconfig <its kubeconfig>` and `--registry kubernetes` (or what
    /// `agent_args` names). Pods are created in the double (namespace `default`,
    /// labelled `flock.io/mesh: enabled`) before their CNI ADD; Services and
    /// EndpointSlices are the test's to apply ([`Cluster::api`]).
    pub kube: bool,
}

/// The API-server double of a kube-mode cluster, on a runtime of its own.
pub struct KubeApi {
    pub api: flock_kube::double::ApiServer,
    pub kubeconfig: PathBuf,
    _rt: tokio::runtime::Runtime,
}

/// The whole cluster; dropping it removes every process, namespace and file.
pub struct Cluster {
    /// Dropped first: pod servers, then the nodes' processes, then etcd, then the
    /// namespaces, then the files.
    pub pods: Vec<Pod>,
    pub nodes: Vec<Node>,
    _etcd: Option<ChildGuard>,
    pub kube: Option<KubeApi>,
    _underlay: Underlay,
    pub dir: tempfile::TempDir,
    pub opts: ClusterOptions,
}

/// One node: its namespace, underlay address, pod subnet and processes.
pub struct Node {
    pub name: String,
    pub zone: &'static str,
    pub netns: String,
    /// Underlay address (10.77.K.1N).
    pub ip: String,
    /// The underlay veth's end in the root netns (on the bridge).
    pub host_veth: String,
    pub dir: PathBuf,
    pub ca_dir: Option<PathBuf>,
    pub agent: Option<ChildGuard>,
    pub envoy: Option<ChildGuard>,
    base_id: u32,
    registry: String,
    registry_ttl: u64,
    agent_args: Vec<String>,
    /// Kube mode: the kubeconfig the agent is started with.
    kubeconfig: Option<PathBuf>,
    restarts: u32,
}

/// A pod: its netns, the node it runs on, its server and (once added) its IP.
pub struct Pod {
    pub name: String,
    pub node: usize,
    pub netns: String,
    pub container_id: String,
    pub annotations: Value,
    pub ip: Option<String>,
    pub server: Option<ChildGuard>,
}

impl Pod {
    /// `/var/run/netns/<netns>`.
    pub fn netns_path(&self) -> String {
        format!("/var/run/netns/{}", self.netns)
    }

    /// A command run inside the pod's netns.
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.netns, program]);
        cmd
    }
}

/// The namespaces and the bridge of one tag: swept at creation, removed on drop.
struct Underlay {
    tag: u8,
}

fn run(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"))
}

fn must(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ipc(args: &[&str]) -> String {
    must(Command::new("ip").args(args))
}

/// `ip netns exec <ns> <program> args...`.
fn in_netns(ns: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns]).arg(program);
    cmd
}

impl Underlay {
    fn prefix(tag: u8) -> String {
        format!("flk{tag}-")
    }

    fn bridge(tag: u8) -> String {
        format!("flkU{tag}")
    }

    /// SIGKILLs every process in the tag's namespaces, deletes them and the bridge
    /// (and, at creation, a crashed run's temporary directory).
    fn sweep(tag: u8) {
        let list = run(Command::new("ip").args(["netns", "list"]));
        let prefix = Self::prefix(tag);
        for line in String::from_utf8_lossy(&list.stdout).lines() {
            let name = line.split_whitespace().next().unwrap_or("");
            if !name.starts_with(&prefix) {
                continue;
            }
            kill_netns_processes(name);
            let _ = run(Command::new("ip").args(["netns", "del", name]));
        }
        let _ = run(Command::new("ip").args(["link", "del", &Self::bridge(tag)]));
        for idx in 0..10 {
            let _ = run(Command::new("ip").args(["link", "del", &format!("flk{tag}h{idx}")]));
            for id in [base_id(tag, idx), base_id(tag, idx) + 1] {
                let _ = std::fs::remove_file(format!(
                    "/dev/shm/envoy_shared_memory_{}",
                    u64::from(id) * 10
                ));
            }
        }
    }

    fn create(tag: u8) -> Self {
        Self::sweep(tag);
        let tmp = std::env::temp_dir();
        for entry in std::fs::read_dir(&tmp).into_iter().flatten().flatten() {
            if entry
                .file_name()
                .to_string_lossy()
                .starts_with(&dir_prefix(tag))
            {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        let bridge = Self::bridge(tag);
        ipc(&["link", "add", &bridge, "type", "bridge"]);
        let this = Self { tag };
        ipc(&[
            "addr",
            "add",
            &format!("10.77.{tag}.254/24"),
            "dev",
            &bridge,
        ]);
        ipc(&["link", "set", &bridge, "up"]);
        this
    }

    /// A namespace `flk<K>-<name>` on the bridge with `ip`/24 (veth index `idx`).
    fn attach(&self, name: &str, idx: u8, ip: &str) -> (String, String) {
        let tag = self.tag;
        let ns = format!("{}{name}", Self::prefix(tag));
        ipc(&["netns", "add", &ns]);
        ipc(&["-n", &ns, "link", "set", "lo", "up"]);
        let host = format!("flk{tag}h{idx}");
        let inner = format!("flk{tag}u{idx}");
        ipc(&["link", "add", &host, "type", "veth", "peer", "name", &inner]);
        ipc(&["link", "set", &host, "master", &Self::bridge(tag), "up"]);
        ipc(&["link", "set", &inner, "netns", &ns]);
        ipc(&["-n", &ns, "addr", "add", &format!("{ip}/24"), "dev", &inner]);
        ipc(&["-n", &ns, "link", "set", &inner, "up"]);
        (ns, host)
    }
}

impl Drop for Underlay {
    fn drop(&mut self) {
        Self::sweep(self.tag);
    }
}

/// SIGKILLs every process whose network namespace is `ns`.
pub fn kill_netns_processes(ns: &str) {
    let out = run(Command::new("ip").args(["netns", "pids", ns]));
    for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
        let _ = Command::new("kill").args(["-KILL", pid]).output();
    }
}

/// The cluster's temporary directory's name prefix (`flock-nodes-<tag>-`).
fn dir_prefix(tag: u8) -> String {
    format!("flock-nodes-{tag}-")
}

fn base_id(tag: u8, idx: u8) -> u32 {
    // Steps of 4 leave room for the supervisor's "next free base id".
    940_000 + u32::from(tag) * 100 + u32::from(idx) * 4
}

impl Cluster {
    /// Builds the underlay, starts etcd, makes the trust material and starts every
    /// node (agent ready, Envoy ready).
    pub fn start(opts: ClusterOptions) -> Self {
        assert!((1..=9).contains(&opts.tag));
        for b in ["flock-cni", "flock-supervisor"] {
            let _ = sibling_bin(b);
        }
        let _ = required_env("FLOCK_CNI_PLUGIN_DIR");
        let _ = required_env("FLOCK_CNITOOL");
        let _ = envoy_bin();
        let tag = opts.tag;
        let underlay = Underlay::create(tag);
        let dir = tempfile::Builder::new()
            .prefix(&dir_prefix(tag))
            .tempdir()
            .unwrap();

        let (etcd, registry, kube) = if opts.kube {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            let bridge_ip: std::net::IpAddr = format!("10.77.{tag}.254").parse().unwrap();
            let api = rt.block_on(flock_kube::double::ApiServer::start_on(bridge_ip));
            let kubeconfig = dir.path().join("kubeconfig");
            api.write_kubeconfig(&kubeconfig);
            api.apply(&kube_object::<k8s_openapi::api::core::v1::Namespace>(
                json!({
                    "apiVersion": "v1", "kind": "Namespace",
                    "metadata": {"name": "default", "labels": {"flock.io/mesh": "enabled"}}
                }),
            ));
            let kube = KubeApi {
                api,
                kubeconfig,
                _rt: rt,
            };
            (None, "kubernetes".to_string(), Some(kube))
        } else {
            let etcd_ip = format!("10.77.{tag}.2");
            let (etcd_ns, _) = underlay.attach("etcd", 0, &etcd_ip);
            let client = format!("http://{etcd_ip}:{ETCD_PORT}");
            let mut cmd = in_netns(&etcd_ns, etcd_bin());
            cmd.args(["--name", "e1", "--data-dir"])
                .arg(dir.path().join("etcd"))
                .args(["--listen-client-urls", &client])
                .args(["--advertise-client-urls", &client])
                .args(["--listen-peer-urls", "http://127.0.0.1:2380"])
                .args(["--initial-advertise-peer-urls", "http://127.0.0.1:2380"])
                .args(["--initial-cluster", "e1=http://127.0.0.1:2380"])
                .args(["--heartbeat-interval", "50", "--election-timeout", "250"]);
            let mut etcd = ChildGuard::spawn(cmd, dir.path().join("etcd.log"));
            let etcd_addr = format!("{etcd_ip}:{ETCD_PORT}");
            wait_for("etcd /health true on the underlay", WAIT, || {
                assert!(etcd.running(), "etcd exited:\n{}", etcd.log_text());
                matches!(http_get(&etcd_addr, "/health"), Ok((200, body)) if body.contains("true"))
            });
            (Some(etcd), format!("etcd://{etcd_addr}"), None)
        };

        let root = dir.path().join("root");
        if opts.shared_root {
            flock_ca(&["init", "--out", root.to_str().unwrap()]);
        }

        let count = opts.zones.len() as u8;
        let mut nodes = Vec::new();
        for (i, zone) in opts.zones.iter().enumerate() {
            let idx = i as u8 + 1;
            let name = format!("n{idx}");
            let ip = format!("10.77.{tag}.1{idx}");
            let (netns, host_veth) = underlay.attach(&name, idx, &ip);
            must(in_netns(&netns, "sysctl").args(["-qw", "net.ipv4.ip_forward=1"]));
            for other in 1..=count {
                if other != idx {
                    ipc(&[
                        "-n",
                        &netns,
                        "route",
                        "add",
                        &pod_subnet(tag, other),
                        "via",
                        &format!("10.77.{tag}.1{other}"),
                    ]);
                }
            }
            let ndir = dir.path().join(&name);
            std::fs::create_dir(&ndir).unwrap();
            let ca_dir = opts.shared_root.then(|| {
                let ca = ndir.join("ca");
                install_issuer(&root, &ca, &name, 1);
                ca
            });
            let conflist = json!({
                "cniVersion": "1.0.0",
                "name": format!("flknodes{tag}"),
                "plugins": [{
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": true,
                    "ipMasq": false,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": pod_subnet(tag, idx)}]],
                        // Pods reach other nodes' pods through their node.
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": ndir.join("ipam").to_str().unwrap()
                    }
                }, {
                    "type": "flock-cni",
                    "agent_socket": ndir.join("cni.sock").to_str().unwrap(),
                    "timeout_ms": 5000,
                    "capabilities": {"io.kubernetes.cri.pod-annotations": true}
                }]
            });
            std::fs::write(ndir.join("net.conflist"), conflist.to_string()).unwrap();
            nodes.push(Node {
                name,
                zone,
                netns,
                ip,
                host_veth,
                dir: ndir,
                ca_dir,
                agent: None,
                envoy: None,
                base_id: base_id(tag, idx),
                registry: registry.clone(),
                registry_ttl: opts.registry_ttl,
                agent_args: opts.agent_args.clone(),
                kubeconfig: kube.as_ref().map(|k| k.kubeconfig.clone()),
                restarts: 0,
            });
        }
        let mut cluster = Self {
            pods: Vec::new(),
            nodes,
            _etcd: etcd,
            kube,
            _underlay: underlay,
            dir,
            opts,
        };
        for i in 0..cluster.nodes.len() {
            cluster.nodes[i].start_agent();
        }
        for i in 0..cluster.nodes.len() {
            cluster.nodes[i].start_envoy();
        }
        cluster
    }

    /// The API-server double (kube mode).
    pub fn api(&self) -> &flock_kube::double::ApiServer {
        &self.kube.as_ref().expect("a kube-mode cluster").api
    }

    /// The root CA directory (`ca init --out`), when the cluster has a shared root.
    pub fn root_dir(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    /// Creates pod `name` on node `node` (index) as service `service`, with its HTTP
    /// server answering its own name on 8080 (when `serve`), and ADDs it through libcni
    /// in the node's netns. Returns its index in `pods`.
    pub fn add_pod(&mut self, node: usize, name: &str, service: &str, serve: bool) -> usize {
        // A client (no server) declares no port: nothing to probe or route to.
        let annotations = if serve {
            json!({
                "flock.io/service": service,
                "flock.io/ports": format!("{APP_PORT}/http"),
                "flock.io/service-account": service,
            })
        } else {
            json!({"flock.io/service": service, "flock.io/service-account": service})
        };
        self.add_pod_with(node, name, annotations, serve)
    }

    /// [`Cluster::add_pod`] with the pod's annotations as given.
    pub fn add_pod_with(
        &mut self,
        node: usize,
        name: &str,
        annotations: Value,
        serve: bool,
    ) -> usize {
        let netns = format!("{}p-{name}", Underlay::prefix(self.opts.tag));
        ipc(&["netns", "add", &netns]);
        ipc(&["-n", &netns, "link", "set", "lo", "up"]);
        if let Some(k) = &self.kube {
            k.api
                .apply(&api_pod(&self.nodes[node].name, name, &annotations, serve));
        }
        let mut pod = Pod {
            name: name.to_owned(),
            node,
            netns,
            container_id: format!("ctr-{name}"),
            annotations,
            ip: None,
            server: None,
        };
        if serve {
            pod.server = Some(http_server(
                &pod,
                &self.dir.path().join(format!("{name}.log")),
            ));
        }
        self.pods.push(pod);
        let i = self.pods.len() - 1;
        self.cni_add(i);
        i
    }

    /// CNI ADD of pod `i` (again, after a DEL) through libcni in its node's netns.
    pub fn cni_add(&mut self, i: usize) {
        let out = self.cni("add", i);
        let v: Value = serde_json::from_str(&out).unwrap();
        let ip = v["ips"][0]["address"]
            .as_str()
            .expect("an IP in the ADD result")
            .split('/')
            .next()
            .unwrap()
            .to_owned();
        self.pods[i].ip = Some(ip);
    }

    /// CNI DEL of pod `i`.
    pub fn cni_del(&mut self, i: usize) {
        self.cni("del", i);
    }

    fn cni(&self, verb: &str, i: usize) -> String {
        let pod = &self.pods[i];
        let node = &self.nodes[pod.node];
        let plugins = required_env("FLOCK_CNI_PLUGIN_DIR");
        let flock_cni_dir = sibling_bin("flock-cni").parent().unwrap().to_owned();
        let mut cmd = in_netns(&node.netns, required_env("FLOCK_CNITOOL"));
        cmd.args([
            verb,
            node.dir.join("net.conflist").to_str().unwrap(),
            &pod.netns_path(),
            &pod.container_id,
            "eth0",
        ])
        .env(
            "CNI_PATH",
            format!("{}:{}", flock_cni_dir.display(), plugins.display()),
        )
        .env("CNI_CACHE_DIR", node.dir.join("cni-cache"))
        .env(
            "CNI_ARGS_K8S",
            format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={};K8S_POD_UID=uid-{}",
                pod.name, pod.name
            ),
        )
        .env("CNI_POD_ANNOTATIONS", pod.annotations.to_string());
        must(&mut cmd)
    }

    /// The agents' and Envoys' logs, for a failure message.
    pub fn logs(&self) -> String {
        let mut s = String::new();
        for n in &self.nodes {
            for g in [&n.agent, &n.envoy].into_iter().flatten() {
                s.push_str(&format!(
                    "---- {} ----\n{}\n",
                    g.log.display(),
                    tail(&g.log_text(), 40)
                ));
            }
        }
        s
    }
}

/// The shipped DaemonSet's agent flags named in `names` (long names without `--`),
/// as the kubelet gives them: `$(VAR)` expanded from the container's env, whose
/// ConfigMap keys come from `deploy/configmap.yaml`. Each as one `--name=value` (or
/// `--name`) argument, in the manifest's order; a name the manifest does not set
/// fails the test.
pub fn manifest_agent_args(names: &[&str]) -> Vec<String> {
    use k8s_openapi::api::apps::v1::DaemonSet;
    use k8s_openapi::api::core::v1::ConfigMap;
    fn read<K: k8s_openapi::serde::de::DeserializeOwned>(file: &str) -> K {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../deploy")
            .join(file);
        let text = std::fs::read_to_string(&path).unwrap();
        let v: Value = serde_saphyr::from_str(&text).unwrap();
        serde_json::from_value(v).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }
    let ds: DaemonSet = read("daemonset.yaml");
    let config: ConfigMap = read("configmap.yaml");
    let data = config.data.unwrap_or_default();
    let pod = ds.spec.unwrap().template.spec.unwrap();
    let agent = pod.containers.iter().find(|c| c.name == "agent").unwrap();
    let env: std::collections::BTreeMap<String, String> = agent
        .env
        .iter()
        .flatten()
        .filter_map(|e| {
            let key = &e.value_from.as_ref()?.config_map_key_ref.as_ref()?.key;
            Some((e.name.clone(), data.get(key)?.clone()))
        })
        .collect();
    let expand = |a: &str| {
        env.iter()
            .fold(a.to_owned(), |a, (k, v)| a.replace(&format!("$({k})"), v))
    };
    let args: Vec<String> = agent.args.iter().flatten().map(|a| expand(a)).collect();
    names
        .iter()
        .map(|n| {
            let long = format!("--{n}");
            args.iter()
                .find(|a| **a == long || a.starts_with(&format!("{long}=")))
                .unwrap_or_else(|| panic!("deploy/daemonset.yaml's agent has no {long}"))
                .clone()
        })
        .collect()
}

/// A Kubernetes object from its JSON.
pub fn kube_object<K: k8s_openapi::serde::de::DeserializeOwned>(v: Value) -> K {
    serde_json::from_value(v).expect("a well-formed API object")
}

/// The Pod object of a kube-mode cluster's pod `name` on `node`: namespace `default`,
/// uid `uid-<name>` (what the CNI ADD's `K8S_POD_UID` says), label `app` and service
/// account from the `flock.io/service` / `flock.io/service-account` annotations the
/// etcd mode uses (so one test body serves both), its other annotations as the pod's,
/// and, when it serves, container port 8080 named `http`.
pub fn api_pod(
    node: &str,
    name: &str,
    annotations: &Value,
    serve: bool,
) -> k8s_openapi::api::core::v1::Pod {
    let service = annotations["flock.io/service"].as_str().unwrap_or(name);
    let account = annotations["flock.io/service-account"]
        .as_str()
        .unwrap_or(service);
    let ports = if serve {
        json!([{"name": "http", "containerPort": APP_PORT}])
    } else {
        json!([])
    };
    kube_object(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}"),
                     "labels": {"app": service}, "annotations": annotations},
        "spec": {"nodeName": node, "serviceAccountName": account,
                 "containers": [{"name": "app", "image": "app", "ports": ports}]},
        "status": {"phase": "Running"}
    }))
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn pod_subnet(tag: u8, node: u8) -> String {
    format!("10.78.{}.0/24", u32::from(tag) * 10 + u32::from(node))
}

/// `flock-agent ca <args>`, panicking with its stderr on failure.
pub fn flock_ca(args: &[&str]) -> String {
    must(Command::new(AGENT_BIN).arg("ca").args(args))
}

/// Writes a new issuer for `name` signed by the root in `root` into `ca_dir` the way
/// the kubelet updates a mounted Secret: the files are symlinks into `..data`, which
/// points at a generation directory; a new generation is written aside and `..data`
/// swapped by one `rename` (the agent sees the whole new set or the old one).
pub fn install_issuer(root: &Path, ca_dir: &Path, name: &str, generation: u32) {
    use std::os::unix::fs::{PermissionsExt, symlink};
    std::fs::create_dir_all(ca_dir).unwrap();
    std::fs::set_permissions(ca_dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let gen_dir = format!("..gen{generation}");
    flock_ca(&[
        "issue",
        "--root",
        root.to_str().unwrap(),
        "--out",
        ca_dir.join(&gen_dir).to_str().unwrap(),
        "--name",
        &format!("{name}-gen{generation}"),
    ]);
    let tmp = ca_dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    symlink(&gen_dir, &tmp).unwrap();
    std::fs::rename(&tmp, ca_dir.join("..data")).unwrap();
    for f in [
        "ca-cert.pem",
        "ca-key.pem",
        "cert-chain.pem",
        "root-cert.pem",
    ] {
        let link = ca_dir.join(f);
        if std::fs::symlink_metadata(&link).is_err() {
            symlink(format!("..data/{f}"), &link).unwrap();
        }
    }
}

/// A Python HTTP/1.1 server in the pod's netns on 0.0.0.0:8080 answering every GET
/// with the pod's name; returns once it answers on the pod's loopback.
pub fn http_server(pod: &Pod, log: &Path) -> ChildGuard {
    let body = &pod.name;
    let src = format!(
        "import http.server\n\
         class H(http.server.BaseHTTPRequestHandler):\n\
         \x20   protocol_version = 'HTTP/1.1'\n\
         \x20   disable_nagle_algorithm = True\n\
         \x20   def do_GET(self):\n\
         \x20       b = b'{body}'\n\
         \x20       self.send_response(200)\n\
         \x20       self.send_header('content-length', str(len(b)))\n\
         \x20       self.end_headers()\n\
         \x20       self.wfile.write(b)\n\
         \x20   def log_message(self, *a): pass\n\
         http.server.ThreadingHTTPServer.daemon_threads = True\n\
         http.server.ThreadingHTTPServer(('0.0.0.0', {APP_PORT}), H).serve_forever()\n"
    );
    let mut cmd = pod.command("python3");
    cmd.args(["-c", &src]);
    let mut server = ChildGuard::spawn(cmd, log.to_owned());
    let url = format!("http://127.0.0.1:{APP_PORT}/");
    wait_for("the pod's HTTP server on its loopback", WAIT, || {
        assert!(server.running(), "server exited: {}", server.log_text());
        pod.command("curl")
            .args(["-sf", "-m", "2", &url])
            .output()
            .is_ok_and(|o| o.stdout == body.as_bytes())
    });
    server
}

impl Node {
    pub fn agent_admin(&self) -> String {
        format!("{}:{AGENT_ADMIN_PORT}", self.ip)
    }

    pub fn envoy_admin(&self) -> String {
        format!("{}:{ENVOY_ADMIN_PORT}", self.ip)
    }

    /// Starts (or restarts) the agent in the node's netns and waits for `/readyz`.
    pub fn start_agent(&mut self) {
        if let Some(mut old) = self.agent.take() {
            let _ = old.child.kill();
            let _ = old.child.wait();
        }
        let mut cmd = if self
            .agent_args
            .iter()
            .any(|a| a.starts_with("--capture-probe-cgroup"))
        {
            // `ip netns exec` mounts a fresh /sys for the namespace, without the
            // cgroup v2 tree the flag names: mount it there (in the command's own
            // mount namespace), as the DaemonSet mounts the host's.
            let mut cmd = in_netns(&self.netns, "sh");
            cmd.args([
                "-c",
                "mount -t cgroup2 cgroup2 /sys/fs/cgroup && exec \"$@\"",
                "sh",
                AGENT_BIN,
            ]);
            cmd
        } else {
            in_netns(&self.netns, AGENT_BIN)
        };
        cmd.args(["--node-name", &self.name])
            .arg("--state-dir")
            .arg(self.dir.join("state"))
            .arg("--cni-socket")
            .arg(self.dir.join("cni.sock"))
            .arg("--xds-socket")
            .arg(self.dir.join("run").join("xds.sock"))
            .args([
                "--admin-address",
                &self.agent_admin(),
                "--allow-non-loopback",
            ])
            .args(["--trust-domain", TRUST_DOMAIN]);
        // The test's own `--registry` (a manifest's) wins.
        if !self.agent_args.iter().any(|a| a.starts_with("--registry")) {
            cmd.args(["--registry", &self.registry]);
        }
        match &self.kubeconfig {
            Some(k) => {
                cmd.arg("--kube").arg("--kubeconfig").arg(k);
            }
            None => {
                cmd.args(["--registry-ttl", &self.registry_ttl.to_string()]);
            }
        }
        cmd.args(["--zone", self.zone, "--region", "r1"])
            .args(["--probe-interval-ms", "1000"])
            .args(&self.agent_args)
            .env("RUST_LOG", "info");
        if let Some(ca) = &self.ca_dir {
            cmd.arg("--ca-dir").arg(ca);
        }
        self.restarts += 1;
        let log = self.dir.join(format!("agent.{}.log", self.restarts));
        let mut agent = ChildGuard::spawn(cmd, log);
        let admin = self.agent_admin();
        wait_for(&format!("{}'s agent /readyz 200", self.name), WAIT, || {
            assert!(
                agent.running(),
                "agent {} exited:\n{}",
                self.name,
                agent.log_text()
            );
            matches!(http_get(&admin, "/readyz"), Ok((200, _)))
        });
        self.agent = Some(agent);
    }

    /// Starts Envoy under `flock-supervisor` in the node's netns on the bootstrap the
    /// agent prints (admin moved to the underlay address), and waits for `/ready`.
    pub fn start_envoy(&mut self) {
        let out = must(
            Command::new(AGENT_BIN)
                .args(["--node-name", &self.name])
                .arg("--xds-socket")
                .arg(self.dir.join("run").join("xds.sock"))
                .args(["--envoy-admin-port", &ENVOY_ADMIN_PORT.to_string()])
                .arg("envoy-bootstrap"),
        );
        let mut boot: Value = serde_json::from_str(&out).unwrap();
        boot["admin"]["address"]["socket_address"]["address"] = json!(self.ip);
        let config = self.dir.join("envoy.json");
        std::fs::write(&config, boot.to_string()).unwrap();
        let mut cmd = in_netns(&self.netns, sibling_bin("flock-supervisor"));
        cmd.arg("--envoy-bin")
            .arg(envoy_bin())
            .arg("--config")
            .arg(&config)
            .arg("--base-id")
            .arg(self.base_id.to_string())
            .arg("--state-dir")
            .arg(self.dir.join("envoy-state"))
            .args(["--admin-address", &self.envoy_admin()])
            .args(["--drain-time-s", "1", "--parent-shutdown-time-s", "2"])
            .args(["--", "--log-level", "warn", "--concurrency", "1"])
            .env("RUST_LOG", "info");
        self.restarts += 1;
        let log = self.dir.join(format!("envoy.{}.log", self.restarts));
        let mut envoy = ChildGuard::spawn(cmd, log);
        let admin = self.envoy_admin();
        wait_for(&format!("{}'s Envoy /ready 200", self.name), WAIT, || {
            assert!(
                envoy.running(),
                "flock-supervisor on {} exited:\n{}",
                self.name,
                envoy.log_text()
            );
            matches!(http_get(&admin, "/ready"), Ok((200, _)))
        });
        self.envoy = Some(envoy);
    }

    /// The node dies: every process in its netns (agent, supervisor, Envoy) SIGKILLed,
    /// its underlay link down (its pods keep running, unreachable).
    pub fn kill(&mut self) {
        kill_netns_processes(&self.netns);
        for g in [self.agent.take(), self.envoy.take()].into_iter().flatten() {
            let mut g = g;
            let _ = g.child.kill();
            let _ = g.child.wait();
        }
        ipc(&["link", "set", &self.host_veth, "down"]);
        for id in [self.base_id, self.base_id + 1] {
            let _ = std::fs::remove_file(format!(
                "/dev/shm/envoy_shared_memory_{}",
                u64::from(id) * 10
            ));
        }
    }

    /// The node comes back: link up, agent (same state dir) and Envoy started again.
    pub fn revive(&mut self) {
        ipc(&["link", "set", &self.host_veth, "up"]);
        // The link's carrier comes up asynchronously (the kernel's link watch can
        // take up to a second): an agent started at once can find its registry
        // unreachable ("No route to host") and exit.
        // Wait for the node's end of the underlay link to have its carrier again.
        let inner = self.host_veth.replacen('h', "u", 1);
        wait_for(
            &format!("{}'s underlay link up again", self.name),
            WAIT,
            || {
                Command::new("ip")
                    .args(["-n", &self.netns, "-o", "link", "show", "dev", &inner])
                    .output()
                    .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("LOWER_UP"))
            },
        );
        self.start_agent();
        self.start_envoy();
    }

    /// Envoy's admin `GET path` body ("" when it does not answer 200).
    pub fn envoy_get(&self, path: &str) -> String {
        admin_get(&self.envoy_admin(), path).unwrap_or_default()
    }

    /// Sum of Envoy's counters whose name contains every one of `parts`.
    pub fn envoy_counter(&self, parts: &[&str]) -> u64 {
        self.envoy_get("/stats?usedonly")
            .lines()
            .filter_map(|l| l.split_once(": "))
            .filter(|(k, _)| parts.iter().all(|p| k.contains(p)))
            .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
            .sum()
    }
}

/// `GET path` (HTTP/1.1, `Connection: close`), decoding a chunked body (Envoy's
/// admin answers in chunks; `http_get` does not decode them): the body when the
/// status is 200.
fn admin_get(addr: &str, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let addr_parsed = addr.parse().ok()?;
    let mut s = std::net::TcpStream::connect_timeout(&addr_parsed, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    if head.split_whitespace().nth(1) != Some("200") {
        return None;
    }
    let mut body = &raw[split + 4..];
    if !head.contains("transfer-encoding: chunked") {
        return Some(String::from_utf8_lossy(body).into_owned());
    }
    let mut out = Vec::new();
    loop {
        let eol = body.windows(2).position(|w| w == b"\r\n")?;
        let size_text = String::from_utf8_lossy(&body[..eol]);
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        body = &body[eol + 2..];
        if size == 0 {
            return Some(String::from_utf8_lossy(&out).into_owned());
        }
        out.extend_from_slice(body.get(..size)?);
        body = body.get(size + 2..)?;
    }
}

/// What the load client saw: one entry per request.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Start, ms after the client started.
    pub at_ms: f64,
    pub latency_us: u64,
    /// HTTP status; 0 = no response (the error is in `body`).
    pub status: u16,
    pub body: String,
    /// The client retried this request once (a connection error on a reused
    /// keep-alive connection, which an HTTP client retries for an idempotent GET).
    pub client_retried: bool,
}

const LOAD_CLIENT: &str = r#"
import http.client, json, os, sys, time
host, port, hdr, stop, out, count = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6])
res, conn, n = [], None, 0
t0 = time.monotonic()
def once():
    global conn
    reused = conn is not None
    try:
        if conn is None:
            conn = http.client.HTTPConnection(host, port, timeout=15)
        conn.request('GET', '/', headers={'Host': hdr})
        r = conn.getresponse()
        b = r.read().decode(errors='replace')
        if (r.getheader('connection') or '').lower() == 'close':
            conn.close(); conn = None
        return r.status, b, False
    except Exception as e:
        try: conn.close()
        except Exception: pass
        conn = None
        return 0, type(e).__name__ + ': ' + str(e), reused
open(out + '.started', 'w').close()
while not os.path.exists(stop) and (count == 0 or n < count):
    s = time.monotonic()
    st, b, stale = once()
    retried = False
    if st == 0 and stale:
        st, b, _ = once()
        retried = True
    e = time.monotonic()
    res.append([round((s - t0) * 1000, 2), int((e - s) * 1e6), st, b[:300], retried])
    n += 1
with open(out + '.tmp', 'w') as f: json.dump(res, f)
os.rename(out + '.tmp', out)
"#;

/// A load client (Python, one keep-alive connection, one request at a time) in a
/// pod's netns sending `GET /` with `Host: host` to `addr` until stopped (or `count`
/// requests when non-zero).
pub struct Load {
    proc: ChildGuard,
    stop: PathBuf,
    out: PathBuf,
    count: u64,
    pub started: Instant,
}

impl Load {
    pub fn start(pod: &Pod, dir: &Path, tag: &str, addr: &str, host: &str, count: u64) -> Self {
        let script = dir.join("load.py");
        std::fs::write(&script, LOAD_CLIENT).unwrap();
        let (h, p) = addr.rsplit_once(':').unwrap();
        let stop = dir.join(format!("{tag}.stop"));
        let out = dir.join(format!("{tag}.json"));
        let _ = std::fs::remove_file(&stop);
        let _ = std::fs::remove_file(&out);
        let mut cmd = pod.command("python3");
        cmd.arg(&script)
            .args([h, p, host])
            .arg(&stop)
            .arg(&out)
            .arg(count.to_string());
        let mut proc = ChildGuard::spawn(cmd, dir.join(format!("{tag}.log")));
        let started_file = PathBuf::from(format!("{}.started", out.display()));
        wait_for("the load client to start", WAIT, || {
            assert!(proc.running(), "load client exited: {}", proc.log_text());
            started_file.exists()
        });
        Self {
            proc,
            stop,
            out,
            count,
            started: Instant::now(),
        }
    }

    /// Stops the client (or waits for its count) and returns its samples.
    pub fn finish(mut self, limit: Duration) -> Vec<Sample> {
        if self.count == 0 {
            std::fs::write(&self.stop, b"").unwrap();
        }
        let out = self.out.clone();
        let proc = &mut self.proc;
        wait_for("the load client's results", limit, || {
            assert!(
                out.exists() || proc.running(),
                "load client died: {}",
                proc.log_text()
            );
            out.exists()
        });
        let v: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        v.iter()
            .map(|s| Sample {
                at_ms: s[0].as_f64().unwrap(),
                latency_us: s[1].as_u64().unwrap(),
                status: s[2].as_u64().unwrap() as u16,
                body: s[3].as_str().unwrap().to_owned(),
                client_retried: s[4].as_bool().unwrap(),
            })
            .collect()
    }
}

/// Latency percentile (0..=100) of `samples`, microseconds.
pub fn percentile_us(samples: &[Sample], p: f64) -> u64 {
    let mut l: Vec<u64> = samples.iter().map(|s| s.latency_us).collect();
    l.sort_unstable();
    if l.is_empty() {
        return 0;
    }
    let i = ((p / 100.0) * (l.len() - 1) as f64).round() as usize;
    l[i]
}

/// How many of `samples` each body (backend pod name) answered, and the failures.
pub fn tally(samples: &[Sample]) -> (std::collections::BTreeMap<String, usize>, Vec<Sample>) {
    let mut by = std::collections::BTreeMap::new();
    let mut failed = Vec::new();
    for s in samples {
        if s.status == 200 {
            *by.entry(s.body.clone()).or_insert(0) += 1;
        } else {
            failed.push(s.clone());
        }
    }
    (by, failed)
}

/// `curl` inside `pod` to the outbound listener with `Host: web`: (status, body,
/// curl's stderr); status 0 when no HTTP response came.
pub fn curl_web(pod: &Pod, host: &str) -> (u16, String, String) {
    let out = pod
        .command("curl")
        .args(["-sS", "-m", "5", "-o", "-", "-w", "\n%{http_code}", "-H"])
        .arg(format!("Host: {host}"))
        .arg(format!("http://{OUTBOUND}/"))
        .output()
        .expect("curl is needed (apt-get install curl)");
    let text = String::from_utf8_lossy(&out.stdout);
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (
        code.trim().parse().unwrap_or(0),
        body.to_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Waits until node `from`'s Envoy has an endpoint `ip:port` of a cluster whose name
/// contains `cluster` in its `/clusters` output.
pub fn envoy_has_host(node: &Node, cluster: &str, hostport: &str) -> bool {
    node.envoy_get("/clusters")
        .lines()
        .any(|l| l.starts_with(cluster) && l.contains(&format!("::{hostport}::")))
}

/// `/clusters` lines of node's Envoy for `hostport` in clusters starting with `cluster`.
pub fn envoy_host_lines(node: &Node, cluster: &str, hostport: &str) -> Vec<String> {
    node.envoy_get("/clusters")
        .lines()
        .filter(|l| l.starts_with(cluster) && l.contains(&format!("::{hostport}::")))
        .map(str::to_owned)
        .collect()
}
