//! Shared pieces of the transparent-capture end-to-end test (`capture.rs`) and its
//! benchmark (`benches/capture.rs`): pods on a libcni bridge whose apps say who called
//! them, unmodified clients (`curl` run inside a pod's netns), Envoy's counters, and
//! the pod netns' nftables ruleset as `nft` prints it.
//!
//! Uses [`crate::common`] (the agent, Envoy under the supervisor, libcni).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

use crate::common::*;

/// A pod added through libcni: its netns, address, container ID and CNI description.
pub struct Pod {
    pub ns: NetNs,
    pub ip: String,
    /// The gateway of its interface (the bridge's address: the node on the pod network).
    pub gateway: String,
    pub container_id: String,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub annotations: Value,
}

impl Pod {
    /// Creates the netns and runs `cnitool add` for pod `default/<name>` with
    /// `annotations`.
    pub fn add(cni: &Cni, tag: &str, name: &str, annotations: Value) -> Self {
        Self::add_in(cni, NetNs::new(tag), "default", name, annotations)
    }

    /// A meshed server pod `default/<name>` in `ns` (where its app already listens):
    /// service and service account `service`, one HTTP port 8080.
    pub fn add_server(cni: &Cni, ns: NetNs, name: &str, service: &str) -> Self {
        Self::add_in(
            cni,
            ns,
            "default",
            name,
            serde_json::json!({"flock.io/service": service, "flock.io/ports": "8080/http",
                               "flock.io/service-account": service}),
        )
    }

    /// A meshed client pod `default/<name>` in a new netns: service and service
    /// account `client`, no ports.
    pub fn add_client(cni: &Cni, tag: &str, name: &str) -> Self {
        Self::add(
            cni,
            tag,
            name,
            serde_json::json!({"flock.io/service": "client", "flock.io/service-account": "client"}),
        )
    }

    /// Like [`Pod::add`] in an existing netns and Kubernetes namespace.
    pub fn add_in(cni: &Cni, ns: NetNs, namespace: &str, name: &str, annotations: Value) -> Self {
        let mut pod = Self {
            ns,
            ip: String::new(),
            gateway: String::new(),
            container_id: format!("ctr-{name}"),
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            uid: format!("uid-{name}"),
            annotations,
        };
        let added: Value =
            serde_json::from_str(&cni.ok("add", &pod.ns, &pod.container_id, &pod.spec())).unwrap();
        let ip0 = &added["ips"][0];
        pod.ip = ip0["address"]
            .as_str()
            .and_then(|a| a.split('/').next())
            .expect("an address in the ADD result")
            .to_owned();
        pod.gateway = ip0["gateway"].as_str().unwrap_or_default().to_owned();
        pod
    }

    pub fn spec(&self) -> PodSpec<'_> {
        PodSpec {
            namespace: &self.namespace,
            name: &self.name,
            uid: &self.uid,
            annotations: self.annotations.clone(),
        }
    }

    /// `cnitool <verb>` for this pod (not asserting success).
    pub fn cni(&self, cni: &Cni, verb: &str) -> std::process::Output {
        cni.run(verb, &self.ns, &self.container_id, &self.spec())
    }

    /// `nft list ruleset` in the pod's netns (text, as an operator sees it).
    pub fn ruleset_text(&self) -> String {
        let out = self
            .ns
            .command("nft")
            .args(["list", "ruleset"])
            .output()
            .expect("nft is needed (scripts/prereqs: Debian package nftables)");
        assert!(
            out.status.success(),
            "nft list ruleset: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// The tables `nft -j list ruleset` lists in the pod's netns, as (family, name).
    pub fn tables(&self) -> Vec<(String, String)> {
        let out = self
            .ns
            .command("nft")
            .args(["-j", "list", "ruleset"])
            .output()
            .unwrap();
        assert!(out.status.success(), "nft -j list ruleset: {out:?}");
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["nftables"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|o| o.get("table"))
            .map(|t| {
                (
                    t["family"].as_str().unwrap_or_default().to_owned(),
                    t["name"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect()
    }

    /// How many rules `nft -j list ruleset` lists in the pod's netns.
    pub fn rule_count(&self) -> usize {
        let out = self
            .ns
            .command("nft")
            .args(["-j", "list", "ruleset"])
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["nftables"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|o| o.get("rule").is_some())
            .count()
    }
}

/// The ruleset text with counter values zeroed (traffic changes them, not the rules).
pub fn without_counts(ruleset: &str) -> String {
    ruleset
        .lines()
        .map(|l| match l.find("counter packets ") {
            Some(i) => {
                let rest = &l[i..];
                let end = rest
                    .find(" bytes ")
                    .and_then(|b| rest[b + 7..].find(' ').map(|e| b + 7 + e))
                    .unwrap_or(rest.len());
                format!("{}counter packets N bytes N{}", &l[..i], &rest[end..])
            }
            None => l.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A real HTTP/1.1 server (Python) inside `ns` on `0.0.0.0:port` that answers every
/// GET with `<name> saw <peer ip>:<peer port>` and prints each caller's address on a
/// line of its log; returns once it answers on the namespace's loopback. The status
/// is 200, or NNN for a path `/status/NNN` (an error backend on demand).
pub fn peer_echo_server_in(ns: &NetNs, port: u16, name: &str, log: &Path) -> ChildGuard {
    let src = format!(
        "import http.server, sys\n\
         class H(http.server.BaseHTTPRequestHandler):\n\
         \x20   protocol_version = 'HTTP/1.1'\n\
         \x20   def do_GET(self):\n\
         \x20       peer = '%s:%d' % self.client_address[:2]\n\
         \x20       print('peer ' + peer, flush=True)\n\
         \x20       b = ('{name} saw ' + peer).encode()\n\
         \x20       code = int(self.path[8:11]) if self.path.startswith('/status/') else 200\n\
         \x20       self.send_response(code)\n\
         \x20       self.send_header('content-length', str(len(b)))\n\
         \x20       self.end_headers()\n\
         \x20       self.wfile.write(b)\n\
         \x20   def log_message(self, *a): pass\n\
         http.server.ThreadingHTTPServer(('0.0.0.0', {port}), H).serve_forever()\n"
    );
    let mut cmd = ns.command("python3");
    cmd.args(["-u", "-c", &src]);
    let mut server = ChildGuard::spawn(cmd, log.to_path_buf());
    let url = format!("http://127.0.0.1:{port}/");
    wait_for("the pod's HTTP server on its loopback", WAIT, || {
        assert!(server.running(), "server exited: {}", server.log_text());
        ns.command("curl")
            .args(["-sf", "-m", "2", &url])
            .output()
            .is_ok_and(|o| o.stdout.starts_with(name.as_bytes()))
    });
    server
}

/// The callers' addresses (`ip:port`) a [`peer_echo_server_in`] has logged.
pub fn peers_seen(server: &ChildGuard) -> Vec<String> {
    server
        .log_text()
        .lines()
        .filter_map(|l| l.strip_prefix("peer "))
        .map(str::to_owned)
        .collect()
}

/// An unmodified client: `curl http://<addr>/` inside `ns` (no proxy settings, no
/// Host trick): (HTTP status, body); status 0 when no HTTP answer came.
pub fn curl_in(ns: &NetNs, url: &str) -> (u16, String) {
    let out = ns
        .command("curl")
        .args(["-sS", "-m", "5", "-o", "-", "-w", "\n%{http_code}", url])
        .output()
        .expect("curl is needed (apt-get install curl)");
    let text = String::from_utf8_lossy(&out.stdout);
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// The same request from the node itself (the host netns, where kubelet probes run).
pub fn curl_from_node(url: &str) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-sS", "-m", "5", "-o", "-", "-w", "\n%{http_code}", url])
        .output()
        .expect("curl is needed (apt-get install curl)");
    let text = String::from_utf8_lossy(&out.stdout);
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// Envoy's counters and gauges (`/stats`, text) by name.
pub fn envoy_stats(admin: &str) -> BTreeMap<String, u64> {
    let Ok((200, body)) = http_get(admin, "/stats") else {
        return BTreeMap::new();
    };
    body.lines()
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(": ")?;
            Some((name.to_owned(), value.trim().parse().ok()?))
        })
        .collect()
}

/// The one stat whose name contains every part of `parts` and ends with `suffix`
/// (0 when Envoy has none yet); panics if several match.
pub fn stat(stats: &BTreeMap<String, u64>, parts: &[&str], suffix: &str) -> u64 {
    let hits: Vec<(&String, &u64)> = stats
        .iter()
        .filter(|(n, _)| n.ends_with(suffix) && parts.iter().all(|p| n.contains(p)))
        .collect();
    assert!(
        hits.len() <= 1,
        "several stats match {parts:?} {suffix}: {hits:?}"
    );
    hits.first().map_or(0, |(_, v)| **v)
}

/// The stats whose names contain `needle`, one per line (for failure messages).
pub fn stats_about(stats: &BTreeMap<String, u64>, needle: &str) -> String {
    stats
        .iter()
        .filter(|(n, _)| n.contains(needle))
        .map(|(n, v)| format!("{n}: {v}\n"))
        .collect()
}

/// Envoy's `/server_info` (fetched with curl: Envoy sends it chunked, which
/// [`http_get`] does not decode); `None` while it does not answer.
pub fn envoy_server_info(admin: &str) -> Option<Value> {
    let mut curl = Command::new("curl");
    curl.args(["-sf", "-m", "2"]);
    if admin.starts_with('/') {
        // Envoy's admin unix socket.
        curl.args(["--unix-socket", admin, "http://localhost/server_info"]);
    } else {
        curl.arg(format!("http://{admin}/server_info"));
    }
    let out = curl.output().ok()?;
    serde_json::from_slice(&out.stdout).ok()
}

/// `n` ADDs through libcni (`$FLOCK_CNITOOL bench`: each ADD followed by its DEL, in the
/// netns at `netns`, container ids `<prefix><i>`, the pod annotations as the runtime's
/// `CNI_POD_ANNOTATIONS`): each ADD's latency in ms, in order.
pub fn cnitool_adds(
    cni: &Cni,
    netns: &str,
    n: usize,
    prefix: &str,
    annotations: &Value,
) -> Vec<f64> {
    let out = Command::new(required_env("FLOCK_CNITOOL"))
        .args(["bench", &n.to_string()])
        .arg(&cni.conflist)
        .arg(netns)
        .args([prefix, "eth0"])
        .env("CNI_PATH", &cni.cni_path)
        .env("CNI_CACHE_DIR", &cni.cache)
        .env(
            "CNI_ARGS_K8S",
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=bench-0;K8S_POD_UID=uid-bench",
        )
        .env("CNI_POD_ANNOTATIONS", annotations.to_string())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cnitool bench ({} {prefix}): {}",
        cni.conflist.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["add_us"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() / 1e3)
        .collect()
}

/// A cgroup v2 group standing in for kubelet's (`system.slice/kubelet.service` on a
/// systemd node): the agent is started with `--capture-probe-cgroup <name>`, and
/// [`ProbeCgroup::curl`] runs a request from inside it, as kubelet's prober would.
/// Dropping it removes the group and the node tables the agent installed in the host
/// netns (`inet`/`bridge flock_node`).
pub struct ProbeCgroup {
    /// The path relative to the cgroup v2 root (what the flag takes).
    pub name: String,
    dir: std::path::PathBuf,
}

impl ProbeCgroup {
    pub fn new(tag: &str) -> Self {
        // A hybrid host mounts the v2 hierarchy at /sys/fs/cgroup/unified.
        let root = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
            .into_iter()
            .find(|r| Path::new(r).join("cgroup.procs").exists() && is_cgroup2(r))
            .expect("a cgroup v2 hierarchy at /sys/fs/cgroup or /sys/fs/cgroup/unified");
        let name = format!("flock-test-kubelet-{tag}-{}", std::process::id());
        let dir = Path::new(root).join(&name);
        std::fs::create_dir_all(&dir).expect("creating the test cgroup");
        Self { name, dir }
    }

    /// `curl url` from a process in this cgroup, in the host netns.
    pub fn curl(&self, url: &str) -> (u16, String) {
        let procs = self.dir.join("cgroup.procs");
        let out = Command::new("sh")
            .args([
                "-c",
                r#"echo $$ > "$1" && exec curl -sS -m 5 -o - -w "\n%{http_code}" "$2""#,
            ])
            .arg("sh")
            .arg(&procs)
            .arg(url)
            .output()
            .expect("curl is needed (apt-get install curl)");
        let text = String::from_utf8_lossy(&out.stdout);
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
        (code.trim().parse().unwrap_or(0), body.to_owned())
    }
}

fn is_cgroup2(dir: &str) -> bool {
    Path::new(dir).join("cgroup.controllers").exists()
}

impl Drop for ProbeCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
        for family in ["inet", "bridge"] {
            let _ = Command::new("nft")
                .args(["delete", "table", family, "flock_node"])
                .output();
        }
    }
}
