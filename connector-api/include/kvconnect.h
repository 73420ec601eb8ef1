/*
 * kvconnect plugin ABI, version 1.3: the C view of kvconnect-api's `ffi` module.
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
 * `sdk_version` to "kvconnect.h 1.3" (the host names it when it refuses the
 * plugin) and `rustc_version` to your compiler.
 *
 * Every entry returns a kvc_status: KVC_OK, or the kind of error with a JSON-encoded error in
 * `*err` (`{"InvalidConfig":{"connector":"x","message":"..."}}`, kvconnect-api's
 * ConnectorError). A buffer is freed by the side that allocated it, by calling its own `free`.
 * Setup-time values (configs, capabilities, model, context, regions, handshake metadata) are
 * JSON; per-step calls take plain arrays. An entry must never unwind or throw into its caller.
 *
 * Entries of ABI 1.0 must all be set: the host refuses a plugin with a NULL one.
 * Entries a later minor appended say so, and may be NULL; the host then does what their
 * comment says. A host of an older minor never calls them; a host of a newer minor finds the
 * entries it knows and your header does not absent (your `struct_size` says which you have).
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
#define KVC_ABI_MINOR 3
/* A hash of the layout of ABI 1.0's structs (offsets and entry types, not sizes), on
 * 64-bit targets: the same for every 1.x. The host refuses a plugin that reports another. */
#define KVC_LAYOUT_FINGERPRINT 0x519a47d8acd937bdULL

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

/* The JSON values that cross, each the serde form of the kvconnect-api type named (its
 * definition in connector-api/src is the schema; the host decodes with it, and a value it
 * cannot decode is an error naming the field). The examples are written from real values.
 *
 * JSON Schemas (draft 2020-12) of ConnectorInfo, Capabilities, ConnectorContext and
 * ConnectorError are in the repository under connector-api/schema/ (*.schema.json); a test keeps them
 * equal to the types and checks real values from the connectors against them.
 *
 * ConnectorInfo: factory info (*out); all three strings required.
 *   {"name":"my-plugin","version":"0.1.0","description":"one line on what it does"}
 *
 * Capabilities: factory capabilities (*out); unknown fields are refused; layouts are dimension
 *   orders (NHD = LBNHC, HND = LBHNC); memory_kinds host|device|disk; transfer_mode
 *   none|pull|push; roles kv_producer|kv_consumer|kv_both.
 *   {"hma":false,"layout":{"required":[],"rejected":["BLNHC"],"preferred":["LBNHC"]},"adapt":null,"block_size_multiple":1,"block_size_divides":null,"cache_dtypes":[],"memory_kinds":["host"],"transfer_mode":"none","roles":["kv_producer","kv_consumer","kv_both"],"layerwise":true,"heterogeneous_tp":false,"mla":false,"async_load":false}
 *
 * KvTransferConfig: factory capabilities and child_capabilities (config);
 *   ConnectorContext.config; a plugin's own settings are in kv_connector_extra_config.
 *   {"kv_connector":"my-plugin","kv_connector_extra_config":{"dir":"/var/cache/kv"}}
 *
 * ConnectorContext: create_scheduler, create_worker (ctx); effective is the negotiated layout
 *   the KV regions follow.
 *   {"config":{"kv_connector":"my-plugin","kv_connector_extra_config":{"dir":"/var/cache/kv"}},"model":{"name":"tiny","num_layers":2,"num_kv_heads":2,"head_dim":4,"dtype":"f16","layers":[{"kind":"full"},{"kind":"full"}]},"effective":{"layout":"LBNHC","hma":false,"block_size":16,"cache_dtype":"f16","memory":"host","transfer_mode":"none","groups":[{"kind":{"kind":"full"},"layers":[0,1]}]},"role":"kv_both","engine_id":"engine-0","tp_rank":0,"tp_size":1}
 *
 * ConnectorError: every entry's *err, with a status other than KVC_OK; one key naming the kind
 *   (NotImplemented {connector, method}, InvalidConfig, InvalidArgument, Io, Other {connector,
 *   message}); the status code says the same kind.
 *   {"InvalidArgument":{"connector":"my-plugin","message":"block 9 is out of range for layer 0 (8 blocks)"}}
 *
 * Request: scheduler entries (req); kv_transfer_params may be absent.
 *   {"id":"req-1","prompt_tokens":[101,2023,2003],"kv_transfer_params":{}}
 *
 * MatchResult: get_num_new_matched_tokens (*out); or "Pending" to be asked again next step.
 *   {"Matched":{"tokens":16,"async_load":false}}
 *
 * BlocksPerGroup: update_state_after_alloc, request_finished (blocks); one list of block ids
 *   per KV cache group.
 *   [[3,5]]
 *
 * RequestFinished: request_finished (*out); transfer_params: an object for the peer, or null.
 *   {"delay_free":false,"transfer_params":null}
 *
 * Vec<KvRegionSpec>: register_kv_caches (regions); addr is an address in this process for
 *   memory host; shm_name may be absent.
 *   [{"name":"layer.0","addr":139637976727552,"len":8192,"memory":"host","device":-1,"layers":[0],"group":0,"num_blocks":16}]
 *
 * FinishedTransfers: get_finished (*out); request ids as strings; load_sources (what a cache
 *   tier supplied to a request's load, reported once) may be absent.
 *   {"finished_sending":[],"finished_recving":["req-1"],"failed_recving":[],"load_sources":[{"request":"req-1","connector":"my-plugin","tier":"disk","tokens":16}]}
 *
 * Vec<ConnectorMetric>: metrics (*out; scheduler and worker); kind "counter" or "gauge"; a
 *   counter's name without _total (the host adds it); labels may be absent; the host adds up
 *   equal samples of the two halves and the ranks.
 *   [{"name":"my_plugin_hits","help":"Blocks found on disk.","kind":"counter","labels":[["tier","disk"]],"value":3}]
 */

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

/* A factory: `self` is the handle `factory_new` made; any thread. */
typedef struct kvc_factory_vtable {
    size_t struct_size;
    /* Frees the factory. */
    void (*free)(void *self);
    /* *out = JSON ConnectorInfo. */
    kvc_status (*info)(void *self, kvc_buffer *out, kvc_buffer *err);
    /* config = JSON KvTransferConfig, model = JSON ModelSpec or empty; *out = JSON
     * Capabilities.
     */
    kvc_status (*capabilities)(void *self, kvc_bytes config, kvc_bytes model, kvc_buffer *out, kvc_buffer *err);
    /* ctx = JSON ConnectorContext; *out = the scheduler handle. */
    kvc_status (*create_scheduler)(void *self, kvc_bytes ctx, void **out, kvc_buffer *err);
    /* ctx = JSON ConnectorContext; *out = the worker handle. */
    kvc_status (*create_worker)(void *self, kvc_bytes ctx, void **out, kvc_buffer *err);
    /* For a composite: config, model as for capabilities; *out = JSON
     * Option<Vec<ChildCaps>> (a list of {name, version, caps}), null for a plain connector.
     * Since 1.1; may be NULL: the connector has no children.
     */
    kvc_status (*child_capabilities)(void *self, kvc_bytes config, kvc_bytes model, kvc_buffer *out, kvc_buffer *err);
} kvc_factory_vtable;

/* A scheduler half: `self` is a handle `create_scheduler` made; one thread at a time. */
typedef struct kvc_scheduler_vtable {
    size_t struct_size;
    /* Frees the instance. */
    void (*free)(void *self);
    /* req = JSON Request; *out = JSON MatchResult. */
    kvc_status (*get_num_new_matched_tokens)(void *self, kvc_bytes req, uint64_t num_computed, kvc_buffer *out, kvc_buffer *err);
    /* req = JSON Request, blocks = JSON BlocksPerGroup. */
    kvc_status (*update_state_after_alloc)(void *self, kvc_bytes req, kvc_bytes blocks, uint64_t num_external_tokens, kvc_buffer *err);
    /* step = JSON StepInfo; *out = the metadata bytes, as the connector made them. */
    kvc_status (*build_connector_meta)(void *self, kvc_bytes step, kvc_buffer *out, kvc_buffer *err);
    /* req, blocks as above; *out = JSON RequestFinished. */
    kvc_status (*request_finished)(void *self, kvc_bytes req, kvc_bytes blocks, kvc_buffer *out, kvc_buffer *err);
    /* *out = JSON events in the shape before media ([{"Stored": {"hashes": [..],
     * "tier": ".."}}], Removed alike; no clears). A host calls it only when the plugin
     * lacks take_kv_events.
     */
    kvc_status (*take_events)(void *self, kvc_buffer *out, kvc_buffer *err);
    /* *out = JSON Vec<KvEvent>: vLLM's event model (BlockStored with parent, tokens,
     * block size and medium; BlockRemoved with medium; AllBlocksCleared).
     * Since 1.2; may be NULL: the host calls `take_events`.
     */
    kvc_status (*take_kv_events)(void *self, kvc_buffer *out, kvc_buffer *err);
    /* *out = JSON Vec<ConnectorMetric>: what the connector counts for the host's
     * /metrics (a list of {name, help, kind: "counter"|"gauge", labels: [[name, value]],
     * value}).
     * Since 1.3; may be NULL: the connector reports no metrics.
     */
    kvc_status (*metrics)(void *self, kvc_buffer *out, kvc_buffer *err);
} kvc_scheduler_vtable;

/* A worker half: `self` is a handle `create_worker` made; one thread at a time. */
typedef struct kvc_worker_vtable {
    size_t struct_size;
    /* Frees the instance. */
    void (*free)(void *self);
    /* regions = JSON Vec<KvRegionSpec> (a list of {name, addr, len, memory, device,
     * layers, group, num_blocks, shm_name?}): regions the host vouches for as
     * KvRegion::new requires; it keeps that memory valid until it frees this instance.
     */
    kvc_status (*register_kv_caches)(void *self, kvc_bytes regions, kvc_buffer *err);
    /* The scheduler's metadata bytes for this step. */
    kvc_status (*bind_connector_meta)(void *self, kvc_bytes meta, kvc_buffer *err);
    /* Starts this step's loads. */
    kvc_status (*start_load_kv)(void *self, kvc_buffer *err);
    /* Waits for one layer's loads. */
    kvc_status (*wait_for_layer_load)(void *self, uint32_t layer, kvc_buffer *err);
    /* Saves one layer of these blocks (block_ids: len u32 block ids). */
    kvc_status (*save_kv_layer)(void *self, uint32_t layer, const uint32_t *block_ids, size_t len, kvc_buffer *err);
    /* Waits for this step's saves. */
    kvc_status (*wait_for_save)(void *self, kvc_buffer *err);
    /* finished = len request ids (UTF-8); *out = JSON FinishedTransfers. */
    kvc_status (*get_finished)(void *self, const kvc_bytes *finished, size_t len, kvc_buffer *out, kvc_buffer *err);
    /* *out = JSON Vec<BlockId>. */
    kvc_status (*block_ids_with_load_errors)(void *self, kvc_buffer *out, kvc_buffer *err);
    /* *out = JSON value, or null for none. */
    kvc_status (*handshake_metadata)(void *self, kvc_buffer *out, kvc_buffer *err);
    /* peer = JSON value. */
    kvc_status (*set_peer_handshake_metadata)(void *self, kvc_bytes peer, kvc_buffer *err);
    /* Releases everything (the handle stays valid until free). */
    kvc_status (*shutdown)(void *self, kvc_buffer *err);
    /* *out = JSON Vec<ConnectorMetric>, as the scheduler's metrics.
     * Since 1.3; may be NULL: the connector reports no metrics.
     */
    kvc_status (*metrics)(void *self, kvc_buffer *out, kvc_buffer *err);
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
