/* fake_nccl.c - TEST DOUBLE of NCCL (libnccl), for pyddp's tests on machines
 * without a GPU. It exports the entry points pyddp's loader resolves
 * (csrc/cuda/ddp_cuda_lib.h). Communicators behave as non-blocking NCCL ones
 * of one rank: set-up and (optionally) launches report ncclInProgress for a
 * few polls, collectives copy send to receive buffers (the one-rank result),
 * and every call is logged (fake_log.h).
 *
 * ncclSend/ncclRecv move data for real between the communicators of one
 * process (several ranks' process groups in one test process, or a rank
 * sending to itself): every ncclGetUniqueId makes a new clique id, and a
 * send from rank s to rank d of a clique meets the oldest receive posted by
 * d from s (NCCL's per-peer ordering). Inside ncclGroupStart/End the calls
 * are queued and matched at the outermost ncclGroupEnd, which is also the
 * launch that can report "in progress"; outside a group each is its own
 * launch. A send's data is copied when it is posted, so the sender may
 * reuse its buffer at once (the fake's events complete at once anyway); a
 * receive is written when its send arrives, which may be a later call from
 * another rank. Sizes that differ are logged ("ncclRecv size mismatch") and
 * nothing is written, as real NCCL would hang or fail. Environment knobs:
 *   FAKE_NCCL_VERSION=code   ncclGetVersion's answer (default 22005)
 *   FAKE_NCCL_INIT_HANG=1    set-up stays in progress forever
 *   FAKE_NCCL_INPROGRESS=1   every launch is "in progress" for two polls
 *   FAKE_NCCL_LAUNCH_HANG=1  every launch stays "in progress"
 *   FAKE_NCCL_ASYNC_ERROR_AT=k  from the k-th collective on, the
 *                            communicator reports ncclRemoteError
 *   FAKE_NCCL_UID_FAIL=1     ncclGetUniqueId fails
 * Never shipped: tests/test_nccl_nogpu.py compiles it into a temp folder.
 */
#include <pthread.h>
#include <stdint.h>
#include "fake_log.h"

typedef struct fake_comm {
    int nranks, rank, async, polls, hang, ncoll;
    uint64_t clique;   /* from the unique id: communicators that can talk */
} fake_comm;
typedef struct fake_cfg { size_t size; unsigned magic, version; int blocking; } fake_cfg;
typedef struct { char internal[128]; } fake_uid;

static const size_t TYPE_SIZE[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};

int ncclGetVersion(int *v) { *v = fake_env_int("FAKE_NCCL_VERSION", 22005); return 0; }
const char *ncclGetErrorString(int r) {
    return r == 6 ? "remote process exited" : "fake NCCL error";
}
const char *ncclGetLastError(void *c) { return "fake last error"; }
static uint64_t next_clique = 1;   /* under mail_mu */
static pthread_mutex_t mail_mu = PTHREAD_MUTEX_INITIALIZER;

int ncclGetUniqueId(fake_uid *u) {
    fake_log("ncclGetUniqueId");
    if (fake_env_int("FAKE_NCCL_UID_FAIL", 0)) return 2;
    memset(u, 0x5a, sizeof *u);
    pthread_mutex_lock(&mail_mu);
    uint64_t id = next_clique++;
    pthread_mutex_unlock(&mail_mu);
    memcpy(u->internal + 8, &id, sizeof id);
    return 0;
}
int ncclCommInitRankConfig(fake_comm **out, int nranks, fake_uid uid, int rank, fake_cfg *cfg) {
    fake_log("ncclCommInitRankConfig nranks=%d rank=%d size=%zu magic=%x version=%u blocking=%d",
             nranks, rank, cfg->size, cfg->magic, cfg->version, cfg->blocking);
    if (cfg->magic != 0xcafebeefu || cfg->size < sizeof *cfg || cfg->version < 21400 ||
        uid.internal[0] != 0x5a)
        return 4;   /* ncclInvalidArgument */
    fake_comm *c = calloc(1, sizeof *c);
    c->nranks = nranks;
    c->rank = rank;
    memcpy(&c->clique, uid.internal + 8, sizeof c->clique);
    c->hang = fake_env_int("FAKE_NCCL_INIT_HANG", 0);
    c->async = 7;   /* ncclInProgress */
    c->polls = 3;
    *out = c;
    return cfg->blocking == 0 ? 7 : 0;
}
int ncclCommGetAsyncError(fake_comm *c, int *r) {
    if (c->async == 7 && !c->hang && --c->polls <= 0) c->async = 0;
    *r = c->async;
    return 0;
}
int ncclCommFinalize(fake_comm *c) { fake_log("ncclCommFinalize"); return 0; }
int ncclCommDestroy(fake_comm *c) { fake_log("ncclCommDestroy"); free(c); return 0; }
int ncclCommAbort(fake_comm *c) {
    fake_log("ncclCommAbort");
    setenv("FAKE_CUDA_HANG", "0", 1);   /* the aborted kernels exit: events complete */
    free(c);
    return 0;
}

/* Account for one launch: async error injection and in-progress replies. */
static int launched(fake_comm *c) {
    int at = fake_env_int("FAKE_NCCL_ASYNC_ERROR_AT", 0);
    if (at > 0 && ++c->ncoll >= at) c->async = 6;   /* ncclRemoteError */
    if (fake_env_int("FAKE_NCCL_LAUNCH_HANG", 0)) {
        c->async = 7;   /* in progress for good, like a peer that never connects */
        c->hang = 1;
        return 7;
    }
    if (c->async == 0 && fake_env_int("FAKE_NCCL_INPROGRESS", 0)) {
        c->async = 7;
        c->polls = 2;
        return 7;
    }
    return 0;
}

static void copy(void *recv, const void *send, size_t count, int type) {
    if (recv != send && count) memmove(recv, send, count * TYPE_SIZE[type]);
}

int ncclAllReduce(const void *s, void *r, size_t n, int t, int op, fake_comm *c, void *st) {
    fake_log("ncclAllReduce send=%p recv=%p count=%zu type=%d op=%d stream=%p", s, r, n, t, op, st);
    copy(r, s, n, t);
    return launched(c);
}
int ncclBroadcast(const void *s, void *r, size_t n, int t, int root, fake_comm *c, void *st) {
    fake_log("ncclBroadcast count=%zu type=%d root=%d stream=%p", n, t, root, st);
    copy(r, s, n, t);
    return launched(c);
}
int ncclReduce(const void *s, void *r, size_t n, int t, int op, int root, fake_comm *c, void *st) {
    fake_log("ncclReduce count=%zu type=%d op=%d root=%d stream=%p", n, t, op, root, st);
    copy(r, s, n, t);
    return launched(c);
}
int ncclAllGather(const void *s, void *r, size_t n, int t, fake_comm *c, void *st) {
    fake_log("ncclAllGather count=%zu type=%d stream=%p", n, t, st);
    copy(r, s, n, t);
    return launched(c);
}
int ncclReduceScatter(const void *s, void *r, size_t n, int t, int op, fake_comm *c, void *st) {
    fake_log("ncclReduceScatter count=%zu type=%d op=%d stream=%p", n, t, op, st);
    copy(r, s, n, t);
    return launched(c);
}
/* ---- point to point ------------------------------------------------- */

/* A send waiting for its receive (data copied at post time) or a receive
 * waiting for its send, in one process-wide list searched in post order. */
typedef struct mail {
    struct mail *next;
    int is_send;
    uint64_t clique;
    int src, dst;      /* the sending and the receiving rank */
    size_t bytes;
    void *data;        /* send: a private copy; receive: the caller's buffer */
} mail;

static mail *mailbox;   /* under mail_mu, oldest first */

/* Post one send or receive: complete it against the oldest waiting
 * opposite, or queue it. */
static void post(int is_send, uint64_t clique, int src, int dst, void *buf, size_t bytes) {
    pthread_mutex_lock(&mail_mu);
    mail **pp = &mailbox;
    while (*pp && !((*pp)->is_send != is_send && (*pp)->clique == clique &&
                    (*pp)->src == src && (*pp)->dst == dst))
        pp = &(*pp)->next;
    mail *m = *pp;
    if (m) {
        *pp = m->next;
        void *to = is_send ? m->data : buf;
        const void *from = is_send ? buf : m->data;
        if (m->bytes != bytes)
            fake_log("ncclRecv size mismatch: rank %d sends %zu bytes, rank %d receives %zu",
                     src, is_send ? bytes : m->bytes, dst, is_send ? m->bytes : bytes);
        else if (bytes)
            memcpy(to, from, bytes);
        if (m->is_send) free(m->data);
        free(m);
    } else {
        m = calloc(1, sizeof *m);
        *m = (mail){NULL, is_send, clique, src, dst, bytes, buf};
        if (is_send) {
            m->data = malloc(bytes ? bytes : 1);
            if (bytes) memcpy(m->data, buf, bytes);
        }
        while (*pp) pp = &(*pp)->next;
        *pp = m;
    }
    pthread_mutex_unlock(&mail_mu);
}

/* Calls queued inside a group (per thread, as NCCL's group state). */
typedef struct queued { int is_send; fake_comm *c; int peer; void *buf; size_t bytes; } queued;
static __thread int group_depth;
static __thread queued *group_q;
static __thread int group_n, group_cap;

static int p2p(int is_send, void *buf, size_t n, int t, int peer, fake_comm *c) {
    if (t < 0 || t > 9 || peer < 0 || peer >= c->nranks) return 4;   /* ncclInvalidArgument */
    size_t bytes = n * TYPE_SIZE[t];
    if (group_depth == 0) {
        post(is_send, c->clique, is_send ? c->rank : peer, is_send ? peer : c->rank, buf, bytes);
        return launched(c);
    }
    if (group_n == group_cap) {
        group_cap = group_cap ? 2 * group_cap : 16;
        group_q = realloc(group_q, (size_t)group_cap * sizeof *group_q);
    }
    group_q[group_n++] = (queued){is_send, c, peer, buf, bytes};
    return 0;
}

int ncclSend(const void *s, size_t n, int t, int peer, fake_comm *c, void *st) {
    fake_log("ncclSend count=%zu type=%d peer=%d rank=%d stream=%p", n, t, peer, c->rank, st);
    return p2p(1, (void *)s, n, t, peer, c);
}
int ncclRecv(void *r, size_t n, int t, int peer, fake_comm *c, void *st) {
    fake_log("ncclRecv count=%zu type=%d peer=%d rank=%d stream=%p", n, t, peer, c->rank, st);
    return p2p(0, r, n, t, peer, c);
}
int ncclGroupStart(void) {
    fake_log("ncclGroupStart");
    group_depth++;
    return 0;
}
/* The outermost end posts the queued calls in order (sends and receives of
 * one group never wait for each other, as in NCCL) and is their launch. */
int ncclGroupEnd(void) {
    fake_log("ncclGroupEnd");
    if (group_depth == 0) return 5;   /* ncclInvalidUsage: no group open */
    if (--group_depth > 0) return 0;
    fake_comm *last = NULL;
    for (int i = 0; i < group_n; i++) {
        queued *q = &group_q[i];
        post(q->is_send, q->c->clique, q->is_send ? q->c->rank : q->peer,
             q->is_send ? q->peer : q->c->rank, q->buf, q->bytes);
        last = q->c;
    }
    group_n = 0;
    return last ? launched(last) : 0;
}
