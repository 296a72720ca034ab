/* ddp_store_wire.h - encoding and decoding of TCPStore messages, shared by
 * the store client and server (docs/design.md, "The store protocol").
 *
 * Integers travel in host byte order (as torch sends them); strings and
 * values are a uint64 length followed by the bytes. ddp_wbuf is a growable
 * byte buffer with a sticky out-of-memory flag, so a request is built with
 * a run of appends and checked once. ddp_rcur reads fields from bytes that
 * may be incomplete: a read past the end sets `more` (wait for more input),
 * a length above its cap sets `bad` (drop the connection).
 */
#ifndef DDP_STORE_WIRE_H
#define DDP_STORE_WIRE_H

#include <stddef.h>
#include <stdint.h>
#include "ddp_status.h"

/* Limits that keep one client from exhausting the server's memory. torch's
 * libuv server allows 8 KiB keys and 8 MiB values; these are looser. */
#define DDP_STORE_MAX_KEY ((size_t)1 << 20)
#define DDP_STORE_MAX_VALUE ((size_t)64 << 20)
#define DDP_STORE_MAX_COUNT ((uint64_t)1 << 20)  /* keys in one CHECK/WAIT/MULTI_* */
#define DDP_STORE_MAX_REPLY ((uint64_t)1 << 30)  /* largest value a client accepts */
#define DDP_STORE_MAX_BUFFERED ((size_t)256 << 20)  /* one request may not exceed this */

enum { DDP_WAIT_STOP_WAITING = 0, DDP_WAIT_CANCELED = 1 };
enum { DDP_CHECK_READY = 0, DDP_CHECK_NOT_READY = 1 };

typedef struct ddp_wbuf {
    unsigned char *p;
    size_t start;       /* bytes before start were consumed; data is p[start..len) */
    size_t len, cap;
    int oom;            /* set by the first failed growth; appends then no-op */
} ddp_wbuf;

void ddp_wbuf_init(ddp_wbuf *b);
void ddp_wbuf_free(ddp_wbuf *b);
/* Make room for n more bytes; 0 on success, -1 (and oom set) on failure. */
int ddp_wbuf_reserve(ddp_wbuf *b, size_t n);
/* The same, but a growth stops at `most` bytes of capacity (or at what the n
 * bytes need, if that is more) instead of doubling past it: for a buffer
 * that is known to need no more than `most`. */
int ddp_wbuf_reserve_upto(ddp_wbuf *b, size_t n, size_t most);
/* The capacity ddp_wbuf_reserve_upto(b, n, most) would leave b with (its
 * current one where the room is there, consumed space reclaimed), without
 * changing b; 0 where the size would overflow: what a caller that bills
 * memory checks before the buffer grows. */
size_t ddp_wbuf_cap_for(const ddp_wbuf *b, size_t n, size_t most);
/* Move the unconsumed bytes to the front and give back the capacity beyond
 * them (kept: the smallest power of two, at least 256, that holds them). On a
 * failed shrink the buffer stays as it was (still valid, not oom). */
void ddp_wbuf_compact(ddp_wbuf *b);
void ddp_wbuf_raw(ddp_wbuf *b, const void *p, size_t n);
void ddp_wbuf_u8(ddp_wbuf *b, uint8_t v);
void ddp_wbuf_u32(ddp_wbuf *b, uint32_t v);
void ddp_wbuf_u64(ddp_wbuf *b, uint64_t v);
/* uint64 length, then the bytes. */
void ddp_wbuf_str(ddp_wbuf *b, const void *p, size_t n);
/* Bytes not yet consumed. */
static inline size_t ddp_wbuf_size(const ddp_wbuf *b) { return b->len - b->start; }
/* (NULL for a buffer never grown: NULL + 0 is undefined behaviour in C.) */
static inline unsigned char *ddp_wbuf_data(const ddp_wbuf *b) {
    return b->p ? b->p + b->start : NULL;
}
/* Mark the first n unconsumed bytes as consumed (O(1); the space is
 * reclaimed by the next reserve that needs it). */
void ddp_wbuf_consume(ddp_wbuf *b, size_t n);

typedef struct ddp_rcur {
    const unsigned char *p;
    size_t n, off;
    int more;           /* a field ran past the end of the bytes seen so far */
    int bad;            /* a length exceeded its cap */
} ddp_rcur;

void ddp_rcur_init(ddp_rcur *c, const void *p, size_t n);
/* Each returns 0 if the field was read, -1 once more or bad is set (later
 * reads then keep failing, so a parser may check only at the end). */
int ddp_rcur_u8(ddp_rcur *c, uint8_t *v);
int ddp_rcur_u32(ddp_rcur *c, uint32_t *v);
int ddp_rcur_u64(ddp_rcur *c, uint64_t *v);
/* A length-prefixed string of at most cap bytes; *s points into the bytes. */
int ddp_rcur_str(ddp_rcur *c, const unsigned char **s, size_t *len, size_t cap);

/* Printable form of a key for error messages: non-printable bytes become
 * \xNN, long keys are cut with "...". Always NUL-terminates out. */
void ddp_store_key_repr(const void *key, size_t klen, char *out, size_t outlen);

#endif
