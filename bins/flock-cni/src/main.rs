//! `flock-cni`: the flock chained CNI plugin (CNI spec 1.1), executed by the container runtime.
//!
//! Status: placeholder until issue 4. It parses no arguments beyond `--help`/`--version`
//! and exits with status 2 and a message saying what is missing, so nothing can mistake
//! it for a working binary.

use clap::Parser;

/// the flock chained CNI plugin (CNI spec 1.1), executed by the container runtime.
///
/// NOT IMPLEMENTED YET: this binary lands with issue 4.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Args {}

fn main() {
    let _args = Args::parse();
    eprintln!("flock-cni: not implemented yet (lands with issue 4); see README.md");
    std::process::exit(2);
}
