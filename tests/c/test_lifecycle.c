/* test_lifecycle.c - many short lives of a 3-rank communicator, the C side of
 * tests/test_exits.py: every round creates the communicators through a store
 * (loopback TCP, upgraded to shared memory in rounds where the ranks share a
 * host identity), runs a few collectives checked against arithmetic, and ends.
 *
 * Ranks as threads of this process:
 *   clean    collectives; rank 0's all-reduce submitted before the others
 *            join it is pending (ddp_comm_pending) until they do; destroy.
 *   pending  collectives, then async all-reduces every rank submits and
 *            destroys without waiting for: each work ends (done, any status).
 *   close    one rank destroys its communicator right after submitting a
 *            large all-reduce (its links close mid-collective).
 *   abort    one rank aborts while the others are in a large all-reduce.
 *   In close and abort the others' all-reduce must fail, within moments, then
 *   they destroy.
 * Ranks as forked processes (rank 0 hosts the store), each reaped by pid with
 * a deadline:
 *   exit     collectives, destroy, exit(0).
 *   live     collectives, async all-reduces submitted, exit(0) without waiting
 *            or destroying (the worker threads still running).
 *   die      one rank submits a large all-reduce and _exit(3)s or SIGKILLs
 *            itself; the others' all-reduce must fail within moments, then
 *            they destroy and exit(0).
 * Under ASan every forked rank's exit runs the leak check too. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ddp_comm.h"
#include "ddp_sock.h"
#include "testutil.h"

#define N 3                 /* ranks */
#define SMALL 1000          /* elements of the small all-reduce */
#define LARGE (1 << 19)     /* elements of the large one (2 MiB of float) */
#define FAIL_MS 5000        /* a survivor's error must come sooner (timeout: 20 s) */
#define ROUND_MS 60000      /* a forked round's deadline */

enum { SC_CLEAN, SC_PENDING, SC_CLOSE, SC_ABORT, SC_EXIT, SC_LIVE, SC_DIE };
static const char *const SC_NAME[] = {"clean", "pending", "close", "abort",
                                      "exit", "live", "die"};

typedef struct rank_ctx {
    int rank, round, scenario, port;
    int failing;            /* the rank that fails (close, abort, die) */
    char prefix[64];
    ddp_comm *comm;
} rank_ctx;

/* Kept where the leak check finds them: a forked rank that exits without
 * destroying leaves these alive on purpose. */
static ddp_comm *g_live_comm;
static ddp_work *g_live_work[2];
static ddp_store_server *g_live_srv;
static pthread_barrier_t g_bar;   /* the ranks of a thread round */

#ifdef __SANITIZE_THREAD__
/* ThreadSanitizer sleeps atexit_sleep_ms (1 s by default) in every process
 * that exits with other threads alive, to catch races with them; the live
 * rounds do that on purpose, in every rank. A tenth of it still gives such
 * races time to show, and keeps the test at a few seconds. TSAN_OPTIONS in
 * the environment override this. */
const char *__tsan_default_options(void);
const char *__tsan_default_options(void) { return "atexit_sleep_ms=100"; }
#endif

static void sleep_ms(int ms) { usleep((useconds_t)ms * 1000); }

/* Connect to the store and create this rank's communicator (collective).
 * Rounds with round % 4 == 3 give every rank its own host identity, so the
 * links stay on TCP; the others share one and move to shared memory. */
static void create(rank_ctx *c) {
    ddp_store *st = NULL;
    T_OK(ddp_store_connect("127.0.0.1", c->port, ddp_wait_for(10000, NULL), &st));
    char host[32];
    snprintf(host, sizeof host, "host-%d", c->round % 4 == 3 ? c->rank : 0);
    ddp_comm_config cfg = {.rank = c->rank, .size = N, .prefix = c->prefix,
                           .advertise_host = "127.0.0.1", .bind_host = "127.0.0.1",
                           .timeout_ms = 20000, .version = "1.0.0", .host_id = host};
    T_OK(ddp_comm_create(&cfg, st, &c->comm));
    ddp_store_close(st);
}

/* Submit a and wait for it; the work's status. */
static ddp_status run_one(ddp_comm *comm, ddp_coll_args *a, int64_t timeout_ms) {
    ddp_work *w = NULL;
    ddp_status st = ddp_comm_submit(comm, a, timeout_ms, &w);
    if (st != DDP_OK) return st;
    st = ddp_work_wait(w, ddp_wait_for(-1, NULL));
    ddp_work_release(w);
    return st;
}

static ddp_coll_args allreduce(float *x, size_t n) {
    return (ddp_coll_args){.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_SUM,
                           .count = n, .buf = x};
}

/* x[i] of rank r's all-reduce input; the sum over N ranks is
 * N(N-1)/2 + N (i % 100), exact in float. */
static float input(int r, size_t i) { return (float)(r + (int)(i % 100)); }

static void fill(float *x, size_t n, int r) {
    for (size_t i = 0; i < n; i++) x[i] = input(r, i);
}

static void check_sum(const float *x, size_t n) {
    for (size_t i = 0; i < n; i++) T_ASSERT(x[i] == (float)(N * (N - 1) / 2 + N * (int)(i % 100)));
}

/* The round's collectives, every result checked: a small all-reduce queued
 * and one run inline, a broadcast from rank round % N, an all-gather and a
 * barrier. */
static void collectives(rank_ctx *c) {
    float x[SMALL];
    fill(x, SMALL, c->rank);
    ddp_coll_args a = allreduce(x, SMALL);
    T_OK(run_one(c->comm, &a, -1));
    check_sum(x, SMALL);
    T_ASSERT(strcmp(ddp_comm_transport(c->comm, (c->rank + 1) % N),
                    c->round % 4 == 3 ? "tcp" : "shm") == 0);
    fill(x, 64, c->rank);
    a = allreduce(x, 64);
    int taken = 0;
    ddp_status st = ddp_comm_run_inline(c->comm, &a, -1, NULL, NULL, &taken);
    if (!taken) st = run_one(c->comm, &a, -1);
    T_OK(st);
    check_sum(x, 64);
    int root = c->round % N;
    int32_t b[7];
    for (int i = 0; i < 7; i++) b[i] = c->rank * 1000 + i;
    ddp_coll_args bc = {.kind = DDP_COLL_BROADCAST, .dtype = DDP_INT32, .root = root,
                        .count = 7, .buf = b};
    T_OK(run_one(c->comm, &bc, -1));
    for (int i = 0; i < 7; i++) T_ASSERT(b[i] == root * 1000 + i);
    int64_t mine[5], all[5 * N];
    for (int i = 0; i < 5; i++) mine[i] = c->rank * 100 + i;
    ddp_coll_args ag = {.kind = DDP_COLL_ALLGATHER, .dtype = DDP_INT64, .count = 5,
                        .sendbuf = mine, .recvbuf = all};
    T_OK(run_one(c->comm, &ag, -1));
    for (int r = 0; r < N; r++)
        for (int i = 0; i < 5; i++) T_ASSERT(all[r * 5 + i] == r * 100 + i);
    ddp_coll_args bar = {.kind = DDP_COLL_BARRIER, .dtype = DDP_UINT8};
    T_OK(run_one(c->comm, &bar, -1));
}

/* A survivor's large all-reduce while c->failing fails: it must end with an
 * error, within FAIL_MS (also when the failing rank's share had gone out:
 * then a second one cannot succeed). */
static void survive(rank_ctx *c, float *big) {
    fill(big, LARGE, c->rank);
    ddp_coll_args a = allreduce(big, LARGE);
    int64_t t0 = ddp_now_ms();
    ddp_status st = run_one(c->comm, &a, 20000);
    if (st == DDP_OK) st = run_one(c->comm, &a, 20000);
    if (st == DDP_OK || ddp_now_ms() - t0 >= FAIL_MS) {
        fprintf(stderr, "round %d (%s): rank %d got %s after %lld ms with rank %d failing\n",
                c->round, SC_NAME[c->scenario], c->rank, ddp_status_name(st),
                (long long)(ddp_now_ms() - t0), c->failing);
        exit(1);
    }
}

/* Submit two async all-reduces of LARGE / 2 (results not checked: a peer
 * may already have ended its communicator, which breaks this one, and then
 * the second submission fails at once; w[k] stays NULL then). */
static void submit_pair(rank_ctx *c, float *big, ddp_work **w) {
    for (int k = 0; k < 2; k++) {
        float *x = big + (size_t)k * (LARGE / 2);
        fill(x, LARGE / 2, c->rank);
        ddp_coll_args a = allreduce(x, LARGE / 2);
        ddp_status st = ddp_comm_submit(c->comm, &a, -1, &w[k]);
        T_ASSERT(st == DDP_OK || st == DDP_ERR_ABORTED);
    }
}

/* One rank's life in scenario c->scenario; as a thread (returns) or as a
 * forked process (the caller exits after it). */
static void rank_life(rank_ctx *c) {
    float *big = malloc(LARGE * sizeof *big);
    T_ASSERT(big != NULL);
    create(c);
    collectives(c);
    ddp_work *w[2] = {NULL, NULL};
    int failing = c->rank == c->failing;
    switch (c->scenario) {
    case SC_CLEAN: {
        /* rank 0's all-reduce waits for the others, which join after the barrier */
        fill(big, SMALL, c->rank);
        ddp_coll_args a = allreduce(big, SMALL);
        if (c->rank == 0) {
            T_OK(ddp_comm_submit(c->comm, &a, -1, &w[0]));
            T_ASSERT(ddp_comm_pending(c->comm) == 1);
        }
        pthread_barrier_wait(&g_bar);
        if (c->rank == 0) {
            T_OK(ddp_work_wait(w[0], ddp_wait_for(-1, NULL)));
            ddp_work_release(w[0]);
        } else {
            T_OK(run_one(c->comm, &a, -1));
        }
        check_sum(big, SMALL);
        T_ASSERT(ddp_comm_pending(c->comm) == 0);
        break;
    }
    case SC_EXIT:
        break;
    case SC_PENDING:
        submit_pair(c, big, w);
        T_ASSERT(ddp_comm_pending(c->comm) <= 2);
        ddp_comm_destroy(c->comm);            /* without waiting */
        c->comm = NULL;
        for (int k = 0; k < 2; k++) {
            T_ASSERT(w[k] == NULL || ddp_work_done(w[k]));   /* none outlives destroy */
            ddp_work_release(w[k]);
        }
        break;
    case SC_LIVE:
        submit_pair(c, big, g_live_work);
        g_live_comm = c->comm;                /* alive as the process exits */
        return;                               /* big too: the works use it */
    case SC_CLOSE:
    case SC_ABORT:
    case SC_DIE:
        if (!failing) {
            survive(c, big);
            break;
        }
        if (c->scenario == SC_ABORT) {
            sleep_ms(30);                     /* the others are waiting */
            ddp_comm_abort(c->comm, "rank gives up");
            break;
        }
        fill(big, LARGE, c->rank);            /* its share of the others' first */
        ddp_coll_args a = allreduce(big, LARGE);   /* all-reduce goes out... */
        T_OK(ddp_comm_submit(c->comm, &a, -1, &w[0]));
        if (c->scenario == SC_CLOSE) {        /* ...and its links close */
            ddp_comm_destroy(c->comm);
            c->comm = NULL;
            ddp_work_release(w[0]);
            break;
        }
        if (c->round % 2) raise(SIGKILL);
        _exit(3);
    }
    ddp_comm_destroy(c->comm);
    c->comm = NULL;
    free(big);
}

static void *rank_thread(void *p) {
    rank_life(p);
    return NULL;
}

static void init_ctx(rank_ctx *ctx, int round, int scenario, int port) {
    for (int r = 0; r < N; r++) {
        ctx[r] = (rank_ctx){.rank = r, .round = round, .scenario = scenario, .port = port,
                            .failing = round % N};
        snprintf(ctx[r].prefix, sizeof ctx[r].prefix, "/life/%d", round);
    }
}

/* One round with threads as ranks, through the store server at port. */
static void thread_round(int round, int scenario, int port) {
    rank_ctx ctx[N];
    pthread_t th[N];
    init_ctx(ctx, round, scenario, port);
    T_ASSERT(pthread_barrier_init(&g_bar, NULL, N) == 0);
    for (int r = 0; r < N; r++) T_ASSERT(pthread_create(&th[r], NULL, rank_thread, &ctx[r]) == 0);
    for (int r = 0; r < N; r++) T_ASSERT(pthread_join(th[r], NULL) == 0);
    T_ASSERT(pthread_barrier_destroy(&g_bar) == 0);
}

/* One round with forked processes as ranks: rank 0 starts the store server
 * and sends its port through a pipe before the others are forked (so this
 * process forks while it has no thread but its own). Every rank is reaped by
 * pid; one still alive at the deadline is killed and fails the test. */
static void fork_round(int round, int scenario) {
    rank_ctx ctx[N];
    pid_t pid[N];
    int fds[2], port = 0;
    T_ASSERT(pipe(fds) == 0);
    init_ctx(ctx, round, scenario, 0);
    for (int r = 0; r < N; r++) {
        fflush(NULL);
        pid[r] = fork();
        T_ASSERT(pid[r] >= 0);
        if (pid[r] == 0) {
            close(fds[0]);
            if (r == 0) {
                T_OK(ddp_store_server_start("127.0.0.1", 0, &g_live_srv, &port));
                T_ASSERT(write(fds[1], &port, sizeof port) == (ssize_t)sizeof port);
            }
            close(fds[1]);
            ctx[r].port = port;
            rank_life(&ctx[r]);
            if (scenario != SC_LIVE) {
                ddp_store_server_stop(g_live_srv);
                g_live_srv = NULL;
            }
            exit(0);
        }
        if (r == 0) T_ASSERT(read(fds[0], &port, sizeof port) == (ssize_t)sizeof port);
    }
    close(fds[0]);
    close(fds[1]);
    int64_t deadline = ddp_now_ms() + ROUND_MS;
    for (int r = 0; r < N; r++) {
        int ws = 0;
        pid_t got;
        while ((got = waitpid(pid[r], &ws, WNOHANG)) == 0 && ddp_now_ms() < deadline) sleep_ms(2);
        if (got == 0) {
            for (int q = 0; q < N; q++) kill(pid[q], SIGKILL);
            for (int q = 0; q < N; q++) waitpid(pid[q], NULL, 0);
            fprintf(stderr, "round %d (%s): rank %d still alive after %d ms\n", round,
                    SC_NAME[scenario], r, ROUND_MS);
            exit(1);
        }
        T_ASSERT(got == pid[r]);
        int dies = scenario == SC_DIE && r == ctx[r].failing;
        int ok = dies ? (round % 2 ? WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL
                                   : WIFEXITED(ws) && WEXITSTATUS(ws) == 3)
                      : WIFEXITED(ws) && WEXITSTATUS(ws) == 0;
        if (!ok) {
            fprintf(stderr, "round %d (%s): rank %d ended with wait status %#x\n", round,
                    SC_NAME[scenario], r, ws);
            exit(1);
        }
    }
}

int main(void) {
    int round = 0;
    int64_t t0 = ddp_now_ms();
    /* Forked rounds first, while this process has no thread to fork with. */
    for (int k = 0; k < 6; k++)
        for (int sc = SC_EXIT; sc <= SC_DIE; sc++) fork_round(round++, sc);
    printf("lifecycle: %d rounds of forked ranks (exit, live, die) ok in %lld ms\n", round,
           (long long)(ddp_now_ms() - t0));
    ddp_store_server *srv;
    int port;
    T_OK(ddp_store_server_start("127.0.0.1", 0, &srv, &port));
    int first = round;
    t0 = ddp_now_ms();
    for (int k = 0; k < 8; k++)
        for (int sc = SC_CLEAN; sc <= SC_ABORT; sc++) thread_round(round++, sc, port);
    ddp_store_server_stop(srv);
    printf("lifecycle: %d rounds of ranks as threads (clean, pending, close, abort) ok in "
           "%lld ms\n", round - first, (long long)(ddp_now_ms() - t0));
    return 0;
}
