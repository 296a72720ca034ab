/* ddp_store_wire.c - byte buffers and field readers for the TCPStore wire
 * protocol (see ddp_store_wire.h). */
#include "ddp_store_wire.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void ddp_wbuf_init(ddp_wbuf *b) { memset(b, 0, sizeof *b); }

void ddp_wbuf_free(ddp_wbuf *b) {
    free(b->p);
    ddp_wbuf_init(b);
}

int ddp_wbuf_reserve(ddp_wbuf *b, size_t n) { return ddp_wbuf_reserve_upto(b, n, SIZE_MAX); }

size_t ddp_wbuf_cap_for(const ddp_wbuf *b, size_t n, size_t most) {
    size_t len = b->len - b->start;   /* what stays once consumed space is reclaimed */
    if (n <= b->cap - len) return b->cap;
    if (n > SIZE_MAX / 2 - len) return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap - len < n) cap *= 2;
    if (cap > most) cap = most > len + n ? most : len + n;
    return cap;
}

int ddp_wbuf_reserve_upto(ddp_wbuf *b, size_t n, size_t most) {
    if (b->oom) return -1;
    if (n <= b->cap - b->len) return 0;
    if (b->start > 0) {   /* reclaim consumed space before growing */
        memmove(b->p, b->p + b->start, b->len - b->start);
        b->len -= b->start;
        b->start = 0;
        if (n <= b->cap - b->len) return 0;
    }
    size_t cap = ddp_wbuf_cap_for(b, n, most);
    if (cap == 0) {
        b->oom = 1;
        return -1;
    }
    unsigned char *p = realloc(b->p, cap);
    if (p == NULL) {
        b->oom = 1;
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

void ddp_wbuf_compact(ddp_wbuf *b) {
    size_t n = ddp_wbuf_size(b), cap = 256;
    if (b->p == NULL) return;
    if (b->start > 0) {
        memmove(b->p, b->p + b->start, n);
        b->len = n;
        b->start = 0;
    }
    while (cap < n) cap *= 2;
    if (cap >= b->cap) return;
    unsigned char *p = realloc(b->p, cap);
    if (p == NULL) return;   /* keep the larger block */
    b->p = p;
    b->cap = cap;
}

void ddp_wbuf_raw(ddp_wbuf *b, const void *p, size_t n) {
    if (n == 0 || ddp_wbuf_reserve(b, n) < 0) return;
    memcpy(b->p + b->len, p, n);
    b->len += n;
}

void ddp_wbuf_u8(ddp_wbuf *b, uint8_t v) { ddp_wbuf_raw(b, &v, 1); }
void ddp_wbuf_u32(ddp_wbuf *b, uint32_t v) { ddp_wbuf_raw(b, &v, sizeof v); }
void ddp_wbuf_u64(ddp_wbuf *b, uint64_t v) { ddp_wbuf_raw(b, &v, sizeof v); }

void ddp_wbuf_str(ddp_wbuf *b, const void *p, size_t n) {
    ddp_wbuf_u64(b, (uint64_t)n);
    ddp_wbuf_raw(b, p, n);
}

void ddp_wbuf_consume(ddp_wbuf *b, size_t n) {
    b->start += n < ddp_wbuf_size(b) ? n : ddp_wbuf_size(b);
    if (b->start == b->len) b->start = b->len = 0;
}

void ddp_rcur_init(ddp_rcur *c, const void *p, size_t n) {
    c->p = p;
    c->n = n;
    c->off = 0;
    c->more = 0;
    c->bad = 0;
}

/* Take n bytes from the cursor; NULL (and `more` set) if not all there. */
static const unsigned char *take(ddp_rcur *c, size_t n) {
    if (c->more || c->bad) return NULL;
    if (n > c->n - c->off) {
        c->more = 1;
        return NULL;
    }
    const unsigned char *p = c->p + c->off;
    c->off += n;
    return p;
}

int ddp_rcur_u8(ddp_rcur *c, uint8_t *v) {
    const unsigned char *p = take(c, 1);
    if (p == NULL) return -1;
    *v = p[0];
    return 0;
}

int ddp_rcur_u32(ddp_rcur *c, uint32_t *v) {
    const unsigned char *p = take(c, sizeof *v);
    if (p == NULL) return -1;
    memcpy(v, p, sizeof *v);
    return 0;
}

int ddp_rcur_u64(ddp_rcur *c, uint64_t *v) {
    const unsigned char *p = take(c, sizeof *v);
    if (p == NULL) return -1;
    memcpy(v, p, sizeof *v);
    return 0;
}

int ddp_rcur_str(ddp_rcur *c, const unsigned char **s, size_t *len, size_t cap) {
    uint64_t n;
    if (ddp_rcur_u64(c, &n) < 0) return -1;
    if (n > cap) {
        c->bad = 1;
        return -1;
    }
    const unsigned char *p = take(c, (size_t)n);
    if (p == NULL) return -1;
    *s = p;
    *len = (size_t)n;
    return 0;
}

void ddp_store_key_repr(const void *key, size_t klen, char *out, size_t outlen) {
    const unsigned char *k = key;
    size_t o = 0;
    if (outlen == 0) return;
    for (size_t i = 0; i < klen; i++) {
        if (o + 8 >= outlen) {   /* room for "\xNN", "..." and the NUL */
            memcpy(out + o, "...", 3);
            o += 3;
            break;
        }
        if (k[i] >= 0x20 && k[i] < 0x7f && k[i] != '\\')
            out[o++] = (char)k[i];
        else
            o += (size_t)snprintf(out + o, outlen - o, "\\x%02x", k[i]);
    }
    out[o] = '\0';
}
