//! `flock-agent --help` and `-h`: the real binary starts with its description and lists the
//! flags an operator needs first.

const BIN: &str = env!("CARGO_BIN_EXE_flock-agent");
/// Runs the binary with `arg` (`-h` or `--help`) and returns its stdout; it must exit 0.
fn help(arg: &str) -> String {
    let out = std::process::Command::new(BIN)
        .arg(arg)
        .env_remove("COLUMNS")
        .output()
        .unwrap_or_else(|e| panic!("running {BIN} {arg}: {e}"));
    assert!(out.status.success(), "{BIN} {arg}: {:?}", out.status);
    String::from_utf8(out.stdout).expect("help is UTF-8")
}

/// The first paragraph of a help text, its wrapped lines joined.
fn first_paragraph(text: &str) -> String {
    text.lines()
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ")
}

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
