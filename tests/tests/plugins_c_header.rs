//! `connector-api/include/kvconnect.h` describes the same ABI as `kvconnect_api::abi`: it is
//! what `abi::c_header()` writes, and a C program compiled against it prints every struct's
//! size and every field's offset, which must equal the Rust values, as must the constants.

use kvconnect_api::abi::{
    self, AbiBuffer, AbiBytes, FactoryVTable, HostApi, PluginDescriptor, SchedulerVTable, WorkerVTable,
};
use std::mem::{offset_of, size_of};
use std::process::Command;

macro_rules! layout {
    ($out:ident, $c:literal, $t:ty; $($f:ident),* $(,)?) => {{
        $out.push((format!("{}.size", $c), size_of::<$t>() as u64));
        $( $out.push((format!("{}.{}", $c, stringify!($f)), offset_of!($t, $f) as u64)); )*
    }};
}

fn rust_values() -> Vec<(String, u64)> {
    let mut v = Vec::new();
    layout!(v, "kvc_bytes", AbiBytes; ptr, len);
    layout!(v, "kvc_buffer", AbiBuffer; ptr, len, cap, free);
    layout!(v, "kvc_host_api", HostApi; struct_size, abi_major, abi_minor, max_log_level, user_data, log);
    for (c, size, entries) in [
        (FactoryVTable::C_NAME, size_of::<FactoryVTable>(), FactoryVTable::entries()),
        (SchedulerVTable::C_NAME, size_of::<SchedulerVTable>(), SchedulerVTable::entries()),
        (WorkerVTable::C_NAME, size_of::<WorkerVTable>(), WorkerVTable::entries()),
    ] {
        v.push((format!("{c}.size"), size as u64));
        v.push((format!("{c}.struct_size"), 0));
        v.extend(entries.iter().map(|e| (format!("{c}.{}", e.name), e.offset as u64)));
    }
    layout!(v, "kvc_plugin_descriptor", PluginDescriptor; magic, abi_major, abi_minor, struct_size,
        layout_fingerprint, name, version, sdk_version, rustc_version, init, factory_new, factory, scheduler, worker);
    v.push(("KVC_ABI_MAGIC".into(), abi::ABI_MAGIC));
    v.push(("KVC_ABI_MAJOR".into(), abi::ABI_MAJOR as u64));
    v.push(("KVC_ABI_MINOR".into(), abi::ABI_MINOR as u64));
    v.push(("KVC_LAYOUT_FINGERPRINT".into(), abi::LAYOUT_FINGERPRINT));
    for (name, code) in [
        ("KVC_OK", abi::status::OK),
        ("KVC_NOT_IMPLEMENTED", abi::status::NOT_IMPLEMENTED),
        ("KVC_INVALID_CONFIG", abi::status::INVALID_CONFIG),
        ("KVC_INVALID_ARGUMENT", abi::status::INVALID_ARGUMENT),
        ("KVC_POISONED", abi::status::POISONED),
        ("KVC_PANICKED", abi::status::PANICKED),
        ("KVC_IO", abi::status::IO),
        ("KVC_OTHER", abi::status::OTHER),
    ] {
        v.push((name.into(), code as u64));
    }
    v.push(("KVC_LOG_TRACE".into(), abi::log_level::TRACE as u64));
    v
}

/// The C program: one `printf` per value, using the header's names.
fn c_source(values: &[(String, u64)]) -> String {
    let mut s =
        String::from("#include <stdio.h>\n#include <stddef.h>\n#include \"kvconnect.h\"\nint main(void) {\n");
    for (name, _) in values {
        let expr = match name.split_once('.') {
            Some((t, "size")) => format!("sizeof({t})"),
            Some((t, f)) => format!("offsetof({t}, {f})"),
            None => name.clone(),
        };
        s.push_str(&format!("    printf(\"{name} %llu\\n\", (unsigned long long)({expr}));\n"));
    }
    s.push_str("    return 0;\n}\n");
    s
}

fn header_path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../connector-api/include/kvconnect.h")
}

/// The checked-in header is the generated one. When the Rust definitions change, this rewrites
/// it and fails once, so the new header is seen and committed with the change.
#[test]
fn c_header_is_the_one_the_rust_definitions_write() {
    let generated = abi::c_header();
    let path = header_path();
    let current = std::fs::read_to_string(&path).unwrap_or_default();
    if current != generated {
        std::fs::write(&path, &generated).unwrap();
        panic!(
            "{} was out of date with kvconnect_api::abi and has been rewritten: review and commit it",
            path.display()
        );
    }
}

#[test]
fn c_header_matches_the_rust_abi() {
    let values = rust_values();
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("check.c");
    std::fs::write(&src, c_source(&values)).unwrap();
    let include = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../connector-api/include");
    let exe = dir.path().join("check");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-std=c99", "-Wall", "-Werror", "-I"])
        .arg(&include)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler '{cc}' ({e}); install gcc or set CC"));
    assert!(out.status.success(), "the header does not compile:\n{}", String::from_utf8_lossy(&out.stderr));
    let run = Command::new(&exe).output().unwrap();
    assert!(run.status.success());
    let printed = String::from_utf8(run.stdout).unwrap();
    let mut mismatches = Vec::new();
    for ((name, want), line) in values.iter().zip(printed.lines()) {
        let got: u64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        if got != *want {
            mismatches.push(format!("{name}: C says {got}, Rust says {want}"));
        }
    }
    assert_eq!(printed.lines().count(), values.len());
    assert!(
        mismatches.is_empty(),
        "kvconnect.h has drifted from kvconnect_api::ffi:\n{}",
        mismatches.join("\n")
    );
}
