/* The scheduler half: looks prompts up in the store and tells the worker half which blocks
 * to load before the forward pass and which to store after it. */
#include "json.h"
#include "plugin.h"

#include <stdlib.h>
#include <string.h>

typedef struct lookup {
    char *id; /* the request id as JSON text (escapes as the host wrote them) */
    size_t idlen;
    u32_vec tokens; /* the prompt's cacheable tokens */
    uint64_t num_computed;
    int hit;
    struct lookup *next;
} lookup;

typedef struct scheduler {
    kv_store *store;
    uint32_t block_size;
    lookup *lookups;
    uint32_t njobs;
    u32_vec jobs; /* encoded jobs, without the leading count */
} scheduler;

kvc_status scheduler_new(kv_store *store, kvc_bytes ctx, void **out, kvc_buffer *err) {
    ctx_fields f;
    kvc_status st = parse_ctx(ctx, &f, err);
    if (st != KVC_OK) return st;
    scheduler *s = calloc(1, sizeof *s);
    if (!s) return fail(err, KVC_OTHER, "out of memory for a scheduler");
    s->store = store_ref(store);
    s->block_size = f.block_size;
    *out = s;
    return KVC_OK;
}

static void lookup_free(lookup *l) {
    free(l->id);
    u32_free(&l->tokens);
    free(l);
}

/* Removes and returns the lookup of request `id`, or NULL. */
static lookup *take_lookup(scheduler *s, const char *id, size_t idlen) {
    for (lookup **p = &s->lookups; *p; p = &(*p)->next) {
        if ((*p)->idlen == idlen && memcmp((*p)->id, id, idlen) == 0) {
            lookup *l = *p;
            *p = l->next;
            return l;
        }
    }
    return NULL;
}

/* The request's id and prompt tokens. */
static kvc_status parse_request(kvc_bytes req, const char **id, size_t *idlen, u32_vec *tokens, kvc_buffer *err) {
    json r, v, it, t;
    if (!json_parse(req.ptr, req.len, &r) || !json_get(r, "id", &v) || !json_raw_string(v, id, idlen))
        return fail(err, KVC_INVALID_ARGUMENT, "the request is not JSON with a string 'id'");
    if (!json_get(r, "prompt_tokens", &v) || json_array_len(v) < 0)
        return fail(err, KVC_INVALID_ARGUMENT, "the request has no 'prompt_tokens' array");
    it = v;
    while (json_array_next(v, &it, &t)) {
        uint64_t x;
        if (!json_u64(t, &x) || x > UINT32_MAX)
            return fail(err, KVC_INVALID_ARGUMENT, "prompt token '%.*s' is not a u32", (int)(t.end - t.p), t.p);
        if (!u32_push(tokens, (uint32_t)x)) return fail(err, KVC_OTHER, "out of memory for the prompt");
    }
    return KVC_OK;
}

/* The request's id alone. */
static kvc_status parse_request_id(kvc_bytes req, const char **id, size_t *idlen, kvc_buffer *err) {
    u32_vec tokens = {0};
    kvc_status st = parse_request(req, id, idlen, &tokens, err);
    u32_free(&tokens);
    return st;
}

static kvc_status get_num_new_matched_tokens(void *self, kvc_bytes req, uint64_t num_computed, kvc_buffer *out,
                                             kvc_buffer *err) {
    scheduler *s = self;
    const char *id;
    size_t idlen;
    u32_vec tokens = {0};
    kvc_status st = parse_request(req, &id, &idlen, &tokens, err);
    if (st != KVC_OK) {
        u32_free(&tokens);
        return st;
    }
    /* Full blocks only, leaving the engine at least one token to compute (it needs the
     * last token's logits). */
    size_t bs = s->block_size;
    tokens.len = tokens.len ? (tokens.len - 1) / bs * bs : 0;
    int hit = tokens.len > 0 && store_find(s->store, tokens.v, tokens.len) != NULL;
    uint64_t matched = hit && tokens.len > num_computed ? tokens.len - num_computed : 0;

    lookup *old = take_lookup(s, id, idlen);
    if (old) lookup_free(old);
    lookup *l = calloc(1, sizeof *l);
    char *copy = malloc(idlen ? idlen : 1);
    if (!l || !copy) {
        free(l);
        free(copy);
        u32_free(&tokens);
        return fail(err, KVC_OTHER, "out of memory for a lookup");
    }
    memcpy(copy, id, idlen);
    *l = (lookup){copy, idlen, tokens, num_computed, hit, s->lookups};
    s->lookups = l;
    return out_json(out, err, "{\"Matched\":{\"tokens\":%llu,\"async_load\":false}}", (unsigned long long)matched);
}

static int push_job(scheduler *s, uint32_t kind, const u32_vec *tokens, uint32_t first, const uint32_t *blocks,
                    uint32_t nblocks) {
    int ok = u32_push(&s->jobs, kind) && u32_push(&s->jobs, (uint32_t)tokens->len) && u32_push(&s->jobs, first) &&
             u32_push(&s->jobs, nblocks);
    for (size_t i = 0; ok && i < tokens->len; i++) ok = u32_push(&s->jobs, tokens->v[i]);
    for (uint32_t i = 0; ok && i < nblocks; i++) ok = u32_push(&s->jobs, blocks[i]);
    if (ok) s->njobs++;
    return ok;
}

static kvc_status update_state_after_alloc(void *self, kvc_bytes req, kvc_bytes blocks, uint64_t num_external_tokens,
                                           kvc_buffer *err) {
    scheduler *s = self;
    const char *id;
    size_t idlen;
    kvc_status st = parse_request_id(req, &id, &idlen, err);
    if (st != KVC_OK) return st;
    json b, it, group, gi, v;
    if (!json_parse(blocks.ptr, blocks.len, &b) || json_array_len(b) < 0)
        return fail(err, KVC_INVALID_ARGUMENT, "the block table is not a JSON list of lists");
    lookup *l = take_lookup(s, id, idlen);
    it = b;
    if (!l || !json_array_next(b, &it, &group)) {
        if (l) lookup_free(l);
        return KVC_OK; /* not looked up, or no blocks: nothing to do */
    }
    u32_vec table = {0};
    gi = group;
    while (json_array_next(group, &gi, &v)) {
        uint64_t x;
        if (!json_u64(v, &x) || x > UINT32_MAX || !u32_push(&table, (uint32_t)x)) {
            u32_free(&table);
            lookup_free(l);
            return fail(err, KVC_INVALID_ARGUMENT, "block id '%.*s' is not a u32", (int)(v.end - v.p), v.p);
        }
    }
    size_t stored = l->tokens.len / s->block_size;
    int ok = 1;
    if (table.len < stored) {
        st = fail(err, KVC_INVALID_ARGUMENT, "request %.*s has %zu blocks allocated but its %zu cacheable tokens need %zu",
                  (int)idlen, id, table.len, l->tokens.len, stored);
    } else if (l->hit && num_external_tokens > 0) {
        uint32_t first = (uint32_t)(l->num_computed / s->block_size);
        if (first < stored) ok = push_job(s, JOB_LOAD, &l->tokens, first, table.v + first, (uint32_t)(stored - first));
    } else if (!l->hit && stored > 0) {
        ok = push_job(s, JOB_SAVE, &l->tokens, 0, table.v, (uint32_t)stored);
    }
    if (!ok) st = fail(err, KVC_OTHER, "out of memory for the step's jobs");
    u32_free(&table);
    lookup_free(l);
    return st;
}

static kvc_status build_connector_meta(void *self, kvc_bytes step, kvc_buffer *out, kvc_buffer *err) {
    (void)step;
    scheduler *s = self;
    size_t words = 1 + s->jobs.len;
    uint32_t *meta = malloc(words * sizeof *meta);
    if (!meta) return fail(err, KVC_OTHER, "out of memory for the step metadata");
    meta[0] = s->njobs;
    if (s->jobs.len) memcpy(meta + 1, s->jobs.v, s->jobs.len * sizeof *meta);
    kvc_status st = out_bytes(out, err, meta, words * sizeof *meta);
    free(meta);
    if (st == KVC_OK) {
        s->jobs.len = 0;
        s->njobs = 0;
    }
    return st;
}

static kvc_status request_finished(void *self, kvc_bytes req, kvc_bytes blocks, kvc_buffer *out, kvc_buffer *err) {
    (void)blocks;
    scheduler *s = self;
    const char *id;
    size_t idlen;
    kvc_status st = parse_request_id(req, &id, &idlen, err);
    if (st != KVC_OK) return st;
    lookup *l = take_lookup(s, id, idlen);
    if (l) lookup_free(l);
    /* Saves finish within their step (wait_for_save), so blocks never need to outlive it. */
    return out_json(out, err, "{\"delay_free\":false,\"transfer_params\":null}");
}

static kvc_status take_events(void *self, kvc_buffer *out, kvc_buffer *err) {
    (void)self;
    return out_json(out, err, "[]");
}

static void scheduler_free(void *self) {
    scheduler *s = self;
    while (s->lookups) {
        lookup *l = s->lookups;
        s->lookups = l->next;
        lookup_free(l);
    }
    u32_free(&s->jobs);
    store_unref(s->store);
    free(s);
}

const kvc_scheduler_vtable SCHEDULER_VTABLE = {
    .struct_size = sizeof(kvc_scheduler_vtable),
    .free = scheduler_free,
    .get_num_new_matched_tokens = get_num_new_matched_tokens,
    .update_state_after_alloc = update_state_after_alloc,
    .build_connector_meta = build_connector_meta,
    .request_finished = request_finished,
    .take_events = take_events,
};
