//! Fuzzes the state-file record parser: it never panics, and a record it accepts is
//! the canonical encoding of what it parsed (so encode and re-parse give it back).

#![no_main]

use flock_core::epoch::{EpochRecord, MAX_RECORD_BYTES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(record) = EpochRecord::parse(data) else {
        return;
    };
    assert!(data.len() <= MAX_RECORD_BYTES);
    let encoded = record.encode();
    assert_eq!(encoded.as_bytes(), data, "accepted a non-canonical record");
    assert_eq!(EpochRecord::parse(encoded.as_bytes()), Ok(record));
});
