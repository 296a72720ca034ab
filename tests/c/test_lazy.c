/* test_lazy.c - links made on first use, and the O(log size) latency path of
 * groups larger than DDP_COLL_MESH_MAX, on real communicators (ranks as
 * threads, one store server, loopback TCP and shared memory):
 *   - no link exists after creation; all-reduces alone make at most
 *     ceil(log2 size) + 1 per rank;
 *   - all-reduce (float64 SUM, int32 AVG, float16 SUM, float32 MAX), broadcast,
 *     reduce, barrier, a small all-gather and all_to_all at several sizes,
 *     powers of two and not, every result checked against arithmetic and
 *     bit-identical on every rank;
 *   - all_to_all links every pair, also with empty host identities (no
 *     shared memory, and the member table keeps them), one accepted dial each;
 *   - a batch of sends and receives between every pair makes both ends dial
 *     at once: the higher rank's connection wins, both ends agree;
 *   - a pair that needs its link at the same step: the lower rank waits for
 *     the higher one's dial and dials nothing (ddp_group_need_mutual), and a
 *     higher peer that is gone is still named at once;
 *   - hosts of 4 ranks: same-host links move to shared memory, a large
 *     all-reduce takes the hierarchical path over links made on first use;
 *   - a broadcast with another root on one rank fails every rank (a
 *     mismatch where it is seen), within moments, never a hang;
 *   - a rank whose group is gone is reported by name at first use, at once.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ddp_comm.h"
#include "ddp_dtype.h"
#include "testutil.h"

#define MAXN 24

typedef struct world {
    int n, port, hosts_of;
    char prefix[64];
    ddp_comm *comm[MAXN];
    pthread_barrier_t bar;
    double got[MAXN][8];   /* per-rank results compared across ranks */
} world;

typedef struct rank_arg {
    world *w;
    int rank;
    void (*body)(world *w, int rank);
} rank_arg;

static ddp_status run(ddp_comm *c, ddp_coll_args a, int64_t timeout_ms, char *msg, size_t len) {
    ddp_work *wk = NULL;
    ddp_status st = ddp_comm_submit(c, &a, timeout_ms, &wk);
    if (st != DDP_OK) {
        snprintf(msg, len, "%s", ddp_last_error());
        return st;
    }
    st = ddp_work_wait(wk, ddp_wait_for(60000, NULL));
    snprintf(msg, len, "%s", st == DDP_OK ? "" : ddp_work_error(wk));
    ddp_work_release(wk);
    return st;
}

static void ok(ddp_comm *c, ddp_coll_args a) {
    char msg[1400];
    ddp_status st = run(c, a, 20000, msg, sizeof msg);
    if (st != DDP_OK) {
        fprintf(stderr, "collective failed: %s: %s\n", ddp_status_name(st), msg);
        exit(1);
    }
}

static void *rank_main(void *p) {
    rank_arg *ra = p;
    world *w = ra->w;
    ddp_store *st = NULL;
    T_OK(ddp_store_connect("127.0.0.1", w->port, ddp_wait_for(10000, NULL), &st));
    char host[32];
    snprintf(host, sizeof host, "node-%d", w->hosts_of ? ra->rank / w->hosts_of : ra->rank);
    if (w->hosts_of < 0) host[0] = '\0';   /* no host identity at all */
    ddp_comm_config cfg = {.rank = ra->rank, .size = w->n, .prefix = w->prefix,
                           .advertise_host = "127.0.0.1", .bind_host = "127.0.0.1",
                           .timeout_ms = 20000, .version = "1.0.0", .host_id = host};
    T_OK(ddp_comm_create(&cfg, st, &w->comm[ra->rank]));
    ddp_store_release(st);
    pthread_barrier_wait(&w->bar);
    ra->body(w, ra->rank);
    pthread_barrier_wait(&w->bar);
    ddp_comm_destroy(w->comm[ra->rank]);
    return NULL;
}

static void run_world(int n, int port, int hosts_of, const char *name,
                      void (*body)(world *, int)) {
    static int serial;
    world *w = calloc(1, sizeof *w);
    rank_arg ra[MAXN];
    pthread_t th[MAXN];
    w->n = n;
    w->port = port;
    w->hosts_of = hosts_of;
    snprintf(w->prefix, sizeof w->prefix, "/lazy/%d", serial++);
    pthread_barrier_init(&w->bar, NULL, (unsigned)n);
    for (int r = 0; r < n; r++) {
        ra[r] = (rank_arg){w, r, body};
        T_ASSERT(pthread_create(&th[r], NULL, rank_main, &ra[r]) == 0);
    }
    for (int r = 0; r < n; r++) pthread_join(th[r], NULL);
    pthread_barrier_destroy(&w->bar);
    free(w);
    printf("lazy: %s at %d ranks ok\n", name, n);
    fflush(stdout);
}

static int ceil_log2(int n) {
    int k = 0;
    while ((1 << k) < n) k++;
    return k;
}

/* Links on first use; the small collectives' results. */
static void collectives(world *w, int me) {
    ddp_comm *c = w->comm[me];
    const int n = w->n;
    T_ASSERT(ddp_comm_links_made(c) == 0);
    pthread_barrier_wait(&w->bar);
    double x[5];
    for (int i = 0; i < 5; i++) x[i] = me * 10.0 + i;
    ok(c, (ddp_coll_args){.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT64, .op = DDP_SUM,
                          .count = 5, .buf = x});
    for (int i = 0; i < 5; i++) T_ASSERT(x[i] == 10.0 * n * (n - 1) / 2 + (double)n * i);
    int32_t v[3] = {me, -me, 7 * me + 1};
    ok(c, (ddp_coll_args){.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_INT32, .op = DDP_AVG,
                          .count = 3, .buf = v});
    /* floor of the exact mean */
    T_ASSERT(v[0] == (int32_t)floor((n - 1) / 2.0));
    T_ASSERT(v[1] == (int32_t)floor(-(n - 1) / 2.0));
    T_ASSERT(v[2] == (int32_t)floor((7.0 * n * (n - 1) / 2 + n) / n));
    uint16_t h[2] = {ddp_float_to_half((float)me), ddp_float_to_half(0.5f)};
    ok(c, (ddp_coll_args){.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT16, .op = DDP_SUM,
                          .count = 2, .buf = h});
    T_ASSERT(ddp_half_to_float(h[0]) == (float)(n * (n - 1) / 2));
    T_ASSERT(ddp_half_to_float(h[1]) == 0.5f * (float)n);
    float f[2] = {(float)((me * 7) % n) + 0.25f, -(float)me};
    ok(c, (ddp_coll_args){.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_MAX,
                          .count = 2, .buf = f});
    T_ASSERT(f[0] == (float)(n - 1) + 0.25f && f[1] == 0.0f);
    /* Every all-reduce so far talked to the doubling partners only. */
    T_ASSERT(ddp_comm_links_made(c) <= ceil_log2(n) + 1);
    /* A third of the mean, float64: bit-identical on every rank. */
    double m = (me + 1) / 3.0;
    ok(c, (ddp_coll_args){.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT64, .op = DDP_AVG,
                          .count = 1, .buf = &m});
    w->got[me][0] = m;
    double b[7];
    for (int i = 0; i < 7; i++) b[i] = me == 3 % n ? 100.0 + i : -1;
    ok(c, (ddp_coll_args){.kind = DDP_COLL_BROADCAST, .dtype = DDP_FLOAT64, .count = 7,
                          .buf = b, .root = 3 % n});
    for (int i = 0; i < 7; i++) T_ASSERT(b[i] == 100.0 + i);
    int64_t s[4] = {me, 1, 2 * me, -me};
    ok(c, (ddp_coll_args){.kind = DDP_COLL_REDUCE, .dtype = DDP_INT64, .op = DDP_SUM,
                          .count = 4, .buf = s, .root = 5 % n});
    if (me == 5 % n) {
        T_ASSERT(s[0] == n * (n - 1) / 2 && s[1] == n && s[2] == n * (n - 1));
        T_ASSERT(s[3] == -(int64_t)(n * (n - 1) / 2));
    } else {
        T_ASSERT(s[0] == me && s[1] == 1 && s[2] == 2 * me);   /* unchanged off the root */
    }
    ok(c, (ddp_coll_args){.kind = DDP_COLL_BARRIER});
    int32_t mine[2] = {me, me * me}, all[2 * MAXN];
    ok(c, (ddp_coll_args){.kind = DDP_COLL_ALLGATHER, .dtype = DDP_INT32, .count = 2,
                          .sendbuf = mine, .recvbuf = all});
    for (int r = 0; r < n; r++) T_ASSERT(all[2 * r] == r && all[2 * r + 1] == r * r);
    T_ASSERT(ddp_comm_links_made(c) <= 3 * ceil_log2(n) + 2 && ddp_comm_links_made(c) < n - 1);
    pthread_barrier_wait(&w->bar);
    for (int r = 0; r < n; r++) T_ASSERT(memcmp(&w->got[r][0], &w->got[0][0], 8) == 0);
}

/* Every pair of the world linked: each link came from exactly one dial that
 * was not refused (after a barrier, over every rank's counts); the refused
 * ones, summed over the world. */
static int one_dial_per_pair(world *w, int me) {
    int refused, dials = ddp_comm_dials(w->comm[me], &refused);
    w->got[me][6] = dials;
    w->got[me][7] = refused;
    pthread_barrier_wait(&w->bar);
    int kept = 0, sum = 0;
    for (int r = 0; r < w->n; r++) {
        kept += (int)(w->got[r][6] - w->got[r][7]);
        sum += (int)w->got[r][7];
    }
    T_ASSERT(kept == w->n * (w->n - 1) / 2);
    return sum;
}

/* all_to_all: every pair needs its link at once, both ways. */
static void everyone(world *w, int me) {
    ddp_comm *c = w->comm[me];
    const int n = w->n;
    int32_t sb[MAXN], rb[MAXN];
    uint64_t cnt[MAXN], disp[MAXN];
    for (int p = 0; p < n; p++) {
        sb[p] = me * 100 + p;
        cnt[p] = 1;
        disp[p] = (uint64_t)p;
    }
    ok(c, (ddp_coll_args){.kind = DDP_COLL_ALLTOALL, .dtype = DDP_INT32, .sendbuf = sb,
                          .recvbuf = rb, .scounts = cnt, .sdispls = disp, .rcounts = cnt,
                          .rdispls = disp});
    for (int p = 0; p < n; p++) T_ASSERT(rb[p] == p * 100 + me);
    T_ASSERT(ddp_comm_links_made(c) == n - 1);
    for (int p = 0; p < n; p++)
        if (p != me) T_ASSERT(strcmp(ddp_comm_transport(c, p), "tcp") == 0);
    one_dial_per_pair(w, me);
}

/* A batch of one send and one receive with every peer: each rank dials its
 * peers one by one as it reaches them, so pairs cross (both ends dial); the
 * higher rank's connection is the one both keep. */
static void crossing(world *w, int me) {
    ddp_comm *c = w->comm[me];
    const int n = w->n;
    ddp_p2p_op ops[2 * MAXN];
    int32_t out[MAXN], in[MAXN];
    int k = 0;
    for (int p = 0; p < n; p++) {
        if (p == me) continue;
        out[p] = me * 1000 + p;
        in[p] = -1;
        ops[k++] = (ddp_p2p_op){.peer = p, .is_send = 1, .dtype = DDP_INT32, .count = 1,
                                .buf = &out[p]};
        ops[k++] = (ddp_p2p_op){.peer = p, .is_send = 0, .dtype = DDP_INT32, .count = 1,
                                .buf = &in[p]};
    }
    ok(c, (ddp_coll_args){.kind = DDP_COLL_P2P_BATCH, .nops = k, .ops = ops});
    for (int p = 0; p < n; p++)
        if (p != me) T_ASSERT(in[p] == p * 1000 + me);
    T_ASSERT(ddp_comm_links_made(c) == n - 1);
    int refused = one_dial_per_pair(w, me);
    if (me == 0) printf("lazy: batch: %d of %d pairs' dials refused\n", refused, n * (n - 1) / 2);
}

/* Rank 1 reaches a 2-rank all-reduce 30 ms after rank 0: rank 0 waits for
 * its dial (well within the grace) instead of dialing too. */
static void late(world *w, int me) {
    ddp_comm *c = w->comm[me];
    if (me == 1) nanosleep(&(struct timespec){0, 30 * 1000000L}, NULL);
    double x = me + 1;
    ok(c, (ddp_coll_args){.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT64, .op = DDP_SUM,
                          .count = 1, .buf = &x});
    T_ASSERT(x == 3);
    int refused, dials = ddp_comm_dials(c, &refused);
    T_ASSERT(dials == (me == 1 ? 1 : 0) && refused == 0);
}

/* Hosts of 4: shared memory on the same host, the hierarchical path. */
static void hosts(world *w, int me) {
    ddp_comm *c = w->comm[me];
    const int n = w->n;
    const size_t cnt = (size_t)1 << 17;   /* 512 KiB of float32 */
    float *x = malloc(cnt * sizeof *x);
    T_ASSERT(x != NULL);
    for (size_t i = 0; i < cnt; i++) x[i] = (float)(me + (int)(i % 7));
    ok(c, (ddp_coll_args){.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_SUM,
                          .count = cnt, .buf = x});
    for (size_t i = 0; i < cnt; i++) T_ASSERT(x[i] == (float)(n * (n - 1) / 2 + n * (int)(i % 7)));
    free(x);
    const int near = me % 4 ? me - 1 : me + 1;   /* same host, a neighbour on either path */
    T_ASSERT(strcmp(ddp_comm_transport(c, near), "shm") == 0);
    T_ASSERT(ddp_comm_links_made(c) < n - 1);
}

/* Rank 6 broadcasts from root 1, the others from root 0. */
static void mismatch(world *w, int me) {
    ddp_comm *c = w->comm[me];
    double b[3] = {0};
    char msg[1400];
    int64_t t0 = ddp_now_ms();
    ddp_status st = run(c, (ddp_coll_args){.kind = DDP_COLL_BROADCAST, .dtype = DDP_FLOAT64,
                                           .count = 3, .buf = b, .root = me == 6 ? 1 : 0},
                        20000, msg, sizeof msg);
    T_ASSERT(st != DDP_OK);
    T_ASSERT(ddp_now_ms() - t0 < 10000);
    w->got[me][0] = st == DDP_ERR_MISMATCH;
    pthread_barrier_wait(&w->bar);
    int seen = 0;
    for (int r = 0; r < w->n; r++) seen += w->got[r][0] != 0;
    T_ASSERT(seen >= 1);
}

/* Rank 2 destroys its group first; rank 9 and rank 1 (which never talked to
 * it) learn at their first use, by name, at once: rank 1 after waiting out
 * the grace for the higher rank's dial. */
static void gone(world *w, int me) {
    ddp_comm *c = w->comm[me];
    if (me == 2) {
        ddp_comm_destroy(c);
        w->comm[me] = NULL;
    }
    pthread_barrier_wait(&w->bar);
    if (me != 9 && me != 1) return;
    double x = 1;
    char msg[1400];
    int64_t t0 = ddp_now_ms();
    ddp_status st = run(c, (ddp_coll_args){.kind = DDP_COLL_RECV, .dtype = DDP_FLOAT64,
                                           .count = 1, .buf = &x, .root = 2}, 20000, msg,
                        sizeof msg);
    T_ASSERT(st == DDP_ERR_CLOSED || st == DDP_ERR_CONNECT);
    T_ASSERT(strstr(msg, "rank 2") != NULL);
    T_ASSERT(ddp_now_ms() - t0 < 5000);
}

int main(void) {
    ddp_store_server *srv;
    int port;
    T_OK(ddp_store_server_start("127.0.0.1", 0, &srv, &port));
    const int sizes[] = {9, 12, 16, 23};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++)
        run_world(sizes[i], port, 0, "small collectives, links on first use", collectives);
    run_world(9, port, 0, "all_to_all (every pair needs its link at once)", everyone);
    run_world(9, port, 0, "a batch with every peer (pairs dial each other at once)", crossing);
    run_world(2, port, 0, "a late higher rank (the lower one does not dial)", late);
    run_world(9, port, -1, "empty host identities (the member table keeps them)", everyone);
    run_world(16, port, 4, "hosts of 4 (shared memory, hierarchical)", hosts);
    run_world(12, port, 0, "a mismatched broadcast root", mismatch);
    run_world(12, port, 0, "a rank that is gone, at first use", gone);
    ddp_store_server_stop(srv);
    printf("lazy: all ok\n");
    return 0;
}
