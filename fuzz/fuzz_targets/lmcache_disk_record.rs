//! LMCache chunk records, as a disk file or the remote tier holds them. Their header carries
//! a checksum: an input whose first byte is odd gets a correctly sealed header for the
//! length it names (bytes 1..9) over the rest, so lengths past the checksum are reached too,
//! as anyone who can write the remote store could send.
#![no_main]

use kvconnect_lmcache::disk_tier::{check_record, record_header, HEADER_LEN};
use kvconnect_lmcache::key::ChunkKey;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let key = ChunkKey([0x0123_4567_89ab_cdef, 42]);
    let rec = match data.split_first() {
        Some((flag, rest)) if flag & 1 == 1 && rest.len() >= 8 => {
            let mut len = [0u8; 8];
            len.copy_from_slice(&rest[..8]);
            let mut rec = record_header(key, u64::from_le_bytes(len) as usize).to_vec();
            rec.extend_from_slice(&rest[8..]);
            rec
        }
        _ => data.to_vec(),
    };
    if let Ok(chunk) = check_record(key, rec.clone()) {
        assert_eq!(chunk.data(), &rec[HEADER_LEN..rec.len() - 16]);
    }
});
