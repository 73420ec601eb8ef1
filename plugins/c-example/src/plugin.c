/*
 * kvconnect's C example plugin: a KV cache store in memory, written against kvconnect.h
 * alone. The scheduler half reports a prompt's stored tokens as matched; the worker half
 * copies the saved blocks' bytes out of the engine's registered KV regions on save and back
 * into the new request's blocks on load. This file holds the descriptor, `init` and the
 * factory; scheduler.c and worker.c the two halves; store.c the store.
 *
 * Build: cc -std=c99 -shared -fPIC -I connector-api/include plugins/c-example/src/\*.c
 *        -o libkvc_c_example.so -lpthread
 */
#include "json.h"
#include "plugin.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The major version this plugin says it was built for: KVC_ABI_MAJOR. Tests build it with
 * another to see how the host refuses it. */
#ifndef KVC_EXAMPLE_ABI_MAJOR
#define KVC_EXAMPLE_ABI_MAJOR KVC_ABI_MAJOR
#endif

#define STR2(x) #x
#define STR(x) STR2(x)
#define TEXT(s) {(const uint8_t *)(s), sizeof(s) - 1}

static const kvc_host_api *HOST;

void plugin_log(uint32_t level, const char *fmt, ...) {
    if (!HOST || !HOST->log || level > HOST->max_log_level) return;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    size_t len = (size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1;
    kvc_bytes target = TEXT(KVC_EXAMPLE_NAME);
    HOST->log(HOST->user_data, level, target, (kvc_bytes){(const uint8_t *)msg, len});
}

kvc_status parse_ctx(kvc_bytes ctx, ctx_fields *out, kvc_buffer *err) {
    json c, eff, v;
    uint64_t bs;
    const char *layout;
    size_t len;
    if (!json_parse(ctx.ptr, ctx.len, &c) || !json_get(c, "effective", &eff))
        return fail(err, KVC_INVALID_ARGUMENT, "the context is not a JSON ConnectorContext with 'effective'");
    if (!json_get(eff, "block_size", &v) || !json_u64(v, &bs) || bs == 0 || bs > UINT32_MAX)
        return fail(err, KVC_INVALID_ARGUMENT, "effective.block_size is missing or not a positive u32");
    if (!json_get(eff, "layout", &v) || !json_raw_string(v, &layout, &len) || len == 0)
        return fail(err, KVC_INVALID_ARGUMENT, "effective.layout is missing");
    /* The capabilities reject cross-layer layouts; a host that negotiated one anyway is told. */
    if (layout[0] != 'L')
        return fail(err, KVC_INVALID_CONFIG, "layout %.*s keeps layers inside blocks; this plugin copies per-layer "
                    "layouts (L first) only", (int)len, layout);
    out->block_size = (uint32_t)bs;
    return KVC_OK;
}

static kvc_status init(const kvc_host_api *host, kvc_buffer *err) {
    if (!host || host->abi_major != KVC_ABI_MAJOR)
        return fail(err, KVC_OTHER, "host speaks kvconnect ABI %u.x, this plugin kvconnect.h " STR(KVC_ABI_MAJOR) "."
                    STR(KVC_ABI_MINOR), host ? host->abi_major : 0);
    if (host->struct_size < offsetof(kvc_host_api, log) + sizeof host->log)
        return fail(err, KVC_OTHER, "the host's kvc_host_api is %zu bytes, too short for its log entry",
                    host->struct_size);
    HOST = host;
    plugin_log(KVC_LOG_DEBUG, "loaded (kvconnect.h %d.%d)", KVC_ABI_MAJOR, KVC_ABI_MINOR);
    return KVC_OK;
}

/* The factory's handle is its store. */
static kvc_status factory_new(void **out, kvc_buffer *err) {
    kv_store *s = store_new();
    if (!s) return fail(err, KVC_OTHER, "out of memory for the store");
    *out = s;
    return KVC_OK;
}

static void factory_free(void *self) {
    store_unref(self);
}

static kvc_status info(void *self, kvc_buffer *out, kvc_buffer *err) {
    (void)self;
    return out_json(out, err, "{\"name\":\"" KVC_EXAMPLE_NAME "\",\"version\":\"0.1.0\",\"description\":"
                              "\"C example plugin: KV blocks stored in memory, keyed by token ids\"}");
}

static kvc_status capabilities(void *self, kvc_bytes config, kvc_bytes model, kvc_buffer *out, kvc_buffer *err) {
    (void)self;
    (void)config;
    (void)model;
    return out_json(out, err,
                    "{\"hma\":false,"
                    "\"layout\":{\"required\":[],\"rejected\":[\"BLNHC\",\"BLHNC\"],\"preferred\":[\"LBNHC\"]},"
                    "\"adapt\":null,\"block_size_multiple\":1,\"block_size_divides\":null,\"cache_dtypes\":[],"
                    "\"memory_kinds\":[\"host\"],\"transfer_mode\":\"none\","
                    "\"roles\":[\"kv_producer\",\"kv_consumer\",\"kv_both\"],"
                    "\"layerwise\":true,\"heterogeneous_tp\":false,\"mla\":false,\"async_load\":false}");
}

static kvc_status create_scheduler(void *self, kvc_bytes ctx, void **out, kvc_buffer *err) {
    return scheduler_new(self, ctx, out, err);
}

static kvc_status create_worker(void *self, kvc_bytes ctx, void **out, kvc_buffer *err) {
    return worker_new(self, ctx, out, err);
}

static const kvc_factory_vtable FACTORY_VTABLE = {
    .struct_size = sizeof(kvc_factory_vtable),
    .free = factory_free,
    .info = info,
    .capabilities = capabilities,
    .create_scheduler = create_scheduler,
    .create_worker = create_worker,
    .child_capabilities = NULL, /* not a composite: the host takes it as no children */
};

#ifdef __VERSION__
#define COMPILER "cc " __VERSION__
#else
#define COMPILER "cc"
#endif

static const kvc_plugin_descriptor DESCRIPTOR = {
    .magic = KVC_ABI_MAGIC,
    .abi_major = KVC_EXAMPLE_ABI_MAJOR,
    .abi_minor = KVC_ABI_MINOR,
    .struct_size = sizeof(kvc_plugin_descriptor),
    .layout_fingerprint = KVC_LAYOUT_FINGERPRINT,
    .name = TEXT(KVC_EXAMPLE_NAME),
    .version = TEXT("0.1.0"),
    .sdk_version = TEXT("kvconnect.h " STR(KVC_EXAMPLE_ABI_MAJOR) "." STR(KVC_ABI_MINOR)),
    .rustc_version = TEXT(COMPILER),
    .init = init,
    .factory_new = factory_new,
    .factory = &FACTORY_VTABLE,
    .scheduler = &SCHEDULER_VTABLE,
    .worker = &WORKER_VTABLE,
};

__attribute__((visibility("default"))) const kvc_plugin_descriptor *kvconnect_plugin_entry(void) {
    return &DESCRIPTOR;
}
