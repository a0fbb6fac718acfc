//! `flock-cni --help` and `-h`: the real binary starts with its description and lists the
//! flags an operator needs first.

const BIN: &str = env!("CARGO_BIN_EXE_flock-cni");
/// Runs the binary with `arg` (`-h` or `--help`) and returns its stdout.
fn help(arg: &str) -> String {
    flock_testkit::help::help_text(BIN, arg)
}

use flock_testkit::help::first_paragraph;

const DESCRIPTION: &str = "The flock chained CNI plugin (CNI spec 1.1.0; configs 0.3.0 to 1.1.0).";

#[test]
fn help_starts_with_the_description() {
    assert_eq!(first_paragraph(&help("--help")), DESCRIPTION);
    // The short form is the summary, whose final period clap drops.
    assert_eq!(
        first_paragraph(&help("-h")),
        DESCRIPTION.trim_end_matches('.')
    );
}

#[test]
fn help_names_the_cni_environment_and_the_config_fields() {
    // The plugin has no flags: the runtime drives it by environment and stdin.
    let text = help("--help");
    for expected in [
        "CNI_COMMAND",
        "CNI_NETNS",
        "\"agent_socket\"",
        "\"timeout_ms\"",
    ] {
        assert!(
            text.contains(expected),
            "--help lacks {expected:?}:\n{text}"
        );
    }
}
