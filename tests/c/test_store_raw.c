/* test_store_raw.c - pyddp's store server against raw connections: garbage,
 * queries before VALIDATE, a wrong magic, unknown queries, absurd lengths and
 * counts, requests arriving in pieces, connections that vanish mid-request;
 * none may disturb the server for other clients, whose requests (made with
 * the real client) go on being served. */
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "ddp_sock.h"
#include "ddp_store.h"
#include "ddp_store_wire.h"
#include "store_util.h"
#include "testutil.h"

static int raw_conn(int validate) {
    int fd;
    T_OK(ddp_sock_connect("127.0.0.1", g_port, W(5000), &fd));
    if (validate) {
        ddp_wbuf b;
        ddp_wbuf_init(&b);
        ddp_wbuf_u8(&b, DDP_Q_VALIDATE);
        ddp_wbuf_u32(&b, DDP_STORE_MAGIC);
        T_OK(ddp_sock_send_all(fd, b.p, b.len, W(5000), NULL));
        ddp_wbuf_free(&b);
    }
    return fd;
}

static void raw_send(int fd, const ddp_wbuf *b) {
    T_OK(ddp_sock_send_all(fd, b->p, b->len, W(5000), NULL));
}

/* The server must close fd: a read ends with EOF/reset, not a timeout. */
static void expect_dropped(int fd) {
    char buf[64];
    ddp_status st = DDP_OK;
    while (st == DDP_OK) st = ddp_sock_recv_all(fd, buf, 1, W(5000), NULL);
    T_STATUS(st, DDP_ERR_CLOSED);
    close(fd);
}

/* Send req (then empty it) on a fresh connection, VALIDATEd first or not;
 * the server must drop that connection. */
static void expect_rejected(int validate, ddp_wbuf *req) {
    int fd = raw_conn(validate);
    raw_send(fd, req);
    req->len = 0;
    expect_dropped(fd);
}

static void test_server_survives_bad_clients(void) {
    ddp_wbuf b;
    ddp_wbuf_init(&b);
    /* 1. garbage instead of VALIDATE */
    ddp_wbuf_raw(&b, "GET / HTTP/1.1\r\n\r\n", 18);
    expect_rejected(0, &b);
    /* 2. a real query without VALIDATE first */
    ddp_wbuf_u8(&b, DDP_Q_GETNUMKEYS);
    expect_rejected(0, &b);
    /* 3. wrong magic */
    ddp_wbuf_u8(&b, DDP_Q_VALIDATE);
    ddp_wbuf_u32(&b, 0xdeadbeefu);
    expect_rejected(0, &b);
    /* 4. unknown query */
    ddp_wbuf_u8(&b, 99);
    expect_rejected(1, &b);
    /* 5. absurd key length */
    ddp_wbuf_u8(&b, DDP_Q_SET);
    ddp_wbuf_u64(&b, (uint64_t)1 << 60);
    expect_rejected(1, &b);
    /* 6. absurd key count */
    ddp_wbuf_u8(&b, DDP_Q_WAIT);
    ddp_wbuf_u64(&b, UINT64_MAX);
    expect_rejected(1, &b);
    /* 7. truncated SET, then vanish */
    int fd = raw_conn(1);
    b.len = 0;
    ddp_wbuf_u8(&b, DDP_Q_SET);
    ddp_wbuf_str(&b, "/trunc", 6);
    ddp_wbuf_u64(&b, 100);
    ddp_wbuf_raw(&b, "only a few", 10);
    raw_send(fd, &b);
    usleep(50000);
    close(fd);
    /* 8. pending WAIT, then vanish; a later SET of that key must be safe */
    fd = raw_conn(1);
    b.len = 0;
    ddp_wbuf_u8(&b, DDP_Q_WAIT);
    ddp_wbuf_u64(&b, 1);
    ddp_wbuf_str(&b, "/orphan", 7);
    raw_send(fd, &b);
    usleep(50000);
    close(fd);
    /* 9. ADD to a key that is not a number drops only that client */
    ddp_store *s = client();
    T_OK(ddp_store_set(s, K("/text"), "abc", 3, W(5000)));
    int64_t r;
    T_STATUS(ddp_store_add(s, K("/text"), 1, &r, W(5000)), DDP_ERR_STORE);
    ddp_store_close(s);

    s = client();
    T_OK(ddp_store_set(s, K("/orphan"), "ok", 2, W(5000)));
    expect_value(s, "/orphan", "ok");
    const char *tk = "/trunc";
    size_t tkl = 6;
    int ready = -1;
    T_OK(ddp_store_check(s, &tk, &tkl, 1, &ready, W(5000)));
    T_ASSERT(ready == 0);   /* the half-sent SET was never applied */
    ddp_store_close(s);
    ddp_wbuf_free(&b);
}

static void test_raw_protocol(void) {
    ddp_wbuf b;
    ddp_wbuf_init(&b);
    int fd = raw_conn(1);
    /* MULTI_SET then MULTI_GET, the SET sent one byte at a time */
    ddp_wbuf_u8(&b, DDP_Q_MULTI_SET);
    ddp_wbuf_u64(&b, 2);
    ddp_wbuf_str(&b, "/m1", 3);
    ddp_wbuf_str(&b, "one", 3);
    ddp_wbuf_str(&b, "/m2", 3);
    ddp_wbuf_str(&b, "two", 3);
    for (size_t i = 0; i < b.len; i++) {
        T_OK(ddp_sock_send_all(fd, b.p + i, 1, W(5000), NULL));
        if (i % 8 == 0) usleep(1000);
    }
    b.len = 0;
    ddp_wbuf_u8(&b, DDP_Q_MULTI_GET);
    ddp_wbuf_u64(&b, 3);
    ddp_wbuf_str(&b, "/m1", 3);
    ddp_wbuf_str(&b, "/m2", 3);
    ddp_wbuf_str(&b, "/m3", 3);
    raw_send(fd, &b);
    const char *want[] = {"one", "two", ""};
    for (int i = 0; i < 3; i++) {
        uint64_t n;
        char v[8];
        T_OK(ddp_sock_recv_all(fd, &n, 8, W(5000), NULL));
        T_ASSERT(n == strlen(want[i]));
        T_OK(ddp_sock_recv_all(fd, v, n, W(5000), NULL));
        T_ASSERT(memcmp(v, want[i], n) == 0);
    }
    /* The server side of the race: WAIT, key set by another client, then
     * CANCEL_WAIT: STOP_WAITING followed by WAIT_CANCELED. */
    b.len = 0;
    ddp_wbuf_u8(&b, DDP_Q_WAIT);
    ddp_wbuf_u64(&b, 1);
    ddp_wbuf_str(&b, "/race", 5);
    raw_send(fd, &b);
    ddp_store *s = client();
    T_OK(ddp_store_set(s, K("/race"), "1", 1, W(5000)));
    int64_t nk;   /* a reply proves the server ran the SET (and the wake-up) */
    T_OK(ddp_store_num_keys(s, &nk, W(5000)));
    ddp_store_close(s);
    b.len = 0;
    ddp_wbuf_u8(&b, DDP_Q_CANCEL_WAIT);
    raw_send(fd, &b);
    unsigned char r[2];
    T_OK(ddp_sock_recv_all(fd, r, 2, W(5000), NULL));
    T_ASSERT(r[0] == DDP_WAIT_STOP_WAITING && r[1] == DDP_WAIT_CANCELED);
    close(fd);
    ddp_wbuf_free(&b);
}

/* Scripted fake server for the client side of the race: answers the
 * handshake, ignores the WAIT until CANCEL_WAIT, then replies STOP_WAITING
 * and WAIT_CANCELED together, then answers one GETNUMKEYS with 42. */
int main(void) {
    ddp_store_server *srv;
    T_OK(ddp_store_server_start("127.0.0.1", 0, &srv, &g_port));
    T_ASSERT(g_port > 0);
    test_server_survives_bad_clients();
    test_raw_protocol();
    ddp_store_server_stop(srv);
    printf("test_store_raw: ok\n");
    return 0;
}
