/* test_p2p_batch.c - batched sends and receives (DDP_COLL_P2P_BATCH): random
 * batches (several messages per pair, per-op dtypes, empty messages, sends
 * and receives interleaved differently on the two sides) against a
 * reference built from the senders' buffers, a ring of several MiB per hop
 * at 2..4 ranks, validation, disagreeing batches reported as
 * DDP_ERR_MISMATCH on both ranks of the pair, a batch against a plain recv,
 * a dying peer, the deadline and the abort flag. */
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "coll_harness.h"

#define SENTINEL 0xEE
#define MAXOPS 64

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static uint64_t rnd(void) { /* xorshift64: reproducible cases */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* Each rank's ops, and the reference pairing: op j of rank r is a receive
 * whose data must equal op src_op[r][j] of rank src_rank[r][j]. */
typedef struct batch {
    int nops[H_MAXR];
    ddp_p2p_op ops[H_MAXR][MAXOPS];
    int src_rank[H_MAXR][MAXOPS], src_op[H_MAXR][MAXOPS];
    int then_allreduce;
    ddp_status st[H_MAXR];
    char msg[H_MAXR][2048];
} batch;

static void *buf_new(ddp_dtype t, size_t count, int is_send) {
    size_t b = count * ddp_dtype_size(t);
    unsigned char *p = malloc(b + 1);
    T_ASSERT(p);
    for (size_t i = 0; i < b; i++) p[i] = is_send ? (unsigned char)rnd() : SENTINEL;
    return p;
}

static void batch_free(batch *b, int n) {
    for (int r = 0; r < n; r++)
        for (int j = 0; j < b->nops[r]; j++) free(b->ops[r][j].buf);
}

static void batch_rank(hworld *w, int r, void *arg) {
    batch *b = arg;
    ddp_coll_args a = {.kind = DDP_COLL_P2P_BATCH, .nops = b->nops[r], .ops = b->ops[r]};
    uint64_t seq = w->g[r].seq;
    b->st[r] = hcoll(w, r, &a);
    ddp_copy_error(b->msg[r], sizeof b->msg[r]);
    if (b->st[r] != DDP_OK || !b->then_allreduce) return;
    T_ASSERT(w->g[r].seq == seq); /* not a collective */
    int32_t one = 1; /* the streams must be in step afterwards */
    ddp_coll_args ar = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_INT32, .op = DDP_SUM,
                        .count = 1, .buf = &one};
    T_OK(hcoll(w, r, &ar));
    T_ASSERT(one == w->n);
}

/* Run b on n ranks; every rank must succeed and every receive hold its
 * sender's bytes. */
static void run_ok(batch *b, int n) {
    hworld w;
    hworld_init(&w, n, 1 << 16, 1 << 20);
    b->then_allreduce = 1;
    hrun(&w, batch_rank, b);
    for (int r = 0; r < n; r++) {
        if (b->st[r] != DDP_OK) {
            fprintf(stderr, "rank %d: %s: %s\n", r, ddp_status_name(b->st[r]), b->msg[r]);
            exit(1);
        }
        for (int j = 0; j < b->nops[r]; j++) {
            const ddp_p2p_op *o = &b->ops[r][j];
            if (o->is_send) continue;
            const ddp_p2p_op *s = &b->ops[b->src_rank[r][j]][b->src_op[r][j]];
            T_ASSERT(s->is_send && s->count == o->count && s->dtype == o->dtype);
            if (memcmp(o->buf, s->buf, o->count * ddp_dtype_size(o->dtype)) != 0) {
                fprintf(stderr, "%d ranks: rank %d op %d (%zu %s from rank %d) differs from "
                        "the data sent\n", n, r, j, o->count, ddp_dtype_name(o->dtype), o->peer);
                exit(1);
            }
        }
    }
    hworld_free(&w);
}

/* A random plan: for every ordered pair p -> q, 0..3 messages of random
 * dtype and size (some empty, a few large); each rank's batch interleaves
 * its queues (per peer, per direction) at random, keeping each queue's
 * order, which is all the matching depends on. */
static void random_batch(batch *b, int n) {
    typedef struct msg { ddp_dtype t; size_t count; } msg;
    msg plan[H_MAXR][H_MAXR][3];
    int nm[H_MAXR][H_MAXR];
    memset(b, 0, sizeof *b);
    for (int p = 0; p < n; p++) {
        for (int q = 0; q < n; q++) {
            nm[p][q] = p == q ? 0 : (int)(rnd() % 4);
            for (int k = 0; k < nm[p][q]; k++) {
                uint64_t x = rnd();
                size_t count = x % 5 == 0 ? 0 : x % 11 == 0 ? (size_t)(x % (1 << 18)) : x % 500;
                plan[p][q][k] = (msg){(ddp_dtype)(rnd() % DDP_DTYPE_COUNT), count};
            }
        }
    }
    int sent_at[H_MAXR][H_MAXR][3]; /* op index of p's k-th send to q */
    for (int r = 0; r < n; r++) {
        int next[2][H_MAXR] = {{0}}; /* [is_send][peer]: next message of that queue */
        for (;;) {
            int live[2 * H_MAXR], nl = 0;
            for (int q = 0; q < n; q++) {
                if (next[1][q] < nm[r][q]) live[nl++] = H_MAXR + q;
                if (next[0][q] < nm[q][r]) live[nl++] = q;
            }
            if (nl == 0) break;
            int pick = live[rnd() % (unsigned)nl], s = pick >= H_MAXR, q = pick % H_MAXR;
            int k = next[s][q]++, j = b->nops[r]++;
            msg m = s ? plan[r][q][k] : plan[q][r][k];
            b->ops[r][j] = (ddp_p2p_op){.peer = q, .is_send = s, .dtype = m.t, .count = m.count,
                                        .buf = buf_new(m.t, m.count, s)};
            if (s) sent_at[r][q][k] = j;
            else b->src_rank[r][j] = q, b->src_op[r][j] = k; /* resolved below */
        }
    }
    for (int r = 0; r < n; r++)
        for (int j = 0; j < b->nops[r]; j++)
            if (!b->ops[r][j].is_send)
                b->src_op[r][j] = sent_at[b->src_rank[r][j]][r][b->src_op[r][j]];
}

static void test_random(void) {
    int cases = 0;
    for (int n = 2; n <= H_MAXR; n++) {
        for (int rep = 0; rep < 12; rep++) {
            batch b;
            random_batch(&b, n);
            run_ok(&b, n);
            batch_free(&b, n);
            cases++;
        }
    }
    /* an empty batch is nothing to do */
    batch e = {.nops = {0}};
    run_ok(&e, 2);
    printf("random batches: %d ok\n", cases);
}

/* Everyone sends to the next rank and receives from the previous one in a
 * single batch, several MiB per hop (more than socket buffers hold; at two
 * ranks next and previous are the same peer, both ways on one link). */
static void ring(batch *b, int n, size_t bytes, int recv_first) {
    memset(b, 0, sizeof *b);
    for (int r = 0; r < n; r++) {
        int next = (r + 1) % n, prev = (r + n - 1) % n, s = recv_first ? 1 : 0;
        b->nops[r] = 2;
        b->ops[r][s] = (ddp_p2p_op){.peer = next, .is_send = 1, .dtype = DDP_UINT8,
                                    .count = bytes, .buf = buf_new(DDP_UINT8, bytes, 1)};
        b->ops[r][1 - s] = (ddp_p2p_op){.peer = prev, .is_send = 0, .dtype = DDP_UINT8,
                                        .count = bytes, .buf = buf_new(DDP_UINT8, bytes, 0)};
        b->src_rank[r][1 - s] = prev;
        b->src_op[r][1 - s] = s; /* the previous rank's send sits at the same index */
    }
}

static void test_ring(void) {
    for (int n = 2; n <= H_MAXR; n++) {
        for (int recv_first = 0; recv_first <= 1; recv_first++) {
            batch b;
            ring(&b, n, (6u << 20) + 12345, recv_first);
            run_ok(&b, n);
            batch_free(&b, n);
        }
    }
    printf("ring exchange: ok\n");
}

/* ---- validation ---------------------------------------------------------------- */

static void expect_batch_invalid(const ddp_group *g, const ddp_p2p_op *ops, int nops, ddp_status want,
                           const char *text) {
    ddp_coll_args a = {.kind = DDP_COLL_P2P_BATCH, .nops = nops, .ops = ops};
    T_STATUS(ddp_coll_validate(g, &a), want);
    if (!strstr(ddp_last_error(), text)) {
        fprintf(stderr, "message \"%s\" lacks \"%s\"\n", ddp_last_error(), text);
        exit(1);
    }
}

static void test_validate(void) {
    hworld w;
    hworld_init(&w, 3, 1 << 16, 1 << 20);
    const ddp_group *g = &w.g[1];
    float x[4];
    ddp_p2p_op ops[2] = {{.peer = 0, .is_send = 1, .dtype = DDP_FLOAT32, .count = 4, .buf = x},
                         {.peer = 2, .is_send = 0, .dtype = DDP_INT8, .count = 16, .buf = x}};
    ddp_coll_args a = {.kind = DDP_COLL_P2P_BATCH, .nops = 2, .ops = ops};
    T_OK(ddp_coll_validate(g, &a));
    a.nops = 0, a.ops = NULL;
    T_OK(ddp_coll_validate(g, &a));
    expect_batch_invalid(g, NULL, 1, DDP_ERR_INVALID, "ops is NULL but nops is 1");
    expect_batch_invalid(g, ops, -1, DDP_ERR_INVALID, "nops is -1");
    ops[1].peer = 1;
    expect_batch_invalid(g, ops, 2, DDP_ERR_INVALID, "op 1: rank 1 cannot receive from itself");
    ops[1].peer = 3;
    expect_batch_invalid(g, ops, 2, DDP_ERR_INVALID, "op 1: peer 3 is out of range for a group of 3");
    ops[1].peer = 2, ops[1].dtype = (ddp_dtype)42;
    expect_batch_invalid(g, ops, 2, DDP_ERR_TYPE, "op 1: ");
    ops[1].dtype = DDP_INT64, ops[1].count = SIZE_MAX / 4;
    expect_batch_invalid(g, ops, 2, DDP_ERR_INVALID, "op 1: count");
    ops[1].count = 3, ops[1].buf = NULL;
    expect_batch_invalid(g, ops, 2, DDP_ERR_INVALID, "op 1 (receive from rank 2): buf is NULL");
    ops[1].count = 0; /* nothing to touch: fine */
    expect_batch_invalid(g, ops, 2, DDP_OK, "");
    T_ASSERT(strcmp(ddp_coll_name(DDP_COLL_P2P_BATCH), "batch_isend_irecv") == 0);
    hworld_free(&w);
    printf("validation: ok\n");
}

/* ---- mismatches --------------------------------------------------------------- */

/* Rank 0 runs ops0, rank 1 runs ops1 (a batch), or `plain` if nops1 < 0. */
typedef struct pairmm {
    const ddp_p2p_op *ops[2];
    int nops[2];
    ddp_coll_args plain;
    ddp_status st[2];
    char msg[2][2048];
} pairmm;

static void pairmm_rank(hworld *w, int r, void *arg) {
    pairmm *m = arg;
    ddp_coll_args a = {.kind = DDP_COLL_P2P_BATCH, .nops = m->nops[r], .ops = m->ops[r]};
    if (m->nops[r] < 0) a = m->plain;
    m->st[r] = hcoll(w, r, &a);
    ddp_copy_error(m->msg[r], sizeof m->msg[r]);
}

static void expect_mismatch(pairmm *m, const char *text) {
    hworld w;
    hworld_init(&w, 2, 1 << 16, 1 << 20);
    hrun(&w, pairmm_rank, m);
    for (int r = 0; r < 2; r++) {
        if (m->st[r] != DDP_ERR_MISMATCH || !strstr(m->msg[r], text)) {
            fprintf(stderr, "rank %d: %s: \"%s\"; expected DDP_ERR_MISMATCH with \"%s\"\n", r,
                    ddp_status_name(m->st[r]), m->msg[r], text);
            exit(1);
        }
    }
    hworld_free(&w);
}

static void test_mismatch(void) {
    float a[8], b[8];
    ddp_p2p_op r0[2] = {{.peer = 1, .is_send = 0, .dtype = DDP_FLOAT32, .count = 2, .buf = a},
                        {.peer = 1, .is_send = 1, .dtype = DDP_FLOAT32, .count = 5, .buf = a}};
    ddp_p2p_op r1[2] = {{.peer = 0, .is_send = 0, .dtype = DDP_FLOAT32, .count = 6, .buf = b},
                        {.peer = 0, .is_send = 1, .dtype = DDP_FLOAT32, .count = 2, .buf = b}};
    pairmm m = {.ops = {r0, r1}, .nops = {2, 2}};
    expect_mismatch(&m, "batch_isend_irecv mismatch: rank 0's send #1 to rank 1 is 5 float32 "
                        "but rank 1's receive #1 from rank 0 is 6 float32");
    r1[0].count = 5, r1[1].dtype = DDP_INT32;
    expect_mismatch(&m, "rank 1's send #1 to rank 0 is 2 int32 but rank 0's receive #1 from "
                        "rank 1 is 2 float32");
    r1[1].dtype = DDP_FLOAT32, r1[1].is_send = 0; /* rank 1 now receives twice */
    expect_mismatch(&m, "rank 0 sends 1 messages to rank 1 but rank 1 receives 2 from rank 0");
    /* a batch against a plain recv on the peer */
    m.nops[1] = -1;
    m.plain = (ddp_coll_args){.kind = DDP_COLL_RECV, .dtype = DDP_FLOAT32, .count = 5, .root = 0,
                              .buf = b};
    m.nops[0] = 1, m.ops[0] = r0 + 1;
    expect_mismatch(&m, "rank 0 called batch_isend_irecv(1 sends to and 0 receives from rank 1) "
                        "but rank 1 called recv(count=5, float32, from rank 0)");
    printf("mismatch detection: ok\n");
}

/* ---- a dying peer, deadline and abort ------------------------------------------- */

static void test_dying_peer(void) {
    const int n = 3;
    hworld w;
    hworld_init(&w, n, 1 << 16, 1 << 20);
    /* rank 2's link to rank 0 (its ring successor) dies 100 KB into the payload */
    w.links[2][0] = hwrap_new(w.links[2][0], 32 + 2 * 16 + 100000, 0);
    w.g[2].links = w.links[2];
    batch b;
    ring(&b, n, 6u << 20, 0);
    int64_t t0 = ddp_now_ms();
    hrun(&w, batch_rank, &b);
    int64_t ms = ddp_now_ms() - t0;
    for (int r = 0; r < n; r++) {
        ddp_status want = r == 2 ? DDP_ERR_ABORTED : DDP_ERR_CLOSED;
        if (b.st[r] != want || !strstr(b.msg[r], "batch_isend_irecv(2 ops) on rank")) {
            fprintf(stderr, "rank %d: %s: %s\n", r, ddp_status_name(b.st[r]), b.msg[r]);
            exit(1);
        }
    }
    /* The others fail on whichever broken link they touch first (rank 2's,
     * or one a failed rank shut down): all "by the peer", some naming 2. */
    int named = 0;
    for (int r = 0; r < 2; r++) {
        T_ASSERT(strstr(b.msg[r], "by the peer"));
        named += strstr(b.msg[r], "rank 2 (socketpair)") != NULL;
    }
    T_ASSERT(named > 0);
    T_ASSERT(ms < H_DEADLINE_MS / 4);
    batch_free(&b, n);
    hworld_free(&w);
    printf("dying peer: ok (%lld ms)\n", (long long)ms);
}

typedef struct lonely {
    atomic_int abort, done;
    int use_abort;
    ddp_status st;
    int64_t ms;
    char msg[2048];
} lonely;

/* Rank 0 sends to rank 1, which never joins (it only sets the abort flag,
 * in the abort variant). */
static void lonely_rank(hworld *w, int r, void *arg) {
    lonely *l = arg;
    if (r == 1) {
        if (l->use_abort) {
            struct timespec ts = {0, 150 * 1000000L};
            nanosleep(&ts, NULL);
            atomic_store(&l->abort, 1);
        }
        while (!atomic_load(&l->done)) {
            struct timespec ts = {0, 5 * 1000000L};
            nanosleep(&ts, NULL);
        }
        return;
    }
    float x[4] = {0};
    ddp_p2p_op op = {.peer = 1, .is_send = 1, .dtype = DDP_FLOAT32, .count = 4, .buf = x};
    ddp_coll_args a = {.kind = DDP_COLL_P2P_BATCH, .nops = 1, .ops = &op};
    int64_t t0 = ddp_now_ms();
    ddp_wait wt = l->use_abort ? ddp_wait_for(H_DEADLINE_MS, &l->abort) : ddp_wait_for(300, NULL);
    l->st = hcoll_wait(w, r, &a, wt);
    l->ms = ddp_now_ms() - t0;
    ddp_copy_error(l->msg, sizeof l->msg);
    atomic_store(&l->done, 1);
}

static void test_timeout_and_abort(void) {
    for (int use_abort = 0; use_abort <= 1; use_abort++) {
        hworld w;
        lonely l = {.use_abort = use_abort};
        hworld_init(&w, 2, 1 << 16, 1 << 20);
        hrun(&w, lonely_rank, &l);
        T_STATUS(l.st, use_abort ? DDP_ERR_ABORTED : DDP_ERR_TIMEOUT);
        T_ASSERT(strstr(l.msg, use_abort ? "aborted while receiving from rank 1 (socketpair)"
                                         : "timed out after"));
        T_ASSERT(strstr(l.msg, "batch_isend_irecv(1 ops) on rank 0 of 2"));
        T_ASSERT(l.ms >= (use_abort ? 140 : 290) && l.ms < H_DEADLINE_MS / 4);
        hworld_free(&w);
    }
    printf("timeout and abort: ok\n");
}

int main(void) {
    test_validate();
    test_random();
    test_ring();
    test_mismatch();
    test_dying_peer();
    test_timeout_and_abort();
    printf("test_p2p_batch: ok\n");
    return 0;
}
