//! CNI spec 1.1.0 as a plugin sees it: environment, stdin network config, errors and
//! results. Every function here is total: malformed input is a [`CniError`] with the
//! spec's code and a message naming what is wrong, never a panic.

use std::ffi::OsString;
use std::fmt;
use std::path::PathBuf;

use flock_core::cniconf::CniVersion;
use serde_json::{Map, Value};

/// The versions of the CNI spec flock-cni implements, in the order VERSION reports them.
pub const SUPPORTED_VERSIONS: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// The newest supported version: what VERSION answers with and what errors are
/// reported at when the config's version is unknown.
pub const CURRENT_VERSION: &str = "1.1.0";

/// The largest stdin (network config with `prevResult`) accepted: 1 MiB. Real ones are
/// a few KiB.
pub const MAX_STDIN_BYTES: usize = 1 << 20;

/// Default `agent_socket`.
pub const DEFAULT_AGENT_SOCKET: &str = "/run/flock/cni.sock";
/// Default `timeout_ms`: the longest the plugin waits for the agent.
pub const DEFAULT_TIMEOUT_MS: u64 = 5_000;
/// The namespaces whose pods the plugin passes through without the agent when the
/// config names none (`exclude_namespaces` absent): the cluster's own components and
/// flock's, which must start while the agent is down (the agent may need them).
pub const DEFAULT_EXCLUDED_NAMESPACES: [&str; 2] = ["kube-system", "flock-system"];
/// Entries `exclude_namespaces` may hold.
pub const MAX_EXCLUDED_NAMESPACES: usize = 64;
/// The largest `timeout_ms` accepted (runtimes time out plugins after a few minutes).
pub const MAX_TIMEOUT_MS: u64 = 120_000;

/// Error codes of the CNI spec (1.1.0, "Error"), plus flock's own (100+).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// 1: incompatible CNI version.
    IncompatibleVersion,
    /// 2: unsupported field in the network configuration.
    UnsupportedField,
    /// 3: container unknown or does not exist.
    UnknownContainer,
    /// 4: invalid necessary environment variables (CNI_COMMAND, CNI_CONTAINERID, ...).
    InvalidEnv,
    /// 5: I/O failure (e.g. reading stdin).
    Io,
    /// 6: failed to decode content (stdin is not a JSON object, too large, ...).
    Decode,
    /// 7: invalid network config (missing name, wrong field type, ...).
    InvalidConfig,
    /// 11: try again later (the agent is unreachable or timed out).
    TryAgainLater,
    /// 50: STATUS: the plugin cannot serve ADD.
    NotAvailable,
    /// 51: STATUS: pods would have limited connectivity.
    LimitedConnectivity,
    /// 100: the flock agent refused the request (its message says why).
    AgentError,
    /// 101: the flock agent answered something this plugin does not understand
    /// (version skew between plugin and agent).
    AgentProtocol,
    /// 102: the pod cannot be meshed: a field or a flock annotation the agent reads is
    /// one the mesh could not serve (the agent's `INVALID_POD` refusal, from
    /// `flock_core::pod`, says which and why), so no pod runs with a service that is
    /// never served.
    InvalidPod,
}

impl ErrorCode {
    /// The numeric code.
    pub fn code(self) -> u32 {
        match self {
            Self::IncompatibleVersion => 1,
            Self::UnsupportedField => 2,
            Self::UnknownContainer => 3,
            Self::InvalidEnv => 4,
            Self::Io => 5,
            Self::Decode => 6,
            Self::InvalidConfig => 7,
            Self::TryAgainLater => 11,
            Self::NotAvailable => 50,
            Self::LimitedConnectivity => 51,
            Self::AgentError => 100,
            Self::AgentProtocol => 101,
            Self::InvalidPod => 102,
        }
    }
}

/// A CNI error result: printed as JSON on stdout, with a non-zero exit status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CniError {
    /// The code.
    pub code: ErrorCode,
    /// A short message.
    pub msg: String,
    /// Longer details (may be empty).
    pub details: String,
}

impl CniError {
    /// An error without details.
    pub fn new(code: ErrorCode, msg: impl Into<String>) -> Self {
        Self {
            code,
            msg: msg.into(),
            details: String::new(),
        }
    }

    /// Adds details.
    pub fn with_details(mut self, details: impl Into<String>) -> Self {
        self.details = details.into();
        self
    }

    /// The spec's error JSON: `{"cniVersion", "code", "msg", "details"?}` plus newline.
    pub fn to_json(&self, cni_version: &str) -> Vec<u8> {
        let mut obj = Map::new();
        obj.insert("cniVersion".into(), Value::String(cni_version.into()));
        obj.insert("code".into(), Value::from(self.code.code()));
        obj.insert("msg".into(), Value::String(self.msg.clone()));
        if !self.details.is_empty() {
            obj.insert("details".into(), Value::String(self.details.clone()));
        }
        to_line(&Value::Object(obj))
    }
}

impl fmt::Display for CniError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CNI error {}: {}", self.code.code(), self.msg)?;
        if !self.details.is_empty() {
            write!(f, " ({})", self.details)?;
        }
        Ok(())
    }
}

impl std::error::Error for CniError {}

/// Compact JSON plus a newline.
pub fn to_line(value: &Value) -> Vec<u8> {
    // Serializing a Value to a Vec cannot fail (no I/O, string keys only).
    let mut out = serde_json::to_vec(value).unwrap_or_default();
    out.push(b'\n');
    out
}

/// A CNI verb (`CNI_COMMAND`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Command {
    /// ADD.
    Add,
    /// DEL.
    Del,
    /// CHECK (>= 0.4.0).
    Check,
    /// STATUS (>= 1.1.0).
    Status,
    /// GC (>= 1.1.0).
    Gc,
    /// VERSION.
    Version,
}

impl Command {
    /// Parses `CNI_COMMAND` (exact, upper case, as the spec writes them).
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "ADD" => Self::Add,
            "DEL" => Self::Del,
            "CHECK" => Self::Check,
            "STATUS" => Self::Status,
            "GC" => Self::Gc,
            "VERSION" => Self::Version,
            _ => return None,
        })
    }

    /// The spec's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Add => "ADD",
            Self::Del => "DEL",
            Self::Check => "CHECK",
            Self::Status => "STATUS",
            Self::Gc => "GC",
            Self::Version => "VERSION",
        }
    }

    /// The first spec version that has this verb.
    pub fn min_version(self) -> CniVersion {
        match self {
            Self::Check => CniVersion::new(0, 4, 0),
            Self::Status | Self::Gc => CniVersion::new(1, 1, 0),
            _ => CniVersion::new(0, 3, 0),
        }
    }
}

/// The pod, from `CNI_ARGS` (`K8S_POD_NAME`, `K8S_POD_NAMESPACE`, `K8S_POD_UID`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodArgs {
    /// `K8S_POD_NAME`.
    pub name: String,
    /// `K8S_POD_NAMESPACE`.
    pub namespace: String,
    /// `K8S_POD_UID`.
    pub uid: String,
}

/// Parses `CNI_ARGS`: `KEY=VALUE` pairs separated by `;` (empty pairs are ignored, as
/// libcni does). Unknown keys are ignored; a pair without `=` is error 4.
pub fn parse_cni_args(args: &str) -> Result<PodArgs, CniError> {
    let mut pod = PodArgs::default();
    for pair in args.split(';').filter(|p| !p.is_empty()) {
        let Some((key, value)) = pair.split_once('=') else {
            return Err(CniError::new(
                ErrorCode::InvalidEnv,
                format!("CNI_ARGS: {:?} is not KEY=VALUE", shorten(pair)),
            ));
        };
        match key {
            "K8S_POD_NAME" => pod.name = value.to_owned(),
            "K8S_POD_NAMESPACE" => pod.namespace = value.to_owned(),
            "K8S_POD_UID" => pod.uid = value.to_owned(),
            _ => {}
        }
    }
    Ok(pod)
}

/// The CNI environment variables of one invocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CniEnv {
    /// `CNI_COMMAND`.
    pub command: Command,
    /// `CNI_CONTAINERID` (required for ADD, DEL, CHECK).
    pub container_id: String,
    /// `CNI_NETNS` (required for ADD and CHECK; optional for DEL).
    pub netns: String,
    /// `CNI_IFNAME` (required for ADD, DEL, CHECK).
    pub ifname: String,
    /// The pod, from `CNI_ARGS`.
    pub pod: PodArgs,
    /// `CNI_PATH` (required for every verb but VERSION; flock-cni delegates to no
    /// plugin, but the spec requires it and runtimes always set it).
    pub path: String,
}

/// Reads `CNI_COMMAND` alone (VERSION needs nothing else).
pub fn parse_command(get: &dyn Fn(&str) -> Option<OsString>) -> Result<Command, CniError> {
    let command = env_string(get, "CNI_COMMAND")?.ok_or_else(|| {
        CniError::new(
            ErrorCode::InvalidEnv,
            "CNI_COMMAND is not set: flock-cni is a CNI plugin, run by a container runtime \
             (try CNI_COMMAND=VERSION flock-cni, or flock-cni --help)",
        )
    })?;
    Command::parse(&command).ok_or_else(|| {
        CniError::new(
            ErrorCode::InvalidEnv,
            format!(
                "unknown CNI_COMMAND {:?}; expected ADD, DEL, CHECK, STATUS, GC or VERSION",
                shorten(&command)
            ),
        )
    })
}

/// Reads and validates the environment of one invocation (`get` is `std::env::var_os`
/// or a test's map). Missing or malformed required variables are error 4.
pub fn parse_env(get: &dyn Fn(&str) -> Option<OsString>) -> Result<CniEnv, CniError> {
    let command = parse_command(get)?;
    let needs_container = matches!(command, Command::Add | Command::Del | Command::Check);
    let needs_netns = matches!(command, Command::Add | Command::Check);
    let required = |name: &str, needed: bool| -> Result<String, CniError> {
        match env_string(get, name)? {
            Some(v) if !v.is_empty() => Ok(v),
            _ if needed => Err(CniError::new(
                ErrorCode::InvalidEnv,
                format!("{name} is required for {} but not set", command.as_str()),
            )),
            _ => Ok(String::new()),
        }
    };
    let container_id = required("CNI_CONTAINERID", needs_container)?;
    if needs_container {
        validate_container_id(&container_id)?;
    }
    let netns = required("CNI_NETNS", needs_netns)?;
    let ifname = required("CNI_IFNAME", needs_container)?;
    if needs_container {
        validate_ifname(&ifname)?;
    }
    let path = required("CNI_PATH", command != Command::Version)?;
    let pod = parse_cni_args(&env_string(get, "CNI_ARGS")?.unwrap_or_default())?;
    Ok(CniEnv {
        command,
        container_id,
        netns,
        ifname,
        pod,
        path,
    })
}

fn env_string(
    get: &dyn Fn(&str) -> Option<OsString>,
    name: &str,
) -> Result<Option<String>, CniError> {
    match get(name) {
        None => Ok(None),
        Some(v) => v.into_string().map(Some).map_err(|_| {
            CniError::new(ErrorCode::InvalidEnv, format!("{name} is not valid UTF-8"))
        }),
    }
}

/// The spec's container ID rule (libcni `ValidateContainerID`), checked by the same
/// function the agent applies to every pod it is handed, so the plugin refuses
/// exactly the IDs the agent would (bound on length included).
pub fn validate_container_id(id: &str) -> Result<(), CniError> {
    flock_core::pod::check_container_id(id).map_err(|why| {
        CniError::new(
            ErrorCode::InvalidEnv,
            format!("CNI_CONTAINERID is invalid: {why}"),
        )
    })
}

/// The spec's interface name rule (libcni `ValidateInterfaceName`): 1–15 bytes, not
/// `.` or `..`, no `/`, `:` or whitespace.
pub fn validate_ifname(name: &str) -> Result<(), CniError> {
    let why = if name.len() > 15 {
        Some("longer than 15 bytes")
    } else if name == "." || name == ".." {
        Some("'.' and '..' are not interface names")
    } else if name
        .chars()
        .any(|c| c == '/' || c == ':' || c.is_whitespace())
    {
        Some("contains '/', ':' or whitespace")
    } else {
        None
    };
    match why {
        None => Ok(()),
        Some(why) => Err(CniError::new(
            ErrorCode::InvalidEnv,
            format!("CNI_IFNAME {:?} is invalid: {why}", shorten(name)),
        )),
    }
}

/// One entry of GC's `cni.dev/valid-attachments`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Attachment {
    /// `containerID`.
    pub container_id: String,
    /// `ifname`.
    pub ifname: String,
}

/// The network config a runtime passes on stdin, as flock-cni reads it.
#[derive(Debug, Clone)]
pub struct NetConf {
    /// `cniVersion` as written (one of [`SUPPORTED_VERSIONS`]).
    pub cni_version: String,
    /// `cniVersion` parsed.
    pub version: CniVersion,
    /// The network `name`.
    pub name: String,
    /// Our `type`.
    pub plugin_type: String,
    /// `agent_socket`.
    pub agent_socket: PathBuf,
    /// `timeout_ms`.
    pub timeout_ms: u64,
    /// `prevResult`, when present and not `null`.
    pub prev_result: Option<Map<String, Value>>,
    /// `runtimeConfig`, when present.
    pub runtime_config: Option<Map<String, Value>>,
    /// GC's valid attachments: the union of `cni.dev/valid-attachments` and
    /// `cni.dev/attachments`; `None` when neither key is present.
    pub valid_attachments: Option<Vec<Attachment>>,
    /// `exclude_namespaces`: pods of these namespaces are passed through (ADD returns
    /// `prevResult`, DEL and CHECK succeed) without calling the agent, so they start
    /// while it is down. Absent: [`DEFAULT_EXCLUDED_NAMESPACES`]; `[]`: none.
    pub exclude_namespaces: Vec<String>,
}

impl NetConf {
    /// Pod annotations from `runtimeConfig` (`io.kubernetes.cri.pod-annotations`, as
    /// containerd passes them, or `podAnnotations`); non-string values are skipped.
    pub fn annotations(&self) -> Vec<(String, String)> {
        let Some(rc) = &self.runtime_config else {
            return Vec::new();
        };
        ["io.kubernetes.cri.pod-annotations", "podAnnotations"]
            .iter()
            .filter_map(|k| rc.get(*k).and_then(Value::as_object))
            .flat_map(|m| m.iter())
            .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_owned())))
            .collect()
    }
}

/// The `cniVersion` a (possibly invalid) stdin declares, if it is one we support: used
/// to report errors at the config's version.
pub fn declared_version(stdin: &[u8]) -> Option<String> {
    if stdin.len() > MAX_STDIN_BYTES {
        return None;
    }
    let v: Value = serde_json::from_slice(stdin).ok()?;
    let s = v.get("cniVersion")?.as_str()?;
    SUPPORTED_VERSIONS.contains(&s).then(|| s.to_owned())
}

/// Parses and validates the stdin network config.
///
/// Error codes: too large, empty, not JSON, not an object → 6; missing or unsupported
/// `cniVersion` → 1; missing/invalid `name` or `type`, wrong types of flock's fields
/// (`agent_socket`, `timeout_ms`), `prevResult`/`runtimeConfig` not objects, malformed
/// GC attachments → 7. Unknown fields are ignored.
pub fn parse_netconf(stdin: &[u8]) -> Result<NetConf, CniError> {
    if stdin.len() > MAX_STDIN_BYTES {
        return Err(CniError::new(
            ErrorCode::Decode,
            format!("network config on stdin is larger than the limit of {MAX_STDIN_BYTES} bytes"),
        ));
    }
    if stdin.iter().all(u8::is_ascii_whitespace) {
        return Err(CniError::new(
            ErrorCode::Decode,
            "stdin is empty: the runtime must pass the network config as JSON on stdin",
        ));
    }
    let value: Value = serde_json::from_slice(stdin).map_err(|e| {
        CniError::new(
            ErrorCode::Decode,
            format!("network config on stdin is not valid JSON: {e}"),
        )
    })?;
    let Value::Object(obj) = value else {
        return Err(CniError::new(
            ErrorCode::Decode,
            format!(
                "network config on stdin is {}, not a JSON object",
                kind_name(&value)
            ),
        ));
    };
    let cni_version = match obj.get("cniVersion") {
        None => {
            return Err(CniError::new(
                ErrorCode::IncompatibleVersion,
                format!(
                    "network config has no \"cniVersion\" (i.e. 0.1.0); flock-cni supports {}",
                    SUPPORTED_VERSIONS.join(", ")
                ),
            ));
        }
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(CniError::new(
                ErrorCode::Decode,
                format!("\"cniVersion\" is {}, not a string", kind_name(other)),
            ));
        }
    };
    let version = match CniVersion::parse(&cni_version) {
        Some(v) if SUPPORTED_VERSIONS.contains(&cni_version.as_str()) => v,
        _ => {
            return Err(CniError::new(
                ErrorCode::IncompatibleVersion,
                format!(
                    "incompatible CNI version {:?}; flock-cni supports {}",
                    shorten(&cni_version),
                    SUPPORTED_VERSIONS.join(", ")
                ),
            ));
        }
    };
    let invalid = |msg: String| CniError::new(ErrorCode::InvalidConfig, msg);
    let name = match obj.get("name") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(Value::String(_)) | None => {
            return Err(invalid("missing network \"name\"".into()));
        }
        Some(other) => {
            return Err(invalid(format!(
                "network \"name\" is {}, not a string",
                kind_name(other)
            )));
        }
    };
    flock_core::cniconf::check_network_dir_name(&name).map_err(|e| invalid(e.to_string()))?;
    let plugin_type = match obj.get("type") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        _ => {
            return Err(invalid(
                "missing plugin \"type\" (a non-empty string)".into(),
            ));
        }
    };
    let agent_socket = match obj.get("agent_socket") {
        None | Some(Value::Null) => PathBuf::from(DEFAULT_AGENT_SOCKET),
        Some(Value::String(s)) if s.starts_with('/') && s.len() < 108 && !s.contains('\0') => {
            PathBuf::from(s)
        }
        Some(Value::String(s)) => {
            return Err(invalid(format!(
                "\"agent_socket\" {:?} must be an absolute path shorter than 108 bytes (a unix socket)",
                shorten(s)
            )));
        }
        Some(other) => {
            return Err(invalid(format!(
                "\"agent_socket\" is {}, not a string",
                kind_name(other)
            )));
        }
    };
    let timeout_ms = match obj.get("timeout_ms") {
        None | Some(Value::Null) => DEFAULT_TIMEOUT_MS,
        Some(v) => match v.as_u64() {
            Some(ms) if (1..=MAX_TIMEOUT_MS).contains(&ms) => ms,
            _ => {
                return Err(invalid(format!(
                    "\"timeout_ms\" must be an integer from 1 to {MAX_TIMEOUT_MS}, not {}",
                    shorten(&v.to_string())
                )));
            }
        },
    };
    let object_field = |key: &str| -> Result<Option<Map<String, Value>>, CniError> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(m)) => Ok(Some(m.clone())),
            Some(other) => Err(invalid(format!(
                "\"{key}\" is {}, not a JSON object",
                kind_name(other)
            ))),
        }
    };
    let prev_result = object_field("prevResult")?;
    let runtime_config = object_field("runtimeConfig")?;
    let mut valid_attachments: Option<Vec<Attachment>> = None;
    for key in ["cni.dev/valid-attachments", "cni.dev/attachments"] {
        let Some(v) = obj.get(key) else { continue };
        let list = valid_attachments.get_or_insert_with(Vec::new);
        let Value::Array(items) = v else {
            return Err(invalid(format!(
                "\"{key}\" is {}, not an array",
                kind_name(v)
            )));
        };
        for (i, item) in items.iter().enumerate() {
            let field = |f: &str| -> Result<String, CniError> {
                match item.get(f) {
                    Some(Value::String(s)) => Ok(s.clone()),
                    _ => Err(invalid(format!(
                        "\"{key}\"[{i}] has no string \"{f}\" (expected {{\"containerID\": .., \"ifname\": ..}})"
                    ))),
                }
            };
            list.push(Attachment {
                container_id: field("containerID")?,
                ifname: field("ifname")?,
            });
        }
    }
    if let Some(list) = &mut valid_attachments {
        list.sort();
        list.dedup();
    }
    let exclude_namespaces = match obj.get("exclude_namespaces") {
        None | Some(Value::Null) => DEFAULT_EXCLUDED_NAMESPACES.map(str::to_owned).to_vec(),
        Some(Value::Array(items)) if items.len() <= MAX_EXCLUDED_NAMESPACES => items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                // A namespace name is a DNS label: anything else can never match a pod
                // and is a typo worth refusing.
                Value::String(ns) => flock_core::pod::check_label(ns)
                    .map(|()| ns.clone())
                    .map_err(|why| invalid(format!("\"exclude_namespaces\"[{i}]: {why}"))),
                other => Err(invalid(format!(
                    "\"exclude_namespaces\"[{i}] is {}, not a namespace name",
                    kind_name(other)
                ))),
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(Value::Array(items)) => {
            return Err(invalid(format!(
                "\"exclude_namespaces\" has {} entries (at most {MAX_EXCLUDED_NAMESPACES})",
                items.len()
            )));
        }
        Some(other) => {
            return Err(invalid(format!(
                "\"exclude_namespaces\" is {}, not an array of namespace names",
                kind_name(other)
            )));
        }
    };
    Ok(NetConf {
        cni_version,
        version,
        name,
        plugin_type,
        agent_socket,
        timeout_ms,
        prev_result,
        runtime_config,
        valid_attachments,
        exclude_namespaces,
    })
}

/// One IP of a result (`ips[]`), with its interface's name resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResultIp {
    /// CIDR.
    pub address: String,
    /// Gateway or empty.
    pub gateway: String,
    /// `interface` index, -1 when absent.
    pub interface: i32,
    /// The interface's name, or empty.
    pub interface_name: String,
}

/// The IPs of a result (any supported version: 0.3.0 to 1.1.0 all use `ips[]`).
/// A present-but-malformed `ips` is error 6.
pub fn result_ips(result: &Map<String, Value>) -> Result<Vec<ResultIp>, CniError> {
    let decode = |msg: String| CniError::new(ErrorCode::Decode, msg);
    let interfaces = result.get("interfaces").and_then(Value::as_array);
    let Some(ips) = result.get("ips") else {
        return Ok(Vec::new());
    };
    let Value::Array(ips) = ips else {
        return Err(decode(format!(
            "prevResult.ips is {}, not an array",
            kind_name(ips)
        )));
    };
    let mut out = Vec::with_capacity(ips.len());
    for (i, ip) in ips.iter().enumerate() {
        let Some(address) = ip.get("address").and_then(Value::as_str) else {
            return Err(decode(format!(
                "prevResult.ips[{i}] has no string \"address\""
            )));
        };
        let gateway = ip.get("gateway").and_then(Value::as_str).unwrap_or("");
        let interface = ip
            .get("interface")
            .and_then(Value::as_i64)
            .and_then(|n| i32::try_from(n).ok())
            .unwrap_or(-1);
        let interface_name = usize::try_from(interface)
            .ok()
            .and_then(|idx| interfaces.and_then(|ifs| ifs.get(idx)))
            .and_then(|iface| iface.get("name"))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        out.push(ResultIp {
            address: address.to_owned(),
            gateway: gateway.to_owned(),
            interface,
            interface_name,
        });
    }
    Ok(out)
}

/// `prevResult` as ADD's output at the config's `cniVersion`.
///
/// Runtimes (libcni) already convert `prevResult` to the config's version, so in
/// practice this only sets `cniVersion`. If the result declares another supported
/// version it is converted the way libcni does between the two result formats
/// (0.3.x/0.4.0 have `ips[].version`, 1.x does not); nothing else changes and key order
/// is kept. A result at an unsupported version is error 1.
pub fn result_at_version(
    prev: &Map<String, Value>,
    cni_version: &str,
) -> Result<Map<String, Value>, CniError> {
    let target = CniVersion::parse(cni_version).unwrap_or(CniVersion::new(1, 1, 0));
    let from = match prev.get("cniVersion") {
        None => target,
        Some(Value::String(s)) if SUPPORTED_VERSIONS.contains(&s.as_str()) => {
            CniVersion::parse(s).unwrap_or(target)
        }
        Some(other) => {
            return Err(CniError::new(
                ErrorCode::IncompatibleVersion,
                format!(
                    "prevResult has cniVersion {}, which flock-cni cannot convert to {cni_version}",
                    shorten(&other.to_string())
                ),
            ));
        }
    };
    let mut out = Map::with_capacity(prev.len() + 1);
    out.insert("cniVersion".into(), Value::String(cni_version.to_owned()));
    for (k, v) in prev {
        if k != "cniVersion" {
            out.insert(k.clone(), v.clone());
        }
    }
    let to_v1 = target.major >= 1;
    if (from.major >= 1) != to_v1
        && let Some(Value::Array(ips)) = out.get_mut("ips")
    {
        for ip in ips.iter_mut().filter_map(Value::as_object_mut) {
            if to_v1 {
                ip.remove("version");
            } else if !ip.contains_key("version") {
                let v6 = ip
                    .get("address")
                    .and_then(Value::as_str)
                    .is_some_and(|a| a.contains(':'));
                // Keep "version" first, as libcni prints it.
                let mut with = Map::with_capacity(ip.len() + 1);
                with.insert(
                    "version".into(),
                    Value::String(if v6 { "6" } else { "4" }.into()),
                );
                with.extend(std::mem::take(ip));
                *ip = with;
            }
        }
    }
    Ok(out)
}

/// VERSION's answer.
pub fn version_json(cni_version: &str) -> Vec<u8> {
    let mut obj = Map::new();
    obj.insert("cniVersion".into(), Value::String(cni_version.into()));
    obj.insert(
        "supportedVersions".into(),
        Value::Array(
            SUPPORTED_VERSIONS
                .iter()
                .map(|v| Value::String((*v).into()))
                .collect(),
        ),
    );
    to_line(&Value::Object(obj))
}

fn kind_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// At most 64 characters of `s`, for messages.
pub(crate) fn shorten(s: &str) -> String {
    if s.chars().count() <= 64 {
        s.to_owned()
    } else {
        let mut out: String = s.chars().take(61).collect();
        out.push_str("...");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let map: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), OsString::from(*v)))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn env_requirements_per_verb() {
        let full = [
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "abc"),
            ("CNI_NETNS", "/var/run/netns/x"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/opt/cni/bin"),
            (
                "CNI_ARGS",
                "IgnoreUnknown=1;K8S_POD_NAME=p;K8S_POD_NAMESPACE=ns;K8S_POD_UID=u",
            ),
        ];
        let e = parse_env(&env(&full)).unwrap();
        assert_eq!(e.pod.name, "p");
        assert_eq!(e.pod.namespace, "ns");
        assert_eq!(e.pod.uid, "u");
        // DEL: netns optional.
        let del = [full[0], full[1], full[3], full[4]];
        let mut del = del.to_vec();
        del[0] = ("CNI_COMMAND", "DEL");
        assert!(parse_env(&env(&del)).is_ok());
        // ADD without netns: 4.
        let mut add = del.clone();
        add[0] = ("CNI_COMMAND", "ADD");
        assert_eq!(
            parse_env(&env(&add)).unwrap_err().code,
            ErrorCode::InvalidEnv
        );
        // STATUS: only the command and path.
        assert!(parse_env(&env(&[("CNI_COMMAND", "STATUS"), ("CNI_PATH", "/x")])).is_ok());
        assert_eq!(
            parse_env(&env(&[("CNI_COMMAND", "STATUS")]))
                .unwrap_err()
                .code,
            ErrorCode::InvalidEnv
        );
        assert_eq!(
            parse_env(&env(&[])).unwrap_err().code,
            ErrorCode::InvalidEnv
        );
        assert_eq!(
            parse_env(&env(&[("CNI_COMMAND", "add")])).unwrap_err().code,
            ErrorCode::InvalidEnv
        );
    }

    #[test]
    fn container_id_ifname_and_args_are_validated() {
        assert!(validate_container_id("a-b_c.1").is_ok());
        assert!(validate_container_id("-a").is_err());
        assert!(validate_container_id("a/b").is_err());
        assert!(validate_ifname("eth0").is_ok());
        assert!(validate_ifname("0123456789abcdef").is_err());
        assert!(validate_ifname("..").is_err());
        assert!(validate_ifname("a b").is_err());
        assert!(parse_cni_args("").is_ok());
        assert!(parse_cni_args("A=1;;B=2").is_ok());
        assert_eq!(parse_cni_args("A").unwrap_err().code, ErrorCode::InvalidEnv);
    }

    #[test]
    fn netconf_errors_have_the_spec_codes() {
        let code = |s: &[u8]| parse_netconf(s).unwrap_err().code;
        assert_eq!(code(b""), ErrorCode::Decode);
        assert_eq!(code(b"{"), ErrorCode::Decode);
        assert_eq!(code(b"[]"), ErrorCode::Decode);
        assert_eq!(code(&vec![b' '; MAX_STDIN_BYTES + 1]), ErrorCode::Decode);
        assert_eq!(
            code(br#"{"name":"n","type":"flock-cni"}"#),
            ErrorCode::IncompatibleVersion
        );
        assert_eq!(
            code(br#"{"cniVersion":"0.2.0","name":"n","type":"flock-cni"}"#),
            ErrorCode::IncompatibleVersion
        );
        assert_eq!(
            code(br#"{"cniVersion":"9.0.0","name":"n","type":"flock-cni"}"#),
            ErrorCode::IncompatibleVersion
        );
        assert_eq!(
            code(br#"{"cniVersion":"1.0.0","type":"flock-cni"}"#),
            ErrorCode::InvalidConfig
        );
        assert_eq!(
            code(br#"{"cniVersion":"1.0.0","name":"n"}"#),
            ErrorCode::InvalidConfig
        );
        assert_eq!(
            code(br#"{"cniVersion":"1.0.0","name":"n","type":"t","timeout_ms":0}"#),
            ErrorCode::InvalidConfig
        );
        assert_eq!(
            code(br#"{"cniVersion":"1.0.0","name":"n","type":"t","agent_socket":"rel"}"#),
            ErrorCode::InvalidConfig
        );
        assert_eq!(
            code(br#"{"cniVersion":"1.0.0","name":"n","type":"t","prevResult":[]}"#),
            ErrorCode::InvalidConfig
        );
        let ok = parse_netconf(
            br#"{"cniVersion":"1.1.0","name":"n","type":"t","unknown":1,
                 "cni.dev/attachments":[{"containerID":"b","ifname":"eth0"}],
                 "cni.dev/valid-attachments":[{"containerID":"a","ifname":"eth0"},{"containerID":"b","ifname":"eth0"}],
                 "runtimeConfig":{"io.kubernetes.cri.pod-annotations":{"a":"b","n":1}}}"#,
        )
        .unwrap();
        assert_eq!(ok.timeout_ms, DEFAULT_TIMEOUT_MS);
        assert_eq!(ok.valid_attachments.as_ref().unwrap().len(), 2);
        assert_eq!(ok.annotations(), [("a".to_owned(), "b".to_owned())]);
    }

    #[test]
    fn results_convert_between_formats_and_keep_the_rest() {
        let v1: Map<String, Value> = serde_json::from_str(
            r#"{"cniVersion":"1.0.0","interfaces":[{"name":"eth0"}],
                "ips":[{"address":"10.0.0.2/24","interface":0},{"address":"fd00::2/64"}],"dns":{}}"#,
        )
        .unwrap();
        let same = result_at_version(&v1, "1.0.0").unwrap();
        assert_eq!(Value::Object(same.clone()), Value::Object(v1.clone()));
        let old = result_at_version(&v1, "0.4.0").unwrap();
        assert_eq!(old["cniVersion"], "0.4.0");
        assert_eq!(old["ips"][0]["version"], "4");
        assert_eq!(old["ips"][1]["version"], "6");
        let back = result_at_version(&old, "1.0.0").unwrap();
        assert_eq!(Value::Object(back), Value::Object(v1.clone()));
        let ips = result_ips(&v1).unwrap();
        assert_eq!(ips[0].interface_name, "eth0");
        assert_eq!(ips[1].interface, -1);
    }
}
