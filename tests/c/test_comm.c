/* test_comm.c - the communicator end to end without Python: an in-process
 * store server, N threads as ranks running the rendezvous over real loopback
 * TCP, collectives queued through ddp_comm_submit (async, in order), the
 * version check, a rank that leaves making the others fail fast, abort, and
 * validation errors that leave the communicator usable, subgroups over the
 * parent's links (interleaved with the parent's work, nested, outliving a
 * destroyed parent by reference), and the inline run of small collectives on
 * the caller's thread (the run_inline op of the communicator's ddp_pg table,
 * ddp_comm_run_inline): results, what it declines, order behind queued work
 * (where it validates nothing: submit does, once), a late peer, its check
 * hook aborting the run, and a destroy from inside the hook; the table's info
 * ops against the communicator's own answers, and a table without the
 * optional ops. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "ddp_comm.h"
#include "ddp_comm_internal.h"
#include "ddp_le.h"
#include "ddp_sock.h"
#include "testutil.h"

#define MAXR 4

typedef struct rank_ctx {
    int rank, size, port;
    const char *prefix;
    const char *version;
    int scenario;
    ddp_status create_status;
    char msg[2048];
    ddp_comm *comm;
} rank_ctx;

enum { SC_SUM, SC_VERSION, SC_LEAVE, SC_ABORT, SC_INVALID, SC_SUB, SC_STALL, SC_INLINE,
       SC_INLINE_DESTROY };

static ddp_status make_comm(rank_ctx *c, ddp_store **store) {
    T_OK(ddp_store_connect("127.0.0.1", c->port, ddp_wait_for(5000, NULL), store));
    ddp_comm_config cfg = {0};
    cfg.rank = c->rank;
    cfg.size = c->size;
    cfg.prefix = c->prefix;
    cfg.advertise_host = "127.0.0.1";
    cfg.bind_host = "127.0.0.1";
    cfg.timeout_ms = 20000;
    cfg.version = c->version;
    cfg.host_id = "testhost";
    return ddp_comm_create(&cfg, *store, &c->comm);
}

static ddp_status run_one(ddp_comm *comm, ddp_coll_args *a, int64_t timeout_ms) {
    ddp_work *w;
    ddp_status st = ddp_comm_submit(comm, a, timeout_ms, &w);
    if (st != DDP_OK) return st;
    st = ddp_work_wait(w, ddp_wait_for(-1, NULL));
    ddp_work_release(w);
    return st;
}

/* The check hook of the inline tests: counts its calls; after `abort_after`
 * calls (0: never) it returns nonzero, or, with `destroy`, destroys the
 * communicator from inside the run (what a Python signal handler may do). */
typedef struct hook_ctx {
    int calls, abort_after;
    ddp_comm *destroy;
} hook_ctx;

static int test_hook(void *p) {
    hook_ctx *h = p;
    h->calls++;
    if (h->destroy && h->calls == 1) ddp_comm_destroy(h->destroy);
    return h->abort_after && h->calls >= h->abort_after;
}

/* The inline run through the one door: the communicator's ddp_pg table. */
static ddp_status run_inline(ddp_comm *comm, ddp_coll_args *a, hook_ctx *h, int *taken) {
    ddp_pg_interrupt intr = {test_hook, h};
    *taken = -1;
    return ddp_pg_run_inline(ddp_comm_pg(comm), a, -1, h ? &intr : NULL, taken);
}

/* The info table answers what the communicator itself answers. */
static void check_info(ddp_comm *comm) {
    ddp_pg pg = ddp_comm_pg(comm);
    const ddp_pg_info *in = ddp_pg_info_of(pg);
    T_ASSERT(in != NULL && pg.ops->run_inline != NULL);
    T_ASSERT(in->tag(comm) == ddp_comm_tag(comm));
    for (int r = 0; r < ddp_comm_size(comm); r++) {
        T_ASSERT(strcmp(in->peer_desc(comm, r), ddp_comm_peer_desc(comm, r)) == 0);
        T_ASSERT(strcmp(in->host_id(comm, r), "testhost") == 0);
        T_ASSERT(strcmp(in->transport(comm, r), ddp_comm_transport(comm, r)) == 0);
    }
    uint64_t s0, d0, s1, d1;
    ddp_flight_entry l0, l1, fr[DDP_FLIGHT_LEN];
    in->progress(comm, &s0, &d0, &l0);
    ddp_comm_progress(comm, &s1, &d1, &l1);
    T_ASSERT(s0 == s1 && d0 == d1 && l0.id == l1.id);
    T_ASSERT(in->flight(comm, fr, DDP_FLIGHT_LEN) == ddp_comm_flight(comm, fr, DDP_FLIGHT_LEN));
}

/* A transport without the optional ops (as NCCL's table): the door answers
 * "not taken" and "no info" without calling anything. */
static void test_pg_optional_ops(void) {
    ddp_pg_ops ops = ddp_comm_pg(NULL).ops[0];
    ops.run_inline = NULL;
    ops.info = NULL;
    ddp_pg pg = {&ops, NULL};
    ddp_coll_args a = {.kind = DDP_COLL_BARRIER, .dtype = DDP_UINT8};
    int taken = -1;
    T_OK(ddp_pg_run_inline(pg, &a, -1, NULL, &taken));
    T_ASSERT(taken == 0 && ddp_pg_info_of(pg) == NULL);
    printf("ok optional ddp_pg ops\n");
}

static void inline_scenario(rank_ctx *c) {
    ddp_comm *comm = c->comm;
    int taken = 0, n = c->size;
    float x[8];
    uint64_t sub0 = 0, done0 = 0, sub = 0, done = 0;
    ddp_flight_entry last, fr[DDP_FLIGHT_LEN];
    if (c->scenario == SC_INLINE_DESTROY) {
        /* rank 1 arrives late; rank 0's hook destroys its communicator: the run
         * ends aborted, the destroy completes when it returns */
        ddp_coll_args a = {.kind = DDP_COLL_BARRIER, .dtype = DDP_UINT8};
        if (c->rank == 0) {
            hook_ctx h = {0, 0, comm};
            ddp_comm_retain(comm);
            T_STATUS(run_inline(comm, &a, &h, &taken), DDP_ERR_ABORTED);
            T_ASSERT(taken && h.calls >= 1);
            T_ASSERT(strcmp(ddp_comm_transport(comm, 1), "closed") == 0);
            ddp_comm_release(comm);
            c->comm = NULL;
        } else {
            usleep(600 * 1000);
            T_ASSERT(run_one(comm, &a, 10000) != DDP_OK);
        }
        return;
    }
    check_info(comm);
    ddp_comm_progress(comm, &sub0, &done0, &last);
    /* taken, correct, counted and recorded like a queued one */
    for (int k = 0; k < 3; k++) {
        for (int i = 0; i < 8; i++) x[i] = (float)(c->rank * 10 + i + k);
        ddp_coll_args a = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_SUM,
                           .count = 8, .buf = x};
        T_OK(run_inline(comm, &a, NULL, &taken));
        T_ASSERT(taken);
        for (int i = 0; i < 8; i++) T_ASSERT(x[i] == (float)(10 * n * (n - 1) / 2 + n * (i + k)));
        int32_t y[3] = {c->rank, c->rank, c->rank};
        ddp_coll_args b = {.kind = DDP_COLL_BROADCAST, .dtype = DDP_INT32, .root = k % n,
                           .count = 3, .buf = y};
        T_OK(run_inline(comm, &b, NULL, &taken));
        T_ASSERT(taken && y[0] == k % n && y[2] == k % n);
    }
    ddp_comm_progress(comm, &sub, &done, &last);
    T_ASSERT(sub == sub0 + 6 && done == done0 + 6 && last.kind == DDP_COLL_BROADCAST);
    size_t nf = ddp_comm_flight(comm, fr, DDP_FLIGHT_LEN);
    T_ASSERT(fr[nf - 1].status == DDP_OK && fr[nf - 1].ended_us >= fr[nf - 1].started_us);
    /* declined: too big, or a kind the inline path does not take; nothing recorded */
    float *big = calloc(65536 / 4 + 1, sizeof *big);   /* per rank (ranks are threads) */
    T_ASSERT(big != NULL);
    ddp_coll_args large = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_SUM,
                           .count = 65536 / 4 + 1, .buf = big};
    ddp_coll_args gath = {.kind = DDP_COLL_ALLGATHER, .dtype = DDP_FLOAT32, .count = 1,
                          .sendbuf = x, .recvbuf = x};
    T_OK(run_inline(comm, &large, NULL, &taken));
    T_ASSERT(!taken);
    T_OK(run_inline(comm, &gath, NULL, &taken));
    T_ASSERT(!taken);
    ddp_comm_progress(comm, &sub, &done, &last);
    T_ASSERT(sub == sub0 + 6);
    /* bad arguments: the error at once, the group still usable */
    ddp_coll_args bad = {.kind = DDP_COLL_BROADCAST, .dtype = DDP_FLOAT32, .root = n,
                         .count = 2, .buf = x};
    T_STATUS(run_inline(comm, &bad, NULL, &taken), DDP_ERR_INVALID);
    T_ASSERT(taken && strstr(ddp_last_error(), "root") != NULL);
    /* behind queued work: declined while it is queued or running, and in any
     * case done after it */
    for (int i = 0; i < 16385; i++) big[i] = 1.0f;
    ddp_work *w = NULL;
    T_OK(ddp_comm_submit(comm, &large, -1, &w));
    /* busy: declined before validation, which submit then does */
    ddp_status bst = run_inline(comm, &bad, NULL, &taken);
    if (!taken) {
        T_OK(bst);
        T_STATUS(run_one(comm, &bad, -1), DDP_ERR_INVALID);
    } else {                                 /* the big one had ended: validated inline */
        T_STATUS(bst, DDP_ERR_INVALID);
        T_ASSERT(strstr(ddp_last_error(), "root") != NULL);
    }
    for (int i = 0; i < 8; i++) x[i] = 1.0f;
    ddp_coll_args a = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_SUM,
                       .count = 8, .buf = x};
    ddp_status st = run_inline(comm, &a, NULL, &taken);
    if (!taken) st = run_one(comm, &a, -1);
    T_OK(st);
    T_ASSERT(ddp_work_done(w));
    T_OK(ddp_work_wait(w, ddp_wait_for(0, NULL)));
    ddp_work_release(w);
    T_ASSERT(big[16384] == (float)n && x[7] == (float)n);
    free(big);
    /* a late peer: the inline run parks, asks the hook, and succeeds */
    if (c->rank == n - 1) usleep(600 * 1000);
    hook_ctx h = {0, 0, NULL};
    int64_t t0 = ddp_now_ms();
    T_OK(run_inline(comm, &a, &h, &taken));
    T_ASSERT(taken && x[0] == (float)(n * n));
    if (c->rank == 0) T_ASSERT(h.calls >= 2 && ddp_now_ms() - t0 >= 400);
    /* the hook aborts: rank 0's run fails within moments and the group breaks;
     * the peers, calling something else a second later, fail fast too (closed
     * links, or a mismatch against what rank 0 had sent) */
    if (c->rank == 0) {
        hook_ctx ha = {0, 2, NULL};
        t0 = ddp_now_ms();
        T_STATUS(run_inline(comm, &a, &ha, &taken), DDP_ERR_ABORTED);
        T_ASSERT(ha.calls == 2 && ddp_now_ms() - t0 < 2000);
        T_STATUS(run_inline(comm, &a, NULL, &taken), DDP_ERR_ABORTED);
        T_ASSERT(taken && strstr(ddp_last_error(), "broken") != NULL);
    } else {
        ddp_coll_args bar = {.kind = DDP_COLL_BARRIER, .dtype = DDP_UINT8};
        usleep(1000 * 1000);
        t0 = ddp_now_ms();
        T_ASSERT(run_one(comm, &bar, 15000) != DDP_OK);
        T_ASSERT(ddp_now_ms() - t0 < 5000);
    }
}

static void *rank_main(void *p) {
    rank_ctx *c = p;
    ddp_store *store = NULL;
    c->create_status = make_comm(c, &store);
    if (c->create_status != DDP_OK) {
        ddp_copy_error(c->msg, sizeof c->msg);
        ddp_store_close(store);
        return NULL;
    }
    ddp_store_close(store);  /* the communicator needs the store only to connect */
    ddp_comm *comm = c->comm;
    T_ASSERT(ddp_comm_rank(comm) == c->rank && ddp_comm_size(comm) == c->size);
    float x[1000];
    if (c->scenario == SC_INLINE || c->scenario == SC_INLINE_DESTROY) {
        inline_scenario(c);
    } else if (c->scenario == SC_SUM || c->scenario == SC_INVALID) {
        if (c->scenario == SC_INVALID) {
            ddp_coll_args bad = {.kind = DDP_COLL_BROADCAST, .dtype = DDP_FLOAT32,
                                 .root = c->size, .count = 4, .buf = x};
            ddp_work *w = NULL;
            T_STATUS(ddp_comm_submit(comm, &bad, -1, &w), DDP_ERR_INVALID);
            T_ASSERT(strstr(ddp_last_error(), "root") != NULL);
        }
        /* several in flight at once, completed in submission order */
        float bufs[3][1000];
        ddp_work *ws[3];
        for (int k = 0; k < 3; k++) {
            for (int i = 0; i < 1000; i++) bufs[k][i] = (float)(c->rank + k + i);
            ddp_coll_args a = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32,
                               .op = DDP_SUM, .count = 1000, .buf = bufs[k]};
            T_OK(ddp_comm_submit(comm, &a, -1, &ws[k]));
        }
        for (int k = 0; k < 3; k++) {
            T_OK(ddp_work_wait(ws[k], ddp_wait_for(-1, NULL)));
            T_ASSERT(ddp_work_done(ws[k]));
            ddp_work_release(ws[k]);
            for (int i = 0; i < 1000; i++) {
                float want = 0;
                for (int r = 0; r < c->size; r++) want += (float)(r + k + i);
                T_ASSERT(bufs[k][i] == want);
            }
        }
    } else if (c->scenario == SC_STALL) {
        /* Flight record and progress after three all-reduces, then rank 0's
         * fourth times out (rank 1 never calls it): its worker announces the
         * timeout in the stall store before the group breaks. */
        ddp_coll_args a = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_SUM,
                           .count = 1000, .buf = x};
        memset(x, 0, sizeof x);
        for (int k = 0; k < 3; k++) T_OK(run_one(comm, &a, -1));
        uint64_t sub = 0, done = 0;
        ddp_flight_entry last, fr[DDP_FLIGHT_LEN];
        ddp_comm_progress(comm, &sub, &done, &last);
        T_ASSERT(sub == 3 && done == 3 && last.seq == 3 && last.bytes == 4000);
        T_ASSERT(ddp_comm_flight(comm, fr, DDP_FLIGHT_LEN) == 3);
        T_ASSERT(fr[2].kind == DDP_COLL_ALLREDUCE && fr[2].ended_us >= fr[2].started_us &&
                 fr[2].started_us >= fr[2].queued_us && fr[2].status == DDP_OK);
        if (c->rank == 0) {
            ddp_store *st = NULL;
            T_OK(ddp_store_connect("127.0.0.1", c->port, ddp_wait_for(5000, NULL), &st));
            char pre[80];
            snprintf(pre, sizeof pre, "%s/stall", c->prefix);
            ddp_comm_set_stall_store(comm, st, pre);
            T_STATUS(run_one(comm, &a, 300), DDP_ERR_TIMEOUT);
            char key[128];
            void *val = NULL;
            size_t vlen = 0;
            snprintf(key, sizeof key, "/%s/stuck/1", pre);
            T_OK(ddp_store_get(st, key, strlen(key), &val, &vlen, ddp_wait_for(5000, NULL)));
            char buf[1300];
            snprintf(buf, sizeof buf, "%.*s", (int)vlen, (char *)val);
            free(val);
            T_ASSERT(strncmp(buf, "rank=0;tag=", 11) == 0 && strstr(buf, ";seq=4;what=") != NULL);
            ddp_comm_progress(comm, &sub, &done, &last);
            T_ASSERT(sub == 4 && done == 4);   /* finished, with an error */
            T_ASSERT(ddp_comm_flight(comm, fr, DDP_FLIGHT_LEN) == 4 &&
                     fr[3].status == DDP_ERR_TIMEOUT);
            ddp_store_release(st);
        } else {
            usleep(800 * 1000);
        }
    } else if (c->scenario == SC_SUB) {
        /* Even and odd ranks form two subgroups; a nested one of {1, 3}'s
         * first member only would be size 1. Work on them interleaves with
         * the world's in one queue. */
        int evens[MAXR], odds[MAXR], ne = 0, no = 0;
        for (int r = 0; r < c->size; r++) {
            if (r % 2) odds[no++] = r; else evens[ne++] = r;
        }
        int mine = c->rank % 2;
        ddp_comm *sub = NULL;
        T_OK(ddp_comm_subgroup(comm, mine ? no : ne, mine ? odds : evens, 100 + mine, &sub));
        T_ASSERT(ddp_comm_rank(sub) == c->rank / 2);
        T_ASSERT(ddp_comm_world_rank(sub, ddp_comm_rank(sub)) == c->rank);
        ddp_comm *bad = NULL;
        T_STATUS(ddp_comm_subgroup(comm, mine ? ne : no, mine ? evens : odds, 7, &bad),
                 DDP_ERR_INVALID);   /* not a member */
        for (int k = 0; k < 3; k++) {
            double v[300], wv[300];
            for (int i = 0; i < 300; i++) v[i] = wv[i] = c->rank * 1000.0 + i + k;
            ddp_coll_args a = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT64, .op = DDP_SUM,
                               .count = 300, .buf = v};
            ddp_coll_args b = a;
            b.buf = wv;
            ddp_work *w1, *w2;
            T_OK(ddp_comm_submit(sub, &a, -1, &w1));
            T_OK(ddp_comm_submit(comm, &b, -1, &w2));
            T_OK(ddp_work_wait(w1, ddp_wait_for(-1, NULL)));
            T_OK(ddp_work_wait(w2, ddp_wait_for(-1, NULL)));
            ddp_work_release(w1);
            ddp_work_release(w2);
            for (int i = 0; i < 300; i++) {
                double ws = 0, ss = 0;
                for (int r = 0; r < c->size; r++) {
                    ws += r * 1000.0 + i + k;
                    if (r % 2 == mine) ss += r * 1000.0 + i + k;
                }
                T_ASSERT(v[i] == ss && wv[i] == ws);
            }
        }
        /* broadcast from group rank 0 of the subgroup (world rank 0 or 1) */
        int32_t y[5] = {c->rank, c->rank, c->rank, c->rank, c->rank};
        ddp_coll_args bc = {.kind = DDP_COLL_BROADCAST, .dtype = DDP_INT32, .root = 0,
                            .count = 5, .buf = y};
        T_OK(run_one(sub, &bc, -1));
        T_ASSERT(y[4] == mine);
        /* the subgroup outlives the destroyed parent: its calls fail, no crash */
        ddp_comm_retain(comm);
        ddp_comm_destroy(comm);
        c->comm = NULL;
        ddp_work *w = NULL;
        T_ASSERT(ddp_comm_submit(sub, &bc, -1, &w) != DDP_OK);
        ddp_comm_abort(sub, "after destroy");   /* harmless */
        ddp_comm_destroy(sub);
        ddp_comm_release(comm);
    } else if (c->scenario == SC_LEAVE) {
        ddp_coll_args a = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_SUM,
                           .count = 1000, .buf = x};
        memset(x, 0, sizeof x);
        T_OK(run_one(comm, &a, -1));
        if (c->rank == c->size - 1) {
            ddp_comm_destroy(comm);   /* leaves without a word */
            c->comm = NULL;
            return NULL;
        }
        int64_t t0 = ddp_now_ms();
        ddp_status st = run_one(comm, &a, 15000);
        T_ASSERT(st == DDP_ERR_CLOSED || st == DDP_ERR_ABORTED);
        T_ASSERT(ddp_now_ms() - t0 < 5000);   /* not the 15 s timeout */
        /* broken now: later work fails at once with the original cause */
        T_ASSERT(run_one(comm, &a, -1) != DDP_OK);
        T_ASSERT(strstr(ddp_last_error(), "broken") != NULL);
    } else if (c->scenario == SC_ABORT) {
        ddp_coll_args a = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_SUM,
                           .count = 1000, .buf = x};
        if (c->rank == 0) {
            usleep(200 * 1000);
            ddp_comm_abort(comm, "test abort");
            T_ASSERT(run_one(comm, &a, -1) == DDP_ERR_ABORTED);
            T_ASSERT(strstr(ddp_last_error(), "test abort") != NULL);
        } else {
            int64_t t0 = ddp_now_ms();
            T_ASSERT(run_one(comm, &a, 15000) != DDP_OK);  /* rank 0 never joins */
            T_ASSERT(ddp_now_ms() - t0 < 5000);
        }
    }
    return NULL;
}

static void run_world(int size, int scenario, int port, const char *prefix,
                      rank_ctx *ctx) {
    pthread_t th[MAXR];
    for (int r = 0; r < size; r++) {
        memset(&ctx[r], 0, sizeof ctx[r]);
        ctx[r].rank = r;
        ctx[r].size = size;
        ctx[r].port = port;
        ctx[r].prefix = prefix;
        ctx[r].scenario = scenario;
        ctx[r].version = (scenario == SC_VERSION && r == 1) ? "9.9.9" : "1.0.0";
        T_ASSERT(pthread_create(&th[r], NULL, rank_main, &ctx[r]) == 0);
    }
    for (int r = 0; r < size; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < size; r++) ddp_comm_destroy(ctx[r].comm);
}

/* A peer that published a line claiming this wire version but says another in
 * its hello (an older pyddp binary under a newer one's metadata, say): rank 0
 * must turn the connection away without a reply, and its first collective
 * with that peer fails (the impostor serves nothing), never links up. */
typedef struct impostor_ctx {
    int port;
    const char *prefix;
} impostor_ctx;

static void *impostor_main(void *p) {
    impostor_ctx *ic = p;
    ddp_store *st = NULL;
    T_OK(ddp_store_connect("127.0.0.1", ic->port, ddp_wait_for(5000, NULL), &st));
    char key[128], line[256];
    snprintf(key, sizeof key, "%s/rank/1", ic->prefix);
    snprintf(line, sizeof line, "ver=1.0.0;wire=%d;addr=127.0.0.1;port=1;host=elsewhere",
             DDP_WIRE_VERSION);
    T_OK(ddp_store_set(st, key, strlen(key), line, strlen(line), ddp_wait_for(5000, NULL)));
    void *val = NULL;
    size_t vlen = 0;
    snprintf(key, sizeof key, "%s/rank/0", ic->prefix);
    T_OK(ddp_store_get(st, key, strlen(key), &val, &vlen, ddp_wait_for(5000, NULL)));
    char buf[512];
    snprintf(buf, sizeof buf, "%.*s", (int)vlen, (char *)val);
    free(val);
    const char *pp = strstr(buf, "port=");
    T_ASSERT(pp != NULL);
    int fd = -1;
    T_OK(ddp_sock_connect("127.0.0.1", atoi(pp + 5), ddp_wait_for(5000, NULL), &fd));
    unsigned char h[24];
    ddp_le_put32(h, 0x44445048u);
    ddp_le_put32(h + 4, DDP_WIRE_VERSION - 1);
    ddp_le_put64(h + 8, ddp_comm_hash(ic->prefix));
    ddp_le_put32(h + 16, 1);
    ddp_le_put32(h + 20, 2);
    T_OK(ddp_sock_send_all(fd, h, sizeof h, ddp_wait_for(5000, NULL), "rank 0"));
    unsigned char reply[8];   /* closed, with no reply */
    T_STATUS(ddp_sock_recv_all(fd, reply, sizeof reply, ddp_wait_for(5000, NULL), "rank 0"),
             DDP_ERR_CLOSED);
    close(fd);
    ddp_store_release(st);
    return NULL;
}

static void run_impostor(int port, const char *prefix) {
    impostor_ctx ic = {port, prefix};
    pthread_t t;
    T_ASSERT(pthread_create(&t, NULL, impostor_main, &ic) == 0);
    rank_ctx c;
    memset(&c, 0, sizeof c);
    c.size = 2;
    c.port = port;
    c.prefix = prefix;
    c.version = "1.0.0";
    ddp_store *st = NULL;
    T_OK(make_comm(&c, &st));   /* links are made on first use: none yet */
    pthread_join(t, NULL);      /* its hello has been sent and turned away */
    double x = 1;
    ddp_coll_args a = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT64, .op = DDP_SUM,
                       .count = 1, .buf = &x};
    ddp_work *w = NULL;
    T_OK(ddp_comm_submit(c.comm, &a, 1500, &w));
    ddp_status s = ddp_work_wait(w, ddp_wait_for(20000, NULL));
    T_ASSERT(s == DDP_ERR_CLOSED || s == DDP_ERR_CONNECT || s == DDP_ERR_TIMEOUT);
    T_ASSERT(strstr(ddp_work_error(w), "rank 1") != NULL);
    ddp_work_release(w);
    ddp_comm_destroy(c.comm);
    ddp_store_release(st);
}

/* Rank 0's member table as every rank reads it (text: "ok <n> <hosts>", the
 * hosts, then "<addr> <port> <host index>" per rank): each rank's line as
 * dialing reads it; a malformed entry fails with the rank it is for. */
static void test_read_table(void) {
    ddp_comm c = {.rank = 1, .size = 3};
    char *lines[3] = {0};
    c.lines = lines;
    char good[] = "ok 3 2\nhnode-a\nh\n10.0.0.1 29500 0\n::1 7 1\nbox.example 65535 0";
    T_OK(ddp_comm_read_table(&c, good));
    T_ASSERT(strcmp(lines[0], "addr=10.0.0.1;port=29500;host=node-a") == 0);
    T_ASSERT(strcmp(lines[1], "addr=::1;port=7;host=") == 0);
    T_ASSERT(strcmp(lines[2], "addr=box.example;port=65535;host=node-a") == 0);
    char addr[64], port[16];
    ddp_comm_line_field(lines[2], "port", port, sizeof port);
    ddp_comm_line_field(lines[1], "addr", addr, sizeof addr);
    T_ASSERT(strcmp(port, "65535") == 0 && strcmp(addr, "::1") == 0);
    const char *bad[] = {
        "ok 3 1\nhh\na 1 0\nb 2 0",            /* rank 2's entry missing */
        "ok 3 1\nhh\na 1 0\nb 2 1\nc 3 0",    /* host index out of range */
        "ok 3 1\nhh\na 1 0\nb 65536 0\nc 3 0",/* port out of range */
        "ok 3 1\nhh\na 1 0\nb -2 0\nc 3 0",   /* negative port */
        "ok 3 1\nhh\na 1 0\nb 2 0 x\nc 3 0",  /* trailing field */
        "ok 3 1\nhh\na 1 0\nb 2\nc 3 0",      /* missing field */
        "ok 3 1\nhh\na 1 0\n 2 0\nc 3 0",     /* empty address */
    };
    const int want_rank[] = {2, 1, 1, 1, 1, 1, 1};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char tab[128], want[64];
        snprintf(tab, sizeof tab, "%s", bad[i]);
        for (int r = 0; r < 3; r++) free(lines[r]), lines[r] = NULL;
        T_STATUS(ddp_comm_read_table(&c, tab), DDP_ERR_PROTOCOL);
        snprintf(want, sizeof want, "rank %d's entry", want_rank[i]);
        T_ASSERT(strstr(ddp_last_error(), want) != NULL);
    }
    char err[64];
    snprintf(err, sizeof err, "error %d\nrank 0: something went wrong", (int)DDP_ERR_VERSION);
    T_STATUS(ddp_comm_read_table(&c, err), DDP_ERR_VERSION);
    T_ASSERT(strcmp(ddp_last_error(), "rank 0: something went wrong") == 0);
    for (int r = 0; r < 3; r++) free(lines[r]);
    printf("comm: the member table's entries, good and malformed\n");
}

int main(void) {
    ddp_store_server *srv;
    int port;
    T_OK(ddp_store_server_start("127.0.0.1", 0, &srv, &port));
    rank_ctx ctx[MAXR];
    char prefix[64];
    int gen = 0;
    test_pg_optional_ops();
    test_read_table();

    for (int n = 1; n <= MAXR; n++) {
        snprintf(prefix, sizeof prefix, "/test/%d", gen++);
        run_world(n, SC_SUM, port, prefix, ctx);
        for (int r = 0; r < n; r++) T_OK(ctx[r].create_status);
    }
    printf("comm: sums at world sizes 1-%d ok\n", MAXR);

    for (int n = 2; n <= MAXR; n++) {
        snprintf(prefix, sizeof prefix, "/test/%d", gen++);
        run_world(n, SC_SUB, port, prefix, ctx);
        for (int r = 0; r < n; r++) T_OK(ctx[r].create_status);
    }
    printf("comm: subgroups over the parent's links at world sizes 2-%d ok\n", MAXR);

    snprintf(prefix, sizeof prefix, "/test/%d", gen++);
    run_world(3, SC_VERSION, port, prefix, ctx);
    for (int r = 0; r < 3; r++) {
        T_ASSERT(ctx[r].create_status == DDP_ERR_VERSION);
        T_ASSERT(strstr(ctx[r].msg, "9.9.9") && strstr(ctx[r].msg, "rank 1"));
    }
    printf("comm: version mismatch detected on every rank\n");

    snprintf(prefix, sizeof prefix, "/test/%d", gen++);
    run_world(2, SC_STALL, port, prefix, ctx);
    printf("comm: flight record, progress, and a timeout announced in the store\n");

    snprintf(prefix, sizeof prefix, "/test/%d", gen++);
    run_impostor(port, prefix);
    printf("comm: a hello of another wire version is refused\n");

    snprintf(prefix, sizeof prefix, "/test/%d", gen++);
    run_world(3, SC_LEAVE, port, prefix, ctx);
    printf("comm: a leaving rank makes the others fail fast\n");

    snprintf(prefix, sizeof prefix, "/test/%d", gen++);
    run_world(2, SC_ABORT, port, prefix, ctx);
    printf("comm: abort breaks the group on both sides\n");

    snprintf(prefix, sizeof prefix, "/test/%d", gen++);
    run_world(2, SC_INVALID, port, prefix, ctx);
    printf("comm: invalid arguments rejected, group still usable\n");

    for (int n = 2; n <= 3; n++) {
        snprintf(prefix, sizeof prefix, "/test/%d", gen++);
        run_world(n, SC_INLINE, port, prefix, ctx);
    }
    snprintf(prefix, sizeof prefix, "/test/%d", gen++);
    run_world(2, SC_INLINE_DESTROY, port, prefix, ctx);
    printf("comm: inline runs (results, declines, order, a late peer, the check hook, "
           "destroy from the hook)\n");

    ddp_store_server_stop(srv);
    printf("comm: all ok\n");
    return 0;
}
