//! `flock-install-cni --help` and `-h`: the real binary starts with its description and lists the
//! flags an operator needs first.

const BIN: &str = env!("CARGO_BIN_EXE_flock-install-cni");
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
