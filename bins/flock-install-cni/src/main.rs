//! `flock-install-cni`: keeps the flock CNI plugin patched into the node's CNI config directory, race-free, and removes every trace on exit.
//!
//! Status: placeholder until issue 4. It parses no arguments beyond `--help`/`--version`
//! and exits with status 2 and a message saying what is missing, so nothing can mistake
//! it for a working binary.

use clap::Parser;

/// keeps the flock CNI plugin patched into the node's CNI config directory, race-free, and removes every trace on exit.
///
/// NOT IMPLEMENTED YET: this binary lands with issue 4.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Args {}

fn main() {
    let _args = Args::parse();
    eprintln!("flock-install-cni: not implemented yet (lands with issue 4); see README.md");
    std::process::exit(2);
}
