/* ddp_store_scan.c - the request framer of the store server (contract in
 * ddp_store_scan.h). Each query's body is described by a template: fixed
 * fields, optionally ending in a count N followed by a group of fields
 * repeated N times. Field kinds: I u32, L u64, K key, V value (u64 length,
 * then the bytes). */
#include "ddp_store_scan.h"

#include <string.h>

#include "ddp_store.h"
#include "ddp_store_wire.h"

typedef struct tmpl {
    const char *fixed, *group;
} tmpl;

/* The body of query q, or fixed == NULL for an unknown query. */
static tmpl template_of(uint8_t q) {
    switch (q) {
    case DDP_Q_VALIDATE: case DDP_Q_PING: return (tmpl){"I", ""};
    case DDP_Q_SET: case DDP_Q_APPEND: return (tmpl){"KV", ""};
    case DDP_Q_COMPARE_SET: return (tmpl){"KVV", ""};
    case DDP_Q_GET: case DDP_Q_DELETE_KEY: return (tmpl){"K", ""};
    case DDP_Q_ADD: return (tmpl){"KL", ""};
    case DDP_Q_CHECK: case DDP_Q_WAIT: case DDP_Q_MULTI_GET: return (tmpl){"N", "K"};
    case DDP_Q_MULTI_SET: return (tmpl){"N", "KV"};
    case DDP_Q_GETNUMKEYS: case DDP_Q_CANCEL_WAIT: return (tmpl){"", ""};
    default: return (tmpl){NULL, NULL};
    }
}

void ddp_store_scan_reset(ddp_store_scan *s) { memset(s, 0, sizeof *s); }

/* Check one field of kind f at s->off: 1 and s->off advanced past it, 0
 * with s->need set, -1 if over its cap. */
static int field(ddp_store_scan *s, char f, const unsigned char *p, size_t n) {
    size_t avail = n - s->off;
    if (f == 'I' || f == 'L') {
        size_t w = f == 'I' ? 4 : 8;
        if (avail < w) { s->need = s->off + w; return 0; }
        s->off += w;
        return 1;
    }
    if (avail < 8) { s->need = s->off + 8; return 0; }
    uint64_t len;
    memcpy(&len, p + s->off, 8);
    if (len > (f == 'K' ? DDP_STORE_MAX_KEY : DDP_STORE_MAX_VALUE)) return -1;
    if (avail - 8 < len) { s->need = s->off + 8 + (size_t)len; return 0; }
    s->off += 8 + (size_t)len;
    return 1;
}

int ddp_store_scan_step(ddp_store_scan *s, const unsigned char *p, size_t n) {
    if (!s->started) {
        if (n < 1) { s->need = 1; return 0; }
        s->q = p[0];
        if (template_of(s->q).fixed == NULL) return -1;
        s->started = 1;
        s->off = 1;
    }
    tmpl t = template_of(s->q);
    for (;;) {
        if (!s->in_group) {
            char f = t.fixed[s->step];
            if (f == '\0') return 1;
            if (f == 'N') {
                if (n - s->off < 8) { s->need = s->off + 8; return 0; }
                memcpy(&s->left, p + s->off, 8);
                if (s->left > DDP_STORE_MAX_COUNT) return -1;
                s->off += 8;
                s->in_group = 1;
                s->step = 0;
                if (s->left == 0) return 1;
                continue;
            }
            int r = field(s, f, p, n);
            if (r <= 0) return r;
            s->step++;
        } else {
            char f = t.group[s->step];
            if (f == '\0') {
                if (--s->left == 0) return 1;
                s->step = 0;
                continue;
            }
            int r = field(s, f, p, n);
            if (r <= 0) return r;
            s->step++;
        }
    }
}
