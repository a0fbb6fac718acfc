//! `flockctl --help` and `-h`: the real binary starts with its description and lists the
//! flags an operator needs first.

const BIN: &str = env!("CARGO_BIN_EXE_flockctl");
/// Runs the binary with `arg` (`-h` or `--help`) and returns its stdout.
fn help(arg: &str) -> String {
    flock_testkit::help::help_text(BIN, arg)
}

use flock_testkit::help::first_paragraph;

const DESCRIPTION: &str = "Inspect a running flock-agent through its admin endpoint.";

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
fn help_names_the_address_the_output_and_every_view() {
    let text = help("--help");
    for expected in [
        "--admin <HOST:PORT>",
        "[env: FLOCK_ADMIN=]",
        "--json",
        "pods",
        "snapshot",
        "endpoints",
        "status",
    ] {
        assert!(
            text.contains(expected),
            "--help lacks {expected:?}:\n{text}"
        );
    }
}
