/* fuzz_store.c - libFuzzer target for the store server's request handling:
 * framing (ddp_store_scan), every query's handler (ddp_store_ops.c), the
 * key map and the waiter index, on arbitrary bytes.
 *
 * The first input byte picks a chunk size; the rest is one connection's
 * byte stream. It is fed to two fresh servers, one all at once and one in
 * chunks (as reads would deliver it), the way ddp_store_server.c does
 * (each read no longer than ddp_store_input_room allows, run only when the
 * framer said the bytes can help, the buffer trimmed after each). Both must consume
 * the same bytes, drop the connection at the same point and queue the same
 * replies: incremental parsing may not change what a request means. A
 * second connection keeps a WAIT pending on the chunked server so SETs wake
 * across connections. Sanitizers catch the rest.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ddp_store_server_int.h"

typedef struct run_result {
    size_t consumed;
    int dropped;
    ddp_wbuf out;
} run_result;

/* Feed data to one connection of a fresh server in pieces of `chunk` bytes
 * (paced: also no more than ddp_store_input_room allows, trimmed after each;
 * with_waiter: another connection waits on "/k"). */
static void feed(const uint8_t *data, size_t size, size_t chunk, int paced, int with_waiter,
                 run_result *res) {
    ddp_store_server srv;
    memset(&srv, 0, sizeof srv);
    if (ddp_kvmap_init(&srv.map) < 0 || ddp_waitmap_init(&srv.waiters) < 0) abort();
    ddp_store_conn c, w;
    memset(&c, 0, sizeof c);
    memset(&w, 0, sizeof w);
    c.fd = w.fd = -1;
    ddp_wbuf_init(&c.in);
    ddp_wbuf_init(&c.out);
    ddp_wbuf_init(&w.in);
    ddp_wbuf_init(&w.out);
    if (with_waiter) {   /* the other connection: VALIDATE, then WAIT on "/k" */
        static const unsigned char req[] = {
            0, 0xce, 0xf7, 0x85, 0x3c, 6, 1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, '/', 'k'};
        size_t used = 0;
        while (ddp_wbuf_size(&w.in) < sizeof req) ddp_wbuf_raw(&w.in, req, sizeof req);
        for (int i = 0; i < 2; i++) {
            if (ddp_store_handle(&srv, &w, ddp_wbuf_data(&w.in), ddp_wbuf_size(&w.in), &used) != 1)
                abort();
            ddp_wbuf_consume(&w.in, used);
        }
    }
    res->consumed = 0;
    res->dropped = 0;
    srv.budget = (size_t)256 << 20;
    c.authed = 1;   /* (the handshake is not this target's) */
    for (size_t off = 0, n = 0; off < size && !res->dropped; off += n) {
        n = size - off < chunk ? size - off : chunk;
        if (paced) {   /* read as the real server does */
            size_t room = 0;
            if (ddp_store_input_room(&srv, &c, &room) < 0) { res->dropped = 1; break; }
            if (room == 0) abort();   /* framed requests were run: there is always room */
            if (n > room) n = room;
            memcpy(c.in.p + c.in.len, data + off, n);
            c.in.len += n;
        } else {
            ddp_wbuf_raw(&c.in, data + off, n);
        }
        while (ddp_wbuf_size(&c.in) > 0 && ddp_wbuf_size(&c.in) >= c.scan.need) {
            size_t used = 0;
            int r = ddp_store_handle(&srv, &c, ddp_wbuf_data(&c.in), ddp_wbuf_size(&c.in), &used);
            if (r < 0) { res->dropped = 1; break; }
            if (r == 0) break;
            ddp_wbuf_consume(&c.in, used);
            res->consumed += used;
        }
        if (paced) ddp_store_input_trim(&srv, &c);
    }
    if (paced && srv.held + srv.allowed != c.in.cap) abort();   /* the books balance */
    res->out = c.out;   /* handed to the caller */
    ddp_store_input_release(&srv, &c);
    ddp_store_conn_clear_wait(&srv, &c);
    ddp_store_conn_clear_wait(&srv, &w);
    ddp_wbuf_free(&w.in);
    ddp_wbuf_free(&w.out);
    ddp_kvmap_free(&srv.map);
    ddp_waitmap_free(&srv.waiters);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    size_t chunk = 1 + data[0] % 17;
    data++, size--;
    run_result whole, pieces;
    feed(data, size, size ? size : 1, 0, 0, &whole);
    feed(data, size, chunk, 1, 1, &pieces);
    if (whole.consumed != pieces.consumed || whole.dropped != pieces.dropped) abort();
    /* the waiter's STOP_WAITING went to the other connection, so the replies on
     * this one match byte for byte */
    if (ddp_wbuf_size(&whole.out) != ddp_wbuf_size(&pieces.out) ||
        (ddp_wbuf_size(&whole.out) > 0 &&
         memcmp(ddp_wbuf_data(&whole.out), ddp_wbuf_data(&pieces.out),
                ddp_wbuf_size(&whole.out)) != 0))
        abort();
    ddp_wbuf_free(&whole.out);
    ddp_wbuf_free(&pieces.out);
    return 0;
}
