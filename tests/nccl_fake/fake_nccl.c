/* fake_nccl.c - TEST DOUBLE of NCCL (libnccl), for pyddp's tests on machines
 * without a GPU. It exports the entry points pyddp's loader resolves
 * (csrc/cuda/ddp_cuda_lib.h). Communicators behave as non-blocking NCCL ones
 * of one rank: set-up and (optionally) launches report ncclInProgress for a
 * few polls, collectives copy send to receive buffers (the one-rank result),
 * and every call is logged (fake_log.h). Environment knobs:
 *   FAKE_NCCL_VERSION=code   ncclGetVersion's answer (default 22005)
 *   FAKE_NCCL_INIT_HANG=1    set-up stays in progress forever
 *   FAKE_NCCL_INPROGRESS=1   every launch is "in progress" for two polls
 *   FAKE_NCCL_LAUNCH_HANG=1  every launch stays "in progress"
 *   FAKE_NCCL_ASYNC_ERROR_AT=k  from the k-th collective on, the
 *                            communicator reports ncclRemoteError
 *   FAKE_NCCL_UID_FAIL=1     ncclGetUniqueId fails
 * Never shipped: tests/test_nccl_nogpu.py compiles it into a temp folder.
 */
#include <stdint.h>
#include "fake_log.h"

typedef struct fake_comm { int nranks, rank, async, polls, hang, ncoll; } fake_comm;
typedef struct fake_cfg { size_t size; unsigned magic, version; int blocking; } fake_cfg;
typedef struct { char internal[128]; } fake_uid;

static const size_t TYPE_SIZE[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};

int ncclGetVersion(int *v) { *v = fake_env_int("FAKE_NCCL_VERSION", 22005); return 0; }
const char *ncclGetErrorString(int r) {
    return r == 6 ? "remote process exited" : "fake NCCL error";
}
const char *ncclGetLastError(void *c) { return "fake last error"; }
int ncclGetUniqueId(fake_uid *u) {
    fake_log("ncclGetUniqueId");
    if (fake_env_int("FAKE_NCCL_UID_FAIL", 0)) return 2;
    memset(u, 0x5a, sizeof *u);
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
int ncclSend(const void *s, size_t n, int t, int peer, fake_comm *c, void *st) {
    fake_log("ncclSend count=%zu type=%d peer=%d", n, t, peer);
    return 0;
}
int ncclRecv(void *r, size_t n, int t, int peer, fake_comm *c, void *st) {
    fake_log("ncclRecv count=%zu type=%d peer=%d", n, t, peer);
    return 0;
}
int ncclGroupStart(void) { fake_log("ncclGroupStart"); return 0; }
int ncclGroupEnd(void) { fake_log("ncclGroupEnd"); return 0; }
