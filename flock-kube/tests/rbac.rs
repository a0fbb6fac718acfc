//! The agent's Kubernetes manifests (`deploy/`): the ClusterRole against every request
//! the suite made to the API-server double, and the DaemonSet's invariants.
//!
//! * `clusterrole_allows_exactly_what_the_suite_asked_for` (`#[ignore]`d): `scripts/test`
//!   sets `FLOCK_KUBE_AUDIT_DIR` for the whole workspace run, so every API-server double
//!   of every test appends one JSON line per request there; afterwards it runs this test
//!   alone (`--run-ignored only`). Each recorded request must be allowed by
//!   `deploy/clusterrole.yaml`, and each (group, resource, verb) it grants must have been
//!   asked for at least once: least privilege in both directions. Without records it
//!   fails rather than pass on nothing.
//! * The other tests parse the manifests into k8s-openapi types and check what the
//!   schema cannot (`scripts/test` also validates them against the Kubernetes OpenAPI
//!   schema, offline).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Container, Namespace, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::de::DeserializeOwned;

/// The largest manifest or audit file read (a runaway audit is a bug to report, not
/// to load).
const MAX_FILE_BYTES: u64 = 64 << 20;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn read_limited(path: &Path) -> String {
    let len = std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .len();
    assert!(
        len <= MAX_FILE_BYTES,
        "{}: {len} bytes, over {MAX_FILE_BYTES}",
        path.display()
    );
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One manifest file as a typed object (YAML → JSON value → k8s-openapi type, so the
/// types' own deserializers decide what a field means).
fn manifest<K: DeserializeOwned>(file: &str) -> K {
    let path = deploy_dir().join(file);
    let value: serde_json::Value = serde_saphyr::from_str(&read_limited(&path))
        .unwrap_or_else(|e| panic!("{}: not YAML: {e}", path.display()));
    serde_json::from_value(value).unwrap_or_else(|e| {
        panic!(
            "{}: not a {}: {e}",
            path.display(),
            std::any::type_name::<K>()
        )
    })
}

/// A permission as RBAC checks a resource request: API group, resource (with
/// `/subresource` when there is one) and verb.
type Permission = (String, String, String);

/// What a ClusterRole grants, expanded rule by rule. Wildcards, resource names and
/// non-resource URLs are refused: the agent's role names each thing it may do.
fn granted(role: &ClusterRole) -> BTreeSet<Permission> {
    assert!(
        role.aggregation_rule.is_none(),
        "the agent's ClusterRole must not aggregate others"
    );
    let mut out = BTreeSet::new();
    for (i, rule) in role.rules.iter().flatten().enumerate() {
        assert!(
            rule.non_resource_urls.as_ref().is_none_or(Vec::is_empty),
            "rule {i}: non-resource URLs"
        );
        assert!(
            rule.resource_names.as_ref().is_none_or(Vec::is_empty),
            "rule {i}: resourceNames (this check does not model them)"
        );
        let groups = rule.api_groups.clone().unwrap_or_default();
        let resources = rule.resources.clone().unwrap_or_default();
        assert!(
            !groups.is_empty() && !resources.is_empty() && !rule.verbs.is_empty(),
            "rule {i} grants nothing: {rule:?}"
        );
        for g in &groups {
            for r in &resources {
                for v in &rule.verbs {
                    assert!(
                        g != "*" && r != "*" && !r.ends_with("/*") && v != "*",
                        "rule {i}: wildcard in {g:?} {r:?} {v:?}"
                    );
                    out.insert((g.clone(), r.clone(), v.clone()));
                }
            }
        }
    }
    out
}

/// One line the API-server double appended to `$FLOCK_KUBE_AUDIT_DIR/<pid>-<n>.jsonl`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct AuditRecord {
    verb: String,
    group: String,
    resource: String,
    // Read to check the format; RBAC of a ClusterRole bound cluster-wide does not
    // depend on it.
    #[allow(dead_code)]
    namespace: Option<String>,
    subresource: Option<String>,
}

impl AuditRecord {
    fn permission(&self) -> Permission {
        let resource = match &self.subresource {
            Some(sub) => format!("{}/{sub}", self.resource),
            None => self.resource.clone(),
        };
        (self.group.clone(), resource, self.verb.clone())
    }
}

/// Every audit record under `dir`: permission → (count, the files that asked for it).
fn audit_records(dir: &Path) -> BTreeMap<Permission, (usize, BTreeSet<String>)> {
    let mut out: BTreeMap<Permission, (usize, BTreeSet<String>)> = BTreeMap::new();
    let entries = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("FLOCK_KUBE_AUDIT_DIR {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("reading the audit dir").path();
        if path.extension().and_then(|e| e.to_str()) != Some("jsonl") {
            continue;
        }
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        for (n, line) in read_limited(&path).lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let record: AuditRecord = serde_json::from_str(line).unwrap_or_else(|e| {
                panic!(
                    "{}:{}: not an audit record ({e}): {line}",
                    path.display(),
                    n + 1
                )
            });
            let slot = out.entry(record.permission()).or_default();
            slot.0 += 1;
            slot.1.insert(file.clone());
        }
    }
    out
}

/// deploy/clusterrole.yaml against every request the suite's API-server doubles
/// recorded (API double: each test that starts one says so). Run by `scripts/test` after
/// the workspace tests with `FLOCK_KUBE_AUDIT_DIR` set for both runs; alone it fails.
#[test]
#[ignore = "reads the audit of the whole suite: scripts/test runs it after the workspace tests"]
fn clusterrole_allows_exactly_what_the_suite_asked_for() {
    let Some(dir) = std::env::var_os("FLOCK_KUBE_AUDIT_DIR") else {
        panic!(
            "no audit records: run through scripts/test (FLOCK_KUBE_AUDIT_DIR is not set, \
             so no API-server double recorded anything)"
        );
    };
    let used = audit_records(Path::new(&dir));
    assert!(
        !used.is_empty(),
        "no audit records: run through scripts/test (FLOCK_KUBE_AUDIT_DIR={} holds no \
         *.jsonl line: the suite's API-server doubles were not started with it set)",
        Path::new(&dir).display()
    );
    let role: ClusterRole = manifest("clusterrole.yaml");
    let grants = granted(&role);

    let denied: Vec<String> = used
        .iter()
        .filter(|(p, _)| !grants.contains(*p))
        .map(|((g, r, v), (n, files))| format!("{v} {g:?}/{r}: {n} request(s), in {files:?}"))
        .collect();
    assert!(
        denied.is_empty(),
        "requests the agent's ClusterRole does not allow (the agent would get 403 \
         Forbidden on a real cluster): grant them in deploy/clusterrole.yaml, or stop \
         making them:\n  {}",
        denied.join("\n  ")
    );
    let unused: Vec<String> = grants
        .iter()
        .filter(|p| !used.contains_key(*p))
        .map(|(g, r, v)| format!("{v} {g:?}/{r}"))
        .collect();
    assert!(
        unused.is_empty(),
        "deploy/clusterrole.yaml grants what no test asked for (remove it, or test the \
         code path that needs it):\n  {}",
        unused.join("\n  ")
    );
    let total: usize = used.values().map(|(n, _)| n).sum();
    eprintln!(
        "{total} recorded API requests, {} distinct permissions, all granted and all used",
        used.len()
    );
}

/// The ClusterRole only reads, except creating Events (about unmeshed pods), deleting
/// Pods (`--repair delete`) and patching Nodes (the startup taint), and names no
/// wildcard (checked by `granted`).
#[test]
fn clusterrole_writes_only_events_unmeshed_pod_deletes_the_node_patch_and_route_status() {
    let role: ClusterRole = manifest("clusterrole.yaml");
    let writes: Vec<Permission> = granted(&role)
        .into_iter()
        .filter(|(_, _, v)| !matches!(v.as_str(), "get" | "list" | "watch"))
        .collect();
    assert_eq!(
        writes,
        [
            (String::new(), "events".into(), "create".into()),
            (String::new(), "nodes".into(), "patch".into()),
            (String::new(), "pods".into(), "delete".into()),
            (
                "gateway.networking.k8s.io".into(),
                "httproutes/status".into(),
                "patch".into()
            ),
        ],
        "the agent writes nothing to the API but Events, unmeshed pods' deletion, its \
         Node's taints and HTTPRoutes' status"
    );
    // Secrets and ConfigMaps are never read by the agent.
    assert!(
        granted(&role)
            .iter()
            .all(|(_, r, _)| r != "secrets" && r != "configmaps")
    );
}

/// Every manifest of deploy/ is listed in kustomization.yaml, and the objects refer to
/// each other consistently: the DaemonSet runs as the ServiceAccount the binding
/// names, in the namespace the Namespace creates, bound to the ClusterRole.
#[test]
fn manifests_are_listed_and_refer_to_each_other() {
    let kustomization: serde_json::Value =
        serde_saphyr::from_str(&read_limited(&deploy_dir().join("kustomization.yaml")))
            .expect("kustomization.yaml is YAML");
    let listed: BTreeSet<String> = kustomization["resources"]
        .as_array()
        .expect("kustomization resources")
        .iter()
        .map(|r| r.as_str().expect("a file name").to_owned())
        .collect();
    let on_disk: BTreeSet<String> = std::fs::read_dir(deploy_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
        .collect();
    assert_eq!(
        listed, on_disk,
        "kustomization.yaml resources vs deploy/*.yaml"
    );

    let ns: Namespace = manifest("namespace.yaml");
    let ns_name = ns.metadata.name.expect("namespace name");
    let sa: ServiceAccount = manifest("serviceaccount.yaml");
    let role: ClusterRole = manifest("clusterrole.yaml");
    let binding: ClusterRoleBinding = manifest("clusterrolebinding.yaml");
    let ds: DaemonSet = manifest("daemonset.yaml");
    let config: ConfigMap = manifest("configmap.yaml");

    assert_eq!(sa.metadata.namespace.as_deref(), Some(ns_name.as_str()));
    assert_eq!(ds.metadata.namespace.as_deref(), Some(ns_name.as_str()));
    assert_eq!(config.metadata.namespace.as_deref(), Some(ns_name.as_str()));
    assert_eq!(binding.role_ref.kind, "ClusterRole");
    assert_eq!(binding.role_ref.api_group, "rbac.authorization.k8s.io");
    assert_eq!(Some(&binding.role_ref.name), role.metadata.name.as_ref());
    let subjects = binding.subjects.expect("binding subjects");
    assert_eq!(subjects.len(), 1, "{subjects:?}");
    assert_eq!(subjects[0].kind, "ServiceAccount");
    assert_eq!(Some(&subjects[0].name), sa.metadata.name.as_ref());
    assert_eq!(subjects[0].namespace.as_deref(), Some(ns_name.as_str()));
    let pod = ds.spec.expect("spec").template.spec.expect("pod spec");
    assert_eq!(pod.service_account_name, sa.metadata.name);
    assert_ne!(pod.automount_service_account_token, Some(false));

    // Every ConfigMap key the pod reads exists.
    let data = config.data.unwrap_or_default();
    for c in pod
        .containers
        .iter()
        .chain(pod.init_containers.iter().flatten())
    {
        for env in c.env.iter().flatten() {
            if let Some(r) = env
                .value_from
                .as_ref()
                .and_then(|v| v.config_map_key_ref.as_ref())
            {
                assert_eq!(Some(&r.name), config.metadata.name.as_ref(), "{}", env.name);
                assert!(
                    data.contains_key(&r.key),
                    "{}: no key {:?}",
                    env.name,
                    r.key
                );
                assert_ne!(
                    r.optional,
                    Some(true),
                    "{}: a missing key must not start the agent",
                    env.name
                );
            }
        }
    }
    // Installed as shipped, flock meshes: strict capture.
    assert_eq!(data.get("capture").map(String::as_str), Some("strict"));
}

fn container<'a>(containers: &'a [Container], name: &str) -> &'a Container {
    containers
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name:?}"))
}

/// `--flag=value` or `--flag value` in a container's args.
fn flag<'a>(c: &'a Container, name: &str) -> Option<&'a str> {
    let args = c.args.as_deref().unwrap_or_default();
    let long = format!("--{name}");
    args.iter().enumerate().find_map(|(i, a)| {
        if let Some(v) = a.strip_prefix(&format!("{long}=")) {
            Some(v)
        } else if *a == long {
            args.get(i + 1).map(String::as_str)
        } else {
            None
        }
    })
}

fn has_flag(c: &Container, name: &str) -> bool {
    let long = format!("--{name}");
    c.args
        .iter()
        .flatten()
        .any(|a| *a == long || a.starts_with(&format!("{long}=")))
}

/// The DaemonSet's node-agent invariants the schema cannot check: least capabilities
/// per container, the startup-taint toleration, hostPath propagation for the pods'
/// network namespaces, priority, update strategy and a grace period covering Envoy's
/// drain, and the agent, installer and Envoy agreeing on shared paths.
#[test]
fn daemonset_keeps_the_node_agent_invariants() {
    let ds: DaemonSet = manifest("daemonset.yaml");
    let spec = ds.spec.expect("spec");
    let pod = spec.template.spec.expect("pod spec");

    assert_eq!(pod.host_network, Some(true));
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    assert_eq!(pod.dns_policy.as_deref(), Some("ClusterFirstWithHostNet"));
    assert_ne!(pod.host_pid, Some(true));
    assert_eq!(
        pod.security_context
            .as_ref()
            .and_then(|s| s.seccomp_profile.as_ref())
            .map(|p| p.type_.as_str()),
        Some("RuntimeDefault")
    );
    assert_ne!(pod.host_ipc, Some(true));

    // Tolerations: the startup taint the agent removes, and tolerate-all for both
    // effects, like every node agent.
    let tolerations = pod.tolerations.clone().unwrap_or_default();
    assert!(
        tolerations.iter().any(|t| {
            t.key.as_deref() == Some(flock_kube::taint::STARTUP_TAINT_KEY)
                && t.effect.as_deref() == Some("NoSchedule")
                && matches!(t.operator.as_deref(), Some("Exists") | None)
        }),
        "no toleration for {}:NoSchedule: {tolerations:?}",
        flock_kube::taint::STARTUP_TAINT_KEY
    );
    for effect in ["NoSchedule", "NoExecute"] {
        assert!(
            tolerations.iter().any(|t| t.key.is_none()
                && t.operator.as_deref() == Some("Exists")
                && t.effect.as_deref() == Some(effect)),
            "no tolerate-all for {effect}"
        );
    }

    // Capabilities: ALL dropped everywhere; each container adds back exactly what
    // docs/security.md and the DaemonSet's comments justify.
    let expected_caps: BTreeMap<&str, &[&str]> = BTreeMap::from([
        ("envoy-dirs", &["CHOWN", "FOWNER"][..]),
        ("envoy-bootstrap", &[][..]),
        ("install-cni", &["CHOWN", "DAC_OVERRIDE"][..]),
        ("agent", &["CHOWN", "NET_ADMIN", "SYS_ADMIN"][..]),
        (
            "envoy",
            &["NET_ADMIN", "SETGID", "SETPCAP", "SETUID", "SYS_ADMIN"][..],
        ),
    ]);
    let init = pod.init_containers.clone().unwrap_or_default();
    let all: Vec<&Container> = pod.containers.iter().chain(init.iter()).collect();
    assert_eq!(
        all.iter().map(|c| c.name.as_str()).collect::<BTreeSet<_>>(),
        expected_caps.keys().copied().collect::<BTreeSet<_>>()
    );
    for c in &all {
        let sc = c
            .security_context
            .as_ref()
            .unwrap_or_else(|| panic!("{}: no securityContext", c.name));
        assert_ne!(sc.privileged, Some(true), "{}", c.name);
        assert_eq!(sc.allow_privilege_escalation, Some(false), "{}", c.name);
        assert_eq!(sc.read_only_root_filesystem, Some(true), "{}", c.name);
        let caps = sc.capabilities.as_ref().expect("capabilities");
        assert_eq!(
            caps.drop.as_deref(),
            Some(&["ALL".to_owned()][..]),
            "{}",
            c.name
        );
        let added: BTreeSet<&str> = caps.add.iter().flatten().map(String::as_str).collect();
        assert_eq!(
            added,
            expected_caps[c.name.as_str()].iter().copied().collect(),
            "{}: added capabilities",
            c.name
        );
    }

    // hostPath volumes: exactly the node paths flock uses; the pods' network
    // namespaces propagate host → container wherever they are mounted.
    let volumes = pod.volumes.clone().unwrap_or_default();
    let host_paths: BTreeMap<String, String> = volumes
        .iter()
        .filter_map(|v| Some((v.host_path.as_ref()?.path.clone(), v.name.clone())))
        .collect();
    assert_eq!(
        host_paths
            .keys()
            .map(String::as_str)
            .collect::<BTreeSet<_>>(),
        BTreeSet::from([
            "/dev/shm",
            "/etc/cni/net.d",
            "/opt/cni/bin",
            "/run/flock",
            "/run/flock-envoy",
            "/sys/fs/cgroup",
            "/var/lib/flock",
            "/var/run/netns"
        ])
    );
    // The host's cgroup tree (where nft resolves kubelet's cgroup): read only, and
    // only the agent's.
    let cgroup = &host_paths["/sys/fs/cgroup"];
    for c in &all {
        for m in c
            .volume_mounts
            .iter()
            .flatten()
            .filter(|m| &m.name == cgroup)
        {
            assert_eq!(c.name, "agent", "only the agent mounts the host's cgroups");
            assert_eq!(m.read_only, Some(true), "the host's cgroups are read only");
        }
    }
    let netns = &host_paths["/var/run/netns"];
    let mut netns_mounts = 0;
    for c in &all {
        for m in c.volume_mounts.iter().flatten() {
            if &m.name == netns {
                netns_mounts += 1;
                assert_eq!(
                    m.mount_propagation.as_deref(),
                    Some("HostToContainer"),
                    "{}: netns mount",
                    c.name
                );
            } else {
                assert!(
                    m.mount_propagation.as_deref().is_none_or(|p| p == "None"),
                    "{}: {} needs no propagation",
                    c.name,
                    m.name
                );
            }
        }
    }
    assert_eq!(
        netns_mounts, 2,
        "the agent (liveness probes) and Envoy (listeners) enter pods' namespaces"
    );

    // Rolling update with surge: the new pod beside the old, never a node without
    // one (the agents hand over through the node lock, the Envoys through a hot
    // restart); no hostPort a surge pod could not share. The grace period covers the
    // supervisor's shutdown.
    let strategy = spec.update_strategy.expect("updateStrategy");
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    let rolling = strategy.rolling_update.expect("rollingUpdate");
    assert_eq!(rolling.max_unavailable, Some(IntOrString::Int(0)));
    assert_eq!(rolling.max_surge, Some(IntOrString::Int(1)));
    for c in &all {
        assert!(
            c.ports.iter().flatten().all(|p| p.host_port.is_none()),
            "{}: a hostPort keeps the surge pod off the node",
            c.name
        );
    }
    let envoy = container(&pod.containers, "envoy");
    let secs = |name: &str| -> i64 {
        flag(envoy, name)
            .unwrap_or_else(|| panic!("envoy: --{name} is set explicitly"))
            .parse()
            .unwrap_or_else(|e| panic!("envoy: --{name}: {e}"))
    };
    let shutdown = secs("drain-time-s") + secs("handoff-timeout-s") + secs("shutdown-margin-s");
    let grace = pod
        .termination_grace_period_seconds
        .expect("terminationGracePeriodSeconds");
    assert!(
        grace > shutdown,
        "terminationGracePeriodSeconds {grace} must exceed the supervisor's longest shutdown {shutdown}"
    );

    // The agent: --kube, its node from the downward API, the installer's ready file.
    let agent = container(&pod.containers, "agent");
    assert!(has_flag(agent, "kube"), "agent: --kube");
    assert!(
        has_flag(agent, "remove-startup-taint"),
        "agent: --remove-startup-taint"
    );
    assert_eq!(flag(agent, "node-name"), Some("$(FLOCK_NODE_NAME)"));
    // Capture on, as the ConfigMap says (strict, shipped), enforced against pods, and
    // kubelet's probes given their source.
    assert_eq!(flag(agent, "capture"), Some("$(FLOCK_CAPTURE)"));
    assert!(
        has_flag(agent, "capture-enforce"),
        "agent: --capture-enforce"
    );
    assert_eq!(
        flag(agent, "capture-probe-cgroup"),
        Some("$(FLOCK_KUBELET_CGROUP)")
    );
    let node_env = agent
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "FLOCK_NODE_NAME")
        .expect("agent: FLOCK_NODE_NAME");
    assert_eq!(
        node_env
            .value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.as_str()),
        Some("spec.nodeName")
    );
    let installer = container(&pod.containers, "install-cni");
    let ready = flag(installer, "ready-file").expect("install-cni: --ready-file");
    assert_eq!(flag(agent, "cni-ready-file"), Some(ready));
    // The ready file is on a volume both containers mount at the same place, and it is
    // the pod's own (a file left on the host by a killed installer is not readiness).
    let ready_dir = Path::new(ready).parent().unwrap();
    let ready_volume = |c: &Container| {
        c.volume_mounts
            .iter()
            .flatten()
            .find(|m| Path::new(&m.mount_path) == ready_dir)
            .map(|m| m.name.clone())
            .unwrap_or_else(|| panic!("{}: {} not mounted", c.name, ready_dir.display()))
    };
    let shared = ready_volume(installer);
    assert_eq!(ready_volume(agent), shared);
    assert!(
        volumes
            .iter()
            .any(|v| v.name == shared && v.empty_dir.is_some()),
        "the ready file's volume is an emptyDir"
    );

    // Readiness: each container's own file (the agent's says standing by or serving,
    // so a surge pod is ready while the old agent still holds the admin port).
    let exec_probe = |c: &Container| -> Vec<String> {
        c.readiness_probe
            .as_ref()
            .and_then(|p| p.exec.as_ref())
            .and_then(|e| e.command.clone())
            .unwrap_or_else(|| panic!("{}: exec readiness probe", c.name))
    };
    assert_eq!(exec_probe(installer), ["test", "-e", ready]);
    let agent_ready = flag(agent, "ready-file").expect("agent: --ready-file");
    assert_eq!(exec_probe(agent), ["test", "-e", agent_ready]);
    assert_eq!(
        exec_probe(envoy),
        [
            "test",
            "-e",
            flag(envoy, "ready-file").expect("envoy: --ready-file")
        ]
    );

    // Envoy reaches the agent's xDS socket: the bootstrap names the agent's socket, and
    // Envoy mounts the directory it is in from the same volume.
    let bootstrap = container(&init, "envoy-bootstrap");
    let xds = flag(agent, "xds-socket").expect("agent: --xds-socket");
    let script = bootstrap.args.as_deref().unwrap_or_default().join(" ");
    assert!(
        script.contains(&format!("--xds-socket {xds}")),
        "the bootstrap's --xds-socket is the agent's {xds}: {script}"
    );
    let mount_of = |c: &Container, path: &Path| {
        c.volume_mounts
            .iter()
            .flatten()
            .filter(|m| path.starts_with(&m.mount_path))
            .max_by_key(|m| m.mount_path.len())
            .map(|m| (m.name.clone(), m.mount_path.clone()))
    };
    let xds_dir = Path::new(xds).parent().unwrap();
    // Envoy's admin: the bootstrap's unix socket is the one the supervisor talks to,
    // inside its private control directory; no TCP admin port anywhere (any process
    // on the host could stop Envoy through it).
    let control = flag(envoy, "control-dir").expect("envoy: --control-dir");
    let admin_socket = flag(envoy, "admin-socket").expect("envoy: --admin-socket");
    assert_eq!(Path::new(admin_socket).parent(), Some(Path::new(control)));
    assert!(
        script.contains(&format!("--envoy-admin-socket {admin_socket}")),
        "the bootstrap's --envoy-admin-socket is the supervisor's {admin_socket}: {script}"
    );
    assert!(!script.contains("--envoy-admin-port"), "{script}");
    assert_eq!(flag(envoy, "admin-address"), None, "envoy: TCP admin");
    assert!(
        envoy.ports.as_deref().unwrap_or_default().is_empty(),
        "envoy: no admin port"
    );
    // Envoy is not root: the supervisor switches to --user, and the agent hands that
    // uid the xDS socket. Its state and control directory are the node's
    // /run/flock-envoy (shared with a surge pod's supervisor, which hot-restarts Envoy
    // from them; envoy-dirs makes it that uid's), never the agent's uid-0 /run/flock,
    // which Envoy mounts read-only for the xDS socket alone. Each ready file is its
    // pod's own (an emptyDir): the old pod's must not make the new one ready.
    let user = flag(envoy, "user").expect("envoy: flock-supervisor --user (Envoy as root)");
    let uid = user.split(':').next().unwrap();
    assert_ne!(uid, "0", "envoy: --user {user}");
    assert_eq!(
        flag(agent, "envoy-uid"),
        Some(uid),
        "the agent hands the xDS socket to Envoy's uid"
    );
    let state = flag(envoy, "state-dir").expect("envoy: --state-dir");
    let envoy_ready = flag(envoy, "ready-file").expect("envoy: --ready-file");
    let envoy_run = &host_paths["/run/flock-envoy"];
    for path in [control, state] {
        let (name, _) = mount_of(envoy, Path::new(path)).unwrap_or_else(|| panic!("{path}"));
        assert_eq!(&name, envoy_run, "{path}: on the node's /run/flock-envoy");
    }
    let dirs = container(&init, "envoy-dirs");
    assert_eq!(
        mount_of(dirs, Path::new(state)).map(|(n, _)| n).as_ref(),
        Some(envoy_run)
    );
    let made = dirs.command.clone().unwrap_or_default().join(" ");
    assert!(
        made.contains(&format!("-o {uid}")) && made.contains("-m 0700"),
        "envoy-dirs: {made}"
    );
    assert_eq!(
        mount_of(envoy, Path::new("/dev/shm"))
            .map(|(n, _)| n)
            .as_ref(),
        host_paths.get("/dev/shm"),
        "envoy: the node's /dev/shm (hot restart across pods)"
    );
    for (c, path) in [(envoy, envoy_ready), (agent, agent_ready)] {
        let (name, _) = mount_of(c, Path::new(path)).unwrap_or_else(|| panic!("{path}"));
        assert!(
            volumes
                .iter()
                .any(|v| v.name == name && v.empty_dir.is_some()),
            "{}: {path} on the pod's own emptyDir",
            c.name
        );
    }
    let run = envoy
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| Some(&m.name) == host_paths.get("/run/flock"))
        .expect("envoy mounts /run/flock for the xDS socket");
    assert_eq!(run.read_only, Some(true), "envoy: /run/flock read-only");
    assert!(mount_of(agent, xds_dir).is_some());
    assert_eq!(mount_of(agent, xds_dir), mount_of(envoy, xds_dir));
    assert_eq!(
        host_paths.get("/run/flock"),
        mount_of(agent, xds_dir).map(|(name, _)| name).as_ref(),
        "the sockets live on the host's /run/flock (the CNI plugin connects from the host)"
    );
}

/// deploy/authorizationpolicy-crd.yaml serves what the agent watches
/// ([`flock_kube::policy::AuthorizationPolicy`]), documents every field of a policy
/// document and no other, and keeps unknown fields: a structural schema would prune a
/// misspelt field silently (the rule would then mean something else), preserved it
/// reaches the agent, which refuses the object (fail closed).
#[test]
fn the_policy_crd_serves_what_the_agent_watches_and_keeps_unknown_fields() {
    use flock_core::authz::{Action, DefaultAction, FromSpec, PolicySpec, RuleSpec, ToSpec};
    use flock_kube::policy::AuthorizationPolicy;
    use k8s_openapi::Resource as _;
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
        CustomResourceDefinition, JSONSchemaProps,
    };

    let crd: CustomResourceDefinition = manifest("authorizationpolicy-crd.yaml");
    assert_eq!(crd.spec.group, AuthorizationPolicy::GROUP);
    assert_eq!(crd.spec.names.kind, AuthorizationPolicy::KIND);
    assert_eq!(crd.spec.names.plural, AuthorizationPolicy::URL_PATH_SEGMENT);
    assert_eq!(crd.spec.scope, "Namespaced");
    assert_eq!(
        crd.metadata.name.as_deref(),
        Some(
            format!(
                "{}.{}",
                AuthorizationPolicy::URL_PATH_SEGMENT,
                AuthorizationPolicy::GROUP
            )
            .as_str()
        )
    );
    let version = crd
        .spec
        .versions
        .iter()
        .find(|v| v.name == AuthorizationPolicy::VERSION)
        .expect("the version the agent watches");
    assert!(version.served && version.storage);
    let root = version
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .expect("a schema");
    let props = |s: &JSONSchemaProps, at: &str| -> BTreeSet<String> {
        s.properties
            .as_ref()
            .unwrap_or_else(|| panic!("{at}: no properties"))
            .keys()
            .cloned()
            .collect()
    };
    let child = |s: &JSONSchemaProps, name: &str| -> JSONSchemaProps {
        s.properties
            .as_ref()
            .and_then(|p| p.get(name))
            .cloned()
            .unwrap_or_else(|| panic!("no {name}"))
    };
    let keeps_unknown = |s: &JSONSchemaProps, at: &str| {
        assert_eq!(
            s.x_kubernetes_preserve_unknown_fields,
            Some(true),
            "{at}: unknown fields would be pruned, not refused"
        );
    };
    let keys = |v: serde_json::Value| -> BTreeSet<String> {
        v.as_object().expect("an object").keys().cloned().collect()
    };
    // Every field of a policy document, each set so it serializes.
    let from = FromSpec {
        ids: vec!["*".into()],
        namespaces: vec!["a".into()],
        service_accounts: vec!["a/b".into()],
    };
    let to = ToSpec {
        ports: vec![80],
        methods: vec!["GET".into()],
        paths: vec!["/".into()],
        hosts: vec!["h".into()],
    };
    let rule = RuleSpec {
        action: Action::Allow,
        from: from.clone(),
        to: to.clone(),
    };
    let spec = PolicySpec {
        namespace: Some("a".into()),
        service: Some("b".into()),
        default: Some(DefaultAction::Deny),
        rules: vec![rule.clone()],
    };
    let spec_schema = child(root, "spec");
    keeps_unknown(&spec_schema, "spec");
    assert_eq!(
        props(&spec_schema, "spec"),
        keys(serde_json::to_value(&spec).unwrap())
    );
    let rule_schema = *match spec_schema.properties.as_ref().unwrap()["rules"].items.clone() {
        Some(k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSONSchemaPropsOrArray::Schema(s)) => s,
        other => panic!("rules items: {other:?}"),
    };
    keeps_unknown(&rule_schema, "spec.rules[]");
    assert_eq!(
        props(&rule_schema, "spec.rules[]"),
        keys(serde_json::to_value(&rule).unwrap())
    );
    for (name, value) in [
        ("from", serde_json::to_value(&from)),
        ("to", serde_json::to_value(&to)),
    ] {
        let s = child(&rule_schema, name);
        keeps_unknown(&s, name);
        assert_eq!(props(&s, name), keys(value.unwrap()), "spec.rules[].{name}");
    }
}

/// The AuthorizationPolicy docs/authz.md shows is one the agent accepts, and it governs
/// the service it says (a doc example that drifted from the parser would be refused:
/// fail closed, and a reader's first policy would deny everything).
#[test]
fn the_documented_authorization_policy_is_accepted() {
    use flock_core::authz::Target;
    use flock_kube::policy::{AuthorizationPolicy, policies_by_target};

    let doc = read_limited(&deploy_dir().join("../docs/authz.md"));
    let start = doc
        .find("```yaml\napiVersion: flock.io/v1alpha1")
        .expect("docs/authz.md shows an AuthorizationPolicy");
    let body = &doc[start + "```yaml\n".len()..];
    let body = &body[..body.find("```").expect("the block ends")];
    let object: AuthorizationPolicy = serde_saphyr::from_str(body).expect("the example is YAML");
    let namespace = object.metadata.namespace.clone().expect("a namespace");
    let name = object.metadata.name.clone().expect("a name");
    let key = (namespace, name);
    let by_target = policies_by_target([(&key, &object)]);
    let target = Target {
        namespace: "shop".into(),
        service: Some("web".into()),
    };
    let sourced = by_target.get(&target).expect("it governs shop/web");
    assert!(
        sourced.written.is_ok(),
        "the documented policy is refused: {:?}",
        sourced.written.as_ref().err()
    );
}

/// The node-patch admission policy (deploy/node-patch-policy.yaml) is bound (Deny),
/// matches Node updates by exactly the agent's service account as the manifests name
/// it, and its rules name the token's node-name extra and the taint the agent removes
/// (`flock_kube::taint::STARTUP_TAINT_KEY`). Its CEL runs only in an API server; the
/// schema check is `scripts/validate-manifests`'.
#[test]
fn the_node_patch_policy_confines_the_agents_node_writes() {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    let path = deploy_dir().join("node-patch-policy.yaml");
    let text = read_limited(&path);
    let docs: Vec<&str> = text.split("\n---\n").collect();
    assert_eq!(docs.len(), 2, "the policy and its binding");
    let parse = |doc: &str| -> serde_json::Value {
        serde_saphyr::from_str(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    let policy: ValidatingAdmissionPolicy = serde_json::from_value(parse(docs[0])).unwrap();
    let binding: ValidatingAdmissionPolicyBinding = serde_json::from_value(parse(docs[1])).unwrap();
    let spec = policy.spec.expect("policy spec");
    let bspec = binding.spec.expect("binding spec");
    assert_eq!(bspec.policy_name, policy.metadata.name);
    assert_eq!(bspec.validation_actions, Some(vec!["Deny".to_string()]));
    assert_eq!(spec.failure_policy.as_deref(), Some("Fail"));

    let rules = spec
        .match_constraints
        .expect("matchConstraints")
        .resource_rules
        .expect("resourceRules");
    assert_eq!(rules.len(), 1);
    assert_eq!(rules[0].resources, Some(vec!["nodes".to_string()]));
    assert_eq!(rules[0].operations, Some(vec!["UPDATE".to_string()]));

    let ns: Namespace = manifest("namespace.yaml");
    let sa: ServiceAccount = manifest("serviceaccount.yaml");
    let user = format!(
        "system:serviceaccount:{}:{}",
        ns.metadata.name.unwrap(),
        sa.metadata.name.unwrap()
    );
    let conditions = spec.match_conditions.expect("matchConditions");
    assert_eq!(conditions.len(), 1);
    assert_eq!(
        conditions[0].expression,
        format!("request.userInfo.username == '{user}'")
    );
    let rules: Vec<String> = spec
        .validations
        .expect("validations")
        .into_iter()
        .map(|v| v.expression)
        .collect();
    assert!(
        rules
            .iter()
            .any(|r| r.contains("authentication.kubernetes.io/node-name")
                && r.contains("object.metadata.name")),
        "{rules:?}"
    );
    assert!(
        rules.iter().any(|r| r.contains(&format!(
            "t.key != '{}'",
            flock_kube::taint::STARTUP_TAINT_KEY
        ))),
        "{rules:?}"
    );
}
