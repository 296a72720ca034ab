/* fuzz_wire.c - libFuzzer target for the data-link decoders: the hello
 * (decode/encode round trip), the collective header (parse and describe,
 * whatever its kind, dtype and op bytes), and both sides of the hello
 * reply and PYDDP_AUTH_TOKEN handshake reading arbitrary peer bytes over a
 * socket pair (they must fail cleanly, never read past what they asked
 * for, never accept a proof without the key).
 *
 * Input: byte 0 selects the case and options, the rest is the peer's bytes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ddp_auth.h"
#include "ddp_coll_internal.h"
#include "ddp_hello.h"
#include "ddp_sock.h"

/* Run the connect (initiator) or accept (responder) side on fd, with the
 * peer's bytes already queued and the peer's write side shut. */
static void handshake_case(const uint8_t *d, size_t n, int accept_side, int keyed) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, sv) < 0) return;
    int big = 1 << 20;
    setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
    size_t done = 0;
    ddp_sock_send_some(sv[1], d, n, &done);
    shutdown(sv[1], SHUT_WR);   /* the peer says nothing more: reads end at EOF */
    ddp_auth key;
    ddp_auth_set(&key, "fuzz-key", 8);
    const ddp_auth *a = keyed ? &key : NULL;
    ddp_status st;
    if (accept_side) {
        ddp_hello h = {DDP_HELLO_MAGIC, 3, 1, 1, 2, (n && (d[0] & 1)) ? DDP_HELLO_HAS_TOKEN : 0,
                       0, 0, 0};
        st = ddp_hello_accept(sv[0], &h, a, "fuzz link", ddp_wait_for(200, NULL), "fuzzer:1");
        /* with a key, random bytes never pass the challenge (2^-256) */
        if (keyed && (h.flags & DDP_HELLO_HAS_TOKEN) && st == DDP_OK && done >= 64) abort();
    } else {
        st = ddp_hello_connect(sv[0], a, "fuzz link", ddp_wait_for(200, NULL), "fuzz peer");
        if (keyed && st == DDP_OK) abort();   /* needs a proof made with the key */
    }
    close(sv[0]);
    close(sv[1]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    uint8_t sel = data[0];
    const uint8_t *d = data + 1;
    size_t n = size - 1;
    switch (sel % 4) {
    case 0: {   /* hello round trip */
        unsigned char raw[DDP_HELLO_BYTES] = {0}, back[DDP_HELLO_BYTES];
        memcpy(raw, d, n < sizeof raw ? n : sizeof raw);
        ddp_hello h;
        ddp_hello_decode(raw, &h);
        ddp_hello_encode(&h, back);
        if (memcmp(raw, back, sizeof raw) != 0) abort();
        break;
    }
    case 1: {   /* collective header: parse against a header of our own, describe */
        unsigned char raw[DDP_COLL_HDR_BYTES] = {0};
        memcpy(raw, d, n < sizeof raw ? n : sizeof raw);
        ddp_coll_hdr mine, h;
        memset(&mine, 0, sizeof mine);
        mine.magic = DDP_COLL_MAGIC;
        mine.tag = 7;
        ddp_coll_hdr_parse(raw, sel >> 4, &mine, &h);
        char buf[256];
        ddp_coll_describe(&h, buf, sizeof buf);
        unsigned char back[DDP_COLL_HDR_BYTES];
        ddp_coll_hdr_encode(&h, back);
        if (memcmp(raw, back, sizeof raw) != 0) abort();
        break;
    }
    case 2: handshake_case(d, n, 0, (sel >> 2) & 1); break;
    case 3: handshake_case(d, n, 1, (sel >> 2) & 1); break;
    }
    return 0;
}
