/* ddp_nccl_coll.c - issuing collectives on the NCCL communicator: the
 * dtype/op tables, argument checks, the per-kind NCCL calls, producer
 * ordering, and host staging (contract in ddp_nccl_comm.h).
 *
 * NCCL has every kind of ddp_coll.h natively except gather and scatter on
 * older releases, all_to_all and batched send/recv: those are built, as NCCL
 * users do, from one ncclSend/ncclRecv per transfer inside one
 * ncclGroupStart/ncclGroupEnd, so NCCL runs them concurrently (no ordering
 * deadlock between peers) and this rank's own block is a device-to-device
 * copy on the communicator's stream. Barrier is a one-byte all-reduce on the
 * communicator's scratch buffer, completed before wait() returns.
 *
 * NCCL's send/recv carry no header: a peer cannot check that the sizes
 * agree (rank p's scounts[q] against rank q's rcounts[p], a send's count
 * and dtype against its receive). What is checked here is only what one
 * rank can see; a mismatch between ranks shows, as for every NCCL
 * collective, as a hang that the work's timeout ends (see
 * ddp_nccl_work_done's message).
 */
#include "ddp_nccl_internal.h"

#include <stdio.h>
#include <string.h>

/* ncclDataType_t for each ddp_dtype (bool travels as uint8, as in torch). */
static const int NC_TYPE[DDP_DTYPE_COUNT] = {
    [DDP_FLOAT16] = DDP_NC_FLOAT16, [DDP_BFLOAT16] = DDP_NC_BFLOAT16,
    [DDP_FLOAT32] = DDP_NC_FLOAT32, [DDP_FLOAT64] = DDP_NC_FLOAT64,
    [DDP_INT8] = DDP_NC_INT8, [DDP_UINT8] = DDP_NC_UINT8,
    [DDP_INT32] = DDP_NC_INT32, [DDP_INT64] = DDP_NC_INT64, [DDP_BOOL] = DDP_NC_UINT8,
};

/* ncclRedOp_t for each ddp_redop; AVG is NCCL's own ncclAvg. */
static const int NC_OP[DDP_REDOP_COUNT] = {
    [DDP_SUM] = DDP_NC_SUM, [DDP_AVG] = DDP_NC_AVG, [DDP_MIN] = DDP_NC_MIN,
    [DDP_MAX] = DDP_NC_MAX, [DDP_PRODUCT] = DDP_NC_PROD,
};

ddp_status ddp_nccl_map(ddp_dtype t, ddp_redop op, int *nc_type, int *nc_op) {
    if ((unsigned)t >= DDP_DTYPE_COUNT)
        return ddp_error(DDP_ERR_TYPE, "NCCL: unknown dtype %d", (int)t);
    if ((unsigned)op >= DDP_REDOP_COUNT)
        return ddp_error(DDP_ERR_INVALID, "NCCL: unknown reduce op %d", (int)op);
    *nc_type = NC_TYPE[t];
    if (nc_op == NULL) return DDP_OK;
    int o = NC_OP[op];
    if (t == DDP_BOOL) {
        /* On 0/1 bytes MAX is logical or and MIN logical and, without the
         * wrap-around a uint8 SUM would have past 255 ranks. */
        if (op == DDP_AVG)
            return ddp_error(DDP_ERR_TYPE, "AVG is not defined for bool arrays on the NCCL "
                             "backend; convert to a float dtype first");
        if (op == DDP_SUM) o = DDP_NC_MAX;
        if (op == DDP_PRODUCT) o = DDP_NC_MIN;
    }
    *nc_op = o;
    return DDP_OK;
}

static int is_reduction(ddp_coll_kind k) {
    return k == DDP_COLL_ALLREDUCE || k == DDP_COLL_REDUCE || k == DDP_COLL_REDUCE_SCATTER;
}

static int has_root(ddp_coll_kind k) {
    return k == DDP_COLL_BROADCAST || k == DDP_COLL_REDUCE || k == DDP_COLL_GATHER ||
           k == DDP_COLL_SCATTER || k == DDP_COLL_SEND || k == DDP_COLL_RECV;
}

/* all_to_all and batches: the core's checks (NULL count arrays and ops,
 * peer range, sends to oneself, overflowing extents, NULL buffers, in-place
 * all_to_all), on a view of this communicator's rank and size, then what
 * NCCL adds: every dtype must map, and the own block's two counts agree (the
 * one size check NCCL's headerless send/recv leave to this rank). */
static ddp_status validate_grouped(const ddp_nccl_comm *c, const ddp_coll_args *a) {
    ddp_group view;
    memset(&view, 0, sizeof view);
    view.rank = c->rank;
    view.size = c->size;
    ddp_status st = ddp_coll_validate(&view, a);
    int nt = 0;
    if (st == DDP_OK && a->kind == DDP_COLL_ALLTOALL) {
        st = ddp_nccl_map(a->dtype, DDP_SUM, &nt, NULL);
        if (st == DDP_OK && a->scounts[c->rank] != a->rcounts[c->rank])
            st = ddp_error(DDP_ERR_MISMATCH, "rank %d sends %zu elements to itself but "
                           "expects %zu elements from itself (its input split and output "
                           "split for rank %d must be equal)", c->rank,
                           a->scounts[c->rank], a->rcounts[c->rank], c->rank);
    }
    for (int i = 0; st == DDP_OK && a->kind == DDP_COLL_P2P_BATCH && i < a->nops; i++) {
        st = ddp_nccl_map(a->ops[i].dtype, DDP_SUM, &nt, NULL);
        if (st != DDP_OK) st = ddp_error_prefix(st, "op %d: ", i);
    }
    if (st != DDP_OK)
        return ddp_error_prefix(st, "rank %d: %s: ", c->rank, ddp_coll_name(a->kind));
    return DDP_OK;
}

ddp_status ddp_nccl_validate(const ddp_nccl_comm *c, const ddp_coll_args *a) {
    if (a->kind == DDP_COLL_ALLTOALL || a->kind == DDP_COLL_P2P_BATCH)
        return validate_grouped(c, a);
    if (a->kind < DDP_COLL_ALLREDUCE || a->kind > DDP_COLL_BARRIER)
        return ddp_error(DDP_ERR_INVALID, "unknown collective kind %d", (int)a->kind);
    const char *nm = ddp_coll_name(a->kind);
    const char *who = (a->kind == DDP_COLL_SEND || a->kind == DDP_COLL_RECV) ? "peer" : "root";
    if (a->kind == DDP_COLL_RECV && a->root == DDP_ANY_SOURCE)
        return ddp_error(DDP_ERR_INVALID, "recv: a receive from any source is not possible on "
                         "GPU tensors (NCCL can only receive from a named peer); pass src=, or "
                         "receive into a CPU tensor");
    if (has_root(a->kind) && (a->root < 0 || a->root >= c->size))
        return ddp_error(DDP_ERR_INVALID, "%s: %s %d is out of range for world size %d", nm, who,
                         a->root, c->size);
    if ((a->kind == DDP_COLL_SEND || a->kind == DDP_COLL_RECV) && a->root == c->rank)
        return ddp_error(DDP_ERR_INVALID, "%s: rank %d cannot %s itself", nm, c->rank,
                         a->kind == DDP_COLL_SEND ? "send to" : "receive from");
    int nt, no;
    ddp_status st;
    if (is_reduction(a->kind)) {
        st = ddp_redop_check(a->dtype, a->op);
        if (st != DDP_OK) return st;
        st = ddp_nccl_map(a->dtype, a->op, &nt, &no);
    } else {
        st = ddp_nccl_map(a->dtype, DDP_SUM, &nt, NULL);
    }
    if (st != DDP_OK) return ddp_error_prefix(st, "%s: ", nm);
    if (a->count == 0 || a->kind == DDP_COLL_BARRIER) return DDP_OK;
    int root_side = a->root == c->rank;
    int bad;
    switch (a->kind) {
    case DDP_COLL_ALLGATHER: case DDP_COLL_REDUCE_SCATTER:
        bad = !a->sendbuf || !a->recvbuf; break;
    case DDP_COLL_GATHER: bad = !a->sendbuf || (root_side && !a->recvbuf); break;
    case DDP_COLL_SCATTER: bad = !a->recvbuf || (root_side && !a->sendbuf); break;
    default: bad = !a->buf; break;
    }
    if (bad)
        return ddp_error(DDP_ERR_INVALID, "%s: a buffer of %zu elements is NULL", nm, a->count);
    return DDP_OK;
}

ddp_status ddp_nccl_pointer_device(const ddp_nccl_comm *c, const void *ptr,
                                   const char *argname, int *device) {
    ddp_cu_ptr_attr at;
    memset(&at, 0, sizeof at);
    ddp_cu_err e = c->api->cudaPointerGetAttributes(&at, ptr);
    if (e != DDP_CU_SUCCESS || (at.type != DDP_CU_MEM_DEVICE && at.type != DDP_CU_MEM_MANAGED))
        return ddp_error(DDP_ERR_INVALID, "%s does not point to GPU memory (CUDA memory type "
                         "%d%s%s)",
                         argname, at.type, e ? ": " : "", e ? c->api->cudaGetErrorString(e) : "");
    *device = at.device;
    return DDP_OK;
}

/* ---- issuing ----------------------------------------------------------- */

/* Host staging around one collective: copy `in` bytes to the device before
 * it, `out` bytes back to pinned memory after it (0 = none). */
typedef struct stage_plan {
    const void *host_in;    /* pinned source of the input (NULL: none) */
    void *dev_in;
    size_t in_bytes;
    void *host_out;         /* pinned destination of the output (NULL: none) */
    const void *dev_out;
    size_t out_bytes;
} stage_plan;

/* This rank's own block of a grouped exchange: a device copy on the
 * communicator's stream (ordered with the NCCL kernels around it), which
 * needs no NCCL connection to oneself. */
static ddp_nc_result own_copy(ddp_nccl_comm *c, void *dst, const void *src, size_t bytes) {
    if (bytes && dst != src &&
        c->api->cudaMemcpyAsync(dst, src, bytes, DDP_CU_MEMCPY_DEFAULT, c->stream) != 0)
        return 1; /* ncclUnhandledCudaError */
    return DDP_NC_SUCCESS;
}

/* The transfers of one grouped launch, issued between ncclGroupStart and
 * ncclGroupEnd by in_group. */
typedef ddp_nc_result (*p2p_body)(ddp_nccl_comm *c, const ddp_coll_args *a, int nt);

/* Run body inside one NCCL group; the group is closed even when a call in
 * it failed (NCCL then reports the failure at ncclGroupEnd too), and the
 * first failure is returned. ncclInProgress from ncclGroupEnd is settled by
 * the caller like any launch. */
static ddp_nc_result in_group(ddp_nccl_comm *c, const ddp_coll_args *a, int nt, p2p_body body) {
    ddp_nc_result r = c->api->ncclGroupStart();
    if (r != DDP_NC_SUCCESS) return r;
    r = body(c, a, nt);
    ddp_nc_result r2 = c->api->ncclGroupEnd();
    return r != DDP_NC_SUCCESS ? r : r2;
}

/* Gather/scatter at the root: one receive / send per other rank. */
static ddp_nc_result rooted_body(ddp_nccl_comm *c, const ddp_coll_args *a, int nt) {
    const ddp_cuda_api *api = c->api;
    size_t bytes = a->count * ddp_dtype_size(a->dtype);
    ddp_nc_result r = DDP_NC_SUCCESS;
    for (int p = 0; p < c->size && r == DDP_NC_SUCCESS; p++) {
        if (p == c->rank) continue;
        r = a->kind == DDP_COLL_GATHER
                ? api->ncclRecv((char *)a->recvbuf + (size_t)p * bytes, a->count, nt, p, c->nc,
                                c->stream)
                : api->ncclSend((const char *)a->sendbuf + (size_t)p * bytes, a->count, nt, p,
                                c->nc, c->stream);
    }
    return r;
}

/* Gather/scatter as grouped point-to-point calls; the root's own block is
 * a device copy. */
static ddp_nc_result rooted_p2p(ddp_nccl_comm *c, const ddp_coll_args *a, int nt) {
    const ddp_cuda_api *api = c->api;
    size_t bytes = a->count * ddp_dtype_size(a->dtype);
    int gather = a->kind == DDP_COLL_GATHER;
    if (c->rank != a->root)
        return gather ? api->ncclSend(a->sendbuf, a->count, nt, a->root, c->nc, c->stream)
                      : api->ncclRecv(a->recvbuf, a->count, nt, a->root, c->nc, c->stream);
    char *own_dst = gather ? (char *)a->recvbuf + (size_t)c->rank * bytes : (char *)a->recvbuf;
    const char *own_src = gather ? (const char *)a->sendbuf
                                 : (const char *)a->sendbuf + (size_t)c->rank * bytes;
    ddp_nc_result r = own_copy(c, own_dst, own_src, bytes);
    return r != DDP_NC_SUCCESS ? r : in_group(c, a, nt, rooted_body);
}

/* all_to_all: a send of block q to rank q and a receive of rank q's block,
 * for every other rank q. Empty blocks are skipped on both sides (when the
 * ranks agree on the sizes, p skips its send to q exactly when q skips its
 * receive from p), as torch's NCCL all_to_all does. */
static ddp_nc_result a2a_body(ddp_nccl_comm *c, const ddp_coll_args *a, int nt) {
    const ddp_cuda_api *api = c->api;
    size_t es = ddp_dtype_size(a->dtype);
    ddp_nc_result r = DDP_NC_SUCCESS;
    for (int q = 0; q < c->size && r == DDP_NC_SUCCESS; q++) {
        if (q == c->rank) continue;
        if (a->scounts[q])
            r = api->ncclSend((const char *)a->sendbuf + a->sdispls[q] * es, a->scounts[q], nt,
                              q, c->nc, c->stream);
        if (r == DDP_NC_SUCCESS && a->rcounts[q])
            r = api->ncclRecv((char *)a->recvbuf + a->rdispls[q] * es, a->rcounts[q], nt, q,
                              c->nc, c->stream);
    }
    return r;
}

static ddp_nc_result alltoall(ddp_nccl_comm *c, const ddp_coll_args *a, int nt) {
    size_t es = ddp_dtype_size(a->dtype);
    int me = c->rank;   /* validated: scounts[me] == rcounts[me] */
    ddp_nc_result r = DDP_NC_SUCCESS;
    if (a->scounts[me])   /* the buffers may be NULL when nothing moves */
        r = own_copy(c, (char *)a->recvbuf + a->rdispls[me] * es,
                     (const char *)a->sendbuf + a->sdispls[me] * es, a->scounts[me] * es);
    return r != DDP_NC_SUCCESS ? r : in_group(c, a, nt, a2a_body);
}

/* A batch: each op as its own send or receive, in batch order (NCCL pairs
 * the k-th send to a peer with that peer's k-th receive from this rank, as
 * ddp_p2p_op requires). Empty ops are skipped, which keeps that pairing
 * whenever the peers agree on the counts. */
static ddp_nc_result batch_body(ddp_nccl_comm *c, const ddp_coll_args *a, int unused) {
    (void)unused;
    const ddp_cuda_api *api = c->api;
    ddp_nc_result r = DDP_NC_SUCCESS;
    for (int i = 0; i < a->nops && r == DDP_NC_SUCCESS; i++) {
        const ddp_p2p_op *o = &a->ops[i];
        int nt = 0;
        if (o->count == 0) continue;
        if (ddp_nccl_map(o->dtype, DDP_SUM, &nt, NULL) != DDP_OK) return 4; /* validated */
        r = o->is_send ? api->ncclSend(o->buf, o->count, nt, o->peer, c->nc, c->stream)
                       : api->ncclRecv(o->buf, o->count, nt, o->peer, c->nc, c->stream);
    }
    return r;
}

static ddp_nc_result call_nccl(ddp_nccl_comm *c, const ddp_coll_args *a, int nt, int no) {
    const ddp_cuda_api *api = c->api;
    ddp_nc_comm nc = c->nc;
    ddp_cu_stream s = c->stream;
    switch (a->kind) {
    case DDP_COLL_ALLREDUCE: return api->ncclAllReduce(a->buf, a->buf, a->count, nt, no, nc, s);
    case DDP_COLL_BROADCAST:
        return api->ncclBroadcast(a->buf, a->buf, a->count, nt, a->root, nc, s);
    case DDP_COLL_REDUCE: return api->ncclReduce(a->buf, a->buf, a->count, nt, no, a->root, nc, s);
    case DDP_COLL_ALLGATHER: return api->ncclAllGather(a->sendbuf, a->recvbuf, a->count, nt, nc, s);
    case DDP_COLL_REDUCE_SCATTER:
        return api->ncclReduceScatter(a->sendbuf, a->recvbuf, a->count, nt, no, nc, s);
    case DDP_COLL_SEND: return api->ncclSend(a->buf, a->count, nt, a->root, nc, s);
    case DDP_COLL_RECV: return api->ncclRecv(a->buf, a->count, nt, a->root, nc, s);
    case DDP_COLL_GATHER: case DDP_COLL_SCATTER: return rooted_p2p(c, a, nt);
    case DDP_COLL_BARRIER:
        return api->ncclAllReduce(c->scratch, c->scratch, 1, DDP_NC_UINT8, DDP_NC_MAX, nc, s);
    case DDP_COLL_ALLTOALL: return alltoall(c, a, nt);
    case DDP_COLL_P2P_BATCH: return in_group(c, a, 0, batch_body);
    }
    return 4; /* ncclInvalidArgument */
}

/* w's description for messages, with sequence number seq (made only when a
 * message needs it: a snprintf per call is a measurable part of a launch). */
#define DESCRIBE(seq) ddp_nccl_describe(c, a->kind, (seq), w->count, w->count2, a->dtype, \
                                        d, sizeof d)

/* Enqueue, under mu: producer order, staging copies, the NCCL call, the
 * completion event. Breaks the communicator if NCCL was entered and the
 * sequence could not be completed (ranks would disagree on what ran). */
static ddp_status issue_locked(ddp_nccl_comm *c, const ddp_coll_args *a, int has_producer,
                               uintptr_t producer, const stage_plan *plan,
                               const ddp_nccl_interrupt *intr, ddp_nccl_work *w) {
    const ddp_cuda_api *api = c->api;
    char d[200];
    if (atomic_load(&c->broken) || c->nc == NULL)
        return ddp_error(atomic_load(&c->broken) ? c->broken_st : DDP_ERR_INVALID,
                         "%s: %s", DESCRIBE(c->seq + 1),
                         atomic_load(&c->broken) ? c->broken_msg : "the communicator is gone");
    ddp_status st = ddp_nccl_use_device(c);
    if (st != DDP_OK) return st;
    int nt = 0, no = 0;   /* a batch maps each op's own dtype (batch_body) */
    if (a->kind != DDP_COLL_P2P_BATCH)
        st = ddp_nccl_map(a->dtype, a->op, &nt, is_reduction(a->kind) ? &no : NULL);
    if (st != DDP_OK) return st;
    ddp_cu_err e = DDP_CU_SUCCESS;
    const char *what = "";
    if (has_producer) {
        what = "ordering after the caller's stream";
        e = api->cudaEventRecord(c->ready, (ddp_cu_stream)producer);
        if (e == DDP_CU_SUCCESS) e = api->cudaStreamWaitEvent(c->stream, c->ready, 0);
    }
    if (e == DDP_CU_SUCCESS && plan && plan->in_bytes) {
        what = "copying the input to the GPU";
        e = api->cudaMemcpyAsync(plan->dev_in, plan->host_in, plan->in_bytes,
                                 DDP_CU_MEMCPY_DEFAULT, c->stream);
    }
    if (e != DDP_CU_SUCCESS)   /* nothing reached NCCL: the communicator stays usable */
        return ddp_error(DDP_ERR_SYS, "%s: %s failed: %s", DESCRIBE(c->seq + 1), what,
                         api->cudaGetErrorString(e));
    w->seq = ++c->seq;
    ddp_nc_result r = call_nccl(c, a, nt, no);
    st = ddp_nccl_settle_locked(c, r, r == DDP_NC_SUCCESS ? "" : DESCRIBE(w->seq),
                                (ddp_wait){w->deadline_ms, NULL}, intr);
    if (st != DDP_OK) return st;
    if (plan && plan->out_bytes) {
        what = "copying the result from the GPU";
        e = api->cudaMemcpyAsync(plan->host_out, plan->dev_out, plan->out_bytes,
                                 DDP_CU_MEMCPY_DEFAULT, c->stream);
    }
    if (e == DDP_CU_SUCCESS) {
        what = "recording the completion event";
        e = api->cudaEventRecord(w->done, c->stream);
    }
    if (e != DDP_CU_SUCCESS) {
        ddp_nccl_fail_locked(c, DDP_ERR_ABORTED, "%s: %s failed: %s", DESCRIBE(w->seq), what,
                             api->cudaGetErrorString(e));
        return ddp_error(c->broken_st, "%s", c->broken_msg);
    }
    return DDP_OK;
}

#undef DESCRIBE

static ddp_status submit_plan(ddp_nccl_comm *c, const ddp_coll_args *a, int has_producer,
                              uintptr_t producer, const stage_plan *plan, int64_t timeout_ms,
                              const ddp_nccl_interrupt *intr, ddp_nccl_work **out) {
    *out = NULL;
    ddp_status st = ddp_nccl_use_device(c);
    if (st != DDP_OK) return st;
    ddp_nccl_work *w = ddp_nccl_work_new(c, a, timeout_ms);
    if (w == NULL)
        return ddp_error(DDP_ERR_NOMEM, "rank %d: could not create a CUDA event for %s",
                         c->rank, ddp_coll_name(a->kind));
    pthread_mutex_lock(&c->mu);
    st = issue_locked(c, a, has_producer, producer, plan, intr, w);
    pthread_mutex_unlock(&c->mu);
    if (st != DDP_OK) {
        char msg[1536];
        ddp_copy_error(msg, sizeof msg);
        ddp_nccl_work_release(w);
        return ddp_error(st, "%s", msg);
    }
    *out = w;
    return DDP_OK;
}

ddp_status ddp_nccl_submit(ddp_nccl_comm *c, const ddp_coll_args *a, int has_producer,
                           uintptr_t producer, int64_t timeout_ms,
                           const ddp_nccl_interrupt *intr, ddp_nccl_work **out) {
    return submit_plan(c, a, has_producer, producer, NULL, timeout_ms, intr, out);
}

static int flag_set(void *flag) { return flag && atomic_load((const atomic_int *)flag); }

/* ---- host staging -------------------------------------------------------- */

#define STAGE_ALIGN 256

/* Grow the staging buffers to `need` bytes (stage_mu held, nothing staged
 * in flight). The old buffers go first: cudaFree waits for the device. */
static ddp_status stage_reserve(ddp_nccl_comm *c, size_t need) {
    if (need <= c->stage_len) return DDP_OK;
    size_t len = c->stage_len * 2 > need ? c->stage_len * 2 : need;
    if (len < 65536) len = 65536;
    const ddp_cuda_api *api = c->api;
    if (c->stage_dev) api->cudaFree(c->stage_dev);
    if (c->stage_host) api->cudaFreeHost(c->stage_host);
    c->stage_dev = c->stage_host = NULL;
    c->stage_len = 0;
    ddp_cu_err e = api->cudaMalloc(&c->stage_dev, len);
    if (e == DDP_CU_SUCCESS) e = api->cudaMallocHost(&c->stage_host, len);
    if (e != DDP_CU_SUCCESS)
        return ddp_error(DDP_ERR_NOMEM, "rank %d: could not allocate %zu bytes of staging memory "
                         "for a host-array collective on cuda:%d: %s", c->rank, len, c->device,
                         api->cudaGetErrorString(e));
    c->stage_len = len;
    return DDP_OK;
}

/* Input and output byte counts of a host collective (the same region for
 * the in-place kinds). */
static void stage_sizes(const ddp_nccl_comm *c, const ddp_coll_args *a, const void **in,
                        size_t *in_bytes, void **out, size_t *out_bytes) {
    size_t n = a->count * ddp_dtype_size(a->dtype), all = n * (size_t)c->size;
    *in = NULL; *out = NULL; *in_bytes = *out_bytes = 0;
    switch (a->kind) {
    case DDP_COLL_ALLGATHER: case DDP_COLL_GATHER:
        *in = a->sendbuf; *in_bytes = n;
        if (a->recvbuf) { *out = a->recvbuf; *out_bytes = all; }
        break;
    case DDP_COLL_REDUCE_SCATTER: case DDP_COLL_SCATTER:
        if (a->sendbuf) { *in = a->sendbuf; *in_bytes = all; }
        *out = a->recvbuf; *out_bytes = n;
        break;
    case DDP_COLL_BARRIER: break;
    default:
        if (a->kind != DDP_COLL_RECV) { *in = a->buf; *in_bytes = n; }
        if (a->kind != DDP_COLL_SEND) { *out = a->buf; *out_bytes = n; }
    }
}

ddp_status ddp_nccl_run_host(ddp_nccl_comm *c, const ddp_coll_args *a, int64_t timeout_ms,
                             const atomic_int *abort) {
    if (a->kind == DDP_COLL_ALLTOALL || a->kind == DDP_COLL_P2P_BATCH)   /* no staging plan */
        return ddp_error(DDP_ERR_INVALID, "rank %d: %s on host arrays is not staged through "
                         "NCCL; host arrays take the CPU transport", c->rank,
                         ddp_coll_name(a->kind));
    const void *in;
    void *out;
    size_t in_bytes, out_bytes;
    stage_sizes(c, a, &in, &in_bytes, &out, &out_bytes);
    int inplace = in && out && in == (const void *)out;
    size_t out_off = inplace ? 0 : (in_bytes + STAGE_ALIGN - 1) / STAGE_ALIGN * STAGE_ALIGN;
    pthread_mutex_lock(&c->stage_mu);
    ddp_status st = ddp_nccl_use_device(c);
    if (st == DDP_OK) st = stage_reserve(c, inplace ? in_bytes : out_off + out_bytes);
    if (st != DDP_OK) {
        pthread_mutex_unlock(&c->stage_mu);
        return st;
    }
    char *hd = c->stage_host, *dd = c->stage_dev;
    if (in_bytes) memcpy(hd, in, in_bytes);
    stage_plan plan = {hd, dd, in_bytes, hd + out_off, dd + out_off, out_bytes};
    /* The same collective, pointed at the device staging buffers. */
    ddp_coll_args da = *a;
    if (a->buf) da.buf = dd;
    if (a->sendbuf) da.sendbuf = dd;
    if (a->recvbuf) da.recvbuf = dd + out_off;
    ddp_nccl_work *w = NULL;
    ddp_nccl_interrupt intr = {flag_set, (void *)abort};
    st = submit_plan(c, &da, 0, 0, &plan, timeout_ms, &intr, &w);
    if (st == DDP_OK) {
        st = ddp_nccl_work_wait(w, (ddp_wait){w->deadline_ms, abort});
        if (st == DDP_ERR_ABORTED && !ddp_nccl_work_done(w)) {
            ddp_nccl_comm_abort(c, "interrupted while waiting for a host-array collective");
            st = ddp_error(DDP_ERR_ABORTED, "rank %d: %s interrupted", c->rank,
                           ddp_coll_name(a->kind));
        } else if (st == DDP_OK && out_bytes) {
            memcpy(out, hd + out_off, out_bytes);
        }
        ddp_nccl_work_release(w);
    }
    pthread_mutex_unlock(&c->stage_mu);
    return st;
}
