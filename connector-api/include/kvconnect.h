/*
 * kvconnect plugin ABI, version 1.1: the C view of kvconnect-api's `abi` module.
 *
 * A plugin is a shared library exporting
 *
 *     const kvc_plugin_descriptor *kvconnect_plugin_entry(void);
 *
 * The descriptor's fields up to `rustc_version` never move in any ABI version. Every entry
 * returns a kvc_status: KVC_OK, or the kind of error with a JSON-encoded error in `*err`
 * (`{"InvalidConfig":{"connector":"x","message":"..."}}`, kvconnect-api's ConnectorError).
 * A buffer is freed by the side that allocated it, by calling its own `free`. Setup-time
 * values (configs, capabilities, model, context, regions, handshake metadata) are JSON;
 * per-step calls take plain arrays. An entry must never unwind or throw into its caller.
 *
 * Hand-maintained; tests/tests/plugins_c_header.rs compiles it and checks every size and
 * offset against the Rust definitions, so it cannot drift.
 */
#ifndef KVCONNECT_H
#define KVCONNECT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVC_ENTRY_SYMBOL "kvconnect_plugin_entry"
#define KVC_ABI_MAGIC 0x43454e4e4f43564bULL /* "KVCONNEC" read as a little-endian u64 */
#define KVC_ABI_MAJOR 1
#define KVC_ABI_MINOR 1

typedef int32_t kvc_status;
#define KVC_OK 0
#define KVC_NOT_IMPLEMENTED 1
#define KVC_INVALID_CONFIG 2
#define KVC_INVALID_ARGUMENT 3
#define KVC_POISONED 4
#define KVC_PANICKED 5
#define KVC_IO 6
#define KVC_OTHER 7

#define KVC_LOG_OFF 0
#define KVC_LOG_ERROR 1
#define KVC_LOG_WARN 2
#define KVC_LOG_INFO 3
#define KVC_LOG_DEBUG 4
#define KVC_LOG_TRACE 5

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

/* Given to the plugin at load; valid for the life of the process. */
typedef struct kvc_host_api {
    size_t struct_size;
    uint16_t abi_major;
    uint16_t abi_minor;
    uint32_t max_log_level;
    const void *user_data;
    void (*log)(const void *user_data, uint32_t level, kvc_bytes target, kvc_bytes message);
} kvc_host_api;

typedef struct kvc_factory_vtable {
    size_t struct_size;
    void (*free)(void *self);
    kvc_status (*info)(void *self, kvc_buffer *out, kvc_buffer *err);
    kvc_status (*capabilities)(void *self, kvc_bytes config, kvc_bytes model, kvc_buffer *out, kvc_buffer *err);
    kvc_status (*create_scheduler)(void *self, kvc_bytes ctx, void **out, kvc_buffer *err);
    kvc_status (*create_worker)(void *self, kvc_bytes ctx, void **out, kvc_buffer *err);
    /* Since 1.1; may be NULL (the host then takes the connector to have no children). For a
     * composite, `*out` = a JSON list of {name, version, caps}; `null` for a plain connector. */
    kvc_status (*child_capabilities)(void *self, kvc_bytes config, kvc_bytes model, kvc_buffer *out,
                                     kvc_buffer *err);
} kvc_factory_vtable;

typedef struct kvc_scheduler_vtable {
    size_t struct_size;
    void (*free)(void *self);
    kvc_status (*get_num_new_matched_tokens)(void *self, kvc_bytes req, uint64_t num_computed, kvc_buffer *out,
                                             kvc_buffer *err);
    kvc_status (*update_state_after_alloc)(void *self, kvc_bytes req, kvc_bytes blocks, uint64_t num_external_tokens,
                                           kvc_buffer *err);
    kvc_status (*build_connector_meta)(void *self, kvc_bytes step, kvc_buffer *out, kvc_buffer *err);
    kvc_status (*request_finished)(void *self, kvc_bytes req, kvc_bytes blocks, kvc_buffer *out, kvc_buffer *err);
    kvc_status (*take_events)(void *self, kvc_buffer *out, kvc_buffer *err);
} kvc_scheduler_vtable;

typedef struct kvc_worker_vtable {
    size_t struct_size;
    void (*free)(void *self);
    /* `regions`: a JSON list of {name, addr, len, memory, device, layers, group, num_blocks,
     * shm_name?}; the host keeps that memory valid until it frees this instance. */
    kvc_status (*register_kv_caches)(void *self, kvc_bytes regions, kvc_buffer *err);
    kvc_status (*bind_connector_meta)(void *self, kvc_bytes meta, kvc_buffer *err);
    kvc_status (*start_load_kv)(void *self, kvc_buffer *err);
    kvc_status (*wait_for_layer_load)(void *self, uint32_t layer, kvc_buffer *err);
    kvc_status (*save_kv_layer)(void *self, uint32_t layer, const uint32_t *block_ids, size_t len, kvc_buffer *err);
    kvc_status (*wait_for_save)(void *self, kvc_buffer *err);
    kvc_status (*get_finished)(void *self, const kvc_bytes *finished, size_t len, kvc_buffer *out, kvc_buffer *err);
    kvc_status (*block_ids_with_load_errors)(void *self, kvc_buffer *out, kvc_buffer *err);
    kvc_status (*handshake_metadata)(void *self, kvc_buffer *out, kvc_buffer *err);
    kvc_status (*set_peer_handshake_metadata)(void *self, kvc_bytes peer, kvc_buffer *err);
    kvc_status (*shutdown)(void *self, kvc_buffer *err);
} kvc_worker_vtable;

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
    kvc_status (*init)(const kvc_host_api *host, kvc_buffer *err);
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
