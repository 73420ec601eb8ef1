#include "out.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void free_buffer(uint8_t *ptr, size_t len, size_t cap) {
    (void)len;
    (void)cap;
    free(ptr);
}

static int fill(kvc_buffer *out, const void *bytes, size_t len) {
    uint8_t *p = malloc(len ? len : 1);
    if (!p) return 0;
    if (len) memcpy(p, bytes, len);
    out->ptr = p;
    out->len = len;
    out->cap = len;
    out->free = free_buffer;
    return 1;
}

kvc_status out_bytes(kvc_buffer *out, kvc_buffer *err, const void *bytes, size_t len) {
    if (!fill(out, bytes, len)) return fail(err, KVC_OTHER, "out of memory for a %zu-byte answer", len);
    return KVC_OK;
}

static char *vformat(const char *fmt, va_list ap, size_t *len) {
    va_list again;
    va_copy(again, ap);
    int n = vsnprintf(NULL, 0, fmt, ap);
    char *s = n < 0 ? NULL : malloc((size_t)n + 1);
    if (s) vsnprintf(s, (size_t)n + 1, fmt, again);
    va_end(again);
    *len = s ? (size_t)n : 0;
    return s;
}

kvc_status out_json(kvc_buffer *out, kvc_buffer *err, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    size_t len;
    char *s = vformat(fmt, ap, &len);
    va_end(ap);
    if (!s) return fail(err, KVC_OTHER, "out of memory formatting an answer");
    kvc_status st = out_bytes(out, err, s, len);
    free(s);
    return st;
}

static const char *kind_name(kvc_status status) {
    switch (status) {
    case KVC_INVALID_CONFIG: return "InvalidConfig";
    case KVC_INVALID_ARGUMENT: return "InvalidArgument";
    case KVC_IO: return "Io";
    default: return "Other";
    }
}

kvc_status fail(kvc_buffer *err, kvc_status status, const char *fmt, ...) {
    if (!err) return status; /* the host always passes one; a caller that does not gets the code */
    va_list ap;
    va_start(ap, fmt);
    size_t len;
    char *msg = vformat(fmt, ap, &len);
    va_end(ap);
    /* The message as a JSON string: quotes, backslashes and control bytes escaped. */
    char *esc = msg ? malloc(len * 6 + 1) : NULL;
    size_t n = 0;
    for (size_t i = 0; esc && i < len; i++) {
        unsigned char c = (unsigned char)msg[i];
        if (c == '"' || c == '\\') {
            esc[n++] = '\\';
            esc[n++] = (char)c;
        } else if (c < 0x20) {
            n += (size_t)sprintf(esc + n, "\\u%04x", c);
        } else {
            esc[n++] = (char)c;
        }
    }
    if (esc) esc[n] = 0;
    char *json = NULL;
    int jl = -1;
    if (esc) {
        const char *f = "{\"%s\":{\"connector\":\"" KVC_EXAMPLE_NAME "\",\"message\":\"%s\"}}";
        jl = snprintf(NULL, 0, f, kind_name(status), esc);
        json = jl < 0 ? NULL : malloc((size_t)jl + 1);
        if (json) snprintf(json, (size_t)jl + 1, f, kind_name(status), esc);
    }
    /* Out of memory: the host still gets the status, with an error it cannot decode. */
    if (json) fill(err, json, (size_t)jl);
    free(json);
    free(esc);
    free(msg);
    return status;
}

int u32_push(u32_vec *vec, uint32_t x) {
    if (vec->len == vec->cap) {
        size_t cap = vec->cap ? vec->cap * 2 : 16;
        uint32_t *v = realloc(vec->v, cap * sizeof *v);
        if (!v) return 0;
        vec->v = v;
        vec->cap = cap;
    }
    vec->v[vec->len++] = x;
    return 1;
}

void u32_free(u32_vec *vec) {
    free(vec->v);
    vec->v = NULL;
    vec->len = vec->cap = 0;
}
