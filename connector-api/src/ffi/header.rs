//! `include/kvconnect.h`, written from the Rust definitions: the vtables' declarations come
//! from their one entry list (`vtables.rs`), the constants from `abi`. The checked-in header
//! is this function's output; `tests/tests/plugins_c_header.rs` rewrites it and fails when it
//! changed, and compiles it to check every size and offset.

use super::json_values::{json_values, SCHEMA_DIR};
use super::vtables::EntryInfo;
use super::{
    log_level, status, FactoryVTable, SchedulerVTable, WorkerVTable, ABI_MAGIC, ABI_MAJOR, ABI_MINOR,
    ENTRY_SYMBOL, LAYOUT_FINGERPRINT,
};
use std::fmt::Write;

/// The text of `kvconnect.h` for this ABI version (and this target's pointer size, which the
/// fingerprint depends on).
pub fn c_header() -> String {
    let mut h = String::new();
    let w = &mut h;
    // Writing to a String cannot fail.
    let _ = write!(
        w,
        r#"/*
 * kvconnect plugin ABI, version {ABI_MAJOR}.{ABI_MINOR}: the C view of kvconnect-api's `ffi` module.
 *
 * Written by kvconnect_api::ffi::c_header() from the Rust definitions; do not edit.
 * tests/tests/plugins_c_header.rs rewrites it when they change (and fails, so the change is
 * seen), and compiles it to check every size and offset.
 *
 * A plugin is a shared library exporting
 *
 *     const kvc_plugin_descriptor *kvconnect_plugin_entry(void);
 *
 * returning a descriptor that lives as long as the process. Its fields up to `rustc_version`
 * never move in any ABI version. Set `magic`, `abi_major`, `abi_minor` and
 * `layout_fingerprint` to the KVC_ constants below, `struct_size` to
 * sizeof(kvc_plugin_descriptor), each vtable's `struct_size` to the sizeof of its struct,
 * `sdk_version` to "kvconnect.h {ABI_MAJOR}.{ABI_MINOR}" (the host names it when it refuses the
 * plugin) and `rustc_version` to your compiler.
 *
 * Every entry returns a kvc_status: KVC_OK, or the kind of error with a JSON-encoded error in
 * `*err` (`{{"InvalidConfig":{{"connector":"x","message":"..."}}}}`, kvconnect-api's
 * ConnectorError). A buffer is freed by the side that allocated it, by calling its own `free`.
 * Setup-time values (configs, capabilities, model, context, regions, handshake metadata) are
 * JSON; per-step calls take plain arrays. An entry must never unwind or throw into its caller.
 *
 * Entries of ABI {ABI_MAJOR}.0 must all be set: the host refuses a plugin with a NULL one.
 * Entries a later minor appended say so, and may be NULL; the host then does what their
 * comment says. A host of an older minor never calls them; a host of a newer minor finds the
 * entries it knows and your header does not absent (your `struct_size` says which you have).
 */
#ifndef KVCONNECT_H
#define KVCONNECT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {{
#endif

#define KVC_ENTRY_SYMBOL "{ENTRY_SYMBOL}"
#define KVC_ABI_MAGIC {ABI_MAGIC:#018x}ULL /* "KVCONNEC" read as a little-endian u64 */
#define KVC_ABI_MAJOR {ABI_MAJOR}
#define KVC_ABI_MINOR {ABI_MINOR}
/* A hash of the layout of ABI {ABI_MAJOR}.0's structs (offsets and entry types, not sizes), on
 * {bits}-bit targets: the same for every {ABI_MAJOR}.x. The host refuses a plugin that reports another. */
#define KVC_LAYOUT_FINGERPRINT {LAYOUT_FINGERPRINT:#018x}ULL

typedef int32_t kvc_status;
"#,
        bits = usize::BITS,
    );
    for (name, code) in [
        ("OK", status::OK),
        ("NOT_IMPLEMENTED", status::NOT_IMPLEMENTED),
        ("INVALID_CONFIG", status::INVALID_CONFIG),
        ("INVALID_ARGUMENT", status::INVALID_ARGUMENT),
        ("POISONED", status::POISONED),
        ("PANICKED", status::PANICKED),
        ("IO", status::IO),
        ("OTHER", status::OTHER),
    ] {
        let _ = writeln!(w, "#define KVC_{name} {code}");
    }
    w.push('\n');
    for (name, level) in [
        ("OFF", log_level::OFF),
        ("ERROR", log_level::ERROR),
        ("WARN", log_level::WARN),
        ("INFO", log_level::INFO),
        ("DEBUG", log_level::DEBUG),
        ("TRACE", log_level::TRACE),
    ] {
        let _ = writeln!(w, "#define KVC_LOG_{name} {level}");
    }
    json_section(w);
    w.push_str(
        r#"
/* Borrowed bytes or UTF-8 text, valid for one call. */
typedef struct kvc_bytes {
    const uint8_t *ptr;
    size_t len;
} kvc_bytes;

/* Bytes owned by the side that allocated them; the receiver calls `free` once. */
typedef struct kvc_buffer {
    uint8_t *ptr;
    size_t len;
    size_t cap;
    void (*free)(uint8_t *ptr, size_t len, size_t cap);
} kvc_buffer;

/* Given to the plugin's `init`; valid for the life of the process, so the plugin may keep it.
 * `log` may be called from any thread. */
typedef struct kvc_host_api {
    size_t struct_size;
    uint16_t abi_major;
    uint16_t abi_minor;
    uint32_t max_log_level;
    const void *user_data;
    void (*log)(const void *user_data, uint32_t level, kvc_bytes target, kvc_bytes message);
} kvc_host_api;
"#,
    );
    vtable(
        w,
        FactoryVTable::C_NAME,
        "A factory: `self` is the handle `factory_new` made; any thread.",
        &FactoryVTable::entries(),
    );
    vtable(
        w,
        SchedulerVTable::C_NAME,
        "A scheduler half: `self` is a handle `create_scheduler` made; one thread at a time.",
        &SchedulerVTable::entries(),
    );
    vtable(
        w,
        WorkerVTable::C_NAME,
        "A worker half: `self` is a handle `create_worker` made; one thread at a time.",
        &WorkerVTable::entries(),
    );
    w.push_str(
        r#"
typedef struct kvc_plugin_descriptor {
    uint64_t magic;
    uint16_t abi_major;
    uint16_t abi_minor;
    size_t struct_size;
    uint64_t layout_fingerprint;
    kvc_bytes name;
    kvc_bytes version;
    kvc_bytes sdk_version;
    kvc_bytes rustc_version;
    /* Called once, after the host has checked the descriptor and before anything else. It must
     * check host->abi_major == KVC_ABI_MAJOR and that host->struct_size covers the fields it
     * reads (else fail with an error saying which versions each side speaks), may keep `host`
     * for the life of the process (logging through host->log, dropping levels above
     * host->max_log_level), and returns KVC_OK or an error in *err. Must not be NULL. */
    kvc_status (*init)(const kvc_host_api *host, kvc_buffer *err);
    /* Makes the factory; `*out` = its handle. Must not be NULL. */
    kvc_status (*factory_new)(void **out, kvc_buffer *err);
    const kvc_factory_vtable *factory;
    const kvc_scheduler_vtable *scheduler;
    const kvc_worker_vtable *worker;
} kvc_plugin_descriptor;

const kvc_plugin_descriptor *kvconnect_plugin_entry(void);

#ifdef __cplusplus
}
#endif

#endif /* KVCONNECT_H */
"#,
    );
    h
}

fn vtable(w: &mut String, c_name: &str, doc: &str, entries: &[EntryInfo]) {
    let _ = write!(w, "\n/* {doc} */\ntypedef struct {c_name} {{\n    size_t struct_size;\n");
    for e in entries {
        let mut lines: Vec<String> = e.doc.iter().map(|l| l.trim().replace('`', "")).collect();
        if let Some(fallback) = e.fallback {
            lines.push(format!("Since {ABI_MAJOR}.{}; may be NULL: {fallback}.", e.since_minor));
        }
        match lines.len() {
            0 => {}
            1 => {
                let _ = writeln!(w, "    /* {} */", lines[0]);
            }
            _ => {
                let _ = writeln!(w, "    /* {}", lines[0]);
                for l in &lines[1..] {
                    let _ = writeln!(w, "     * {l}");
                }
                let _ = writeln!(w, "     */");
            }
        }
        let params: Vec<String> = e
            .c_params
            .iter()
            .map(|(t, n)| {
                let n = if *n == "this" { "self" } else { n };
                if t.ends_with('*') {
                    format!("{t}{n}")
                } else {
                    format!("{t} {n}")
                }
            })
            .collect();
        let _ = writeln!(w, "    {} (*{})({});", e.c_ret, e.name, params.join(", "));
    }
    let _ = writeln!(w, "}} {c_name};");
}

/// The JSON values, each with its Rust type (the schema), where it crosses and an example.
fn json_section(w: &mut String) {
    w.push_str(
        "\n/* The JSON values that cross, each the serde form of the kvconnect-api type named (its\n \
         * definition in connector-api/src is the schema; the host decodes with it, and a value it\n \
         * cannot decode is an error naming the field). The examples are written from real values.\n",
    );
    let _ = write!(
        w,
        " *\n * JSON Schemas (draft 2020-12) of ConnectorInfo, Capabilities, ConnectorContext and\n \
         * ConnectorError are in the repository under {SCHEMA_DIR}/ (*.schema.json); a test keeps them\n \
         * equal to the types and checks real values from the connectors against them.\n",
    );
    for v in json_values() {
        w.push_str(" *\n");
        let mut line = String::from(" *");
        for word in format!("{}: {}; {}.", v.rust_type, v.used_by, v.rules).split(' ') {
            if line.len() + 1 + word.len() > 96 {
                w.push_str(&line);
                w.push('\n');
                line = String::from(" *  ");
            }
            line.push(' ');
            line.push_str(word);
        }
        let _ = write!(w, "{line}\n *   {}\n", v.example);
    }
    w.push_str(" */\n");
}
