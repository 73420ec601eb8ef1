//! The pd composite's metadata envelope (KVPD, header length, JSON header, parts).
#![no_main]

use kvconnect_pd::meta::MetaEnvelope;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let names = ["lmcache".to_owned(), "nixl".to_owned()];
    if let Ok(env) = MetaEnvelope::decode(data, &names) {
        assert_eq!(MetaEnvelope::decode(&env.encode(), &names).expect("decode again"), env);
    }
});
