//! `nft -j list table` output (what flock-capture reads back from the kernel's copy of
//! a pod's capture table): arbitrary bytes → a ruleset or a bounded error, never a
//! panic; an accepted listing verifies against itself and re-serialises to a listing
//! that reads back the same (so a CHECK compares what nft printed, not an artefact of
//! our parser).
#![no_main]

use flock_core::capture::{MAX_LISTED_BYTES, parse_listed, verify};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(set) = parse_listed(text) else {
        return;
    };
    assert!(text.len() <= MAX_LISTED_BYTES);
    assert_eq!(verify(&set, &set), Ok(()));
    let again = set.to_listing().to_string();
    if again.len() <= MAX_LISTED_BYTES {
        assert_eq!(parse_listed(&again).as_ref(), Ok(&set), "listing does not round-trip");
    }
});
