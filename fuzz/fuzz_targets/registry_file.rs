//! The `file:` registry's on-disk format: any bytes → the registry or a reason, never a
//! panic (the backend moves corrupt files aside and starts empty).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = flock_bird::registry::decode_file(data);
});
