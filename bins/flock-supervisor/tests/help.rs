//! `flock-supervisor --help` and `-h`: the real binary starts with its description and lists the
//! flags an operator needs first.

const BIN: &str = env!("CARGO_BIN_EXE_flock-supervisor");
/// Runs the binary with `arg` (`-h` or `--help`) and returns its stdout.
fn help(arg: &str) -> String {
    flock_testkit::help::help_text(BIN, arg)
}

use flock_testkit::help::first_paragraph;

const DESCRIPTION: &str = "Runs Envoy and hot-restarts it without dropping a request.";

#[test]
fn help_starts_with_the_description() {
    assert_eq!(first_paragraph(&help("--help")), DESCRIPTION);
    // The short form is the summary: its first paragraph (clap drops the final
    // period, except under `verbatim_doc_comment`, which this binary uses).
    assert_eq!(
        first_paragraph(&help("-h")).trim_end_matches('.'),
        DESCRIPTION.trim_end_matches('.')
    );
}

#[test]
fn help_names_envoy_its_state_and_the_restart_policy() {
    let text = help("--help");
    for expected in [
        "--envoy-bin <PATH>",
        "--config <FILE>",
        "--state-dir <DIR>",
        "--control-dir <DIR>",
        "--admin-socket <PATH>",
        "--admin-address <HOST:PORT>",
        "--base-id <N>",
        "--ready-file <PATH>",
        "--drain-time-s <N>",
        "--max-restarts <N>",
        "[ENVOY ARGS]...",
    ] {
        assert!(
            text.contains(expected),
            "--help lacks {expected:?}:\n{text}"
        );
    }
}
