#include "store.h"

#include <stdlib.h>
#include <string.h>

kv_store *store_new(void) {
    kv_store *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    if (pthread_mutex_init(&s->mu, NULL) != 0) {
        free(s);
        return NULL;
    }
    s->refs = 1;
    return s;
}

kv_store *store_ref(kv_store *s) {
    pthread_mutex_lock(&s->mu);
    s->refs++;
    pthread_mutex_unlock(&s->mu);
    return s;
}

void store_unref(kv_store *s) {
    pthread_mutex_lock(&s->mu);
    size_t left = --s->refs;
    pthread_mutex_unlock(&s->mu);
    if (left) return;
    for (kv_entry *e = s->head; e;) {
        kv_entry *next = e->next;
        entry_free(e);
        e = next;
    }
    pthread_mutex_destroy(&s->mu);
    free(s);
}

static const kv_entry *find_locked(kv_store *s, const uint32_t *tokens, size_t ntokens) {
    for (const kv_entry *e = s->head; e; e = e->next) {
        if (e->ntokens == ntokens && memcmp(e->tokens, tokens, ntokens * sizeof *tokens) == 0) return e;
    }
    return NULL;
}

const kv_entry *store_find(kv_store *s, const uint32_t *tokens, size_t ntokens) {
    pthread_mutex_lock(&s->mu);
    const kv_entry *e = find_locked(s, tokens, ntokens);
    pthread_mutex_unlock(&s->mu);
    return e;
}

void store_put(kv_store *s, kv_entry *e) {
    pthread_mutex_lock(&s->mu);
    int dup = find_locked(s, e->tokens, e->ntokens) != NULL;
    if (!dup) {
        e->next = s->head;
        s->head = e;
    }
    pthread_mutex_unlock(&s->mu);
    if (dup) entry_free(e);
}

void entry_free(kv_entry *e) {
    if (!e) return;
    free(e->tokens);
    free(e->layers);
    free(e->data);
    free(e);
}
