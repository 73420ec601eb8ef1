/* What the plugin's parts share: the host's logger, the context fields they read, the
 * step metadata format, and the scheduler and worker halves. */
#ifndef KVC_EXAMPLE_PLUGIN_H
#define KVC_EXAMPLE_PLUGIN_H

#include "kvconnect.h"
#include "out.h"
#include "store.h"

/* Logs through the host (kvc_host_api.log), if init gave one and the level is on. */
void plugin_log(uint32_t level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The context fields both halves use (`ctx` is the JSON ConnectorContext). */
typedef struct ctx_fields {
    uint32_t block_size; /* effective.block_size */
} ctx_fields;

kvc_status parse_ctx(kvc_bytes ctx, ctx_fields *out, kvc_buffer *err);

/* Step metadata, from the scheduler half to the worker half: native-endian u32 words,
 * [njobs] then per job [kind, ntokens, first, nblocks, tokens..., blocks...]. A save job
 * stores blocks[0..nblocks] as the prompt `tokens`; a load job fills blocks[i] with stored
 * block first + i of that prompt. */
enum { JOB_SAVE = 0, JOB_LOAD = 1, JOB_DONE = 2 /* a save already published */ };

kvc_status scheduler_new(kv_store *store, kvc_bytes ctx, void **out, kvc_buffer *err);
kvc_status worker_new(kv_store *store, kvc_bytes ctx, void **out, kvc_buffer *err);

extern const kvc_scheduler_vtable SCHEDULER_VTABLE;
extern const kvc_worker_vtable WORKER_VTABLE;

#endif
