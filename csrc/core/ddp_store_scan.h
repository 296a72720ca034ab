/* ddp_store_scan.h - incremental framing of TCPStore requests for the
 * server: finds where one request ends in a connection's input without
 * re-reading the part already checked, however the request is split
 * across reads, and rejects what can never be valid (unknown query, a key
 * or value over its cap, a count over DDP_STORE_MAX_COUNT).
 *
 * The scanner keeps its place (offset, field, repetitions left) between
 * calls, and says how many bytes must be buffered before it can move on,
 * so the server does not even call it for a read that cannot help: a
 * request of n bytes costs O(n / read size + fields) in total.
 */
#ifndef DDP_STORE_SCAN_H
#define DDP_STORE_SCAN_H

#include <stddef.h>
#include <stdint.h>

typedef struct ddp_store_scan {
    size_t off;        /* bytes of the request checked so far */
    size_t need;       /* no progress is possible before this many bytes are buffered */
    uint64_t left;     /* repetitions of the repeated group still to check */
    uint8_t q;         /* the query byte, once started */
    uint8_t started, in_group, step;
} ddp_store_scan;

/* Start over (for the next request). */
void ddp_store_scan_reset(ddp_store_scan *s);

/* Continue checking the request that starts at p[0] (the bytes of earlier
 * calls, possibly more). 1: complete, s->off is its length and s->q its
 * query; 0: incomplete, s->need says how many bytes to wait for; -1:
 * invalid (the connection must be dropped). After 1 or -1 reset before
 * the next request. */
int ddp_store_scan_step(ddp_store_scan *s, const unsigned char *p, size_t n);

#endif
