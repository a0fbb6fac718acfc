//! The pod store's file decoder (`flock_bird::store::decode_record`): any bytes give a
//! record or a reason, never a panic. An accepted record is within every limit, its
//! re-encoding fits the file limit and decodes to the same record, and it is refused
//! under any other file name (a renamed file is quarantined, not loaded).
#![no_main]

use flock_bird::store::{
    MAX_FILE_BYTES, decode_record, encode_record, file_name_for, validate_record,
};
use flock_core::pod::PodKey;
use libfuzzer_sys::fuzz_target;

const OTHER_NAME: &str = "pod-00000000000000000000000000000000.json";

fuzz_target!(|data: &[u8]| {
    // Use the file name of the key the bytes claim, so that accepted records get past
    // the name check and through the whole decoder.
    let name = serde_json::from_slice::<serde_json::Value>(data)
        .ok()
        .and_then(|v| {
            let k = &v["pod"]["key"];
            Some(PodKey::new(
                k["container_id"].as_str()?,
                k["ifname"].as_str()?,
            ))
        })
        .map(|k| file_name_for(&k))
        .unwrap_or_else(|| OTHER_NAME.to_string());
    match decode_record(&name, data) {
        Ok(rec) => {
            assert!(data.len() <= MAX_FILE_BYTES);
            assert_eq!(validate_record(&rec), Ok(()));
            assert_eq!(file_name_for(&rec.key), name);
            let encoded = encode_record(&rec).expect("an accepted record encodes");
            assert!(
                encoded.len() <= MAX_FILE_BYTES,
                "a valid record must fit its file"
            );
            assert_eq!(decode_record(&name, &encoded).as_ref(), Ok(&rec));
            if name != OTHER_NAME {
                assert!(decode_record(OTHER_NAME, data).is_err());
            }
        }
        Err(reason) => assert!(!reason.is_empty()),
    }
});
