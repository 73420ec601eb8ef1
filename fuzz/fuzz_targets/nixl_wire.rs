//! The nixl producer's control frames, both directions; what decodes re-encodes to itself.
#![no_main]

use kvconnect_nixl::wire::{read_frame, write_frame, ClientMsg, ServerMsg};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = read_frame::<_, ClientMsg>(&mut &data[..], 1 << 20) {
        let mut buf = Vec::new();
        write_frame(&mut buf, &m).expect("encode");
        assert_eq!(read_frame::<_, ClientMsg>(&mut &buf[..], 1 << 20).expect("decode again"), m);
    }
    let _ = read_frame::<_, ServerMsg>(&mut &data[..], 1 << 20);
});
