//! Kube mode end to end: the real agent binary with `--kube --kubeconfig`, real libcni
//! (`cnitool` + Debian's `bridge` and `host-local` chained with the real `flock-cni`,
//! pods in real network namespaces) and real Envoy under `flock-supervisor`.
//!
//! The Kubernetes API server is flock-kube's API-server DOUBLE (`flock_kube::double`,
//! feature `testing`): no control plane can run where this suite runs. It serves the
//! real HTTP API (list, watch, get) to the agent's kube client over TCP with the
//! kubeconfig it writes, and can be made unreachable; everything else here is real.
//!
//! What is checked:
//! * a pod with NO flock annotations, in a namespace labelled `flock.io/mesh: enabled`,
//!   gets its identity from `spec.serviceAccountName` (its SVID's SPIFFE ID in the
//!   agent's snapshot and in Envoy's config) and its ports from its containers (an
//!   inbound listener for the container port);
//! * an annotation claiming another service account changes nothing, and a malformed
//!   `flock.io/ports` annotation does not stop the pod at the plugin;
//! * a Service created after the pod's ADD registers the pod (the agent's registry view)
//!   without a restart, and a meshed client reaches it through both Envoy listeners;
//! * with the API unreachable, a CNI ADD fails with the agent's clear message;
//! * with the agent down, a kube-system pod's ADD succeeds (the plugin's default
//!   `exclude_namespaces`) and a meshed pod's fails naming the agent's socket;
//!   once the agent is back the meshed pod's retried ADD meshes it;
//! * an AuthorizationPolicy object for the Service is enforced by the callee's Envoy
//!   (403, then 200 once it names the caller), a misspelt field fails closed and is
//!   named in `/readyz`, and deleting it restores the default;
//! * an HTTPRoute on the Service routes by header and weight, a missing backend is
//!   reported and answered 500, a route with an unsupported filter is refused alone
//!   (both in `/debug/routes`, and in each route's status subresource: `Accepted`,
//!   `ResolvedRefs`), and deleting the route restores the default route;
//! * a Service's `flock.io/max-*` annotations become the circuit breakers of each of
//!   its mesh clusters in Envoy (live), a malformed one keeps the defaults and is
//!   reported in `/debug/routes`, and removing them restores the defaults;
//! * a pod whose namespace is not opted in is not meshed.
//!
//! Needs what `mtls.rs` needs (root, Envoy, libcni, sibling binaries).

mod common;

use common::*;
use flock_kube::double::ApiServer;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use serde_json::{Value, json};
use std::time::Duration;

const BODY: &str = "hello from a kube pod";
const TRUST_DOMAIN: &str = "mesh.test";

fn namespace(name: &str, labels: Value) -> Namespace {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": name, "labels": labels}
    }))
    .unwrap()
}

/// A pod on node `n1` (the agent's `--node-name`) with one container.
fn pod(ns: &str, name: &str, uid: &str, account: &str, labels: Value, ports: Value) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "uid": uid, "labels": labels},
        "spec": {
            "nodeName": "n1",
            "serviceAccountName": account,
            "containers": [{"name": "app", "image": "app", "ports": ports}]
        }
    }))
    .unwrap()
}

fn curl(ns: &NetNs, args: &[&str]) -> (u16, String) {
    let out = ns
        .command("curl")
        .args(["-sS", "-m", "5", "-o", "-", "-w", "\n%{http_code}"])
        .args(args)
        .output()
        .expect("curl is needed (apt-get install curl)");
    let text = String::from_utf8_lossy(&out.stdout);
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// The names of the secrets in the agent's Envoy snapshot (SPIFFE IDs of the SVIDs).
fn secrets(agent: &Agent) -> Vec<String> {
    let snap = agent.json("/debug/snapshot");
    snap["groups"]["envoy"]["resources"]["sds"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The agent's registry entries (`/debug/registry`) as (service, service_port, port).
fn registered(agent: &Agent) -> Vec<(String, u64, u64)> {
    let view = agent.json("/debug/registry");
    view["endpoints"]
        .as_object()
        .map(|eps| {
            eps.values()
                .map(|e| {
                    (
                        e["service"].as_str().unwrap_or_default().to_owned(),
                        e["service_port"].as_u64().unwrap_or_default(),
                        e["port"].as_u64().unwrap_or_default(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn meshed_pods(agent: &Agent) -> Vec<String> {
    agent.json("/debug/pods")["pods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pod"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn kube_pods_get_identity_ports_and_memberships_from_the_api() {
    let _ = required_env("FLOCK_CNI_PLUGIN_DIR");
    let _ = required_env("FLOCK_CNITOOL");
    // The double runs on its own runtime for the whole test.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let api = rt.block_on(ApiServer::start());
    api.apply(&namespace("shop", json!({"flock.io/mesh": "enabled"})));
    api.apply(&namespace("plain", json!({})));
    let work = tempfile::Builder::new()
        .prefix("flock-kube-e2e-")
        .tempdir()
        .unwrap();
    let kubeconfig = work.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig);

    let agent_args = [
        "--kube",
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
        "--kube-pod-wait",
        "1s",
        "--trust-domain",
        TRUST_DOMAIN,
        "--endpoint-labels",
        "version,app.kubernetes.io/version",
    ];
    let mut agent = Agent::start(&agent_args);
    let agent_pid = agent.proc.pid();
    let envoy = SupervisedEnvoy::start(&agent);

    let net = ChainedNetwork::start(work.path(), &agent, "kube", 8000);
    let cni = &net.cni;

    // web-0: flock annotations claiming another service account, plus a service and
    // a malformed ports annotation (which an annotation-mode agent would refuse with
    // CNI error 102); the plugin leaves them to the agent, which ignores them: its
    // identity and port must come from the API.
    let web_uid = "5b7c3c1e-0000-4000-8000-0000000000b1";
    api.apply(&pod(
        "shop",
        "web-0",
        web_uid,
        "web",
        json!({"app": "web"}),
        json!([{"name": "http", "containerPort": 8080}]),
    ));
    let ns_web = NetNs::new("kw");
    let _server = http_server_in(&ns_web, 8080, BODY, work.path().join("web.log"));
    let web_pod = PodSpec {
        namespace: "shop",
        name: "web-0",
        uid: web_uid,
        annotations: json!({"flock.io/service-account": "admin",
                            "flock.io/service": "web", "flock.io/ports": "http"}),
    };
    cni.ok("add", &ns_web, "ctr-web", &web_pod);
    assert_eq!(meshed_pods(&agent), vec!["shop/web-0".to_string()]);
    let listed = agent.json("/debug/pods");
    assert_eq!(listed["pods"][0]["service_account"], "web", "{listed}");
    assert_eq!(listed["pods"][0]["ports"][0]["app_port"], 8080, "{listed}");
    let web_id = format!("spiffe://{TRUST_DOMAIN}/ns/shop/sa/web");
    let ids = secrets(&agent);
    assert!(ids.contains(&web_id), "no SVID for {web_id}: {ids:?}");
    assert!(
        !ids.iter().any(|id| id.ends_with("/sa/admin")),
        "the annotation's account was used: {ids:?}"
    );
    // Envoy got the inbound listener of the container port, with the API's identity.
    wait_for("Envoy has web-0's inbound listener and SVID", WAIT, || {
        let dump = envoy.config_dump();
        dump.contains("inbound|shop/web-0|8080") && dump.contains(&web_id)
    });
    assert!(
        agent
            .proc
            .log_text()
            .contains("identity annotations ignored"),
        "no log line about the ignored annotation"
    );
    // No Service selects it yet: registered nowhere.
    assert_eq!(registered(&agent), Vec::new());

    // A meshed client in the same namespace (service account `client`, no ports).
    api.apply(&pod(
        "shop",
        "client-0",
        "5b7c3c1e-0000-4000-8000-0000000000c1",
        "client",
        json!({"app": "client"}),
        json!([]),
    ));
    let ns_client = NetNs::new("kc");
    let client_pod = PodSpec {
        namespace: "shop",
        name: "client-0",
        uid: "5b7c3c1e-0000-4000-8000-0000000000c1",
        annotations: json!({}),
    };
    cni.ok("add", &ns_client, "ctr-client", &client_pod);

    // The Service appears after the ADD: the agent registers web-0 under it (port 80
    // → the listener of targetPort "http", 15006) without a restart or a CNI call.
    let service: Service = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": {"selector": {"app": "web"},
                 "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}
    }))
    .unwrap();
    api.apply(&service);
    wait_for("web-0 registered under Service web", WAIT, || {
        registered(&agent) == vec![("web".to_string(), 80, 15006)]
    });
    let (status, body) = wait_for("client → web.shop through both Envoys", WAIT, || {
        let r = curl(
            &ns_client,
            &["-H", "Host: web.shop", "http://127.0.0.1:15001/"],
        );
        (r.0 == 200).then_some(r)
    });
    assert_eq!((status, body.as_str()), (200, BODY));
    assert_eq!(agent.proc.pid(), agent_pid);

    // An AuthorizationPolicy object for Service web that does not name client: web-0's
    // Envoy answers client 403 (RBAC on the inbound listener, the caller's identity
    // from its verified certificate); one that allows shop/client GETs lets it in
    // again. Both reach Envoy live, with no restart.
    let web_policy = |rules: Value| -> flock_kube::policy::AuthorizationPolicy {
        serde_json::from_value(json!({
            "apiVersion": "flock.io/v1alpha1", "kind": "AuthorizationPolicy",
            "metadata": {"name": "web", "namespace": "shop"},
            "spec": {"service": "web", "default": "deny", "rules": rules}
        }))
        .unwrap()
    };
    let get_web = || {
        curl(
            &ns_client,
            &["-H", "Host: web.shop", "http://127.0.0.1:15001/"],
        )
        .0
    };
    api.apply(&web_policy(json!([{"action": "allow",
        "from": {"serviceAccounts": ["shop/someone-else"]}}])));
    wait_for("client denied by web's AuthorizationPolicy", WAIT, || {
        get_web() == 403
    });
    let listed = agent.json("/debug/policies").to_string();
    assert!(
        listed.contains("AuthorizationPolicy shop/web"),
        "/debug/policies names the object: {listed}"
    );
    api.apply(&web_policy(json!([{"action": "allow",
        "from": {"serviceAccounts": ["shop/client"]}, "to": {"methods": ["GET"]}}])));
    wait_for("client allowed once the policy names it", WAIT, || {
        get_web() == 200
    });
    // A misspelt field fails closed and is named in /readyz; deleting the object
    // restores the mesh's default.
    api.apply(&web_policy(json!([{"action": "allow",
        "frm": {"serviceAccounts": ["shop/client"]}}])));
    wait_for("client denied by the refused policy", WAIT, || {
        get_web() == 403
    });
    let (_, ready) = agent.get("/readyz");
    assert!(
        ready.contains("authorization policy refused: shop/web"),
        "{ready}"
    );
    assert!(api.delete::<flock_kube::policy::AuthorizationPolicy>(Some("shop"), "web"));
    wait_for("client allowed with no policy", WAIT, || get_web() == 200);

    // An HTTPRoute (Gateway API, the upstream CRD's shape) on Service web: requests
    // with `x-route: direct` go to web itself, the rest to a backend that does not
    // exist (reported, and answered 500 as Gateway API says); a route with a filter
    // flock does not support is refused alone; deleting the route restores web's
    // default route. All live, from the API, with no restart.
    let http_route = |name: &str, rules: Value| -> flock_kube::route::HttpRoute {
        serde_json::from_value(json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": name, "namespace": "shop"},
            "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "web", "port": 80}],
                     "rules": rules}
        }))
        .unwrap()
    };
    let get_web_with = |header: &str| {
        curl(
            &ns_client,
            &[
                "-H",
                "Host: web.shop",
                "-H",
                header,
                "http://127.0.0.1:15001/",
            ],
        )
        .0
    };
    api.apply(&http_route(
        "web",
        json!([
            {"matches": [{"headers": [{"name": "x-route", "value": "direct"}]}],
             "backendRefs": [{"name": "web", "port": 80}]},
            {"backendRefs": [{"name": "web-gone", "port": 80}]}
        ]),
    ));
    wait_for("web routed by its HTTPRoute", WAIT, || {
        get_web() == 500 && get_web_with("x-route: direct") == 200
    });
    api.apply(&http_route(
        "bad",
        json!([{"filters": [{"type": "RequestMirror"}],
                "backendRefs": [{"name": "web", "port": 80}]}]),
    ));
    let routes = wait_for("both HTTPRoutes reported", WAIT, || {
        let r = agent.json("/debug/routes").to_string();
        (r.contains("HTTPRoute shop/bad") && r.contains("HTTPRoute shop/web")).then_some(r)
    });
    assert!(
        routes.contains("Refused") && routes.contains("RequestMirror"),
        "{routes}"
    );
    assert!(
        routes.contains("PartiallyInvalid") && routes.contains("web-gone"),
        "{routes}"
    );
    assert_eq!(
        get_web_with("x-route: direct"),
        200,
        "the refused route broke web's"
    );
    // The same state in each route's own status (the status subresource), under
    // the mesh's controllerName, at the object's generation.
    let condition = |route: &str, ty: &str| -> Option<Value> {
        let obj = api.get::<flock_kube::route::HttpRoute>(Some("shop"), route)?;
        let entry = obj.status?["parents"]
            .as_array()?
            .iter()
            .find(|p| p["controllerName"] == flock_kube::route::CONTROLLER_NAME)?
            .clone();
        let generation = obj.metadata.generation;
        let c = entry["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == ty)?
            .clone();
        (c["observedGeneration"].as_i64() == generation).then_some(c)
    };
    let resolved = wait_for("web's status: a backend not found", WAIT, || {
        condition("web", "ResolvedRefs")
    });
    assert_eq!(resolved["status"], "False", "{resolved}");
    assert_eq!(resolved["reason"], "BackendNotFound", "{resolved}");
    assert!(
        resolved["message"].as_str().unwrap().contains("web-gone"),
        "{resolved}"
    );
    assert_eq!(condition("web", "Accepted").unwrap()["status"], "True");
    let refused = wait_for("bad's status: not accepted", WAIT, || {
        condition("bad", "Accepted")
    });
    assert_eq!(refused["status"], "False", "{refused}");
    assert_eq!(refused["reason"], "UnsupportedValue", "{refused}");
    assert!(
        refused["message"]
            .as_str()
            .unwrap()
            .contains("RequestMirror"),
        "{refused}"
    );
    // Fixed (a new generation): the status follows.
    api.apply(&http_route(
        "web",
        json!([
            {"matches": [{"headers": [{"name": "x-route", "value": "direct"}]}],
             "backendRefs": [{"name": "web", "port": 80}]},
            {"backendRefs": [{"name": "web", "port": 80}]}
        ]),
    ));
    let resolved = wait_for("web's status: every backend resolved", WAIT, || {
        condition("web", "ResolvedRefs").filter(|c| c["status"] == "True")
    });
    println!("HTTPRoute shop/web status: {resolved}");
    assert!(api.delete::<flock_kube::route::HttpRoute>(Some("shop"), "bad"));
    assert!(api.delete::<flock_kube::route::HttpRoute>(Some("shop"), "web"));
    wait_for(
        "web's default route once its HTTPRoute is gone",
        WAIT,
        || get_web() == 200,
    );

    // Route subsets from pod labels: web-0 relabelled `version: v2` in the API (no
    // CNI call) registers with that label, and only it (`--endpoint-labels` names the
    // version keys: `team` stays on the node); a route to the subset v2 of web reaches it,
    // and one to a subset no pod carries (v9) is reported and answered 500.
    api.apply(&pod(
        "shop",
        "web-0",
        web_uid,
        "web",
        json!({"app": "web", "version": "v2", "team": "payments"}),
        json!([{"name": "http", "containerPort": 8080}]),
    ));
    let labels = wait_for("web-0's entry carries its version label", WAIT, || {
        let view = agent.json("/debug/registry");
        let labels = view["endpoints"]
            .as_object()?
            .values()
            .find(|e| e["service"] == "web")?["labels"]
            .clone();
        (!labels.is_null()).then_some(labels)
    });
    assert_eq!(labels, json!({"version": "v2"}));
    let subset_route = |name: &str, subset: &str| -> flock_kube::route::HttpRoute {
        serde_json::from_value(json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": name, "namespace": "shop", "annotations": {
                "flock.io/subsets": json!({
                    "v2": {"service": "web", "labels": {"version": "v2"}},
                    "v9": {"service": "web", "labels": {"version": "v9"}}
                }).to_string()}},
            "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "web", "port": 80}],
                     "rules": [{"backendRefs": [{"group": "flock.io", "kind": "ServiceSubset",
                                                 "name": subset, "port": 80}]}]}
        }))
        .unwrap()
    };
    api.apply(&subset_route("web", "v9"));
    wait_for("web routed to an empty subset: 500", WAIT, || {
        get_web() == 500
    });
    let routes = agent.json("/debug/routes").to_string();
    assert!(
        routes.contains("subset version=v9 has no endpoints"),
        "{routes}"
    );
    api.apply(&subset_route("web", "v2"));
    wait_for("web routed to its subset v2", WAIT, || get_web() == 200);
    assert!(api.delete::<flock_kube::route::HttpRoute>(Some("shop"), "web"));
    wait_for("web's default route again", WAIT, || get_web() == 200);

    // Connection-pool limits from web's annotations: every mesh cluster of web in
    // Envoy gets them as its circuit breakers (the others keep the defaults), live;
    // a malformed annotation keeps the defaults and is reported; removing them
    // restores the defaults. Traffic flows throughout.
    let web_limits = || -> Vec<(String, u64, u64)> {
        let dump: Value = serde_json::from_str(&envoy.config_dump()).unwrap_or_default();
        let mut out = Vec::new();
        for c in dump["configs"].as_array().into_iter().flatten() {
            for cl in c["dynamic_active_clusters"]
                .as_array()
                .into_iter()
                .flatten()
            {
                let name = cl["cluster"]["name"].as_str().unwrap_or_default();
                if name.contains("|web.shop") {
                    let t = &cl["cluster"]["circuit_breakers"]["thresholds"][0];
                    out.push((
                        name.to_string(),
                        t["max_connections"].as_u64().unwrap_or(0),
                        t["max_requests"].as_u64().unwrap_or(0),
                    ));
                }
            }
        }
        out
    };
    let defaults = flock_xds::translate::policy::ConnectionPool::default();
    let with_annotations = |pairs: &[(&str, &str)]| {
        let mut s = service.clone();
        s.metadata.annotations = Some(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        s
    };
    assert!(
        web_limits().iter().all(|(_, c, r)| (*c, *r)
            == (
                u64::from(defaults.max_connections),
                u64::from(defaults.max_requests)
            )),
        "{:?}",
        web_limits()
    );
    api.apply(&with_annotations(&[
        ("flock.io/max-connections", "3"),
        ("flock.io/max-requests", "7"),
    ]));
    let limited = wait_for("web's clusters limited by its annotations", WAIT, || {
        let l = web_limits();
        (!l.is_empty() && l.iter().all(|(_, c, r)| (*c, *r) == (3, 7))).then_some(l)
    });
    println!("web's mesh clusters under its annotations' limits: {limited:?}");
    assert_eq!(get_web(), 200);
    api.apply(&with_annotations(&[("flock.io/max-requests", "0")]));
    let routes = wait_for("the malformed pool annotation reported", WAIT, || {
        let r = agent.json("/debug/routes").to_string();
        r.contains("Service shop/web").then_some(r)
    });
    assert!(
        routes.contains("metadata.annotations[flock.io/max-requests]"),
        "{routes}"
    );
    wait_for("web's clusters back on the default limits", WAIT, || {
        web_limits().iter().all(|(_, c, r)| {
            (*c, *r)
                == (
                    u64::from(defaults.max_connections),
                    u64::from(defaults.max_requests),
                )
        })
    });
    assert_eq!(get_web(), 200);
    api.apply(&service);
    wait_for("the refusal gone with the annotation", WAIT, || {
        !agent
            .json("/debug/routes")
            .to_string()
            .contains("Service shop/web")
    });

    // A pod whose namespace is not opted in: the ADD succeeds, nothing is meshed.
    api.apply(&pod(
        "plain",
        "app-0",
        "5b7c3c1e-0000-4000-8000-0000000000d1",
        "default",
        json!({"app": "web"}),
        json!([{"containerPort": 8080}]),
    ));
    let ns_plain = NetNs::new("kp");
    let plain_pod = PodSpec {
        namespace: "plain",
        name: "app-0",
        uid: "5b7c3c1e-0000-4000-8000-0000000000d1",
        annotations: json!({}),
    };
    cni.ok("add", &ns_plain, "ctr-plain", &plain_pod);
    assert!(!meshed_pods(&agent).contains(&"plain/app-0".to_string()));
    assert!(!envoy.config_dump().contains("plain/app-0"));

    // The API goes away; a pod it has (but the agent never saw) cannot be identified.
    api.set_unreachable(true);
    api.apply(&pod(
        "shop",
        "web-1",
        "5b7c3c1e-0000-4000-8000-0000000000b2",
        "web",
        json!({"app": "web"}),
        json!([{"name": "http", "containerPort": 8080}]),
    ));
    let ns_late = NetNs::new("kl");
    let late_pod = PodSpec {
        namespace: "shop",
        name: "web-1",
        uid: "5b7c3c1e-0000-4000-8000-0000000000b2",
        annotations: json!({}),
    };
    let out = cni.run("add", &ns_late, "ctr-late", &late_pod);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !out.status.success(),
        "ADD succeeded without the API: {said}"
    );
    assert!(
        said.contains("cannot identify pod shop/web-1: the Kubernetes API is unreachable (")
            && said.contains("refusing to guess its identity"),
        "unclear error: {said}"
    );
    assert!(!meshed_pods(&agent).contains(&"shop/web-1".to_string()));
    api.set_unreachable(false);

    // The agent goes down. A kube-system pod still starts (the plugin's default
    // `exclude_namespaces`: it never calls the agent); a meshed pod's ADD fails with
    // "try again later" naming the agent's socket, and after the runtime's DEL (which
    // succeeds without the agent) its retried ADD meshes it once the agent is back.
    agent.kill9();
    let ns_system = NetNs::new("ks");
    let system_pod = PodSpec {
        namespace: "kube-system",
        name: "coredns-0",
        uid: "5b7c3c1e-0000-4000-8000-0000000000e1",
        annotations: json!({}),
    };
    cni.ok("add", &ns_system, "ctr-system", &system_pod);
    api.apply(&pod(
        "shop",
        "web-2",
        "5b7c3c1e-0000-4000-8000-0000000000b3",
        "web",
        json!({"app": "web"}),
        json!([{"name": "http", "containerPort": 8080}]),
    ));
    let ns_web2 = NetNs::new("kw2");
    let web2_pod = PodSpec {
        namespace: "shop",
        name: "web-2",
        uid: "5b7c3c1e-0000-4000-8000-0000000000b3",
        annotations: json!({}),
    };
    let out = cni.run("add", &ns_web2, "ctr-web2", &web2_pod);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !out.status.success(),
        "ADD succeeded without the agent: {said}"
    );
    // (cnitool prints the plugin's message, not its code: 11 is the plugin's tests'.)
    assert!(
        said.contains(&format!("no flock agent at {}", agent.cni_socket.display()))
            && said.contains("is the flock agent running?"),
        "the error does not name the agent's socket: {said}"
    );
    cni.ok("del", &ns_web2, "ctr-web2", &web2_pod);
    agent.respawn("n1", "memory", &agent_args);
    agent.wait_ready(WAIT);
    cni.ok("add", &ns_web2, "ctr-web2", &web2_pod);
    let meshed = meshed_pods(&agent);
    assert!(meshed.contains(&"shop/web-2".to_string()), "{meshed:?}");
    assert!(
        !meshed.iter().any(|p| p.starts_with("kube-system/")),
        "{meshed:?}"
    );

    drop(envoy);
    drop(api);
    rt.shutdown_timeout(Duration::from_secs(1));
}
