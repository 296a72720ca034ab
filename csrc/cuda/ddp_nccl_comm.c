/* ddp_nccl_comm.c - the NCCL communicator's life: creation through the
 * store, failure and abort, destruction (contract in ddp_nccl_comm.h; shared
 * state in ddp_nccl_internal.h; its works are ddp_nccl_work.c's).
 *
 * Every wait here is a poll loop with a deadline: NCCL's non-blocking mode
 * turns set-up and launches into "in progress" states and CUDA events into
 * "not ready" answers, so nothing blocks inside NCCL or CUDA where a dead
 * peer could hold this process forever.
 */
#include "ddp_nccl_internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- small helpers -------------------------------------------------- */

void ddp_nccl_nap(int *us) {
    struct timespec ts = {0, (long)*us * 1000L};
    nanosleep(&ts, NULL);
    if (*us < 1000) *us *= 2;
}

ddp_status ddp_nccl_use_device(ddp_nccl_comm *c) {
    int cur = -1;
    if (c->api->cudaGetDevice(&cur) == DDP_CU_SUCCESS && cur == c->device) return DDP_OK;
    ddp_cu_err e = c->api->cudaSetDevice(c->device);
    if (e != DDP_CU_SUCCESS)
        return ddp_error(DDP_ERR_SYS, "rank %d: cudaSetDevice(%d) failed: %s", c->rank,
                         c->device, c->api->cudaGetErrorString(e));
    return DDP_OK;
}

const char *ddp_nccl_describe(const ddp_nccl_comm *c, ddp_coll_kind k, uint64_t seq,
                              size_t count, size_t count2, ddp_dtype t, char *buf, size_t len) {
    char sz[96];
    if (k == DDP_COLL_ALLTOALL)
        snprintf(sz, sizeof sz, "%zu x %s sent, %zu received", count, ddp_dtype_name(t), count2);
    else if (k == DDP_COLL_P2P_BATCH)
        snprintf(sz, sizeof sz, "%zu send%s, %zu receive%s", count, count == 1 ? "" : "s",
                 count2, count2 == 1 ? "" : "s");
    else
        snprintf(sz, sizeof sz, "%zu x %s", count, ddp_dtype_name(t));
    snprintf(buf, len, "NCCL %s #%llu (%s) on rank %d (cuda:%d)", ddp_coll_name(k),
             (unsigned long long)seq, sz, c->rank, c->device);
    return buf;
}

const char *ddp_nccl_errtext(const ddp_nccl_comm *c, ddp_nc_result r, char *buf, size_t len) {
    const char *last = c->api->ncclGetLastError(c->nc);
    snprintf(buf, len, "%s (ncclResult %d)%s%s", c->api->ncclGetErrorString(r), r,
             last && *last ? ": " : "", last ? last : "");
    return buf;
}

ddp_status ddp_nccl_status_of(ddp_nc_result r) {
    return r == 2 /* ncclSystemError */ || r == 6 /* ncclRemoteError */ ? DDP_ERR_CLOSED
                                                                        : DDP_ERR_ABORTED;
}

static void vfail_locked(ddp_nccl_comm *c, ddp_status st, const char *fmt, va_list ap) {
    if (atomic_load(&c->broken)) return;
    vsnprintf(c->broken_msg, sizeof c->broken_msg, fmt, ap);
    c->broken_st = st;
    if (c->nc) {
        /* Frees the communicator and makes its kernels on the GPU exit, so
         * the stream drains and peers blocked on this rank fail too. */
        c->api->ncclCommAbort(c->nc);
        c->nc = NULL;
    }
    atomic_store(&c->broken, 1);
}

void ddp_nccl_fail_locked(ddp_nccl_comm *c, ddp_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfail_locked(c, st, fmt, ap);
    va_end(ap);
}

void ddp_nccl_fail(ddp_nccl_comm *c, ddp_status st, const char *fmt, ...) {
    atomic_store(&c->stop, 1);
    pthread_mutex_lock(&c->mu);
    va_list ap;
    va_start(ap, fmt);
    vfail_locked(c, st, fmt, ap);
    va_end(ap);
    pthread_mutex_unlock(&c->mu);
}

void ddp_nccl_comm_abort(ddp_nccl_comm *c, const char *reason) {
    if (c == NULL) return;
    ddp_nccl_fail(c, DDP_ERR_ABORTED, "rank %d: the NCCL process group was aborted: %s",
                  c->rank, reason ? reason : "abort() called");
}

ddp_status ddp_nccl_settle_locked(ddp_nccl_comm *c, ddp_nc_result r, const char *what,
                                  ddp_wait w, const ddp_nccl_interrupt *intr) {
    char e[600];
    int us = 20;
    int64_t next_check = ddp_now_ms() + DDP_WAIT_SLICE_MS;
    while (r == DDP_NC_IN_PROGRESS) {
        if (atomic_load(&c->stop)) break;
        int interrupted = ddp_wait_aborted(w);
        if (!interrupted && intr && ddp_now_ms() >= next_check) {
            interrupted = intr->check(intr->ctx);
            next_check = ddp_now_ms() + DDP_WAIT_SLICE_MS;
        }
        if (ddp_wait_expired(w) || interrupted) {
            ddp_nccl_fail_locked(c, interrupted ? DDP_ERR_ABORTED : DDP_ERR_TIMEOUT,
                "%s: NCCL did not finish launching it before the %s; the communicator was "
                "aborted. A peer is probably unreachable or stuck: check that every rank "
                "is alive and that the nodes can reach each other (NCCL_SOCKET_IFNAME, "
                "firewall; NCCL_DEBUG=INFO shows details)", what,
                interrupted ? "wait was interrupted" : "timeout");
            break;
        }
        ddp_nccl_nap(&us);
        if (c->api->ncclCommGetAsyncError(c->nc, &r) != DDP_NC_SUCCESS) break;
    }
    if (r != DDP_NC_SUCCESS && r != DDP_NC_IN_PROGRESS && c->nc)
        ddp_nccl_fail_locked(c, ddp_nccl_status_of(r), "%s failed: %s. Another rank probably failed "
                             "or exited; check its output", what,
                             ddp_nccl_errtext(c, r, e, sizeof e));
    if (atomic_load(&c->broken)) return ddp_error(c->broken_st, "%s", c->broken_msg);
    if (r != DDP_NC_SUCCESS)  /* stopped by a concurrent abort not yet recorded */
        return ddp_error(DDP_ERR_ABORTED, "%s: the communicator is being aborted", what);
    return DDP_OK;
}

int ddp_nccl_comm_rank(const ddp_nccl_comm *c) { return c->rank; }
int ddp_nccl_comm_size(const ddp_nccl_comm *c) { return c->size; }
int ddp_nccl_comm_device(const ddp_nccl_comm *c) { return c->device; }

/* ---- creation ------------------------------------------------------- */

#define UID_MAGIC "PYDDPNC1"

/* What rank 0 publishes: the unique id, or why it could not make one. */
typedef struct uid_record {
    char magic[8];
    int32_t status;          /* 0, or the ncclResult of ncclGetUniqueId */
    int32_t nccl_version;
    char version[32];        /* pyddp version */
    ddp_nc_uid uid;
    char msg[384];
} uid_record;
_Static_assert(sizeof(uid_record) == 8 + 4 + 4 + 32 + 128 + 384, "uid_record is packed");

/* Rank 0: make and publish the id. Others: fetch it and check versions. */
static ddp_status exchange_uid(const ddp_nccl_config *cfg, const ddp_cuda_api *api,
                               ddp_store *store, ddp_wait w, ddp_nc_uid *uid) {
    char key[512], v0[16], v1[16];
    int mine = 0;
    api->ncclGetVersion(&mine);
    int n = snprintf(key, sizeof key, "%s/nccl_uid", cfg->prefix);
    if (n < 0 || (size_t)n >= sizeof key)
        return ddp_error(DDP_ERR_INVALID, "NCCL set-up: key prefix too long");
    uid_record rec;
    if (cfg->rank == 0) {
        memset(&rec, 0, sizeof rec);
        memcpy(rec.magic, UID_MAGIC, 8);
        rec.nccl_version = mine;
        snprintf(rec.version, sizeof rec.version, "%s", cfg->version ? cfg->version : "");
        ddp_nc_result r = api->ncclGetUniqueId(&rec.uid);
        if (r != DDP_NC_SUCCESS) {
            rec.status = r;
            const char *last = api->ncclGetLastError(NULL);
            snprintf(rec.msg, sizeof rec.msg, "ncclGetUniqueId failed: %s (ncclResult %d)%s%s",
                     api->ncclGetErrorString(r), r, last && *last ? ": " : "", last ? last : "");
        }
        ddp_status st = ddp_store_set(store, key, strlen(key), &rec, sizeof rec, w);
        if (st != DDP_OK) return ddp_error_prefix(st, "rank 0: publishing the NCCL id: ");
        if (r != DDP_NC_SUCCESS)
            return ddp_error(DDP_ERR_SYS, "rank 0: %s. Check NCCL_SOCKET_IFNAME (it must name an "
                             "existing network interface) and NCCL_DEBUG=INFO's output", rec.msg);
        *uid = rec.uid;
        return DDP_OK;
    }
    void *val = NULL;
    size_t len = 0;
    ddp_status st = ddp_store_get(store, key, strlen(key), &val, &len, w);
    if (st != DDP_OK)
        return ddp_error_prefix(st, "rank %d: waiting for rank 0's NCCL id (key %s): ",
                                cfg->rank, key);
    int ok = len == sizeof rec;
    if (ok) memcpy(&rec, val, sizeof rec);
    free(val);
    if (!ok || memcmp(rec.magic, UID_MAGIC, 8) != 0)
        return ddp_error(DDP_ERR_PROTOCOL, "rank %d: the NCCL id under %s is not pyddp's "
                         "(%zu bytes); is another program using the same store prefix?",
                         cfg->rank, key, len);
    rec.msg[sizeof rec.msg - 1] = 0;
    rec.version[sizeof rec.version - 1] = 0;
    if (rec.status != 0)
        return ddp_error(DDP_ERR_SYS, "rank %d: rank 0 could not create the NCCL id: %s",
                         cfg->rank, rec.msg);
    if (cfg->version && strcmp(rec.version, cfg->version) != 0)
        return ddp_error(DDP_ERR_VERSION, "rank %d runs pyddp %s but rank 0 runs pyddp %s; "
                         "install the same version on every node", cfg->rank, cfg->version,
                         rec.version);
    if (rec.nccl_version / 100 != mine / 100)
        return ddp_error(DDP_ERR_VERSION, "rank %d uses NCCL %s but rank 0 uses NCCL %s; "
                         "install the same nvidia-nccl-cu* wheel (or NCCL build) on every node",
                         cfg->rank, ddp_nccl_version_str(mine, v0, sizeof v0),
                         ddp_nccl_version_str(rec.nccl_version, v1, sizeof v1));
    *uid = rec.uid;
    return DDP_OK;
}

/* Join the NCCL communicator (non-blocking), polling until it is ready. */
static ddp_status init_nccl(ddp_nccl_comm *c, ddp_nc_uid uid, ddp_wait w) {
    const ddp_cuda_api *api = c->api;
    ddp_nc_config cfg = {sizeof cfg, DDP_NC_API_MAGIC, DDP_NC_MIN_VERSION, 0};
    ddp_nc_comm nc = NULL;
    char e[600];
    ddp_nc_result r = api->ncclCommInitRankConfig(&nc, c->size, uid, c->rank, &cfg);
    int us = 50;
    while (r == DDP_NC_IN_PROGRESS && nc != NULL) {
        if (ddp_wait_expired(w) || ddp_wait_aborted(w)) {
            api->ncclCommAbort(nc);
            if (ddp_wait_aborted(w))
                return ddp_error(DDP_ERR_ABORTED, "rank %d: NCCL communicator set-up on cuda:%d "
                                 "was interrupted", c->rank, c->device);
            return ddp_error(DDP_ERR_TIMEOUT, "rank %d: NCCL communicator set-up on cuda:%d did "
                             "not finish before the timeout: some rank did not join, or the "
                             "ranks cannot reach each other. Check that every rank started, "
                             "that NCCL_SOCKET_IFNAME names an interface the nodes share, and "
                             "that the firewall allows TCP between the nodes (NCCL_DEBUG=INFO "
                             "shows the details)", c->rank, c->device);
        }
        ddp_nccl_nap(&us);
        if (api->ncclCommGetAsyncError(nc, &r) != DDP_NC_SUCCESS) break;
    }
    if (r != DDP_NC_SUCCESS) {
        c->nc = nc;
        ddp_nccl_errtext(c, r, e, sizeof e);
        c->nc = NULL;
        if (nc) api->ncclCommAbort(nc);
        return ddp_error(ddp_nccl_status_of(r), "rank %d: creating the NCCL communicator on cuda:%d "
                         "failed: %s. NCCL refuses two ranks on one GPU: check that each "
                         "process uses its own device (LOCAL_RANK)", c->rank, c->device, e);
    }
    c->nc = nc;
    return DDP_OK;
}

static void free_resources(ddp_nccl_comm *c) {
    const ddp_cuda_api *api = c->api;
    if (ddp_nccl_use_device(c) == DDP_OK) {
        if (c->stream) api->cudaStreamDestroy(c->stream);
        if (c->ready) api->cudaEventDestroy(c->ready);
        if (c->scratch) api->cudaFree(c->scratch);
        if (c->stage_dev) api->cudaFree(c->stage_dev);
        if (c->stage_host) api->cudaFreeHost(c->stage_host);
        ddp_nccl_events_free(c);
    }
    pthread_mutex_destroy(&c->mu);
    pthread_mutex_destroy(&c->stage_mu);
    pthread_mutex_destroy(&c->ev_mu);
    free(c);
}

void ddp_nccl_comm_retain(ddp_nccl_comm *c) { atomic_fetch_add(&c->refs, 1); }

/* The last reference frees the stream, events and buffers. */
void ddp_nccl_comm_release(ddp_nccl_comm *c) {
    if (atomic_fetch_sub(&c->refs, 1) == 1) free_resources(c);
}

ddp_status ddp_nccl_comm_create(const ddp_nccl_config *cfg, ddp_store *store,
                                ddp_nccl_comm **out) {
    *out = NULL;
    const ddp_cuda_api *api = ddp_cuda_api_get();
    if (api == NULL)
        return ddp_error(DDP_ERR_UNAVAILABLE, "NCCL and the CUDA runtime are not loaded");
    if (cfg->size < 1 || cfg->rank < 0 || cfg->rank >= cfg->size)
        return ddp_error(DDP_ERR_INVALID, "NCCL set-up: rank %d is out of range for world size "
                         "%d", cfg->rank, cfg->size);
    ddp_nccl_comm *c = calloc(1, sizeof *c);
    if (c == NULL) return ddp_error(DDP_ERR_NOMEM, "NCCL set-up: out of memory");
    c->api = api;
    c->rank = cfg->rank;
    c->size = cfg->size;
    c->device = cfg->device;
    c->timeout_ms = cfg->timeout_ms;
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->stage_mu, NULL);
    pthread_mutex_init(&c->ev_mu, NULL);
    atomic_init(&c->refs, 1);
    ddp_wait w = ddp_wait_for(cfg->timeout_ms, cfg->abort);
    ddp_nc_uid uid;
    ddp_cu_err e = DDP_CU_SUCCESS;
    const char *what = "";
    ddp_status st = ddp_nccl_use_device(c);
    if (st == DDP_OK) st = exchange_uid(cfg, api, store, w, &uid);
    if (st != DDP_OK) goto fail;
    what = "cudaStreamCreateWithFlags";
    e = api->cudaStreamCreateWithFlags(&c->stream, DDP_CU_STREAM_NON_BLOCKING);
    if (e == DDP_CU_SUCCESS) {
        what = "cudaEventCreateWithFlags";
        e = api->cudaEventCreateWithFlags(&c->ready, DDP_CU_EVENT_DISABLE_TIMING);
    }
    if (e == DDP_CU_SUCCESS) {
        what = "cudaMalloc";
        e = api->cudaMalloc(&c->scratch, 256);
    }
    if (e != DDP_CU_SUCCESS) {
        st = ddp_error(DDP_ERR_SYS, "rank %d: %s on cuda:%d failed: %s", c->rank, what,
                       c->device, api->cudaGetErrorString(e));
        goto fail;
    }
    st = init_nccl(c, uid, w);
    if (st != DDP_OK) goto fail;
    *out = c;
    return DDP_OK;
fail:
    free_resources(c);
    return st;
}

void ddp_nccl_comm_destroy(ddp_nccl_comm *c, ddp_wait w) {
    if (c == NULL) return;
    atomic_store(&c->stop, 1);   /* no one should be in NCCL now; if so, make it leave */
    pthread_mutex_lock(&c->mu);
    if (c->nc && ddp_nccl_use_device(c) == DDP_OK) {
        /* Finalize flushes NCCL's pending work; if that cannot finish in
         * time (a peer died), abort instead of hanging. */
        ddp_nc_result r = c->api->ncclCommFinalize(c->nc);
        int us = 50;
        while (r == DDP_NC_IN_PROGRESS && !ddp_wait_expired(w) && !ddp_wait_aborted(w)) {
            ddp_nccl_nap(&us);
            if (c->api->ncclCommGetAsyncError(c->nc, &r) != DDP_NC_SUCCESS) break;
        }
        if (r == DDP_NC_SUCCESS) {
            c->api->ncclCommDestroy(c->nc);
            atomic_store(&c->finalized, 1);   /* everything issued did complete */
        } else {
            c->api->ncclCommAbort(c->nc);
        }
        c->nc = NULL;
    }
    if (!atomic_load(&c->broken)) {
        snprintf(c->broken_msg, sizeof c->broken_msg, "rank %d: the NCCL process group was "
                 "destroyed", c->rank);
        c->broken_st = DDP_ERR_INVALID;
        atomic_store(&c->broken, 1);
    }
    pthread_mutex_unlock(&c->mu);
    ddp_nccl_comm_release(c);
}
