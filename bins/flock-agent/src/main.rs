//! `flock-agent`: the flock node agent (pod store, CNI server, registry, liveness, orphan GC, xDS).
//!
//! Status: placeholder until issue 6. It parses no arguments beyond `--help`/`--version`
//! and exits with status 2 and a message saying what is missing, so nothing can mistake
//! it for a working binary.

use clap::Parser;

/// the flock node agent (pod store, CNI server, registry, liveness, orphan GC, xDS).
///
/// NOT IMPLEMENTED YET: this binary lands with issue 6.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Args {}

fn main() {
    let _args = Args::parse();
    eprintln!("flock-agent: not implemented yet (lands with issue 6); see README.md");
    std::process::exit(2);
}
