//! `flock-agent --help` and `-h`: the real binary starts with its description and lists the
//! flags an operator needs first.

const BIN: &str = env!("CARGO_BIN_EXE_flock-agent");
/// Runs the binary with `arg` (`-h` or `--help`) and returns its stdout.
fn help(arg: &str) -> String {
    flock_testkit::help::help_text(BIN, arg)
}

use flock_testkit::help::first_paragraph;

const DESCRIPTION: &str = "The flock node agent: runs beside a node-local Envoy on every node.";

#[test]
fn help_starts_with_the_description() {
    assert_eq!(first_paragraph(&help("--help")), DESCRIPTION);
    // The short form is the summary, whose final period clap drops.
    assert_eq!(
        first_paragraph(&help("-h")),
        DESCRIPTION.trim_end_matches('.')
    );
    // The long form carries the whole description, down to how to try it.
    assert!(help("--help").contains("Try it: `flock-agent --dev`"));
}

#[test]
fn help_names_every_flag_group() {
    let text = help("--help");
    for expected in [
        // Identity of the node, state and the CNI side.
        "--node-name <NAME>",
        "--state-dir <DIR>",
        "--store-sync <WHAT>",
        "--cni-socket <PATH>",
        // xDS listeners and who may use them.
        "--xds-socket <PATH>",
        "--envoy-uid <UID>",
        "--xds-address <HOST:PORT>",
        "--xds-tls-cert <PATH>",
        "--admin-address <HOST:PORT>",
        "--allow-non-loopback",
        // Registry, identity, try-it mode, hardening.
        "--registry <SPEC>",
        "--identity <SOURCE>",
        "--ca-dir <DIR>",
        "--dev",
        "--keep-capability <CAP>",
        // The headed groups.
        "Registry security:",
        "--registry-ca <FILE>",
        "Kubernetes:",
        "--kube",
        "--remove-startup-taint [<BOOL>]",
        "Transparent capture:",
        "--capture <MODE>",
        "Authorization:",
        "--authz-dir <DIR>",
        "Telemetry:",
        "--access-log <FILE|->",
        "--access-log-sample-percent <PERCENT>",
        "--workload-metrics",
        "--trace-collector <HOST:PORT>",
        // The xDS quotas.
        "--xds-max-unix-connections <N>",
        "--xds-idle-timeout <SECS>",
        "xDS subscription budget:",
        "--xds-budget-connection-names <N>",
        "--xds-budget-client-bytes <BYTES>",
        "--xds-budget-total-names <N>",
        // Subcommands.
        "envoy-bootstrap",
        "ca ",
    ] {
        assert!(
            text.contains(expected),
            "--help lacks {expected:?}:\n{text}"
        );
    }
}
