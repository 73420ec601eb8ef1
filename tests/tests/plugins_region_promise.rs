//! A plugin cannot make its own KV regions: `KvRegion::new`, the unsafe promise that a
//! region's memory is valid, exists only with kvconnect-api's `host` feature. A plugin crate
//! built as its author builds it (kvconnect-api without features) and calling it does not
//! compile; the same crate with the feature does, so the refusal is the feature's doing.

use kvconnect_tests::plugin_fixtures::build_region_forger;
use std::path::Path;

#[test]
fn a_plugin_cannot_vouch_for_memory_itself() {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let refused = build_region_forger(tmp, &[]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "a plugin made a KvRegion without the host feature:\n{stderr}");
    assert!(
        stderr.contains("no function or associated item named `new`") && stderr.contains("KvRegion"),
        "the build failed for another reason:\n{stderr}"
    );

    let allowed = build_region_forger(tmp, &["--features", "host"]);
    assert!(
        allowed.status.success(),
        "with the host feature the same crate should build:\n{}",
        String::from_utf8_lossy(&allowed.stderr)
    );
}
