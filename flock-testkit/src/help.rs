//! A binary's `--help` / `-h` as the `bins/*/tests/help.rs` suites read it.

/// Runs `bin` with `arg` (`-h` or `--help`) and returns its stdout; it must exit 0.
/// `COLUMNS` is removed so clap wraps at its default width.
pub fn help_text(bin: &str, arg: &str) -> String {
    let out = std::process::Command::new(bin)
        .arg(arg)
        .env_remove("COLUMNS")
        .output()
        .unwrap_or_else(|e| panic!("running {bin} {arg}: {e}"));
    assert!(out.status.success(), "{bin} {arg}: {:?}", out.status);
    String::from_utf8(out.stdout).expect("help is UTF-8")
}

/// The first paragraph of a help text, its wrapped lines joined.
pub fn first_paragraph(text: &str) -> String {
    text.lines()
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ")
}
