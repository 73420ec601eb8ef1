/*
 * The store: KV blocks kept in memory, keyed by the prompt tokens they hold. One store per
 * factory, shared (reference-counted) by every scheduler and worker the factory makes, from
 * any thread. An entry is immutable once put and lives as long as the store.
 */
#ifndef KVC_EXAMPLE_STORE_H
#define KVC_EXAMPLE_STORE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

/* One stored prompt: `nblocks` blocks of every layer in `layers`, K then V, each part `blk`
 * bytes; the bytes of (layer index li, block b, part p) start at ((li*nblocks+b)*2+p)*blk. */
typedef struct kv_entry {
    uint32_t *tokens;
    size_t ntokens;
    uint32_t nblocks;
    uint32_t *layers;
    size_t nlayers;
    size_t blk;
    uint8_t *data;
    struct kv_entry *next;
} kv_entry;

typedef struct kv_store {
    pthread_mutex_t mu;
    size_t refs;
    kv_entry *head;
} kv_store;

/* A new store with one reference, or NULL when out of memory. */
kv_store *store_new(void);
kv_store *store_ref(kv_store *s);
void store_unref(kv_store *s);

/* The entry holding exactly these tokens, or NULL. */
const kv_entry *store_find(kv_store *s, const uint32_t *tokens, size_t ntokens);

/* Adds `e` (taking it, with its arrays) unless an entry for the same tokens is there
 * already, in which case `e` is freed: the first writer wins. */
void store_put(kv_store *s, kv_entry *e);

void entry_free(kv_entry *e);

#endif
