/* The worker half: copies blocks between the engine's registered KV regions and the store.
 * Regions are per-layer ([L][K|V][B][..]): layer index li, part p, block b of a region of
 * nb blocks starts at ((li*2+p)*nb+b)*blk. */
#include "json.h"
#include "plugin.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct region {
    uint8_t *base;
    uint32_t *layers;
    size_t nlayers;
    uint32_t nblocks;
} region;

/* One job of the bound step metadata; the arrays point into worker.meta. */
typedef struct job {
    uint32_t kind;
    const uint32_t *tokens;
    uint32_t ntokens;
    uint32_t first;
    const uint32_t *blocks;
    uint32_t nblocks;
    uint8_t *data;  /* a save's bytes, in kv_entry order over worker.layers */
    uint8_t *saved; /* a save's layers done, one flag per worker.layers */
} job;

typedef struct worker {
    kv_store *store;
    region *regions;
    size_t nregions;
    u32_vec layers; /* every registered layer, in region order */
    size_t blk;     /* bytes of one block of one layer and one of K/V */
    uint32_t *meta;
    job *jobs;
    size_t njobs;
    u32_vec load_errors;
} worker;

kvc_status worker_new(kv_store *store, kvc_bytes ctx, void **out, kvc_buffer *err) {
    ctx_fields f;
    kvc_status st = parse_ctx(ctx, &f, err);
    if (st != KVC_OK) return st;
    worker *w = calloc(1, sizeof *w);
    if (!w) return fail(err, KVC_OTHER, "out of memory for a worker");
    w->store = store_ref(store);
    *out = w;
    return KVC_OK;
}

static void clear_jobs(worker *w) {
    for (size_t i = 0; i < w->njobs; i++) {
        free(w->jobs[i].data);
        free(w->jobs[i].saved);
    }
    free(w->jobs);
    free(w->meta);
    w->jobs = NULL;
    w->meta = NULL;
    w->njobs = 0;
}

static void clear_regions(worker *w) {
    for (size_t i = 0; i < w->nregions; i++) free(w->regions[i].layers);
    free(w->regions);
    w->regions = NULL;
    w->nregions = 0;
    u32_free(&w->layers);
    w->blk = 0;
}

/* Where (layer, part, block) lives, or NULL when the layer is not registered or the block is
 * out of its region. *gl = the layer's index in w->layers. */
static uint8_t *span(const worker *w, uint32_t layer, uint32_t part, uint32_t block, size_t *gl) {
    size_t g = 0;
    for (size_t r = 0; r < w->nregions; r++) {
        const region *reg = &w->regions[r];
        for (size_t li = 0; li < reg->nlayers; li++, g++) {
            if (reg->layers[li] != layer) continue;
            if (block >= reg->nblocks) return NULL;
            if (gl) *gl = g;
            return reg->base + (((li * 2 + part) * reg->nblocks) + block) * w->blk;
        }
    }
    return NULL;
}

static kvc_status no_span(const worker *w, uint32_t layer, uint32_t block, kvc_buffer *err) {
    for (size_t r = 0; r < w->nregions; r++)
        for (size_t li = 0; li < w->regions[r].nlayers; li++)
            if (w->regions[r].layers[li] == layer)
                return fail(err, KVC_INVALID_ARGUMENT, "block %u is out of range for layer %u (%u blocks)", block,
                            layer, w->regions[r].nblocks);
    return fail(err, KVC_INVALID_ARGUMENT, "no registered region holds layer %u", layer);
}

static kvc_status parse_region(worker *w, json r, region *out, kvc_buffer *err) {
    json v, it, l;
    uint64_t addr, len, nblocks;
    const char *mem;
    size_t memlen;
    if (!json_get(r, "addr", &v) || !json_u64(v, &addr) || !json_get(r, "len", &v) || !json_u64(v, &len) ||
        !json_get(r, "num_blocks", &v) || !json_u64(v, &nblocks) || nblocks == 0 || nblocks > UINT32_MAX ||
        !json_get(r, "memory", &v) || !json_raw_string(v, &mem, &memlen) || !json_get(r, "layers", &l) ||
        json_array_len(l) <= 0)
        return fail(err, KVC_INVALID_ARGUMENT, "region %.*s lacks addr, len, memory, a non-empty layers list or "
                    "num_blocks > 0", (int)(r.end - r.p), r.p);
    if (memlen != 4 || memcmp(mem, "host", 4) != 0)
        return fail(err, KVC_INVALID_ARGUMENT, "region memory is %.*s; this plugin copies host memory only",
                    (int)memlen, mem);
    size_t nl = (size_t)json_array_len(l);
    uint64_t parts = (uint64_t)nl * 2 * nblocks;
    if (len % parts != 0)
        return fail(err, KVC_INVALID_ARGUMENT, "region of %llu bytes does not split into %zu layers x K,V x %llu blocks",
                    (unsigned long long)len, nl, (unsigned long long)nblocks);
    size_t blk = (size_t)(len / parts);
    if (w->blk && blk != w->blk)
        return fail(err, KVC_INVALID_ARGUMENT, "regions disagree on the block size (%zu and %zu bytes)", w->blk, blk);
    w->blk = blk;
    out->base = (uint8_t *)(uintptr_t)addr;
    out->nblocks = (uint32_t)nblocks;
    out->nlayers = 0;
    out->layers = malloc(nl * sizeof *out->layers);
    if (!out->layers) return fail(err, KVC_OTHER, "out of memory for a region");
    it = l;
    while (json_array_next(l, &it, &v)) {
        uint64_t x;
        if (!json_u64(v, &x) || x > UINT32_MAX)
            return fail(err, KVC_INVALID_ARGUMENT, "layer '%.*s' is not a u32", (int)(v.end - v.p), v.p);
        if (span(w, (uint32_t)x, 0, 0, NULL))
            return fail(err, KVC_INVALID_ARGUMENT, "layer %llu is in two regions", (unsigned long long)x);
        out->layers[out->nlayers++] = (uint32_t)x;
        if (!u32_push(&w->layers, (uint32_t)x)) return fail(err, KVC_OTHER, "out of memory for a region");
    }
    return KVC_OK;
}

static kvc_status register_kv_caches(void *self, kvc_bytes regions, kvc_buffer *err) {
    worker *w = self;
    json rs, it, r;
    clear_regions(w);
    long n = json_parse(regions.ptr, regions.len, &rs) ? json_array_len(rs) : -1;
    if (n <= 0) return fail(err, KVC_INVALID_ARGUMENT, "regions are not a non-empty JSON list");
    w->regions = calloc((size_t)n, sizeof *w->regions);
    if (!w->regions) return fail(err, KVC_OTHER, "out of memory for %ld regions", n);
    it = rs;
    while (json_array_next(rs, &it, &r)) {
        /* Counted before parsing, so clear_regions frees a half-parsed one's layers. */
        kvc_status st = parse_region(w, r, &w->regions[w->nregions++], err);
        if (st != KVC_OK) {
            clear_regions(w);
            return st;
        }
    }
    return KVC_OK;
}

static kvc_status bind_connector_meta(void *self, kvc_bytes meta, kvc_buffer *err) {
    worker *w = self;
    clear_jobs(w);
    if (meta.len == 0) return KVC_OK;
    if (meta.len % 4 != 0) return fail(err, KVC_INVALID_ARGUMENT, "step metadata of %zu bytes is not u32 words", meta.len);
    size_t words = meta.len / 4;
    w->meta = malloc(meta.len);
    if (!w->meta) return fail(err, KVC_OTHER, "out of memory for the step metadata");
    memcpy(w->meta, meta.ptr, meta.len);
    uint32_t njobs = w->meta[0];
    if (njobs > words) return fail(err, KVC_INVALID_ARGUMENT, "step metadata claims %u jobs in %zu words", njobs, words);
    w->jobs = calloc(njobs ? njobs : 1, sizeof *w->jobs);
    if (!w->jobs) return fail(err, KVC_OTHER, "out of memory for %u jobs", njobs);
    size_t at = 1;
    for (uint32_t i = 0; i < njobs; i++) {
        if (words - at < 4) return fail(err, KVC_INVALID_ARGUMENT, "step metadata is truncated at job %u", i);
        job *j = &w->jobs[w->njobs++];
        j->kind = w->meta[at];
        j->ntokens = w->meta[at + 1];
        j->first = w->meta[at + 2];
        j->nblocks = w->meta[at + 3];
        at += 4;
        if (j->kind > JOB_LOAD || (uint64_t)j->ntokens + j->nblocks > words - at)
            return fail(err, KVC_INVALID_ARGUMENT, "step metadata job %u is malformed", i);
        j->tokens = w->meta + at;
        j->blocks = w->meta + at + j->ntokens;
        at += (size_t)j->ntokens + j->nblocks;
    }
    return KVC_OK;
}

static kvc_status need_regions(const worker *w, kvc_buffer *err) {
    if (w->nregions) return KVC_OK;
    return fail(err, KVC_INVALID_ARGUMENT, "no KV regions: call register_kv_caches first");
}

/* Copies one load job's blocks in; 0 when the store cannot serve it. */
static int load(worker *w, const job *j) {
    const kv_entry *e = store_find(w->store, j->tokens, j->ntokens);
    if (!e || e->blk != w->blk || (uint64_t)j->first + j->nblocks > e->nblocks) return 0;
    for (size_t gl = 0; gl < w->layers.len; gl++) {
        size_t el = 0;
        while (el < e->nlayers && e->layers[el] != w->layers.v[gl]) el++;
        if (el == e->nlayers) return 0;
        for (uint32_t i = 0; i < j->nblocks; i++) {
            for (uint32_t part = 0; part < 2; part++) {
                uint8_t *dst = span(w, w->layers.v[gl], part, j->blocks[i], NULL);
                if (!dst) return 0;
                memcpy(dst, e->data + ((el * e->nblocks + j->first + i) * 2 + part) * e->blk, w->blk);
            }
        }
    }
    return 1;
}

static kvc_status start_load_kv(void *self, kvc_buffer *err) {
    worker *w = self;
    kvc_status st = need_regions(w, err);
    if (st != KVC_OK) return st;
    for (size_t i = 0; i < w->njobs; i++) {
        const job *j = &w->jobs[i];
        if (j->kind != JOB_LOAD || load(w, j)) continue;
        /* The engine recomputes these blocks (kv_load_failure_policy decides). */
        plugin_log(KVC_LOG_WARN, "load of a %u-token prompt failed: not stored for these regions", j->ntokens);
        for (uint32_t b = 0; b < j->nblocks; b++)
            if (!u32_push(&w->load_errors, j->blocks[b])) return fail(err, KVC_OTHER, "out of memory");
    }
    return KVC_OK;
}

static kvc_status wait_for_layer_load(void *self, uint32_t layer, kvc_buffer *err) {
    (void)self;
    (void)layer;
    (void)err;
    return KVC_OK; /* loads complete inside start_load_kv */
}

static kvc_status save_kv_layer(void *self, uint32_t layer, const uint32_t *block_ids, size_t len, kvc_buffer *err) {
    worker *w = self;
    kvc_status st = need_regions(w, err);
    if (st != KVC_OK) return st;
    size_t gl = 0;
    for (size_t i = 0; i < len; i++)
        if (!span(w, layer, 0, block_ids[i], NULL)) return no_span(w, layer, block_ids[i], err);
    for (size_t k = 0; k < w->njobs; k++) {
        job *j = &w->jobs[k];
        if (j->kind != JOB_SAVE) continue;
        size_t nl = w->layers.len;
        if (!j->data) {
            j->data = malloc(nl * j->nblocks * 2 * w->blk + 1);
            j->saved = calloc(nl, 1);
            if (!j->data || !j->saved) return fail(err, KVC_OTHER, "out of memory for a save");
        }
        for (uint32_t i = 0; i < j->nblocks; i++) {
            for (uint32_t part = 0; part < 2; part++) {
                const uint8_t *src = span(w, layer, part, j->blocks[i], &gl);
                if (!src) return no_span(w, layer, j->blocks[i], err);
                memcpy(j->data + ((gl * j->nblocks + i) * 2 + part) * w->blk, src, w->blk);
            }
        }
        if (j->nblocks) j->saved[gl] = 1;
    }
    return KVC_OK;
}

static kvc_status wait_for_save(void *self, kvc_buffer *err) {
    worker *w = self;
    for (size_t k = 0; k < w->njobs; k++) {
        job *j = &w->jobs[k];
        if (j->kind != JOB_SAVE) continue;
        size_t done = 0;
        for (size_t gl = 0; j->saved && gl < w->layers.len; gl++) done += j->saved[gl];
        if (done != w->layers.len || !j->data) {
            plugin_log(KVC_LOG_WARN, "%zu of %zu layers saved; entry dropped", done, w->layers.len);
            continue;
        }
        kv_entry *e = calloc(1, sizeof *e);
        uint32_t *tokens = malloc(j->ntokens * sizeof *tokens + 1);
        uint32_t *layers = malloc(w->layers.len * sizeof *layers);
        if (!e || !tokens || !layers) {
            free(e);
            free(tokens);
            free(layers);
            return fail(err, KVC_OTHER, "out of memory for a store entry");
        }
        memcpy(tokens, j->tokens, j->ntokens * sizeof *tokens);
        memcpy(layers, w->layers.v, w->layers.len * sizeof *layers);
        *e = (kv_entry){tokens, j->ntokens, j->nblocks, layers, w->layers.len, w->blk, j->data, NULL};
        j->data = NULL;
        store_put(w->store, e);
    }
    /* A step's saves end here. */
    for (size_t k = 0; k < w->njobs; k++)
        if (w->jobs[k].kind == JOB_SAVE) w->jobs[k].kind = JOB_DONE;
    return KVC_OK;
}

static kvc_status get_finished(void *self, const kvc_bytes *finished, size_t len, kvc_buffer *out, kvc_buffer *err) {
    (void)self;
    (void)finished;
    (void)len;
    /* Nothing is asynchronous: loads and saves finish within their step. */
    return out_json(out, err, "{\"finished_sending\":[],\"finished_recving\":[],\"failed_recving\":[]}");
}

static kvc_status block_ids_with_load_errors(void *self, kvc_buffer *out, kvc_buffer *err) {
    worker *w = self;
    size_t cap = 2 + w->load_errors.len * 11;
    char *s = malloc(cap + 1);
    if (!s) return fail(err, KVC_OTHER, "out of memory");
    size_t n = 0;
    s[n++] = '[';
    for (size_t i = 0; i < w->load_errors.len; i++)
        n += (size_t)snprintf(s + n, cap + 1 - n, i ? ",%u" : "%u", w->load_errors.v[i]);
    s[n++] = ']';
    kvc_status st = out_bytes(out, err, s, n);
    free(s);
    if (st == KVC_OK) w->load_errors.len = 0;
    return st;
}

static kvc_status handshake_metadata(void *self, kvc_buffer *out, kvc_buffer *err) {
    (void)self;
    return out_json(out, err, "null"); /* no peer: nothing to hand one */
}

static kvc_status set_peer_handshake_metadata(void *self, kvc_bytes peer, kvc_buffer *err) {
    (void)self;
    (void)peer;
    (void)err;
    return KVC_OK;
}

static kvc_status worker_shutdown(void *self, kvc_buffer *err) {
    (void)err;
    worker *w = self;
    clear_jobs(w);
    clear_regions(w);
    return KVC_OK;
}

static void worker_free(void *self) {
    worker *w = self;
    clear_jobs(w);
    clear_regions(w);
    u32_free(&w->load_errors);
    store_unref(w->store);
    free(w);
}

const kvc_worker_vtable WORKER_VTABLE = {
    .struct_size = sizeof(kvc_worker_vtable),
    .free = worker_free,
    .register_kv_caches = register_kv_caches,
    .bind_connector_meta = bind_connector_meta,
    .start_load_kv = start_load_kv,
    .wait_for_layer_load = wait_for_layer_load,
    .save_kv_layer = save_kv_layer,
    .wait_for_save = wait_for_save,
    .get_finished = get_finished,
    .block_ids_with_load_errors = block_ids_with_load_errors,
    .handshake_metadata = handshake_metadata,
    .set_peer_handshake_metadata = set_peer_handshake_metadata,
    .shutdown = worker_shutdown,
};
