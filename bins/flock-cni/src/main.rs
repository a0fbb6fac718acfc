//! `flock-cni`: the flock chained CNI plugin (CNI spec 1.1), executed by the container
//! runtime. The logic is `flock_cni::plugin`; this file gathers the inputs and prints.

use std::io::{IsTerminal, Read, Write};

use clap::Parser;
use flock_cni::cni::{self, CniError, ErrorCode};
use flock_cni::plugin::{self, Output};

/// The flock chained CNI plugin (CNI spec 1.1.0; configs 0.3.0 to 1.1.0).
///
/// A container runtime runs it, after the primary CNI plugin in a .conflist's "plugins",
/// with the CNI environment (CNI_COMMAND = ADD, DEL, CHECK, STATUS, GC or VERSION;
/// CNI_CONTAINERID, CNI_NETNS, CNI_IFNAME, CNI_ARGS, CNI_PATH) and the network config
/// on stdin. It reports the pod to the flock agent over gRPC on a unix socket and
/// prints the result (ADD: the primary's prevResult, unchanged) or a CNI error JSON on
/// stdout; logs go to stderr.
///
/// Config fields: "agent_socket" (default /run/flock/cni.sock), "timeout_ms" (default
/// 5000: the longest any call to the agent may take). flock-install-cni installs the
/// binary and patches the configs.
///
/// Try: CNI_COMMAND=VERSION flock-cni
#[derive(Parser)]
#[command(version)]
struct Args {}

fn main() {
    let _args = Args::parse();
    let get_env = |k: &str| std::env::var_os(k);
    let is_version = std::env::var_os("CNI_COMMAND").is_some_and(|c| c == "VERSION");
    let mut stdin_bytes = Vec::new();
    let stdin = std::io::stdin();
    let read: Result<Option<&[u8]>, std::io::Error> = if is_version && stdin.is_terminal() {
        Ok(None)
    } else {
        stdin
            .lock()
            .take(cni::MAX_STDIN_BYTES as u64 + 1)
            .read_to_end(&mut stdin_bytes)
            .map(|_| Some(stdin_bytes.as_slice()))
    };
    let out = match read {
        Ok(stdin) => plugin::run(&get_env, stdin),
        Err(e) => Output::error(
            &CniError::new(
                ErrorCode::Io,
                format!("cannot read the network config from stdin: {e}"),
            ),
            cni::CURRENT_VERSION,
        ),
    };
    for line in &out.stderr {
        eprintln!("{line}");
    }
    let mut stdout = std::io::stdout().lock();
    if stdout
        .write_all(&out.stdout)
        .and_then(|()| stdout.flush())
        .is_err()
    {
        std::process::exit(1);
    }
    std::process::exit(out.exit_code);
}
