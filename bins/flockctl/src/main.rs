//! `flockctl`: inspect a running flock agent (pods, snapshot, endpoints) through its admin endpoint.

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// Inspect a running flock-agent through its admin endpoint.
///
/// Prints what the agent holds in a form meant for people; add --json for the raw
/// documents (/debug/pods, /debug/snapshot, /debug/registry).
#[derive(Parser, Debug)]
#[command(version, about, long_about)]
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
    /// Pods meshed on this node: service, IP, ports, health.
    Pods,
    /// The xDS snapshots served: version and resource names per type and node group.
    Snapshot,
    /// Endpoints in the registry (every node's), with owner and health.
    Endpoints,
    /// Whether the agent is ready, and why not.
    Status,
}

/// GET `path` from the admin endpoint: (status, body).
fn get(admin: &str, path: &str) -> anyhow::Result<(u16, String)> {
    let addr = admin
        .to_socket_addrs()
        .with_context(|| format!("resolving --admin {admin}"))?
        .next()
        .with_context(|| format!("--admin {admin} resolves to nothing"))?;
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(3)).with_context(|| {
        format!(
            "connecting to the agent's admin endpoint {admin} (is flock-agent running? see --admin)"
        )
    })?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .context("reading the admin response")?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .context("malformed admin response")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("malformed admin status line")?;
    Ok((status, body.to_string()))
}

fn get_json(admin: &str, path: &str) -> anyhow::Result<Value> {
    let (status, body) = get(admin, path)?;
    if status != 200 {
        bail!("{path} answered {status}: {}", body.trim());
    }
    serde_json::from_str(&body).with_context(|| format!("{path} is not JSON"))
}

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flockctl: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> anyhow::Result<()> {
    let path = match args.command {
        Command::Pods => "/debug/pods",
        Command::Snapshot => "/debug/snapshot",
        Command::Endpoints => "/debug/registry",
        Command::Status => {
            let (status, body) = get(&args.admin, "/readyz")?;
            print!("{body}");
            if status != 200 {
                bail!("agent not ready");
            }
            return Ok(());
        }
    };
    let doc = get_json(&args.admin, path)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    match args.command {
        Command::Pods => {
            let pods = doc["pods"].as_array().cloned().unwrap_or_default();
            println!(
                "{:<32} {:<20} {:<16} {:<24} {:<10}",
                "POD", "SERVICE", "IP", "PORTS", "HEALTH"
            );
            for p in &pods {
                let ports: Vec<String> = p["ports"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|x| format!("{}/{}", x["app_port"], s(&x["protocol"])))
                    .collect();
                let ip = p["ips"].get(0).map(s).unwrap_or_default();
                println!(
                    "{:<32} {:<20} {:<16} {:<24} {:<10}",
                    s(&p["pod"]),
                    s(&p["service"]),
                    ip,
                    if ports.is_empty() {
                        "-".into()
                    } else {
                        ports.join(",")
                    },
                    s(&p["health"])
                );
            }
            println!("{} pod(s)", pods.len());
        }
        Command::Snapshot => {
            let groups = doc["groups"].as_object().cloned().unwrap_or_default();
            for (group, g) in &groups {
                println!("group {group}: version {}", g["version"]);
                for (t, names) in g["resources"].as_object().into_iter().flatten() {
                    let names = names.as_array().cloned().unwrap_or_default();
                    println!("  {t} ({}):", names.len());
                    for n in names {
                        println!("    {}", s(&n));
                    }
                }
            }
            if groups.is_empty() {
                println!("no snapshot published yet");
            }
        }
        Command::Endpoints => {
            println!(
                "registry {} (synced: {}, revision {})",
                s(&doc["backend"]),
                doc["synced"],
                doc["revision"]
            );
            let eps = doc["endpoints"].as_object().cloned().unwrap_or_default();
            println!(
                "{:<28} {:<24} {:<16} {:<14} {:<10}",
                "SERVICE", "ADDRESS", "NODE", "POD", "HEALTH"
            );
            for e in eps.values() {
                println!(
                    "{:<28} {:<24} {:<16} {:<14} {:<10}",
                    format!(
                        "{}.{}:{}",
                        s(&e["service"]),
                        s(&e["namespace"]),
                        e["service_port"]
                    ),
                    format!("{}:{}", s(&e["address"]), e["port"]),
                    s(&e["node"]),
                    s(&e["pod"]),
                    s(&e["health"])
                );
            }
            println!("{} endpoint(s)", eps.len());
        }
        Command::Status => unreachable!("handled above"),
    }
    Ok(())
}
