/* fuzz_store_auth.c - libFuzzer target for the first code a stranger reaches
 * on the port of a store server with PYDDP_AUTH_TOKEN set: the server's side
 * of the token handshake and the requests behind it (ddp_store_conn_process,
 * the step the server thread runs on each connection every round), on one
 * connection's bytes. They are buffered the way the server's reads buffer
 * them: before the connection has authenticated, no more than the
 * handshake step's bytes; after that, up to a chunk size.
 *
 * Input: byte 0 selects. Bit 1 set: a server without a token (a client with
 * one is told so and dropped; plain requests are served). Bit 0 set (server
 * with a token): the harness first passes the handshake as a client with the
 * key, checking the server's proof, and the rest is the requests that follow
 * it. Otherwise the rest is a stranger's bytes from the first one, and the
 * stranger must never authenticate nor get more than the handshake's answers
 * (the server's nonce and proof, or the "authenticate first" marker). Bits
 * 2..: the chunk size. fuzz_store.c fuzzes the request parser itself harder.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp_store_server_int.h"

#define ANSWER_BYTES (1 + DDP_AUTH_NONCE + DDP_AUTH_MAC)   /* verdict, nonce, proof */

/* Buffer d[0..n) into c as conn_read would and process it after each read;
 * -1 if the server dropped the connection. */
static int feed(ddp_store_server *srv, ddp_store_conn *c, const uint8_t *d, size_t n,
                size_t chunk) {
    for (size_t off = 0; off < n;) {
        size_t take = chunk;
        if (!c->authed) {   /* the handshake's next step, not a byte more */
            size_t want = c->auth_stage == 0 ? DDP_STORE_AUTH_HELLO : DDP_AUTH_MAC;
            size_t have = ddp_wbuf_size(&c->in);
            if (have >= want) abort();   /* a whole step buffered, and still waiting */
            if (take > want - have) take = want - have;
        }
        if (take > n - off) take = n - off;
        ddp_wbuf_raw(&c->in, d + off, take);
        off += take;
        if (ddp_store_conn_process(srv, c) < 0) return -1;
    }
    return 0;
}

/* Pass the handshake as a pyddp client with the server's key would. */
static void authenticate(ddp_store_server *srv, ddp_store_conn *c) {
    unsigned char hello[DDP_STORE_AUTH_HELLO], mac[DDP_AUTH_MAC];
    uint32_t magic = DDP_STORE_AUTH_MAGIC;
    hello[0] = DDP_Q_AUTH;
    memcpy(hello + 1, &magic, 4);
    if (ddp_auth_nonce(hello + 5) != DDP_OK) abort();
    if (feed(srv, c, hello, sizeof hello, sizeof hello) < 0) abort();
    const unsigned char *ans = ddp_wbuf_data(&c->out);
    if (ddp_wbuf_size(&c->out) != ANSWER_BYTES || ans[0] != 0) abort();
    if (ddp_auth_proof(&srv->key, "responder", DDP_STORE_AUTH_PURPOSE, hello + 5, ans + 1,
                       mac) != DDP_OK ||
        !ddp_auth_equal(mac, ans + 1 + DDP_AUTH_NONCE, DDP_AUTH_MAC))
        abort();   /* the server proved it has the key */
    if (ddp_auth_proof(&srv->key, "initiator", DDP_STORE_AUTH_PURPOSE, hello + 5, ans + 1,
                       mac) != DDP_OK)
        abort();
    if (feed(srv, c, mac, sizeof mac, sizeof mac) < 0 || !c->authed) abort();
    ddp_wbuf_consume(&c->out, ANSWER_BYTES);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    uint8_t sel = data[0];
    int keyed = !(sel & 2), harness_auth = keyed && (sel & 1);
    size_t chunk = 1 + (sel >> 2) % 41;
    ddp_store_server srv;
    memset(&srv, 0, sizeof srv);
    if (ddp_kvmap_init(&srv.map) < 0 || ddp_waitmap_init(&srv.waiters) < 0) abort();
    ddp_auth_set(&srv.key, "fuzz-key", 8);
    srv.has_key = keyed;
    srv.budget = (size_t)256 << 20;
    ddp_store_conn c;
    memset(&c, 0, sizeof c);
    snprintf(c.addr, sizeof c.addr, "fuzzer:1");
    c.fd = -1;   /* what the server sends at once goes nowhere; c.out keeps it */
    c.authed = !keyed;
    ddp_wbuf_init(&c.in);
    ddp_wbuf_init(&c.out);
    if (harness_auth) authenticate(&srv, &c);
    feed(&srv, &c, data + 1, size - 1, chunk);
    if (keyed && !harness_auth && (c.authed || ddp_wbuf_size(&c.out) > ANSWER_BYTES))
        abort();   /* a stranger got past the handshake, or got more than its answers */
    ddp_store_conn_clear_wait(&srv, &c);
    ddp_wbuf_free(&c.in);
    ddp_wbuf_free(&c.out);
    ddp_kvmap_free(&srv.map);
    ddp_waitmap_free(&srv.waiters);
    return 0;
}
