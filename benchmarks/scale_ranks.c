/* scale_ranks.c - N ranks as threads of one process over loopback, for
 * benchmarks/scale.py: how long a world of N takes to initialise, how many
 * sockets each rank holds, how many requests the one store serves, and the
 * latency of the first and of the steady 8-byte all-reduce. It uses only
 * the core's public C API (ddp_store.h, ddp_comm.h), so it measures
 * whichever core it is compiled against without change.
 *
 *   scale_ranks N [--hosts-of G] [--iters K] [--timeout-ms T]
 *
 * One in-process store server on 127.0.0.1; RLIMIT_NOFILE raised to its hard
 * limit; N threads (256 KiB stacks) each connect a store client, wait at a
 * start gate, and call ddp_comm_create at the same moment. Ranks g*G ..
 * g*G+G-1 share the host id "scalehost<g>" (G = 1: every rank its own
 * "host"). Then, after a second gate, one all-reduce of one float64 (sum;
 * the "first"), then K more (the "steady"), each checked against the sum of
 * the ranks. PYDDP_* settings come from the environment (scale.py sets
 * PYDDP_SHM_DISABLE=1 unless told otherwise).
 *
 * Output: one JSON line on stdout, e.g.
 *   {"n":8,"ok":true,"init_s":0.012,...}
 * Any failure (a rank's error, a gate or a wait past its deadline) prints
 * {"n":N,"ok":false,"error":"..."} and the message on stderr, and exits 1.
 *
 * Sockets per rank = (S - S_store - S_base) / N, where S is the number of
 * socket descriptors in /proc/self/fd after the all-reduces, S_store those
 * whose local port is the store's (the server's listener and its accepted
 * connections: the store's side, not the ranks'), and S_base the sockets
 * the program held before any rank started (other than the store's). What
 * remains is what the ranks hold: each one's store client, its data
 * listener if kept, and its ends of the links to peers (a loopback link
 * between two ranks here is two descriptors, one per rank, as on two hosts).
 */
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ddp_comm.h"
#include "ddp_store.h"

#define STACK_BYTES (256u << 10)
#define MSG_LEN 1024
#define GATE_GRACE_MS 5000

/* A gate: ranks arrive, the main thread waits for all of them (or a
 * failure, or the deadline), notes the time and opens it. */
typedef struct gate {
    int arrived, open;
    double opened_at;   /* seconds, monotonic */
} gate;

enum { G_START, G_INIT, G_DONE, G_END, G_COUNT };

typedef struct world {
    int n, hosts_of, iters;
    int64_t timeout_ms;
    int store_port;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    gate gates[G_COUNT];
    atomic_int failed;
    char msg[MSG_LEN];           /* the first failure */
    double *init_s, *first_s, *steady_s;   /* per rank */
} world;

typedef struct rank_arg {
    world *w;
    int rank;
} rank_arg;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* An absolute CLOCK_REALTIME deadline ms from now, for pthread_cond_timedwait. */
static struct timespec deadline_in(int64_t ms) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += (time_t)(ms / 1000);
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

/* Record the first failure (later ones are dropped) and wake the main thread. */
static void fail(world *w, const char *fmt, ...) {
    pthread_mutex_lock(&w->mu);
    if (!atomic_exchange(&w->failed, 1)) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(w->msg, sizeof w->msg, fmt, ap);
        va_end(ap);
    }
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

/* A rank's side of gate g: arrive, then wait until it opens. 0 once open;
 * -1 if the run failed meanwhile or the deadline (the comm timeout) passed
 * (recorded as the failure). */
static int gate_pass(world *w, int g, int rank) {
    struct timespec dl = deadline_in(w->timeout_ms);
    int rc = 0;
    pthread_mutex_lock(&w->mu);
    w->gates[g].arrived++;
    pthread_cond_broadcast(&w->cv);
    while (!w->gates[g].open && !atomic_load(&w->failed) && rc == 0)
        rc = pthread_cond_timedwait(&w->cv, &w->mu, &dl);
    int ok = w->gates[g].open;
    pthread_mutex_unlock(&w->mu);
    if (!ok && !atomic_load(&w->failed))
        fail(w, "rank %d: gate %d not opened within %lld ms", rank, g,
             (long long)w->timeout_ms);
    return ok ? 0 : -1;
}

/* The main thread's side: wait for every rank to arrive at g, then open it.
 * Returns 0; -1 on a failure or the deadline (recorded). The deadline is the
 * comm timeout plus GATE_GRACE_MS, so that a rank's own error, which says
 * more, is the one reported when its wait runs out first. */
static int gate_open(world *w, int g) {
    struct timespec dl = deadline_in(w->timeout_ms + GATE_GRACE_MS);
    int rc = 0;
    pthread_mutex_lock(&w->mu);
    while (w->gates[g].arrived < w->n && !atomic_load(&w->failed) && rc == 0)
        rc = pthread_cond_timedwait(&w->cv, &w->mu, &dl);
    int all = w->gates[g].arrived == w->n && !atomic_load(&w->failed);
    int arrived = w->gates[g].arrived;
    if (all) {
        w->gates[g].opened_at = now_s();
        w->gates[g].open = 1;
        pthread_cond_broadcast(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    if (!all && !atomic_load(&w->failed))
        fail(w, "only %d of %d ranks reached gate %d within %lld ms", arrived, w->n, g,
             (long long)(w->timeout_ms + GATE_GRACE_MS));
    return all ? 0 : -1;
}

/* One 8-byte all-reduce (float64 x1, sum) of rank's value; checks the sum.
 * Returns its duration in seconds, or -1 after recording a failure. */
static double allreduce_once(world *w, ddp_comm *comm, int rank) {
    double v = (double)rank, want = (double)w->n * (double)(w->n - 1) / 2.0;
    ddp_coll_args a = {0};
    a.kind = DDP_COLL_ALLREDUCE;
    a.dtype = DDP_FLOAT64;
    a.op = DDP_SUM;
    a.count = 1;
    a.buf = &v;
    ddp_work *wk = NULL;
    double t0 = now_s();
    ddp_status st = ddp_comm_submit(comm, &a, w->timeout_ms, &wk);
    if (st != DDP_OK) {
        fail(w, "rank %d: all-reduce submit: %s: %s", rank, ddp_status_name(st),
             ddp_last_error());
        return -1;
    }
    st = ddp_work_wait(wk, ddp_wait_for(w->timeout_ms, NULL));
    double dt = now_s() - t0;
    if (st != DDP_OK) {
        fail(w, "rank %d: all-reduce: %s: %s", rank, ddp_status_name(st),
             st == DDP_ERR_TIMEOUT ? "wait timed out" : ddp_work_error(wk));
        ddp_work_release(wk);
        return -1;
    }
    ddp_work_release(wk);
    if (v != want) {
        fail(w, "rank %d: all-reduce gave %.17g, expected %.17g", rank, v, want);
        return -1;
    }
    return dt;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of xs[0..n) (sorted in place); 0 for n == 0. */
static double median(double *xs, int n) {
    if (n <= 0) return 0;
    qsort(xs, (size_t)n, sizeof *xs, cmp_double);
    return n % 2 ? xs[n / 2] : (xs[n / 2 - 1] + xs[n / 2]) / 2;
}

/* One rank: store client, start gate, ddp_comm_create (timed), gate, first
 * and steady all-reduces, gate (the main thread counts sockets), gate,
 * destroy. Any failure is recorded in w and ends the thread. */
static void *rank_main(void *p) {
    rank_arg *ra = p;
    world *w = ra->w;
    int r = ra->rank;
    ddp_store *store = NULL;
    ddp_comm *comm = NULL;
    double *iter = NULL;
    ddp_status st = ddp_store_connect("127.0.0.1", w->store_port,
                                      ddp_wait_for(w->timeout_ms, NULL), &store);
    if (st != DDP_OK) {
        fail(w, "rank %d: store connect: %s", r, ddp_last_error());
        goto out;
    }
    char prefix[64], host[64];
    snprintf(prefix, sizeof prefix, "/pyddp/scale/%d", w->n);
    snprintf(host, sizeof host, "scalehost%d", r / w->hosts_of);
    ddp_comm_config cfg = {0};
    cfg.rank = r;
    cfg.size = w->n;
    cfg.prefix = prefix;
    cfg.advertise_host = "127.0.0.1";
    cfg.bind_host = "127.0.0.1";
    cfg.timeout_ms = w->timeout_ms;
    cfg.version = "scale";
    cfg.host_id = host;
    if (gate_pass(w, G_START, r) < 0) goto out;
    st = ddp_comm_create(&cfg, store, &comm);
    w->init_s[r] = now_s() - w->gates[G_START].opened_at;
    if (st != DDP_OK) {
        fail(w, "rank %d: ddp_comm_create after %.1f s: %s: %s", r, w->init_s[r],
             ddp_status_name(st), ddp_last_error());
        goto out;
    }
    if (gate_pass(w, G_INIT, r) < 0) goto out;
    if ((w->first_s[r] = allreduce_once(w, comm, r)) < 0) goto out;
    iter = calloc((size_t)(w->iters > 0 ? w->iters : 1), sizeof *iter);
    if (iter == NULL) {
        fail(w, "rank %d: out of memory", r);
        goto out;
    }
    for (int i = 0; i < w->iters; i++)
        if ((iter[i] = allreduce_once(w, comm, r)) < 0) goto out;
    w->steady_s[r] = median(iter, w->iters);
    if (gate_pass(w, G_DONE, r) < 0) goto out;
    gate_pass(w, G_END, r);
out:
    free(iter);
    ddp_comm_destroy(comm);
    ddp_store_close(store);
    return NULL;
}

/* Socket descriptors of this process: *total, and *store those whose local
 * port is store_port (the store server's listener and accepted connections). */
static void count_sockets(int store_port, int *total, int *store) {
    *total = *store = 0;
    DIR *d = opendir("/proc/self/fd");
    if (d == NULL) return;
    int self = dirfd(d);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        int fd = atoi(e->d_name);
        struct stat sb;
        if (fd == self || fstat(fd, &sb) < 0 || !S_ISSOCK(sb.st_mode)) continue;
        ++*total;
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        if (getsockname(fd, (struct sockaddr *)&ss, &len) < 0) continue;
        int port = -1;
        if (ss.ss_family == AF_INET) port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
        if (ss.ss_family == AF_INET6) port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
        if (port == store_port) ++*store;
    }
    closedir(d);
}

/* Print {"n":N,"ok":false,"error":...} (the message JSON-escaped, with the
 * sockets open now and the descriptor limit: a full mesh may run out) and
 * the message on stderr, then exit 1 without waiting for the ranks. */
static void die(int n, const char *why) {
    char msg[MSG_LEN + 128];
    struct rlimit rl = {0};
    int total = 0, store = 0;
    getrlimit(RLIMIT_NOFILE, &rl);
    count_sockets(-1, &total, &store);
    snprintf(msg, sizeof msg, "[sockets open at exit: %d; RLIMIT_NOFILE %llu] %s", total,
             (unsigned long long)rl.rlim_cur, why);
    fprintf(stderr, "scale_ranks: N=%d: %s\n", n, msg);
    printf("{\"n\":%d,\"ok\":false,\"error\":\"", n);
    for (const char *c = msg; *c; c++) {
        if (*c == '"' || *c == '\\') putchar('\\');
        if ((unsigned char)*c < 0x20) printf("\\u%04x", (unsigned char)*c);
        else putchar(*c);
    }
    printf("\"}\n");
    fflush(stdout);
    _exit(1);
}

static void usage(void) {
    fprintf(stderr, "usage: scale_ranks N [--hosts-of G] [--iters K] [--timeout-ms T]\n");
    exit(2);
}

/* The max and the mean of xs[0..n). */
static void max_mean(const double *xs, int n, double *mx, double *mean) {
    double s = 0;
    *mx = 0;
    for (int i = 0; i < n; i++) {
        s += xs[i];
        if (xs[i] > *mx) *mx = xs[i];
    }
    *mean = n ? s / n : 0;
}

int main(int argc, char **argv) {
    if (argc < 2) usage();
    world *w = calloc(1, sizeof *w);
    if (w == NULL) return 1;
    w->n = atoi(argv[1]);
    w->hosts_of = 1;
    w->iters = 20;
    w->timeout_ms = 120000;
    for (int i = 2; i < argc; i++) {
        if (i + 1 >= argc) usage();
        if (strcmp(argv[i], "--hosts-of") == 0) w->hosts_of = atoi(argv[++i]);
        else if (strcmp(argv[i], "--iters") == 0) w->iters = atoi(argv[++i]);
        else if (strcmp(argv[i], "--timeout-ms") == 0) w->timeout_ms = atoll(argv[++i]);
        else usage();
    }
    if (w->n < 1 || w->hosts_of < 1 || w->iters < 0 || w->timeout_ms < 1) usage();
    int n = w->n;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
        getrlimit(RLIMIT_NOFILE, &rl);
    }
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    w->init_s = calloc((size_t)n, sizeof(double));
    w->first_s = calloc((size_t)n, sizeof(double));
    w->steady_s = calloc((size_t)n, sizeof(double));
    rank_arg *args = calloc((size_t)n, sizeof *args);
    pthread_t *tids = calloc((size_t)n, sizeof *tids);
    if (!w->init_s || !w->first_s || !w->steady_s || !args || !tids) die(n, "out of memory");

    ddp_store_server *srv = NULL;
    if (ddp_store_server_start("127.0.0.1", 0, &srv, &w->store_port) != DDP_OK)
        die(n, ddp_last_error());
    int base_total, base_store;
    count_sockets(w->store_port, &base_total, &base_store);

    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, STACK_BYTES);
    char msg[MSG_LEN];
    for (int r = 0; r < n; r++) {
        args[r] = (rank_arg){w, r};
        int e = pthread_create(&tids[r], &attr, rank_main, &args[r]);
        if (e != 0) {
            snprintf(msg, sizeof msg, "cannot start rank %d's thread: %s", r, strerror(e));
            die(n, msg);
        }
    }
    pthread_attr_destroy(&attr);

    /* Each gate_open fails (and records why) on a rank's failure or the deadline. */
    if (gate_open(w, G_START) < 0 || gate_open(w, G_INIT) < 0) die(n, w->msg);
    uint64_t req_init = ddp_store_server_requests(srv);
    if (gate_open(w, G_DONE) < 0) die(n, w->msg);
    uint64_t req_all = ddp_store_server_requests(srv);
    int total, store_side;
    count_sockets(w->store_port, &total, &store_side);
    if (gate_open(w, G_END) < 0) die(n, w->msg);
    for (int r = 0; r < n; r++) pthread_join(tids[r], NULL);   /* each ends by itself */
    if (atomic_load(&w->failed)) die(n, w->msg);
    ddp_store_server_stop(srv);

    double init_max, init_mean, first_max, first_mean, steady_max, steady_mean;
    max_mean(w->init_s, n, &init_max, &init_mean);
    max_mean(w->first_s, n, &first_max, &first_mean);
    max_mean(w->steady_s, n, &steady_max, &steady_mean);
    double steady_med = median(w->steady_s, n);
    double per_rank = (double)(total - store_side - (base_total - base_store)) / n;
    printf("{\"n\":%d,\"ok\":true,\"hosts_of\":%d,\"iters\":%d,\"nofile\":%llu,"
           "\"init_s\":%.6f,\"init_mean_s\":%.6f,\"sockets_per_rank\":%.2f,"
           "\"sockets_total\":%d,\"sockets_store\":%d,\"store_requests\":%llu,"
           "\"store_requests_init\":%llu,\"first_us\":%.1f,\"first_mean_us\":%.1f,"
           "\"steady_us\":%.1f,\"steady_max_us\":%.1f}\n",
           n, w->hosts_of, w->iters, (unsigned long long)rl.rlim_cur, init_max, init_mean,
           per_rank, total, store_side, (unsigned long long)req_all,
           (unsigned long long)req_init, first_max * 1e6, first_mean * 1e6, steady_med * 1e6,
           steady_max * 1e6);
    fflush(stdout);
    return 0;
}
