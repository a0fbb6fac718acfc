//! The chained plugin: one invocation, from environment and stdin to stdout and exit
//! status. The binary (`bins/flock-cni`) only gathers its inputs and prints the result.
//!
//! # Behaviour per verb
//!
//! | verb | agent call | agent unreachable / timeout | agent ERROR |
//! |---|---|---|---|
//! | ADD | `AddPod` | error 11 (try again later): pods never start unmeshed | error 102 when the agent refuses the pod as one the mesh could not serve (`INVALID_POD`), else 100 |
//! | DEL | `RemovePod` | **success**, warning on stderr: GC and the agent's orphan sweep repair it, and a dead agent must never block pod deletion | error 100 |
//! | CHECK | `Check` | error 11 | error 100 |
//! | STATUS | `Status` | error 50 | — (50 / 51 from the answer) |
//! | GC | `GarbageCollect` | error 11 | error 100, every failure listed |
//! | VERSION | none | — | — |
//!
//! ADD without `prevResult` is error 7: flock-cni is a chained plugin and only reports
//! what the primary CNI set up. ADD prints `prevResult` unchanged at the config's
//! `cniVersion`; DEL, CHECK, STATUS and GC print nothing on success.
//!
//! ADD does not judge the pod itself: whether the flock annotations matter depends on
//! the agent's mode (with `--kube` it takes identity and ports from the API and ignores
//! them), which the plugin does not know. The agent runs the pod validator and answers
//! `INVALID_POD` naming the field; the plugin reports that as error 102. What the plugin
//! owns is checked as it is parsed: `CNI_CONTAINERID` and `CNI_IFNAME` (with the same
//! rules), the config and the shape of `prevResult`.

use std::ffi::OsString;
use std::time::Duration;

use serde_json::{Map, Value};

use crate::client::{self, AgentError};
use crate::cni::{self, CURRENT_VERSION, CniEnv, CniError, Command, ErrorCode, NetConf, ResultIp};
use crate::proto::v1::{
    AddPodRequest, Attachment, Availability, CheckRequest, GarbageCollectRequest, IpConfig,
    Outcome, PodRef, PodResponse, Refusal, RemovePodRequest, StatusRequest,
};

/// What the binary prints and how it exits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// Bytes for stdout (a result, an error JSON, or nothing).
    pub stdout: Vec<u8>,
    /// Lines for stderr (warnings an operator may want).
    pub stderr: Vec<String>,
    /// The exit status: 0 on success, 1 with an error JSON.
    pub exit_code: i32,
}

impl Output {
    fn ok(stdout: Vec<u8>) -> Self {
        Self {
            stdout,
            stderr: Vec::new(),
            exit_code: 0,
        }
    }

    /// An error result at `cni_version`.
    pub fn error(err: &CniError, cni_version: &str) -> Self {
        Self {
            stdout: err.to_json(cni_version),
            stderr: vec![format!("flock-cni: {err}")],
            exit_code: 1,
        }
    }
}

/// Runs one invocation. `get_env` is `std::env::var_os` in the binary; `stdin` is
/// everything the runtime wrote (the binary reads at most [`cni::MAX_STDIN_BYTES`] + 1
/// bytes, so a larger input is reported as such). `stdin` is `None` for VERSION when
/// the binary did not read it (a terminal).
pub fn run(get_env: &dyn Fn(&str) -> Option<OsString>, stdin: Option<&[u8]>) -> Output {
    let declared = stdin
        .and_then(cni::declared_version)
        .unwrap_or_else(|| CURRENT_VERSION.to_owned());
    match invoke(get_env, stdin) {
        Ok(out) => out,
        Err(e) => Output::error(&e, &declared),
    }
}

fn invoke(
    get_env: &dyn Fn(&str) -> Option<OsString>,
    stdin: Option<&[u8]>,
) -> Result<Output, CniError> {
    if cni::parse_command(get_env)? == Command::Version {
        let version = stdin
            .and_then(cni::declared_version)
            .unwrap_or_else(|| CURRENT_VERSION.to_owned());
        return Ok(Output::ok(cni::version_json(&version)));
    }
    let env = cni::parse_env(get_env)?;
    let conf = cni::parse_netconf(stdin.unwrap_or_default())?;
    if conf.version < env.command.min_version() {
        return Err(CniError::new(
            ErrorCode::IncompatibleVersion,
            format!(
                "{} needs cniVersion {} or newer; the config says {}",
                env.command.as_str(),
                env.command.min_version(),
                conf.cni_version
            ),
        ));
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CniError::new(ErrorCode::Io, format!("cannot start an async runtime: {e}")))?;
    runtime.block_on(verb(&env, &conf))
}

async fn verb(env: &CniEnv, conf: &NetConf) -> Result<Output, CniError> {
    let socket = conf.agent_socket.as_path();
    let timeout = Duration::from_millis(conf.timeout_ms);
    let pod = PodRef {
        name: env.pod.name.clone(),
        namespace: env.pod.namespace.clone(),
        uid: env.pod.uid.clone(),
    };
    // Excluded namespaces (kube-system, flock's own) never reach the agent: their pods
    // start, and are removed, whether the agent is up or not.
    if conf.exclude_namespaces.contains(&env.pod.namespace)
        && matches!(env.command, Command::Add | Command::Del | Command::Check)
    {
        return passed_through(env, conf);
    }
    match env.command {
        Command::Add => {
            let prev = add_prev_result(conf)?;
            let output = cni::result_at_version(prev, &conf.cni_version)?;
            let ips = cni::result_ips(prev)?;
            let annotations = conf.annotations();
            let req = AddPodRequest {
                container_id: env.container_id.clone(),
                netns: env.netns.clone(),
                ifname: env.ifname.clone(),
                pod: Some(pod),
                ips: ips.iter().map(ip_config).collect(),
                annotations: annotations.into_iter().collect(),
                network_name: conf.name.clone(),
                cni_version: conf.cni_version.clone(),
                prev_result_json: serde_json::to_string(&Value::Object(prev.clone()))
                    .unwrap_or_default(),
            };
            let resp = client::call(socket, timeout, |mut c| async move { c.add_pod(req).await })
                .await
                .map_err(|e| agent_failure(&e, "ADD"))?;
            pod_outcome(&resp, "ADD")?;
            Ok(Output::ok(cni::to_line(&Value::Object(output))))
        }
        Command::Del => {
            let req = RemovePodRequest {
                container_id: env.container_id.clone(),
                netns: env.netns.clone(),
                ifname: env.ifname.clone(),
                pod: Some(pod),
                network_name: conf.name.clone(),
            };
            match client::call(
                socket,
                timeout,
                |mut c| async move { c.remove_pod(req).await },
            )
            .await
            {
                Ok(resp) => {
                    pod_outcome(&resp, "DEL")?;
                    Ok(Output::ok(Vec::new()))
                }
                Err(e) if e.is_unreachable() => Ok(Output {
                    stdout: Vec::new(),
                    stderr: vec![format!(
                        "flock-cni: DEL of container {} succeeded without the agent: {e}; \
                         the agent's orphan GC removes the pod when it is back",
                        env.container_id,
                    )],
                    exit_code: 0,
                }),
                // The agent has the DEL and completes it on its own (it does not
                // abandon an operation whose caller went away): the pod is removed
                // without the runtime having to wait for it.
                Err(e @ AgentError::Timeout { .. }) => Ok(Output {
                    stdout: Vec::new(),
                    stderr: vec![format!(
                        "flock-cni: DEL of container {}: {e}; the agent completes the removal on its own",
                        env.container_id
                    )],
                    exit_code: 0,
                }),
                Err(e) => Err(agent_failure(&e, "DEL")),
            }
        }
        Command::Check => {
            let Some(prev) = &conf.prev_result else {
                return Err(CniError::new(
                    ErrorCode::InvalidConfig,
                    "CHECK without prevResult: the runtime must pass the result of ADD",
                ));
            };
            let ips = cni::result_ips(prev)?;
            let req = CheckRequest {
                container_id: env.container_id.clone(),
                netns: env.netns.clone(),
                ifname: env.ifname.clone(),
                pod: Some(pod),
                ips: ips.iter().map(ip_config).collect(),
                network_name: conf.name.clone(),
            };
            let resp = client::call(socket, timeout, |mut c| async move { c.check(req).await })
                .await
                .map_err(|e| agent_failure(&e, "CHECK"))?;
            pod_outcome(&resp, "CHECK")?;
            Ok(Output::ok(Vec::new()))
        }
        Command::Status => {
            let req = StatusRequest {
                network_name: conf.name.clone(),
            };
            let resp = client::call(socket, timeout, |mut c| async move { c.status(req).await })
                .await
                .map_err(|e| CniError::new(ErrorCode::NotAvailable, format!("STATUS: {e}")))?;
            match Availability::try_from(resp.availability) {
                Ok(Availability::Available) => Ok(Output::ok(Vec::new())),
                Ok(Availability::LimitedConnectivity) => Err(CniError::new(
                    ErrorCode::LimitedConnectivity,
                    format!("flock agent reports limited connectivity: {}", resp.message),
                )),
                _ => Err(CniError::new(
                    ErrorCode::NotAvailable,
                    format!("flock agent cannot serve ADD: {}", resp.message),
                )),
            }
        }
        Command::Gc => {
            let Some(valid) = &conf.valid_attachments else {
                return Err(CniError::new(
                    ErrorCode::InvalidConfig,
                    "GC without \"cni.dev/valid-attachments\" (or \"cni.dev/attachments\"): \
                     refusing to guess which attachments are garbage",
                ));
            };
            let req = GarbageCollectRequest {
                network_name: conf.name.clone(),
                valid_attachments: valid
                    .iter()
                    .map(|a| Attachment {
                        container_id: a.container_id.clone(),
                        ifname: a.ifname.clone(),
                    })
                    .collect(),
            };
            let resp = client::call(socket, timeout, |mut c| async move {
                c.garbage_collect(req).await
            })
            .await
            .map_err(|e| agent_failure(&e, "GC"))?;
            let outcome = Outcome::try_from(resp.outcome).unwrap_or(Outcome::Unspecified);
            if resp.errors.is_empty() && matches!(outcome, Outcome::Success | Outcome::Ignored) {
                return Ok(Output::ok(Vec::new()));
            }
            if outcome == Outcome::Unspecified {
                return Err(protocol_error("GC"));
            }
            Err(CniError::new(
                ErrorCode::AgentError,
                format!(
                    "GC: flock agent removed {} attachment(s) and failed {} time(s){}",
                    resp.removed,
                    resp.errors.len(),
                    if resp.message.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", resp.message)
                    }
                ),
            )
            .with_details(resp.errors.join("; ")))
        }
        Command::Version => Ok(Output::ok(cni::version_json(&conf.cni_version))),
    }
}

fn ip_config(ip: &ResultIp) -> IpConfig {
    IpConfig {
        address: ip.address.clone(),
        gateway: ip.gateway.clone(),
        interface: ip.interface,
        interface_name: ip.interface_name.clone(),
    }
}

fn pod_outcome(resp: &PodResponse, verb: &str) -> Result<(), CniError> {
    match Outcome::try_from(resp.outcome) {
        Ok(Outcome::Success | Outcome::Ignored) => Ok(()),
        // The agent's own words: whatever failed, it said so itself.
        Ok(Outcome::Error) if resp.refusal == Refusal::InvalidPod as i32 => Err(CniError::new(
            ErrorCode::InvalidPod,
            format!("{verb} refused: the flock agent answered: {}", resp.message),
        )),
        Ok(Outcome::Error) => Err(CniError::new(
            ErrorCode::AgentError,
            format!("{verb} failed: the flock agent answered: {}", resp.message),
        )),
        _ => Err(protocol_error(verb)),
    }
}

/// ADD, DEL or CHECK of a pod in an excluded namespace: ADD answers `prevResult` (at
/// the config's version), DEL and CHECK succeed; the agent is not called.
fn passed_through(env: &CniEnv, conf: &NetConf) -> Result<Output, CniError> {
    if env.command != Command::Add {
        return Ok(Output::ok(Vec::new()));
    }
    let output = cni::result_at_version(add_prev_result(conf)?, &conf.cni_version)?;
    Ok(Output::ok(cni::to_line(&Value::Object(output))))
}

/// ADD's `prevResult`: flock-cni only reports what the primary plugin set up.
fn add_prev_result(conf: &NetConf) -> Result<&Map<String, Value>, CniError> {
    conf.prev_result.as_ref().ok_or_else(|| {
        CniError::new(
            ErrorCode::InvalidConfig,
            "ADD without prevResult: flock-cni is a chained plugin and must come \
             after the primary CNI plugin in a .conflist's \"plugins\"",
        )
    })
}

fn protocol_error(verb: &str) -> CniError {
    CniError::new(
        ErrorCode::AgentProtocol,
        format!(
            "flock agent answered {verb} without a known outcome: plugin and agent versions differ"
        ),
    )
}

/// A call that produced no answer, or an error status, as a CNI error that names the
/// cause: no agent at the socket, an agent that did not answer in time, or the
/// agent's own error.
fn agent_failure(e: &AgentError, verb: &str) -> CniError {
    match e {
        _ if e.is_unreachable() => CniError::new(ErrorCode::TryAgainLater, format!("{verb}: {e}")),
        // Not "could not reach": the agent is up and has the request. It runs the
        // operation to completion and undoes an ADD whose answer nobody received, so
        // a retry starts from a clean state.
        AgentError::Timeout { .. } => CniError::new(
            ErrorCode::TryAgainLater,
            format!(
                "{verb}: {e}; it finishes the operation on its own{}",
                if verb == "ADD" {
                    " and undoes this ADD, since its answer was not received: retry the ADD"
                } else {
                    ""
                }
            ),
        ),
        AgentError::Status(s) if s.code() == tonic::Code::Unimplemented => CniError::new(
            ErrorCode::AgentProtocol,
            format!("flock agent does not implement {verb}: {}", s.message()),
        ),
        _ => CniError::new(ErrorCode::AgentError, format!("{verb} failed: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add(service: &str) -> Output {
        invoke_in("ADD", "default", service, "")
    }

    /// `command` of pod `<namespace>/web-0` against a socket no agent listens on (a
    /// request that reaches the client fails with "try again later", 11); `extra`:
    /// more netconf fields.
    fn invoke_in(command: &str, namespace: &str, service: &str, extra: &str) -> Output {
        let args = format!("K8S_POD_NAME=web-0;K8S_POD_NAMESPACE={namespace}");
        let env = |k: &str| -> Option<OsString> {
            Some(
                match k {
                    "CNI_COMMAND" => command,
                    "CNI_CONTAINERID" => "c1",
                    "CNI_NETNS" => "/var/run/netns/c1",
                    "CNI_IFNAME" => "eth0",
                    "CNI_PATH" => "/opt/cni/bin",
                    "CNI_ARGS" => args.as_str(),
                    _ => return None,
                }
                .into(),
            )
        };
        let stdin = format!(
            r#"{{"cniVersion":"1.1.0","name":"k8s","type":"flock-cni",
                "agent_socket":"/nonexistent/flock-test.sock","timeout_ms":200,{extra}
                "prevResult":{{"cniVersion":"1.1.0","ips":[{{"address":"10.0.0.5/24"}}]}},
                "runtimeConfig":{{"podAnnotations":{{"flock.io/service":"{service}","flock.io/ports":"8080"}}}}}}"#
        );
        run(&env, Some(stdin.as_bytes()))
    }

    fn code(out: &Output) -> u64 {
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["code"].as_u64().unwrap()
    }

    /// The plugin does not judge the flock annotations (the agent may ignore them, with
    /// `--kube`): a malformed one still gets as far as the agent (here absent: 11),
    /// where the old pre-check answered 102 without asking it.
    #[test]
    fn add_leaves_the_annotations_to_the_agent() {
        // A dot in the service name is one the agent refuses in annotation mode.
        assert_eq!(code(&add("web.v2")), 11);
        assert_eq!(code(&add("")), 11);
        assert_eq!(code(&add("web")), 11);
    }

    /// Pods of an excluded namespace start, and are removed and checked, without the
    /// agent (none listens here): ADD answers prevResult; by default kube-system and
    /// flock-system are excluded, a config's list replaces the default, `[]` excludes
    /// nothing, and a meshed namespace still gets 11 naming the socket.
    #[test]
    fn excluded_namespaces_pass_through_without_the_agent() {
        for ns in ["kube-system", "flock-system"] {
            let out = invoke_in("ADD", ns, "web", "");
            assert_eq!(out.exit_code, 0, "{ns}: {:?}", out.stderr);
            let result: Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(result["ips"][0]["address"], "10.0.0.5/24");
            for verb in ["DEL", "CHECK"] {
                assert_eq!(invoke_in(verb, ns, "web", "").exit_code, 0, "{verb} {ns}");
            }
        }
        let meshed = invoke_in("ADD", "default", "web", "");
        assert_eq!(code(&meshed), 11);
        let said = String::from_utf8_lossy(&meshed.stdout);
        assert!(said.contains("/nonexistent/flock-test.sock"), "{said}");

        let listed = r#""exclude_namespaces":["infra"],"#;
        assert_eq!(invoke_in("ADD", "infra", "web", listed).exit_code, 0);
        assert_eq!(code(&invoke_in("ADD", "kube-system", "web", listed)), 11);
        let none = r#""exclude_namespaces":[],"#;
        assert_eq!(code(&invoke_in("ADD", "kube-system", "web", none)), 11);
    }

    /// A malformed list is the config's error (7), named, not a silent "exclude nothing".
    #[test]
    fn a_malformed_exclusion_list_is_refused() {
        for (extra, says) in [
            (r#""exclude_namespaces":"kube-system","#, "not an array"),
            (
                r#""exclude_namespaces":["Kube_System"],"#,
                "exclude_namespaces\\\"[0]",
            ),
            (r#""exclude_namespaces":[7],"#, "not a namespace name"),
        ] {
            let out = invoke_in("ADD", "kube-system", "web", extra);
            assert_eq!(code(&out), 7, "{extra}");
            let said = String::from_utf8_lossy(&out.stdout);
            assert!(said.contains(says), "{extra}: {said}");
        }
        let many = format!(
            r#""exclude_namespaces":[{}],"#,
            vec!["\"a\""; MAX + 1].join(",")
        );
        assert_eq!(code(&invoke_in("ADD", "a", "web", &many)), 7);
    }

    const MAX: usize = cni::MAX_EXCLUDED_NAMESPACES;
}
