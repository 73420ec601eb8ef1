#include "json.h"

#include <string.h>

static const char *skip_ws(const char *p, const char *end) {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
    return p;
}

/* The end of the value starting at p (after white space), or NULL. Depth-limited. */
static const char *skip_value(const char *p, const char *end, int depth) {
    if (depth > 64) return NULL;
    p = skip_ws(p, end);
    if (p >= end) return NULL;
    if (*p == '"') {
        for (p++; p < end; p++) {
            if (*p == '\\') {
                p++;
            } else if (*p == '"') {
                return p + 1;
            }
        }
        return NULL;
    }
    if (*p == '{' || *p == '[') {
        char close = *p == '{' ? '}' : ']';
        p = skip_ws(p + 1, end);
        if (p < end && *p == close) return p + 1;
        for (;;) {
            if (close == '}') {
                p = skip_value(p, end, depth + 1); /* the key */
                if (!p) return NULL;
                p = skip_ws(p, end);
                if (p >= end || *p != ':') return NULL;
                p++;
            }
            p = skip_value(p, end, depth + 1);
            if (!p) return NULL;
            p = skip_ws(p, end);
            if (p >= end) return NULL;
            if (*p == close) return p + 1;
            if (*p != ',') return NULL;
            p++;
        }
    }
    /* A number, true, false or null. */
    const char *start = p;
    while (p < end && (strchr("+-.0123456789eE", *p) || (*p >= 'a' && *p <= 'z'))) p++;
    return p > start ? p : NULL;
}

static int value_at(const char *p, const char *end, json *out) {
    p = skip_ws(p, end);
    const char *e = skip_value(p, end, 0);
    if (!e) return 0;
    out->p = p;
    out->end = e;
    return 1;
}

int json_parse(const uint8_t *ptr, size_t len, json *out) {
    if (!ptr) return 0;
    const char *end = (const char *)ptr + len;
    if (!value_at((const char *)ptr, end, out)) return 0;
    return skip_ws(out->end, end) == end;
}

int json_get(json obj, const char *key, json *out) {
    if (obj.p >= obj.end || *obj.p != '{') return 0;
    size_t klen = strlen(key);
    const char *p = skip_ws(obj.p + 1, obj.end);
    while (p < obj.end && *p == '"') {
        json k;
        if (!value_at(p, obj.end, &k)) return 0;
        p = skip_ws(k.end, obj.end);
        if (p >= obj.end || *p != ':') return 0;
        json v;
        if (!value_at(p + 1, obj.end, &v)) return 0;
        if ((size_t)(k.end - k.p) == klen + 2 && memcmp(k.p + 1, key, klen) == 0) {
            *out = v;
            return 1;
        }
        p = skip_ws(v.end, obj.end);
        if (p < obj.end && *p == ',') p = skip_ws(p + 1, obj.end);
    }
    return 0;
}

int json_array_next(json arr, json *it, json *out) {
    if (arr.p >= arr.end || *arr.p != '[') return 0;
    const char *p = it->p == arr.p ? arr.p + 1 : it->end;
    p = skip_ws(p, arr.end);
    if (it->p != arr.p) {
        if (p >= arr.end || *p != ',') return 0;
        p++;
    }
    p = skip_ws(p, arr.end);
    if (p >= arr.end || *p == ']') return 0;
    if (!value_at(p, arr.end, out)) return 0;
    *it = *out;
    return 1;
}

long json_array_len(json arr) {
    if (arr.p >= arr.end || *arr.p != '[') return -1;
    long n = 0;
    json it = arr, v;
    while (json_array_next(arr, &it, &v)) n++;
    return n;
}

int json_u64(json v, uint64_t *out) {
    uint64_t x = 0;
    if (v.p >= v.end) return 0;
    for (const char *p = v.p; p < v.end; p++) {
        if (*p < '0' || *p > '9') return 0;
        uint64_t d = (uint64_t)(*p - '0');
        if (x > (UINT64_MAX - d) / 10) return 0;
        x = x * 10 + d;
    }
    *out = x;
    return 1;
}

int json_raw_string(json v, const char **ptr, size_t *len) {
    if (v.end - v.p < 2 || *v.p != '"') return 0;
    *ptr = v.p + 1;
    *len = (size_t)(v.end - v.p - 2);
    return 1;
}
