//! `flockctl`: inspect a running flock agent (pods, snapshot, endpoints) through its admin endpoint.

use anyhow::bail;
use clap::{Parser, Subcommand};
use flock_admin::AdminClient;
use flock_admin::api::{Pods, Policies, ProxyStatus, RegistryView, Snapshot, Status, SyncState};
use flock_admin::policy::{Answer, Call, HttpRequest, Target};
use std::fmt::Write as _;

/// Inspect a running flock-agent through its admin endpoint.
///
/// Prints what the agent holds in a form meant for people; add --json for the raw
/// documents (/debug/status, /debug/pods, /debug/snapshot, /debug/registry,
/// /debug/policies, /debug/proxy-status).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// The agent's admin address (flock-agent --admin-address).
    #[arg(
        long,
        global = true,
        default_value = "127.0.0.1:18090",
        env = "FLOCK_ADMIN",
        value_name = "HOST:PORT"
    )]
    admin: String,
    /// Print the raw JSON.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Pods meshed on this node: service, service account, IP, ports, health.
    Pods,
    /// The xDS snapshots served: version and resource names per type and node group.
    Snapshot,
    /// Endpoints in the registry (every node's), with owner and health.
    Endpoints,
    /// Whether the agent is ready, and why not (and which authorization policies
    /// are refused).
    Status,
    /// Whether every xDS client (the node's Envoy, proxyless gRPC apps) runs what the
    /// agent sent: SYNCED, STALE (sent, not answered yet), NACKED (rejected: the
    /// client keeps its last accepted version; its reason is printed) or NOT SENT, per
    /// type. Exits 1 when a type is NACKED.
    ProxyStatus,
    /// The traffic-policy routes (HTTPRoutes) the agent read: Accepted,
    /// PartiallyInvalid (a backend or rule dropped; the problems are printed) or
    /// Refused (not served; the field and reason are printed). Exits 1 when a route
    /// is not Accepted.
    Routes,
    /// The authorization policies in force, per namespace and service; or, with
    /// `check`, whether one call would be allowed and the rule that decides it.
    Policy {
        #[command(subcommand)]
        check: Option<PolicyCommand>,
    },
}

#[derive(Subcommand, Debug)]
enum PolicyCommand {
    /// Whether a caller may call a service, and which rule (or default) decides.
    /// Exits 0 when allowed, 1 when denied.
    Check {
        /// The caller's SPIFFE ID (`spiffe://<trust domain>/ns/<ns>/sa/<sa>`); omit
        /// for a plaintext caller.
        #[arg(long, value_name = "SPIFFE_ID")]
        from: Option<String>,
        /// The service called: `<namespace>/<service>` or `<service>.<namespace>`.
        #[arg(long, value_name = "SERVICE")]
        to: String,
        /// The service port called.
        #[arg(long)]
        port: Option<u16>,
        /// The HTTP method (an HTTP call; with --path).
        #[arg(long, value_name = "M")]
        method: Option<String>,
        /// The HTTP path, without query.
        #[arg(long, value_name = "P")]
        path: Option<String>,
        /// The HTTP host (`:authority`).
        #[arg(long, value_name = "H", default_value = "")]
        host: String,
    },
}

/// `ns/svc` or `svc.ns`.
fn parse_target(s: &str) -> anyhow::Result<Target> {
    let (namespace, service) = match (s.split_once('/'), s.split_once('.')) {
        (Some((ns, svc)), _) => (ns, svc),
        (None, Some((svc, ns))) => (ns, svc),
        _ => bail!("--to {s:?}: expected <namespace>/<service> or <service>.<namespace>"),
    };
    if namespace.is_empty() || service.is_empty() {
        bail!("--to {s:?}: expected <namespace>/<service> or <service>.<namespace>");
    }
    Ok(Target {
        namespace: namespace.to_string(),
        service: Some(service.to_string()),
    })
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match run(&args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flockctl: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: &Args) -> anyhow::Result<()> {
    let client = AdminClient::new(args.admin.clone());
    match &args.command {
        Command::Status => {
            let status = client.status().await?;
            print(args, &status, render_status)?;
            if !status.ready {
                bail!("agent not ready");
            }
        }
        Command::Pods => print(args, &client.pods().await?, render_pods)?,
        Command::Snapshot => print(args, &client.snapshot().await?, render_snapshot)?,
        Command::Endpoints => print(args, &client.registry().await?, render_endpoints)?,
        Command::Routes => {
            let doc = client.routes().await?;
            print(args, &doc, render_routes)?;
            if doc.routes.iter().any(|r| r.state != "Accepted") {
                std::process::exit(1);
            }
        }
        Command::ProxyStatus => {
            let doc = client.proxy_status().await?;
            print(args, &doc, render_proxy_status)?;
            if doc
                .streams
                .iter()
                .flat_map(|s| &s.types)
                .any(|t| t.state == SyncState::Nacked)
            {
                std::process::exit(1);
            }
        }
        Command::Policy { check: None } => print(args, &client.policies().await?, render_policies)?,
        Command::Policy {
            check:
                Some(PolicyCommand::Check {
                    from,
                    to,
                    port,
                    method,
                    path,
                    host,
                }),
        } => {
            let to = parse_target(to)?;
            let http = match (method, path) {
                (None, None) => None,
                (m, p) => Some(HttpRequest {
                    method: m.as_deref().unwrap_or("GET"),
                    path: p.as_deref().unwrap_or("/"),
                    host,
                }),
            };
            let doc = client.policies().await?;
            let answer = flock_admin::policy::check(
                &doc,
                &Call {
                    from: from.as_deref(),
                    to: &to,
                    port: *port,
                    http,
                },
            );
            print!("{}", render_answer(&answer));
            if !answer.allowed {
                std::process::exit(1);
            }
        }
    }
    Ok(())
}

/// Prints `doc` as JSON (`--json`) or through `render`.
fn print<T: serde::Serialize>(
    args: &Args,
    doc: &T,
    render: fn(&T) -> String,
) -> anyhow::Result<()> {
    if args.json {
        println!("{}", serde_json::to_string_pretty(doc)?);
    } else {
        print!("{}", render(doc));
    }
    Ok(())
}

/// An enum's wire name (`http`, `healthy`): the word the JSON document carries.
fn word<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v)
        .map(|s| s.trim_matches('"').to_string())
        .unwrap_or_else(|_| "-".into())
}

fn render_status(s: &Status) -> String {
    s.readiness_line()
}

fn render_pods(doc: &Pods) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<32} {:<20} {:<20} {:<16} {:<24} {:<10}",
        "POD", "SERVICE", "ACCOUNT", "IP", "PORTS", "HEALTH"
    );
    for p in &doc.pods {
        let ports: Vec<String> = p
            .ports
            .iter()
            // As the ports annotation writes them: a proxyless server's is `grpc-xds`.
            .map(|x| {
                if x.proxyless {
                    format!("{}/grpc-xds", x.app_port)
                } else {
                    format!("{}/{}", x.app_port, word(&x.protocol))
                }
            })
            .collect();
        let ip = p.ips.first().map(ToString::to_string).unwrap_or_default();
        let _ = writeln!(
            out,
            "{:<32} {:<20} {:<20} {:<16} {:<24} {:<10}",
            p.pod,
            // Kube mode: no annotation service (memberships are in `registry`).
            if p.service.is_empty() {
                "-"
            } else {
                &p.service
            },
            if p.service_account.is_empty() {
                "default"
            } else {
                &p.service_account
            },
            ip,
            if ports.is_empty() {
                "-".into()
            } else {
                ports.join(",")
            },
            word(&p.health)
        );
    }
    let _ = writeln!(out, "{} pod(s)", doc.pods.len());
    out
}

/// A client-chosen string (node ID, user agent) on one line: control characters
/// escaped, so a node cannot forge lines of the table.
fn one_line(s: &str) -> String {
    if s.is_empty() {
        "-".into()
    } else {
        s.escape_debug().to_string()
    }
}

fn render_routes(doc: &flock_admin::api::Routes) -> String {
    let mut out = format!("{:<32} {:<32} {:<18}\n", "FILE", "ROUTE", "STATE");
    for r in &doc.routes {
        let _ = writeln!(
            out,
            "{:<32} {:<32} {:<18}",
            one_line(&r.key),
            r.route.as_deref().unwrap_or("-"),
            r.state
        );
        for p in &r.problems {
            let _ = writeln!(out, "  {}", one_line(p));
        }
    }
    out
}

fn render_proxy_status(doc: &ProxyStatus) -> String {
    const TYPES: [&str; 6] = ["cds", "eds", "lds", "rds", "vhds", "sds"];
    let mut out = String::new();
    let _ = write!(
        out,
        "{:<8} {:<28} {:<14} {:<10}",
        "STREAM", "NODE", "AGENT", "SERVICE"
    );
    for t in TYPES {
        let _ = write!(out, " {:<16}", t.to_uppercase());
    }
    out.push('\n');
    let mut reasons = String::new();
    for s in &doc.streams {
        let _ = write!(
            out,
            "{:<8} {:<28} {:<14} {:<10}",
            s.stream,
            one_line(&s.node),
            one_line(&s.user_agent),
            s.service
        );
        for name in TYPES {
            let cell = match s.types.iter().find(|t| t.type_name == name) {
                None => "-".to_string(),
                Some(t) => match (t.state, t.rejected, t.sent, t.acked) {
                    (SyncState::Nacked, Some(v), ..) => format!("NACKED ({v})"),
                    (SyncState::Synced, _, _, Some(v)) => format!("SYNCED ({v})"),
                    (SyncState::Stale, _, Some(v), _) => format!("STALE ({v})"),
                    (state, ..) => state.as_str().to_string(),
                },
            };
            let _ = write!(out, " {cell:<16}");
            if let Some(t) = s.types.iter().find(|t| t.type_name == name)
                && t.state == SyncState::Nacked
            {
                let kept = t.acked.map_or("nothing".into(), |v| format!("version {v}"));
                let _ = writeln!(
                    reasons,
                    "stream {} {}: rejected version {}, runs {kept}: {:?}",
                    s.stream,
                    name,
                    t.rejected.unwrap_or_default(),
                    t.error.as_deref().unwrap_or("")
                );
            }
        }
        out.push('\n');
    }
    let _ = writeln!(out, "{} stream(s)", doc.streams.len());
    if let Some(v) = doc.envoy_version {
        let _ = writeln!(out, "agent's Envoy snapshot: version {v}");
    }
    out.push_str(&reasons);
    out
}

fn render_answer(a: &Answer) -> String {
    let mut out = format!("{}: {}\n", if a.allowed { "allow" } else { "deny" }, a.why);
    for (pod, allowed, why) in &a.pods {
        let _ = writeln!(
            out,
            "  but on pod {pod}: {}: {why}",
            if *allowed { "allow" } else { "deny" }
        );
    }
    out
}

fn render_policies(doc: &Policies) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<32} {:<10} {:<18} ORIGIN",
        "TARGET", "STATE", "DEFAULT"
    );
    for p in &doc.policies {
        let (state, default) = match (&p.spec, &p.error) {
            (Some(spec), None) => (
                "in force".to_string(),
                spec.default
                    .map(|d| d.to_string())
                    .unwrap_or_else(|| "-".into()),
            ),
            _ => ("REFUSED".to_string(), "deny all".to_string()),
        };
        let _ = writeln!(
            out,
            "{:<32} {:<10} {:<18} {}",
            p.target.to_string(),
            state,
            default,
            p.origin
        );
        if let Some(spec) = &p.spec {
            for (i, r) in spec.rules.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "  rules[{i}]: {}",
                    serde_json::to_string(r).unwrap_or_default()
                );
            }
        }
        if let Some(e) = &p.error {
            let _ = writeln!(out, "  error: {e}");
        }
    }
    let narrowed: Vec<_> = doc.pods.iter().filter(|p| p.annotation.is_some()).collect();
    for p in &narrowed {
        let _ = writeln!(
            out,
            "pod {} narrows its own policy: {}",
            p.pod,
            p.annotation.as_deref().unwrap_or_default()
        );
    }
    let _ = writeln!(out, "{} policy(ies)", doc.policies.len());
    out
}

fn render_snapshot(doc: &Snapshot) -> String {
    let mut out = String::new();
    for (group, g) in &doc.groups {
        let _ = writeln!(out, "group {group}: version {}", g.version);
        for (t, names) in &g.resources {
            let _ = writeln!(out, "  {t} ({}):", names.len());
            for n in names {
                let _ = writeln!(out, "    {n}");
            }
        }
    }
    if doc.groups.is_empty() {
        let _ = writeln!(out, "no snapshot published yet");
    }
    out
}

fn render_endpoints(doc: &RegistryView) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "registry {} (synced: {}, revision {})",
        doc.backend, doc.synced, doc.revision
    );
    let _ = writeln!(
        out,
        "{:<28} {:<24} {:<16} {:<14} {:<10}",
        "SERVICE", "ADDRESS", "NODE", "POD", "HEALTH"
    );
    for e in doc.endpoints.values() {
        let _ = writeln!(
            out,
            "{:<28} {:<24} {:<16} {:<14} {:<10}",
            format!("{}.{}:{}", e.service, e.namespace, e.service_port),
            format!("{}:{}", e.address, e.port),
            e.node,
            e.pod,
            word(&e.health)
        );
    }
    let _ = writeln!(out, "{} endpoint(s)", doc.endpoints.len());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use flock_admin::api::{
        Endpoint, Health, Pod, PodKey, PodPort, Protocol, ProxyStream, SnapshotGroup, TypeStatus,
    };
    use std::collections::BTreeMap;

    #[test]
    fn pods_print_one_row_each_with_words_for_enums() {
        let doc = Pods {
            pods: vec![Pod {
                pod: "default/web-1".into(),
                container_id: "c1".into(),
                ifname: "eth0".into(),
                uid: "u".into(),
                service: "web".into(),
                service_account: "web-sa".into(),
                ips: vec!["10.1.0.5".parse().unwrap()],
                netns: "/proc/self/ns/net".into(),
                ports: vec![
                    PodPort {
                        app_port: 8080,
                        listen_port: 15006,
                        protocol: Protocol::Http,
                        proxyless: false,
                    },
                    PodPort {
                        app_port: 9090,
                        listen_port: 15007,
                        protocol: Protocol::Grpc,
                        proxyless: true,
                    },
                ],
                health: Health::Unhealthy,
                added_at_ms: flock_admin::api::UnixMs(1),
            }],
        };
        let out = render_pods(&doc);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3, "{out}");
        assert!(lines[0].starts_with("POD "), "{out}");
        let cols: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(
            cols,
            [
                "default/web-1",
                "web",
                "web-sa",
                "10.1.0.5",
                "8080/http,9090/grpc-xds",
                "unhealthy"
            ]
        );
        assert_eq!(lines[2], "1 pod(s)");
    }

    #[test]
    fn snapshot_lists_types_and_names_per_group() {
        let empty = render_snapshot(&Snapshot::default());
        assert_eq!(empty, "no snapshot published yet\n");
        let mut doc = Snapshot::default();
        doc.groups.insert(
            "envoy".into(),
            SnapshotGroup {
                version: 7,
                resources: BTreeMap::from([("cds".into(), vec!["a".into(), "b".into()])]),
            },
        );
        assert_eq!(
            render_snapshot(&doc),
            "group envoy: version 7\n  cds (2):\n    a\n    b\n"
        );
    }

    #[test]
    fn endpoints_show_service_address_and_health() {
        let ep = Endpoint {
            service: "web".into(),
            namespace: "default".into(),
            service_port: 8080,
            protocol: Protocol::Http,
            address: "10.1.0.5".parse().unwrap(),
            port: 15006,
            node: "n1".into(),
            pod: "default/web-1".into(),
            pod_key: PodKey {
                container_id: "c1".into(),
                ifname: "eth0".into(),
            },
            region: String::new(),
            zone: String::new(),
            health: Health::Healthy,
            identity: None,
            also_accept: Vec::new(),
            labels: Default::default(),
        };
        let doc = RegistryView {
            backend: "memory".into(),
            synced: true,
            revision: 3,
            generation: 1,
            endpoints: BTreeMap::from([("k".into(), ep)]),
        };
        let out = render_endpoints(&doc);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "registry memory (synced: true, revision 3)");
        let cols: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(
            cols,
            [
                "web.default:8080",
                "10.1.0.5:15006",
                "n1",
                "default/web-1",
                "healthy"
            ]
        );
        assert_eq!(lines[3], "1 endpoint(s)");
    }

    #[test]
    fn status_prints_the_readiness_line() {
        let s = Status {
            ready: false,
            not_ready: Some("first xDS snapshot not published yet".into()),
            node: "n1".into(),
            pods: 0,
            registry: "memory".into(),
            registry_synced: true,
            xds_version: None,
            policies_refused: Vec::new(),
        };
        assert_eq!(
            render_status(&s),
            "not ready: first xDS snapshot not published yet\n"
        );
    }

    fn ty(name: &str, state: SyncState, sent: u64, acked: Option<u64>) -> TypeStatus {
        TypeStatus {
            type_name: name.into(),
            state,
            sent: Some(sent),
            acked,
            rejected: (state == SyncState::Nacked).then_some(sent),
            error: (state == SyncState::Nacked).then(|| "bad\ncluster".into()),
        }
    }

    #[test]
    fn proxy_status_shows_each_type_and_the_reason_of_a_nack_on_one_line() {
        let doc = ProxyStatus {
            envoy_version: Some(9),
            streams: vec![ProxyStream {
                stream: 3,
                node: "envoy\nforged 1 row".into(),
                cluster: String::new(),
                user_agent: "envoy".into(),
                service: "ads-delta".into(),
                types: vec![
                    ty("cds", SyncState::Nacked, 9, Some(8)),
                    ty("eds", SyncState::Synced, 8, Some(8)),
                    ty("lds", SyncState::Stale, 9, Some(8)),
                ],
            }],
        };
        let text = render_proxy_status(&doc);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 5, "{text}");
        assert!(
            lines[1].starts_with("3        envoy\\nforged 1 row"),
            "{text}"
        );
        assert!(lines[1].contains("NACKED (9)"), "{text}");
        assert!(lines[1].contains("SYNCED (8)"), "{text}");
        assert!(lines[1].contains("STALE (9)"), "{text}");
        assert!(lines[1].trim_end().ends_with('-'), "no rds, sds: {text}");
        assert_eq!(lines[2], "1 stream(s)");
        assert_eq!(lines[3], "agent's Envoy snapshot: version 9");
        assert_eq!(
            lines[4],
            "stream 3 cds: rejected version 9, runs version 8: \"bad\\ncluster\""
        );
    }
}
