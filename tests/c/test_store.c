/* test_store.c - store client and server over loopback: every query, WAIT
 * timeouts that leave the connection usable (including the STOP_WAITING /
 * CANCEL_WAIT race, played by a scripted fake server), concurrent clients,
 * closing a client while other threads, holding their own references, are
 * blocked in requests on it; DDP_ERR_STORE for garbage, a lost connection or
 * a closed client; the server's request counter growing by exactly the
 * requests made; a MULTI_GET of hundreds of values of every size around the
 * client's read buffer. Raw connections that misbehave are test_store_raw.c's. */
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "ddp_sock.h"
#include "ddp_store.h"
#include "ddp_store_wire.h"
#include "store_util.h"
#include "testutil.h"

/* COMPARE_SET key and compare the returned value with want. */
static void expect_cas(ddp_store *s, const char *key, const char *expected,
                       const char *desired, const char *want) {
    void *v;
    size_t vl;
    T_OK(ddp_store_compare_set(s, K(key), K(expected), K(desired), &v, &vl, W(5000)));
    T_ASSERT(vl == strlen(want) && memcmp(v, want, vl) == 0);
    free(v);
}

static void test_basic_ops(void) {
    ddp_store *s = client();
    T_ASSERT(strstr(ddp_store_peer(s), "127.0.0.1:") != NULL);
    int64_t n, r;
    T_OK(ddp_store_num_keys(s, &n, W(5000)));
    T_ASSERT(n == 0);
    T_OK(ddp_store_set(s, K("/a"), "hello", 5, W(5000)));
    expect_value(s, "/a", "hello");
    T_OK(ddp_store_set(s, K("/empty"), "", 0, W(5000)));
    expect_value(s, "/empty", "");

    T_OK(ddp_store_add(s, K("/ctr"), 5, &r, W(5000)));
    T_ASSERT(r == 5);
    T_OK(ddp_store_add(s, K("/ctr"), -7, &r, W(5000)));
    T_ASSERT(r == -2);
    expect_value(s, "/ctr", "-2");   /* stored as ASCII decimal, like torch */

    T_OK(ddp_store_append(s, K("/app"), "ab", 2, W(5000)));
    T_OK(ddp_store_append(s, K("/app"), "cd", 2, W(5000)));
    expect_value(s, "/app", "abcd");

    const char *keys[] = {"/a", "/app", "/nope"};
    size_t kl[] = {2, 4, 5};
    int ready = -1;
    T_OK(ddp_store_check(s, keys, kl, 2, &ready, W(5000)));
    T_ASSERT(ready == 1);
    T_OK(ddp_store_check(s, keys, kl, 3, &ready, W(5000)));
    T_ASSERT(ready == 0);
    T_OK(ddp_store_wait(s, keys, kl, 2, W(5000)));

    /* absent, expected empty: stores desired */
    expect_cas(s, "/cs", "", "x", "x");
    /* present, mismatch: unchanged, returns current */
    expect_cas(s, "/cs", "y", "z", "x");
    /* present, match: swapped */
    expect_cas(s, "/cs", "x", "zz", "zz");
    /* absent, expected non-empty: returns expected, stores nothing */
    expect_cas(s, "/cs2", "e", "d", "e");
    T_OK(ddp_store_check(s, (const char *[]){"/cs2"}, (size_t[]){4}, 1, &ready, W(5000)));
    T_ASSERT(ready == 0);

    T_OK(ddp_store_num_keys(s, &n, W(5000)));
    T_ASSERT(n == 5);   /* /a /empty /ctr /app /cs */
    T_OK(ddp_store_delete(s, K("/a"), &r, W(5000)));
    T_ASSERT(r == 1);
    T_OK(ddp_store_delete(s, K("/a"), &r, W(5000)));
    T_ASSERT(r == 0);
    T_OK(ddp_store_num_keys(s, &n, W(5000)));
    T_ASSERT(n == 4);

    /* A value bigger than any socket buffer arrives in many pieces. */
    size_t big = (size_t)8 << 20;
    unsigned char *b = malloc(big);
    void *v;
    size_t vl;
    T_ASSERT(b);
    for (size_t i = 0; i < big; i++) b[i] = (unsigned char)(i * 2654435761u >> 13);
    T_OK(ddp_store_set(s, K("/big"), b, big, W(10000)));
    T_OK(ddp_store_get(s, K("/big"), &v, &vl, W(10000)));
    T_ASSERT(vl == big && memcmp(v, b, big) == 0);
    free(v);
    free(b);
    T_STATUS(ddp_store_set(s, K("/huge"), "", DDP_STORE_MAX_VALUE + 1, W(1000)),
             DDP_ERR_INVALID);
    ddp_store_close(s);
}

static void test_wait_timeout_keeps_connection(void) {
    ddp_store *s = client();
    const char *keys[] = {"/present", "/never"};
    size_t kl[] = {8, 6};
    T_OK(ddp_store_set(s, K("/present"), "1", 1, W(5000)));
    int64_t t0 = ddp_now_ms();
    T_STATUS(ddp_store_wait(s, keys, kl, 2, W(300)), DDP_ERR_TIMEOUT);
    T_ASSERT(ddp_now_ms() - t0 >= 290);
    T_ASSERT(strstr(ddp_last_error(), "/never") != NULL);      /* names the missing key */
    T_ASSERT(strstr(ddp_last_error(), "127.0.0.1:") != NULL);  /* and the server */
    void *v;
    size_t vl;
    T_STATUS(ddp_store_get(s, K("/never"), &v, &vl, W(200)), DDP_ERR_TIMEOUT);
    /* Same connection still in sync. */
    expect_value(s, "/present", "1");
    int64_t r;
    T_OK(ddp_store_add(s, K("/after"), 3, &r, W(5000)));
    T_ASSERT(r == 3);
    ddp_store_close(s);
}

typedef struct {
    int id;
    int iters;
} worker_arg;

/* Each worker: wait for the go key set by main, then many adds and a set. */
static void *worker(void *p) {
    worker_arg *a = p;
    ddp_store *s = client();
    const char *go = "/go";
    size_t gol = 3;
    T_OK(ddp_store_wait(s, &go, &gol, 1, W(10000)));
    for (int i = 0; i < a->iters; i++) {
        int64_t r;
        T_OK(ddp_store_add(s, K("/shared"), 1, &r, W(10000)));
    }
    char key[32], val[32];
    snprintf(key, sizeof key, "/w%d", a->id);
    snprintf(val, sizeof val, "v%d", a->id);
    T_OK(ddp_store_set(s, K(key), K(val), W(10000)));
    ddp_store_close(s);
    return NULL;
}

static void test_concurrent_clients(void) {
    enum { NW = 4, ITERS = 200 };
    pthread_t th[NW];
    worker_arg args[NW];
    for (int i = 0; i < NW; i++) {
        args[i] = (worker_arg){i, ITERS};
        T_ASSERT(pthread_create(&th[i], NULL, worker, &args[i]) == 0);
    }
    ddp_store *s = client();
    usleep(100000);   /* let the workers block in WAIT: SET must wake them */
    T_OK(ddp_store_set(s, K("/go"), "1", 1, W(5000)));
    for (int i = 0; i < NW; i++) pthread_join(th[i], NULL);
    char want[32];
    snprintf(want, sizeof want, "%d", NW * ITERS);
    expect_value(s, "/shared", want);
    for (int i = 0; i < NW; i++) {
        char key[32], val[32];
        snprintf(key, sizeof key, "/w%d", i);
        snprintf(val, sizeof val, "v%d", i);
        expect_value(s, key, val);
    }
    ddp_store_close(s);
}

/* A raw, validated connection for hand-made requests. */
static void *fake_server(void *p) {
    int lfd = *(int *)p, fd;
    unsigned char buf[64];
    T_OK(ddp_sock_accept(lfd, W(5000), &fd));
    T_OK(ddp_sock_recv_all(fd, buf, 10, W(5000), NULL));   /* VALIDATE + PING */
    T_OK(ddp_sock_send_all(fd, buf + 6, 4, W(5000), NULL));
    T_OK(ddp_sock_recv_all(fd, buf, 1 + 8 + 8 + 2, W(5000), NULL));   /* WAIT "/k" */
    T_ASSERT(buf[0] == DDP_Q_WAIT);
    T_OK(ddp_sock_recv_all(fd, buf, 1, W(5000), NULL));
    T_ASSERT(buf[0] == DDP_Q_CANCEL_WAIT);
    T_OK(ddp_sock_send_all(fd, "\0\1", 2, W(5000), NULL));
    T_OK(ddp_sock_recv_all(fd, buf, 1, W(5000), NULL));
    T_ASSERT(buf[0] == DDP_Q_GETNUMKEYS);
    int64_t n = 42;
    T_OK(ddp_sock_send_all(fd, &n, 8, W(5000), NULL));
    close(fd);
    return NULL;
}

static void test_client_cancel_race(void) {
    int lfd, port;
    T_OK(ddp_sock_listen("127.0.0.1", 0, 0, 0, &lfd, &port));
    pthread_t th;
    T_ASSERT(pthread_create(&th, NULL, fake_server, &lfd) == 0);
    ddp_store *s;
    T_OK(ddp_store_connect("127.0.0.1", port, W(5000), &s));
    const char *k = "/k";
    size_t kl = 2;
    /* The keys arrived as we gave up: the wait succeeds. */
    T_OK(ddp_store_wait(s, &k, &kl, 1, W(200)));
    int64_t n;
    T_OK(ddp_store_num_keys(s, &n, W(5000)));
    T_ASSERT(n == 42);
    pthread_join(th, NULL);
    /* The fake server is gone: the next request fails and the client is
     * then unusable with the original reason. */
    T_ASSERT(ddp_store_num_keys(s, &n, W(2000)) != DDP_OK);
    T_STATUS(ddp_store_num_keys(s, &n, W(2000)), DDP_ERR_STORE);
    T_ASSERT(strstr(ddp_last_error(), "unusable") != NULL);
    ddp_store_close(s);
    close(lfd);
}

typedef struct {
    ddp_store *s;       /* this thread's own reference, released at the end */
    ddp_status st;
    int64_t ms;
    char msg[1024];
} blocked_arg;

/* WAIT with no deadline for a key nobody sets: only a close can end it. */
static void *blocked_waiter(void *p) {
    blocked_arg *a = p;
    const char *k = "/never-set";
    size_t kl = strlen(k);
    int64_t t0 = ddp_now_ms();
    a->st = ddp_store_wait(a->s, &k, &kl, 1, W(-1));
    a->ms = ddp_now_ms() - t0;
    ddp_copy_error(a->msg, sizeof a->msg);
    ddp_store_release(a->s);   /* possibly the last reference: frees here */
    return NULL;
}

static void test_close_wakes_blocked_requests(void) {
    enum { NT = 2 };   /* one inside the WAIT, one queued behind it for the mutex */
    ddp_store *s = client();
    blocked_arg a[NT];
    pthread_t th[NT];
    for (int i = 0; i < NT; i++) {
        memset(&a[i], 0, sizeof a[i]);
        ddp_store_retain(s);
        a[i].s = s;
        T_ASSERT(pthread_create(&th[i], NULL, blocked_waiter, &a[i]) == 0);
    }
    usleep(300000);   /* both are blocked by now */
    int64_t t0 = ddp_now_ms();
    ddp_store_close(s);   /* drops only main's reference */
    for (int i = 0; i < NT; i++) pthread_join(th[i], NULL);
    T_ASSERT(ddp_now_ms() - t0 < 1000);   /* woken, not left to a deadline */
    for (int i = 0; i < NT; i++) {
        T_STATUS(a[i].st, DDP_ERR_STORE);
        T_ASSERT(a[i].ms >= 250);
        T_ASSERT(strstr(a[i].msg, "was closed") != NULL);
        T_ASSERT(strstr(a[i].msg, "127.0.0.1:") != NULL);
    }
    /* The reverse order: close first, then a holder's request fails at once
     * and its release frees the client. */
    s = client();
    ddp_store_retain(s);
    ddp_store_close(s);
    int64_t n;
    T_STATUS(ddp_store_num_keys(s, &n, W(5000)), DDP_ERR_STORE);
    T_ASSERT(strstr(ddp_last_error(), "was closed") != NULL);
    ddp_store_release(s);
    /* The server never noticed anything wrong. */
    s = client();
    T_OK(ddp_store_num_keys(s, &n, W(5000)));
    ddp_store_close(s);
}

/* Fake server that sends garbage: the first connection gets a wrong PING
 * echo, the second a proper handshake and then reply 7 to its WAIT. */
static void *garbage_server(void *p) {
    int lfd = *(int *)p, fd;
    unsigned char buf[64];
    for (int conn = 0; conn < 2; conn++) {
        T_OK(ddp_sock_accept(lfd, W(5000), &fd));
        T_OK(ddp_sock_recv_all(fd, buf, 10, W(5000), NULL));   /* VALIDATE + PING */
        if (conn == 0) buf[6] ^= 0xff;
        T_OK(ddp_sock_send_all(fd, buf + 6, 4, W(5000), NULL));
        if (conn == 1) {
            T_OK(ddp_sock_recv_all(fd, buf, 1 + 8 + 8 + 2, W(5000), NULL));
            T_OK(ddp_sock_send_all(fd, "\7", 1, W(5000), NULL));
        }
        /* Hold the connection until the client has given up on it. */
        ddp_status st = DDP_OK;
        while (st == DDP_OK) st = ddp_sock_recv_all(fd, buf, 1, W(5000), NULL);
        close(fd);
    }
    return NULL;
}

static void test_garbage_is_a_store_error(void) {
    int lfd, port;
    T_OK(ddp_sock_listen("127.0.0.1", 0, 0, 0, &lfd, &port));
    pthread_t th;
    T_ASSERT(pthread_create(&th, NULL, garbage_server, &lfd) == 0);
    ddp_store *s = NULL;
    T_STATUS(ddp_store_connect("127.0.0.1", port, W(5000), &s), DDP_ERR_STORE);
    T_ASSERT(strstr(ddp_last_error(), "MASTER_PORT") != NULL);
    T_ASSERT(s == NULL);
    T_OK(ddp_store_connect("127.0.0.1", port, W(5000), &s));
    const char *k = "/k";
    size_t kl = 2;
    T_STATUS(ddp_store_wait(s, &k, &kl, 1, W(5000)), DDP_ERR_STORE);
    T_ASSERT(strstr(ddp_last_error(), "unexpected reply 7") != NULL);
    ddp_store_close(s);
    pthread_join(th, NULL);
    close(lfd);
}

static void test_connect_failures(void) {
    int lfd, port;
    T_OK(ddp_sock_listen("127.0.0.1", 0, 0, 0, &lfd, &port));
    close(lfd);
    ddp_store *s;
    T_STATUS(ddp_store_connect("127.0.0.1", port, W(300), &s), DDP_ERR_CONNECT);
    char want[32];
    snprintf(want, sizeof want, "127.0.0.1:%d", port);
    T_ASSERT(strstr(ddp_last_error(), want) != NULL);
    T_ASSERT(s == NULL);
}

/* ddp_store_server_requests counts exactly the requests made, on a server
 * of its own (the other tests' leftovers do not count). */
static void test_request_count(void) {
    ddp_store_server *srv;
    int port;
    T_OK(ddp_store_server_start("127.0.0.1", 0, &srv, &port));
    T_ASSERT(ddp_store_server_requests(srv) == 0);
    T_ASSERT(ddp_store_server_requests(NULL) == 0);
    ddp_store *s;
    T_OK(ddp_store_connect("127.0.0.1", port, W(5000), &s));
    uint64_t n0 = ddp_store_server_requests(srv);
    T_ASSERT(n0 == 2);   /* VALIDATE and PING */
    int64_t r;
    T_OK(ddp_store_set(s, K("/k"), "v", 1, W(5000)));            /* 1 */
    expect_value(s, "/k", "v");                                  /* 2: WAIT, GET */
    T_OK(ddp_store_add(s, K("/c"), 3, &r, W(5000)));             /* 1 */
    T_OK(ddp_store_num_keys(s, &r, W(5000)));                    /* 1 */
    T_ASSERT(ddp_store_server_requests(srv) == n0 + 5);
    /* A burst of small ones. */
    for (int i = 0; i < 100; i++) T_OK(ddp_store_add(s, K("/c"), 1, &r, W(5000)));
    T_ASSERT(ddp_store_server_requests(srv) == n0 + 105);
    /* multi_get: the values in the keys' order, in two requests (WAIT, MULTI_GET) */
    T_OK(ddp_store_set(s, K("/m1"), "one", 3, W(5000)));
    T_OK(ddp_store_num_keys(s, &r, W(5000)));   /* a reply: the SET was served before it */
    const char *keys[3] = {"/m1", "/k", "/m1"};
    size_t klens[3] = {3, 2, 3}, vlens[3];
    void *vals[3];
    uint64_t before = ddp_store_server_requests(srv);
    T_OK(ddp_store_multi_get(s, keys, klens, 3, vals, vlens, W(5000)));
    T_ASSERT(ddp_store_server_requests(srv) == before + 2);
    T_ASSERT(vlens[0] == 3 && memcmp(vals[0], "one", 3) == 0);
    T_ASSERT(vlens[1] == 1 && memcmp(vals[1], "v", 1) == 0);
    T_ASSERT(vlens[2] == 3 && memcmp(vals[2], "one", 3) == 0);
    for (int i = 0; i < 3; i++) free(vals[i]);
    /* a missing key: the wait times out, nothing is handed out, the client still works */
    keys[1] = "/absent";
    klens[1] = 7;
    T_STATUS(ddp_store_multi_get(s, keys, klens, 3, vals, vlens, W(300)), DDP_ERR_TIMEOUT);
    T_ASSERT(vals[0] == NULL && vals[1] == NULL && vals[2] == NULL);
    expect_value(s, "/k", "v");
    /* multi_set: every key in one request, the last of a repeated key winning */
    const char *mk[3] = {"/s1", "/s2", "/s1"};
    size_t mkl[3] = {3, 3, 3}, mvl[3] = {1, 2, 3};
    const void *mv[3] = {"a", "bb", "ccc"};
    before = ddp_store_server_requests(srv);
    T_OK(ddp_store_multi_set(s, mk, mkl, mv, mvl, 3, W(5000)));
    T_OK(ddp_store_num_keys(s, &r, W(5000)));
    T_ASSERT(ddp_store_server_requests(srv) == before + 2);
    expect_value(s, "/s1", "ccc");
    expect_value(s, "/s2", "bb");
    T_OK(ddp_store_multi_set(s, mk, mkl, mv, mvl, 0, W(5000)));   /* none: a no-op */
    T_OK(ddp_store_num_keys(s, &r, W(5000)));   /* a reply: the MULTI_SET was served */
    /* a value over the limit: refused before anything is sent */
    mvl[1] = DDP_STORE_MAX_VALUE + 1;
    before = ddp_store_server_requests(srv);
    T_STATUS(ddp_store_multi_set(s, mk, mkl, mv, mvl, 3, W(5000)), DDP_ERR_INVALID);
    T_OK(ddp_store_num_keys(s, &r, W(5000)));
    T_ASSERT(ddp_store_server_requests(srv) == before + 1);
    expect_value(s, "/s1", "ccc");
    ddp_store_close(s);
    ddp_store_server_stop(srv);
}

/* A MULTI_GET whose reply is many values of sizes on both sides of the
 * client's read buffer (64 KiB; fields of 32 KiB and more bypass it) and of
 * its refills: every value byte for byte, in the keys' order, and the
 * requests after it answered in step (nothing read ahead is left over). */
static void test_multi_get_sizes(void) {
    static const size_t sizes[] = {0, 1, 7, 136, 4096, 32767, 32768, 65535, 65536, 70001,
                                   200000};
    enum { NKEYS = 600 };
    ddp_store *s = client();
    char names[NKEYS][24];
    const char *keys[NKEYS];
    size_t klens[NKEYS], vlens[NKEYS];
    void *vals[NKEYS];
    unsigned char *src = malloc(200000);
    T_ASSERT(src);
    for (int i = 0; i < NKEYS; i++) {
        size_t n = sizes[(size_t)i % (sizeof sizes / sizeof *sizes)];
        if (i >= 22) n = i % 3 ? 136 : n % 5000;   /* then mostly small, like a rendezvous */
        for (size_t b = 0; b < n; b++) src[b] = (unsigned char)(i * 31 + b * 7);
        snprintf(names[i], sizeof names[i], "/mg/%d", i);
        keys[i] = names[i];
        klens[i] = strlen(names[i]);
        T_OK(ddp_store_set(s, keys[i], klens[i], src, n, W(5000)));
        vlens[i] = n;
    }
    size_t want[NKEYS];
    memcpy(want, vlens, sizeof want);
    T_OK(ddp_store_multi_get(s, keys, klens, NKEYS, vals, vlens, W(10000)));
    for (int i = 0; i < NKEYS; i++) {
        T_ASSERT(vlens[i] == want[i]);
        for (size_t b = 0; b < want[i]; b++)
            T_ASSERT(((unsigned char *)vals[i])[b] == (unsigned char)(i * 31 + b * 7));
        free(vals[i]);
    }
    int64_t r;
    T_OK(ddp_store_add(s, K("/mg/after"), 41, &r, W(5000)));
    T_ASSERT(r == 41);
    expect_value(s, "/mg/after", "41");
    free(src);
    ddp_store_close(s);
    printf("multi_get of %d values from 0 to 200000 bytes: ok\n", NKEYS);
}

int main(void) {
    ddp_store_server *srv;
    T_OK(ddp_store_server_start("127.0.0.1", 0, &srv, &g_port));
    T_ASSERT(g_port > 0);
    test_basic_ops();
    test_wait_timeout_keeps_connection();
    test_concurrent_clients();
    test_client_cancel_race();
    test_close_wakes_blocked_requests();
    test_garbage_is_a_store_error();
    test_connect_failures();
    test_request_count();
    test_multi_get_sizes();
    /* Stopping with a client still connected: the client then sees a
     * closed connection, not a hang. */
    ddp_store *s = client();
    ddp_store_server_stop(srv);
    int64_t n;
    T_STATUS(ddp_store_num_keys(s, &n, W(2000)), DDP_ERR_STORE);
    ddp_store_close(s);
    ddp_store_server_stop(NULL);
    /* Listening on all interfaces, reached over IPv4 by name. */
    T_OK(ddp_store_server_start(NULL, 0, &srv, &g_port));
    s = NULL;
    T_OK(ddp_store_connect("localhost", g_port, W(5000), &s));
    T_OK(ddp_store_set(s, K("/x"), "y", 1, W(5000)));
    expect_value(s, "/x", "y");
    ddp_store_close(s);
    ddp_store_server_stop(srv);
    printf("test_store: ok\n");
    return 0;
}
