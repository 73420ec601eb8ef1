/*
 * A small reader for the JSON the host sends (configs, contexts, requests, regions): enough
 * to find a member of an object, walk an array and read numbers and strings. It never
 * allocates; every function checks bounds and returns 0 on malformed input.
 */
#ifndef KVC_EXAMPLE_JSON_H
#define KVC_EXAMPLE_JSON_H

#include <stddef.h>
#include <stdint.h>

/* A JSON value: [p, end) holds exactly it (no surrounding white space). */
typedef struct json {
    const char *p;
    const char *end;
} json;

/* The document in [ptr, ptr + len); 0 unless it is one well-formed value. */
int json_parse(const uint8_t *ptr, size_t len, json *out);

/* Member `key` of object `obj` (keys compared as written, without unescaping). */
int json_get(json obj, const char *key, json *out);

/* Walks array `arr`: start with *it = arr, then each call gives the next element. */
int json_array_next(json arr, json *it, json *out);

/* Number of elements of array `arr`, or -1. */
long json_array_len(json arr);

/* An unsigned integer that fits in 64 bits. */
int json_u64(json v, uint64_t *out);

/* The raw text of a string between its quotes (escapes left as written). */
int json_raw_string(json v, const char **ptr, size_t *len);

#endif
