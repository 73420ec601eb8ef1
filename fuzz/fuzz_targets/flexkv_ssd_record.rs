//! FlexKV SSD tier records (a 4 KiB header page, then the payload). The input's first 32
//! bytes are the header; the rest, after a zeroed page, the payload. An input whose first
//! byte past the header is odd gets the payload's true checksum in its header, so the
//! checks after it are reached.
#![no_main]

use kvconnect_flexkv::ssd_tier::check_record;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 33 {
        let _ = check_record(data, 0);
        return;
    }
    let (header, rest) = data.split_at(32);
    let mut rec = vec![0u8; 4096];
    rec[..32].copy_from_slice(header);
    rec.extend_from_slice(rest);
    if rest[0] & 1 == 1 {
        let sum = kvconnect_flexkv::hash::checksum(rest);
        rec[24..32].copy_from_slice(&sum.to_le_bytes());
    }
    let mut hash = [0u8; 8];
    hash.copy_from_slice(&header[8..16]);
    if let Ok(p) = check_record(&rec, u64::from_le_bytes(hash)) {
        assert_eq!(p, rest);
    }
});
