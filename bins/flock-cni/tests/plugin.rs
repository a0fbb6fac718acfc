//! The real `flock-cni` binary, exec'd the way a runtime does (environment + stdin),
//! against the in-test double of the agent's `flock.cni.v1.CniService` on a unix socket.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use flock_cni::proto::v1::{Availability, Outcome, Refusal};
use flock_cni::testing::{Call, TestAgent};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_flock-cni");

struct Fixture {
    dir: tempfile::TempDir,
    agent: TestAgent,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let agent = TestAgent::start(&dir.path().join("agent.sock")).unwrap();
    Fixture { dir, agent }
}

struct Run {
    stdout: String,
    stderr: String,
    code: i32,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not one JSON value ({e}): {:?}", self.stdout))
    }

    /// An error result: exit 1, the code, and one error JSON on stdout.
    fn assert_error(&self, code: u64) -> Value {
        assert_eq!(
            self.code, 1,
            "exit status; stdout {:?} stderr {:?}",
            self.stdout, self.stderr
        );
        let v = self.json();
        assert_eq!(v["code"], code, "error code: {v}");
        assert!(v["msg"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(v["cniVersion"].is_string(), "{v}");
        assert!(!self.stderr.contains("panicked"), "{}", self.stderr);
        v
    }

    fn assert_ok_empty(&self) {
        assert_eq!(
            self.code, 0,
            "stdout {:?} stderr {:?}",
            self.stdout, self.stderr
        );
        assert_eq!(
            self.stdout, "",
            "DEL/CHECK/STATUS/GC print nothing on success"
        );
    }
}

/// Runs the plugin with exactly `env` (nothing inherited) and `stdin`.
fn exec(env: &[(&str, &str)], stdin: &[u8]) -> Run {
    let mut child = Command::new(BIN)
        .env_clear()
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    let stdin = stdin.to_vec();
    // Write from a thread: the plugin may exit before reading everything.
    let writer = std::thread::spawn(move || {
        let _ = input.write_all(&stdin);
    });
    let out = child.wait_with_output().unwrap();
    let _ = writer.join();
    Run {
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
        code: out.status.code().unwrap_or(-1),
    }
}

fn cni(f: &Fixture, command: &str, id: &str, conf: &Value) -> Run {
    let env = [
        ("CNI_COMMAND", command),
        ("CNI_CONTAINERID", id),
        ("CNI_NETNS", "/var/run/netns/test"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/opt/cni/bin"),
        (
            "CNI_ARGS",
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=cart-7d4;K8S_POD_UID=uid-1",
        ),
    ];
    let _ = f;
    exec(&env, &serde_json::to_vec(conf).unwrap())
}

fn prev_result(version: &str) -> Value {
    let mut ips = json!([
        {"address": "10.22.0.5/16", "gateway": "10.22.0.1", "interface": 2},
        {"address": "fd00:22::5/64", "interface": 2}
    ]);
    if !version.starts_with('1') {
        ips[0]["version"] = json!("4");
        ips[1]["version"] = json!("6");
    }
    json!({
        "cniVersion": version,
        "interfaces": [
            {"name": "cni0", "mac": "aa:bb:cc:dd:ee:01"},
            {"name": "veth1234", "mac": "aa:bb:cc:dd:ee:02"},
            {"name": "eth0", "mac": "aa:bb:cc:dd:ee:03", "sandbox": "/var/run/netns/test"}
        ],
        "ips": ips,
        "routes": [{"dst": "0.0.0.0/0"}],
        "dns": {"nameservers": ["10.96.0.10"]},
        "x-unknown": {"kept": [1, 2.5, "three"]}
    })
}

fn conf(f: &Fixture, version: &str, prev: Option<Value>) -> Value {
    let mut c = json!({
        "cniVersion": version,
        "name": "k8s-pod-network",
        "type": "flock-cni",
        "agent_socket": f.agent.socket().to_str().unwrap(),
        "timeout_ms": 2000,
        "some_future_field": {"ignored": true},
        "runtimeConfig": {"io.kubernetes.cri.pod-annotations": {"sidecar.flock.dev/inject": "true"}}
    });
    if let Some(p) = prev {
        c["prevResult"] = p;
    }
    c
}

#[test]
fn version_and_help_work_as_a_user_expects() {
    let r = exec(&[("CNI_COMMAND", "VERSION")], br#"{"cniVersion":"0.4.0"}"#);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(
        r.json(),
        json!({"cniVersion": "0.4.0", "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]})
    );
    let r = exec(&[("CNI_COMMAND", "VERSION")], b"");
    assert_eq!(r.json()["cniVersion"], "1.1.0");
    for flag in ["--help", "--version"] {
        let out = Command::new(BIN).arg(flag).env_clear().output().unwrap();
        assert!(out.status.success(), "{flag}");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("flock-cni"),
            "{flag}"
        );
    }
    let out = Command::new(BIN).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("agent_socket") && help.contains("CNI_COMMAND"),
        "{help}"
    );
}

/// ADD prints prevResult unchanged, at the config's version, for every supported
/// version, and reports the pod (CNI_ARGS, IPs, runtimeConfig annotations) to the agent.
#[test]
fn add_passes_prev_result_through_and_reports_the_pod() {
    let f = fixture();
    for (i, version) in ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]
        .iter()
        .enumerate()
    {
        let prev = prev_result(version);
        let id = format!("ctr{i}");
        let r = cni(&f, "ADD", &id, &conf(&f, version, Some(prev.clone())));
        assert_eq!(r.code, 0, "{version}: {} {}", r.stdout, r.stderr);
        assert_eq!(
            r.json(),
            prev,
            "{version}: prevResult must come back unchanged"
        );
        assert_eq!(
            r.stdout.lines().count(),
            1,
            "nothing but the result on stdout"
        );
        let Some(Call::Add(req)) = f.agent.calls().last().cloned() else {
            panic!("no AddPod call");
        };
        assert_eq!(req.container_id, id);
        assert_eq!(req.netns, "/var/run/netns/test");
        assert_eq!(req.ifname, "eth0");
        assert_eq!(req.network_name, "k8s-pod-network");
        assert_eq!(req.cni_version, *version);
        let pod = req.pod.unwrap();
        assert_eq!(
            (pod.name.as_str(), pod.namespace.as_str(), pod.uid.as_str()),
            ("cart-7d4", "shop", "uid-1")
        );
        let ips: Vec<_> = req
            .ips
            .iter()
            .map(|ip| {
                (
                    ip.address.as_str(),
                    ip.gateway.as_str(),
                    ip.interface_name.as_str(),
                )
            })
            .collect();
        assert_eq!(
            ips,
            [
                ("10.22.0.5/16", "10.22.0.1", "eth0"),
                ("fd00:22::5/64", "", "eth0")
            ]
        );
        assert_eq!(
            req.annotations
                .get("sidecar.flock.dev/inject")
                .map(String::as_str),
            Some("true")
        );
    }
}

#[test]
fn add_without_prev_result_is_a_clear_error() {
    let f = fixture();
    let r = cni(&f, "ADD", "c1", &conf(&f, "1.0.0", None));
    let v = r.assert_error(7);
    assert!(v["msg"].as_str().unwrap().contains("chained"), "{v}");
    assert!(
        f.agent.calls().is_empty(),
        "no agent call for an invalid ADD"
    );
}

/// The plugin does not judge the flock annotations (with `--kube` the agent ignores
/// them, and the plugin cannot know the agent's mode): a malformed one goes to the
/// agent as it came. The agent is the judge; its `INVALID_POD` refusal reaches the
/// runtime as error 102 with the agent's message naming the field, and a plain ERROR
/// stays 100.
#[test]
fn add_sends_annotations_to_the_agent_and_reports_its_invalid_pod_refusal_as_102() {
    let f = fixture();
    let mut c = conf(&f, "1.1.0", Some(prev_result("1.1.0")));
    c["runtimeConfig"] = json!({"io.kubernetes.cri.pod-annotations":
        {"flock.io/service": "web.v2", "flock.io/ports": "http"}});
    // An agent that ignores the annotations (kube mode) meshes the pod.
    let r = cni(&f, "ADD", "c1", &c);
    assert_eq!(r.code, 0, "{} {}", r.stdout, r.stderr);
    let Some(Call::Add(req)) = f.agent.calls().last().cloned() else {
        panic!("the plugin did not ask the agent");
    };
    assert_eq!(
        req.annotations.get("flock.io/ports").map(String::as_str),
        Some("http")
    );
    assert_eq!(f.agent.pods(), [("c1".to_owned(), "eth0".to_owned())]);

    // An agent that reads them (annotation mode) refuses the pod: 102, its reason.
    let why = "invalid request: pod shop/cart-7d4 cannot be meshed: flock.io/service: \"web.v2\" is not a DNS label";
    f.agent.set(|b| {
        b.add_outcome = Outcome::Error;
        b.add_refusal = Refusal::InvalidPod;
        b.add_message = why.into();
    });
    let v = cni(&f, "ADD", "c2", &c).assert_error(102);
    let msg = v["msg"].as_str().unwrap();
    assert!(msg.contains(why), "{v}");
    assert_eq!(f.agent.calls().len(), 2, "one AddPod per ADD");
}

#[test]
fn add_failures_map_to_codes_and_time_is_bounded() {
    let f = fixture();
    f.agent.set(|b| {
        b.add_outcome = Outcome::Error;
        b.add_message = "namespace not meshed".into();
    });
    let v = cni(
        &f,
        "ADD",
        "c1",
        &conf(&f, "1.0.0", Some(prev_result("1.0.0"))),
    )
    .assert_error(100);
    assert!(
        v["msg"].as_str().unwrap().contains("namespace not meshed"),
        "{v}"
    );

    // Unreachable: try again later.
    let mut c = conf(&f, "1.0.0", Some(prev_result("1.0.0")));
    c["agent_socket"] = json!(f.dir.path().join("nobody.sock").to_str().unwrap());
    cni(&f, "ADD", "c1", &c).assert_error(11);

    // A stalled agent: the plugin gives up after timeout_ms.
    f.agent.set(|b| {
        b.add_outcome = Outcome::Success;
        b.delay = Duration::from_secs(10);
    });
    let mut c = conf(&f, "1.0.0", Some(prev_result("1.0.0")));
    c["timeout_ms"] = json!(300);
    let start = Instant::now();
    let v = cni(&f, "ADD", "c1", &c).assert_error(11);
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "took {:?}",
        start.elapsed()
    );
    assert!(v["msg"].as_str().unwrap().contains("300 ms"), "{v}");
}

#[test]
fn del_succeeds_when_unknown_empty_twice_or_agent_gone() {
    let f = fixture();
    // Unknown pod, no prevResult, no CNI_NETNS.
    let env = [
        ("CNI_COMMAND", "DEL"),
        ("CNI_CONTAINERID", "never-added"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/opt/cni/bin"),
    ];
    exec(&env, &serde_json::to_vec(&conf(&f, "1.1.0", None)).unwrap()).assert_ok_empty();
    // Added, then deleted twice.
    let prev = prev_result("1.1.0");
    assert_eq!(
        cni(&f, "ADD", "c2", &conf(&f, "1.1.0", Some(prev.clone()))).code,
        0
    );
    assert_eq!(f.agent.pods().len(), 1);
    cni(&f, "DEL", "c2", &conf(&f, "1.1.0", Some(prev.clone()))).assert_ok_empty();
    assert!(f.agent.pods().is_empty());
    cni(&f, "DEL", "c2", &conf(&f, "1.1.0", Some(prev.clone()))).assert_ok_empty();
    let removes = f
        .agent
        .calls()
        .iter()
        .filter(|c| matches!(c, Call::Remove(_)))
        .count();
    assert_eq!(removes, 3);
    // Agent gone: DEL still succeeds, with a warning on stderr.
    let mut c = conf(&f, "1.1.0", Some(prev));
    c["agent_socket"] = json!(f.dir.path().join("nobody.sock").to_str().unwrap());
    let r = cni(&f, "DEL", "c2", &c);
    r.assert_ok_empty();
    assert!(r.stderr.contains("without the agent"), "{}", r.stderr);
}

#[test]
fn check_consults_the_agent_and_needs_0_4_0() {
    let f = fixture();
    let prev = prev_result("1.0.0");
    assert_eq!(
        cni(&f, "ADD", "c3", &conf(&f, "1.0.0", Some(prev.clone()))).code,
        0
    );
    cni(&f, "CHECK", "c3", &conf(&f, "1.0.0", Some(prev.clone()))).assert_ok_empty();
    cni(&f, "CHECK", "other", &conf(&f, "1.0.0", Some(prev.clone()))).assert_error(100);
    cni(&f, "CHECK", "c3", &conf(&f, "1.0.0", None)).assert_error(7);
    cni(
        &f,
        "CHECK",
        "c3",
        &conf(&f, "0.3.1", Some(prev_result("0.3.1"))),
    )
    .assert_error(1);
}

#[test]
fn status_is_50_when_the_agent_is_unreachable() {
    let f = fixture();
    let env = [("CNI_COMMAND", "STATUS"), ("CNI_PATH", "/opt/cni/bin")];
    let run = |c: &Value| exec(&env, &serde_json::to_vec(c).unwrap());
    run(&conf(&f, "1.1.0", None)).assert_ok_empty();
    f.agent
        .set(|b| b.availability = Availability::LimitedConnectivity);
    run(&conf(&f, "1.1.0", None)).assert_error(51);
    f.agent.set(|b| b.availability = Availability::NotAvailable);
    run(&conf(&f, "1.1.0", None)).assert_error(50);
    let mut c = conf(&f, "1.1.0", None);
    c["agent_socket"] = json!(f.dir.path().join("nobody.sock").to_str().unwrap());
    let v = run(&c).assert_error(50);
    assert!(v["msg"].as_str().unwrap().contains("nobody.sock"), "{v}");
    run(&conf(&f, "1.0.0", None)).assert_error(1);
}

#[test]
fn gc_accepts_both_attachment_keys_and_reports_every_error() {
    let f = fixture();
    for id in ["keep-a", "keep-b", "stale"] {
        assert_eq!(
            cni(
                &f,
                "ADD",
                id,
                &conf(&f, "1.1.0", Some(prev_result("1.1.0")))
            )
            .code,
            0
        );
    }
    let env = [("CNI_COMMAND", "GC"), ("CNI_PATH", "/opt/cni/bin")];
    let mut c = conf(&f, "1.1.0", None);
    c["cni.dev/valid-attachments"] = json!([{"containerID": "keep-a", "ifname": "eth0"}]);
    c["cni.dev/attachments"] = json!([{"containerID": "keep-b", "ifname": "eth0"}]);
    exec(&env, &serde_json::to_vec(&c).unwrap()).assert_ok_empty();
    let mut pods = f.agent.pods();
    pods.sort();
    assert_eq!(
        pods,
        [
            ("keep-a".to_owned(), "eth0".to_owned()),
            ("keep-b".to_owned(), "eth0".to_owned())
        ]
    );
    let Some(Call::Gc(req)) = f.agent.calls().last().cloned() else {
        panic!("no GC call")
    };
    assert_eq!(req.valid_attachments.len(), 2);

    f.agent
        .set(|b| b.gc_errors = vec!["netns pin busy".into(), "registry down".into()]);
    let v = exec(&env, &serde_json::to_vec(&c).unwrap()).assert_error(100);
    assert!(
        v["details"].as_str().unwrap().contains("registry down"),
        "{v}"
    );

    let mut none = conf(&f, "1.1.0", None);
    none.as_object_mut().unwrap().remove("runtimeConfig");
    exec(&env, &serde_json::to_vec(&none).unwrap()).assert_error(7);
    c["cniVersion"] = json!("1.0.0");
    exec(&env, &serde_json::to_vec(&c).unwrap()).assert_error(1);
}

/// (what, environment, stdin, expected code)
type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, Vec<u8>, u64);

/// Malformed stdin, missing environment, wrong versions and huge input: the right
/// code, one error JSON on stdout, and never a panic.
#[test]
fn bad_input_gets_the_right_codes() {
    let f = fixture();
    let good = serde_json::to_vec(&conf(&f, "1.0.0", Some(prev_result("1.0.0")))).unwrap();
    let env = |cmd: &'static str| {
        vec![
            ("CNI_COMMAND", cmd),
            ("CNI_CONTAINERID", "c1"),
            ("CNI_NETNS", "/var/run/netns/x"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/opt/cni/bin"),
        ]
    };
    let without = |name: &str| -> Vec<(&str, &str)> {
        env("ADD").into_iter().filter(|(k, _)| *k != name).collect()
    };
    let with = |name: &'static str, value: &'static str| -> Vec<(&'static str, &'static str)> {
        env("ADD")
            .into_iter()
            .map(|(k, v)| if k == name { (k, value) } else { (k, v) })
            .collect()
    };
    let cases: Vec<Case<'_>> = vec![
        ("no CNI_COMMAND", without("CNI_COMMAND"), good.clone(), 4),
        ("unknown CNI_COMMAND", with("CNI_COMMAND", "FROB"), good.clone(), 4),
        ("no CNI_CONTAINERID", without("CNI_CONTAINERID"), good.clone(), 4),
        ("no CNI_NETNS on ADD", without("CNI_NETNS"), good.clone(), 4),
        ("no CNI_IFNAME", without("CNI_IFNAME"), good.clone(), 4),
        ("no CNI_PATH", without("CNI_PATH"), good.clone(), 4),
        ("bad container id", with("CNI_CONTAINERID", "../etc"), good.clone(), 4),
        ("bad ifname", with("CNI_IFNAME", "eth0:1"), good.clone(), 4),
        ("bad CNI_ARGS", with("CNI_PATH", "/x").into_iter().chain([("CNI_ARGS", "K8S_POD_NAME")]).collect(), good.clone(), 4),
        ("empty stdin", env("ADD"), b"".to_vec(), 6),
        ("malformed stdin", env("ADD"), b"{\"cniVersion\": \"1.0.0\",".to_vec(), 6),
        ("not an object", env("ADD"), b"[1,2]".to_vec(), 6),
        ("binary garbage", env("ADD"), vec![0xff, 0xfe, 0x00, 0x7b], 6),
        ("huge input", env("ADD"), { let mut v = b"{\"pad\":\"".to_vec(); v.resize(3 << 20, b'a'); v }, 6),
        ("no cniVersion", env("ADD"), br#"{"name":"n","type":"flock-cni"}"#.to_vec(), 1),
        ("0.2.0", env("ADD"), br#"{"cniVersion":"0.2.0","name":"n","type":"flock-cni"}"#.to_vec(), 1),
        ("2.0.0", env("ADD"), br#"{"cniVersion":"2.0.0","name":"n","type":"flock-cni"}"#.to_vec(), 1),
        ("no name", env("DEL"), br#"{"cniVersion":"1.0.0","type":"flock-cni"}"#.to_vec(), 7),
        ("bad timeout", env("DEL"), br#"{"cniVersion":"1.0.0","name":"n","type":"flock-cni","timeout_ms":-1}"#.to_vec(), 7),
        ("prevResult not an object", env("ADD"), br#"{"cniVersion":"1.0.0","name":"n","type":"flock-cni","prevResult":"x"}"#.to_vec(), 7),
        ("prevResult.ips malformed", env("ADD"), br#"{"cniVersion":"1.0.0","name":"n","type":"flock-cni","prevResult":{"cniVersion":"1.0.0","ips":{}}}"#.to_vec(), 6),
    ];
    for (what, env, stdin, code) in cases {
        let r = exec(&env, &stdin);
        assert_eq!(r.code, 1, "{what}: {} {}", r.stdout, r.stderr);
        let v: Value = serde_json::from_str(&r.stdout)
            .unwrap_or_else(|e| panic!("{what}: {e}: {:?}", r.stdout));
        assert_eq!(v["code"], code, "{what}: {v}");
        assert!(!r.stderr.contains("panicked"), "{what}: {}", r.stderr);
    }
    assert!(
        f.agent.calls().is_empty(),
        "no invalid invocation reached the agent"
    );
}

/// Each way an ADD can fail says which it was, so an operator knows where to look: the
/// agent's own error ("the flock agent answered: ..."), no agent at the socket (missing
/// file vs connection refused), or an agent that took the request and did not answer
/// in time, each naming the socket. None of them is reported as another.
#[test]
fn add_errors_name_the_real_cause() {
    let f = fixture();
    let msg = |r: Run, code: u64| r.assert_error(code)["msg"].as_str().unwrap().to_owned();
    let add = |c: &Value| cni(&f, "ADD", "c1", c);

    // The agent answered with an error: its words, and nothing about reachability.
    f.agent.set(|b| {
        b.add_outcome = Outcome::Error;
        b.add_message = "registry unavailable: etcd timed out".into();
    });
    let m = msg(add(&conf(&f, "1.1.0", Some(prev_result("1.1.0")))), 100);
    assert!(
        m.contains("the flock agent answered: registry unavailable: etcd timed out"),
        "{m}"
    );
    assert!(
        !m.contains("did not answer") && !m.contains("no flock agent"),
        "{m}"
    );

    // No socket file at all.
    let missing = f.dir.path().join("missing.sock");
    let mut c = conf(&f, "1.1.0", Some(prev_result("1.1.0")));
    c["agent_socket"] = json!(missing.to_str().unwrap());
    let m = msg(add(&c), 11);
    assert!(
        m.contains(&format!(
            "no flock agent at {}: no such socket",
            missing.display()
        )),
        "{m}"
    );

    // A socket file nobody listens on (an agent that died): connection refused.
    let dead = f.dir.path().join("dead.sock");
    drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
    c["agent_socket"] = json!(dead.to_str().unwrap());
    let m = msg(add(&c), 11);
    assert!(
        m.contains(&format!(
            "no flock agent at {}: connection refused",
            dead.display()
        )),
        "{m}"
    );

    // The agent took the request and did not answer within the timeout.
    f.agent.set(|b| {
        b.add_outcome = Outcome::Success;
        b.delay = Duration::from_secs(10);
    });
    let mut c = conf(&f, "1.1.0", Some(prev_result("1.1.0")));
    c["timeout_ms"] = json!(300);
    let m = msg(add(&c), 11);
    assert!(
        m.contains(&format!(
            "the flock agent did not answer within 300 ms at {}",
            f.agent.socket().display()
        )),
        "{m}"
    );
    assert!(
        !m.contains("no flock agent") && !m.contains("answered:"),
        "{m}"
    );
}

/// An ADD made while no agent listens (one agent handing the node to its successor in
/// an upgrade) waits for the agent that appears within the plugin's connect retry
/// (`flock_cni::client::CONNECT_RETRY`), and succeeds through it; with no agent at all
/// it still fails with "no flock agent", once the retry is over and within the
/// timeout.
#[test]
fn an_add_during_an_agent_hand_over_waits_for_the_next_agent() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("agent.sock");
    let f = fixture();
    let mut c = conf(&f, "1.1.0", Some(prev_result("1.1.0")));
    c["agent_socket"] = json!(socket.to_str().unwrap());
    // The next agent binds 400 ms after the ADD started.
    let late = {
        let socket = socket.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(400));
            TestAgent::start(&socket).unwrap()
        })
    };
    let start = Instant::now();
    let r = cni(&f, "ADD", "c-handover", &c);
    let took = start.elapsed();
    let agent = late.join().unwrap();
    assert_eq!(r.code, 0, "stdout {:?} stderr {:?}", r.stdout, r.stderr);
    assert!(
        took >= Duration::from_millis(400),
        "answered before the agent existed: {took:?}"
    );
    assert_eq!(agent.pods().len(), 1, "the late agent got the ADD");

    // Nobody comes: the ADD fails as before, after the retry, within the timeout.
    let mut c = conf(&f, "1.1.0", Some(prev_result("1.1.0")));
    c["agent_socket"] = json!(dir.path().join("nobody.sock").to_str().unwrap());
    c["timeout_ms"] = json!(5000);
    let start = Instant::now();
    let v = cni(&f, "ADD", "c-none", &c).assert_error(11);
    let took = start.elapsed();
    assert!(v["msg"].as_str().unwrap().contains("no flock agent"), "{v}");
    assert!(
        took >= flock_cni::client::CONNECT_RETRY - Duration::from_millis(300)
            && took < Duration::from_secs(5) + Duration::from_secs(1),
        "gave up after {took:?}"
    );
}
