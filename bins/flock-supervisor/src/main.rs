//! `flock-supervisor`: runs Envoy and hot-restarts it without dropping a request.
//!
//! Status: placeholder until issue 5. It parses no arguments beyond `--help`/`--version`
//! and exits with status 2 and a message saying what is missing, so nothing can mistake
//! it for a working binary.

use clap::Parser;

/// runs Envoy and hot-restarts it without dropping a request.
///
/// NOT IMPLEMENTED YET: this binary lands with issue 5.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Args {}

fn main() {
    let _args = Args::parse();
    eprintln!("flock-supervisor: not implemented yet (lands with issue 5); see README.md");
    std::process::exit(2);
}
