/*
 * What the plugin hands the host: buffers it allocated (the host frees them through
 * kvc_buffer.free) and errors as kvconnect.h describes them.
 */
#ifndef KVC_EXAMPLE_OUT_H
#define KVC_EXAMPLE_OUT_H

#include "kvconnect.h"

#define KVC_EXAMPLE_NAME "c-example"

/* Copies `len` bytes into a new buffer in *out. KVC_OK, or KVC_OTHER when out of memory. */
kvc_status out_bytes(kvc_buffer *out, kvc_buffer *err, const void *bytes, size_t len);

/* Formats JSON text (printf-style) into *out. */
kvc_status out_json(kvc_buffer *out, kvc_buffer *err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Writes a ConnectorError of kind `status` (KVC_INVALID_ARGUMENT, KVC_INVALID_CONFIG,
 * KVC_IO, KVC_OTHER) with a printf-style message into *err, and returns `status`. */
kvc_status fail(kvc_buffer *err, kvc_status status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* A growing list of u32 (token ids, block ids, encoded metadata). */
typedef struct u32_vec {
    uint32_t *v;
    size_t len;
    size_t cap;
} u32_vec;

int u32_push(u32_vec *vec, uint32_t x);
void u32_free(u32_vec *vec);

#endif
