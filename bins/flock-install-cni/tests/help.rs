//! `flock-install-cni --help` and `-h`: the real binary starts with its description and lists the
//! flags an operator needs first.

const BIN: &str = env!("CARGO_BIN_EXE_flock-install-cni");
/// Runs the binary with `arg` (`-h` or `--help`) and returns its stdout.
fn help(arg: &str) -> String {
    flock_testkit::help::help_text(BIN, arg)
}

use flock_testkit::help::first_paragraph;

const DESCRIPTION: &str = "Keeps the flock CNI plugin chained into every primary CNI network config of a node, race-free, and removes every trace on exit.";

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
fn help_names_the_directories_the_plugin_and_the_exit_policy() {
    let text = help("--help");
    for expected in [
        "--cni-conf-dir <CNI_CONF_DIR>",
        "--cni-bin-dir <CNI_BIN_DIR>",
        "--plugin-config <PLUGIN_CONFIG>",
        "--mode <MODE>",
        "--ready-file <READY_FILE>",
        "--on-exit <ON_EXIT>",
        "[env: FLOCK_CNI_CONF_DIR=]",
    ] {
        assert!(
            text.contains(expected),
            "--help lacks {expected:?}:\n{text}"
        );
    }
}
