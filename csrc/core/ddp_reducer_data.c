/* ddp_reducer_data.c - the reducer's CPU data path (contract in
 * ddp_reducer.h): gradients are copied into bucket slots as they become
 * ready, each launchable bucket's averaged all-reduce is handed to the ops
 * table at once (for a process group, ddp_reducer_pg_ops: submitted through
 * its ddp_pg table; the CPU communicator queues it on its worker thread,
 * which runs it while the caller's thread goes on with backward), and finish
 * waits for them in bucket order and copies the averages back.
 *
 * Averaging is DDP_AVG: the collective sums across ranks and divides once at
 * the end, exactly as torch's DDP documents (sum, then divide by world size).
 * Narrowed buckets (a reduce dtype) are rounded once to the bucket's dtype as
 * the gradients are copied in, and the copy back widens the average, so the
 * conversion costs no pass of its own. float16 buckets hold each gradient
 * already divided by the world size and are all-reduced with SUM, so a
 * float16 sum is never larger than the largest gradient (torch's
 * fp16_compress_hook divides first too); bfloat16 has float32's range, so
 * its buckets hold the gradients themselves and use AVG, and the narrowing
 * is a plain rounding rather than a correctly rounded division. That rule
 * is ddp_plan_bucket_rule's (ddp_reducer_plan.c), which the generic path
 * asks too.
 */
#include "ddp_reducer_int.h"

#include "ddp_dtype_cast.h"

#include <stdlib.h>
#include <string.h>

/* ---- ops over a process group (ddp_pg.h) ------------------------------- */

/* Queue an in-place all-reduce on the ddp_pg at ctx; the handle is its work. */
static ddp_status pg_launch(void *ctx, void *buf, size_t count, ddp_dtype t, ddp_redop op,
                            void **handle) {
    const ddp_pg *pg = ctx;
    ddp_coll_args a;
    memset(&a, 0, sizeof a);
    a.kind = DDP_COLL_ALLREDUCE;
    a.dtype = t;
    a.op = op;
    a.count = count;
    a.buf = buf;
    ddp_pg_opts o = {.timeout_ms = -1};
    ddp_pg_work w;
    ddp_status st = ddp_pg_submit(*pg, &a, &o, &w);
    *handle = st == DDP_OK ? w.w : NULL;
    return st;
}

static ddp_status pg_wait(void *ctx, void *handle, ddp_wait w, int *done) {
    const ddp_pg_ops *ops = ((const ddp_pg *)ctx)->ops;
    ops->work_wait(handle, w);
    *done = ops->work_done(handle);
    if (!*done) return ddp_wait_aborted(w) ? DDP_ERR_ABORTED : DDP_ERR_TIMEOUT;
    /* Done: ask again with a zero wait so the status is the work's own, not
     * a slice that expired just as it finished. */
    ddp_status st = ops->work_wait(handle, ddp_wait_for(0, NULL));
    if (st != DDP_OK) ddp_set_error_text(ops->work_error(handle));
    return st;
}

static void pg_release(void *ctx, void *handle) {
    ((const ddp_pg *)ctx)->ops->work_release(handle);
}

const ddp_reducer_ops ddp_reducer_pg_ops = {pg_launch, pg_wait, pg_release};

/* ---- attach and slots -------------------------------------------------- */

ddp_status ddp_reducer_attach(ddp_reducer *r, void *const *bufs, const ddp_reducer_ops *ops,
                              void *ctx, int world_size) {
    if (r->in_iter)
        return ddp_error(DDP_ERR_INVALID, "reducer: cannot attach buffers during an iteration");
    if (world_size < 1 || (world_size > 1 && ops == NULL))
        return ddp_error(DDP_ERR_INVALID, "reducer: attach needs ops and a world size >= 1 "
                         "(got %d)", world_size);
    for (size_t b = 0; b < r->plan.nbuckets; b++)
        if (bufs[b] == NULL && r->plan.bucket_numel[b] > 0)
            return ddp_error(DDP_ERR_INVALID, "reducer: bucket %zu has no buffer", b);
    void **copy = malloc((r->plan.nbuckets ? r->plan.nbuckets : 1) * sizeof *copy);
    if (copy == NULL) return ddp_error(DDP_ERR_NOMEM, "reducer: out of memory");
    memcpy(copy, bufs, r->plan.nbuckets * sizeof *copy);
    free(r->bufs);
    r->bufs = copy;
    r->ops = ops;
    r->ctx = ctx;
    r->world = world_size;
    return DDP_OK;
}

void *ddp_reducer_slot(const ddp_reducer *r, size_t i) {
    if (r->bufs == NULL || i >= r->plan.nparams) return NULL;
    size_t b = r->plan.param_bucket[i];
    return (char *)r->bufs[b] + r->plan.param_offset[i] * ddp_dtype_size(r->plan.bucket_dtype[b]);
}

/* Describe bucket b for error messages. */
static ddp_status bucket_error(const ddp_reducer *r, ddp_status st, size_t b) {
    const ddp_plan *p = &r->plan;
    return ddp_error_prefix(st, "DDP gradient all-reduce of bucket %zu of %zu (%zu parameters, "
                            "%zu %s elements) failed: ", b, p->nbuckets,
                            p->bucket_begin[b + 1] - p->bucket_begin[b], p->bucket_numel[b],
                            ddp_dtype_name(p->bucket_dtype[b]));
}

/* Launch buckets [first, first + count). Stops at the first failure, which
 * is remembered for finish and returned. */
static ddp_status launch_range(ddp_reducer *r, size_t first, size_t count) {
    if (r->world == 1) return DDP_OK;   /* the average over one rank is the input */
    for (size_t b = first; b < first + count; b++) {
        ddp_redop op = ddp_plan_bucket_rule(&r->plan, b, r->world).op;
        ddp_status st = r->ops->launch(r->ctx, r->bufs[b], r->plan.bucket_numel[b],
                                       r->plan.bucket_dtype[b], op, &r->works[b]);
        if (st != DDP_OK) {
            r->works[b] = NULL;
            bucket_error(r, st, b);
            ddp_reducer_fail(r, st);
            return st;
        }
    }
    return DDP_OK;
}

ddp_status ddp_reducer_ready(ddp_reducer *r, size_t i, const void *grad, ddp_dtype t,
                             size_t numel, void *copy_back) {
    const ddp_plan *p = &r->plan;
    if (r->bufs == NULL)
        return ddp_error(DDP_ERR_INVALID, "reducer: no bucket buffers attached");
    if (i >= p->nparams || !r->in_iter || r->ready[i]) {
        size_t f, c;
        return ddp_reducer_mark_ready(r, i, &f, &c);  /* fails with the precise message */
    }
    size_t b = p->param_bucket[i];
    if (grad != NULL && t != p->bucket_grad_dtype[b])
        return ddp_error(DDP_ERR_TYPE, "reducer: the gradient of parameter %zu is %s but the "
                         "parameter is %s", i, ddp_dtype_name(t),
                         ddp_dtype_name(p->bucket_grad_dtype[b]));
    if (grad != NULL && numel != p->param_numel[i])
        return ddp_error(DDP_ERR_INVALID, "reducer: the gradient of parameter %zu has %zu "
                         "elements but the parameter has %zu", i, numel, p->param_numel[i]);
    size_t esz = ddp_dtype_size(p->bucket_dtype[b]);
    void *slot = ddp_reducer_slot(r, i);
    /* With one rank the averaged gradient equals the gradient, so a value
     * that would be copied back to where it came from need not move at all. */
    int stays = r->world == 1 && grad != NULL && copy_back == grad;
    ddp_bucket_rule rule = ddp_plan_bucket_rule(p, b, r->world);
    if (!stays) {
        if (grad == NULL)
            memset(slot, 0, p->param_numel[i] * esz);
        else if (rule.narrow)
            ddp_cast_narrow(p->bucket_dtype[b], slot, t, grad, p->param_numel[i], rule.divisor);
        else if (grad != slot)
            memcpy(slot, grad, p->param_numel[i] * esz);
    }
    r->copy_back[i] = (stays || copy_back == slot) ? NULL : copy_back;
    size_t first, count;
    ddp_status st = ddp_reducer_mark_ready(r, i, &first, &count);
    if (st != DDP_OK) return st;
    return launch_range(r, first, count);
}

size_t ddp_reducer_pending(const ddp_reducer *r) {
    size_t n = r->used_work != NULL;
    for (size_t b = 0; b < r->plan.nbuckets; b++) n += r->works[b] != NULL;
    return n;
}

/* Wait for *h (if any) within w. Returns DDP_OK when it is done (its own
 * failure, if any, is recorded via ddp_reducer_fail with bucket context when
 * b < nbuckets), or the slice's TIMEOUT/ABORTED when not done yet. */
static ddp_status wait_one(ddp_reducer *r, void **h, size_t b, ddp_wait w, int record) {
    if (*h == NULL) return DDP_OK;
    int done = 0;
    ddp_status st = r->ops->wait(r->ctx, *h, w, &done);
    if (!done) return st == DDP_OK ? DDP_ERR_TIMEOUT : st;
    if (st != DDP_OK && record) {
        if (b < r->plan.nbuckets)
            bucket_error(r, st, b);
        else
            ddp_error_prefix(st, "DDP all-reduce of the used-parameter flags failed: ");
        ddp_reducer_fail(r, st);
    }
    r->ops->release(r->ctx, *h);
    *h = NULL;
    return DDP_OK;
}

/* Copy bucket b's averages to their copy-back targets, skipping parameters no
 * rank used when track_used. */
static void copy_back_bucket(ddp_reducer *r, size_t b, int track_used) {
    const ddp_plan *p = &r->plan;
    size_t esz = ddp_dtype_size(p->bucket_dtype[b]);
    int widen = ddp_plan_bucket_rule(p, b, r->world).narrow;
    for (size_t k = p->bucket_begin[b]; k < p->bucket_begin[b + 1]; k++) {
        size_t i = p->members[k];
        if (r->copy_back[i] == NULL || (track_used && r->used_global[i] == 0)) continue;
        if (widen)
            ddp_cast_widen(p->bucket_grad_dtype[b], r->copy_back[i], p->bucket_dtype[b],
                           ddp_reducer_slot(r, i), p->param_numel[i]);
        else
            memcpy(r->copy_back[i], ddp_reducer_slot(r, i), p->param_numel[i] * esz);
    }
}

/* Wait for everything launched, from next_wait on, then the use flags. With
 * copy_early, each bucket is copied back as soon as it is done, while later
 * buckets are still on the wire. */
static ddp_status wait_all(ddp_reducer *r, ddp_wait w, int record, int copy_early) {
    for (; r->next_wait < r->plan.nbuckets; r->next_wait++) {
        ddp_status st = wait_one(r, &r->works[r->next_wait], r->next_wait, w, record);
        if (st != DDP_OK) return st;
        if (copy_early && r->failed == DDP_OK) copy_back_bucket(r, r->next_wait, 0);
    }
    return wait_one(r, &r->used_work, SIZE_MAX, w, record);
}

static void launch_used(ddp_reducer *r) {
    size_t n = r->plan.nparams;
    memcpy(r->used_global, r->used, n * sizeof *r->used);
    r->used_launched = 1;
    if (r->world == 1 || n == 0) return;
    ddp_status st = r->ops->launch(r->ctx, r->used_global, n, DDP_INT32, DDP_SUM,
                                   &r->used_work);
    if (st != DDP_OK) {
        r->used_work = NULL;
        ddp_error_prefix(st, "DDP all-reduce of the used-parameter flags could not start: ");
        ddp_reducer_fail(r, st);
    }
}

/* End the iteration and return its first failure (message restored). */
static ddp_status end_with_status(ddp_reducer *r) {
    ddp_status st = r->failed;
    if (st != DDP_OK) ddp_set_error_text(r->failed_msg);
    ddp_reducer_end(r);
    return st;
}

ddp_status ddp_reducer_finish(ddp_reducer *r, int track_used, ddp_wait w) {
    const ddp_plan *p = &r->plan;
    if (!r->in_iter)
        return ddp_error(DDP_ERR_INVALID, "reducer: finish called outside a synced iteration");
    if (r->narrival < p->nparams)
        return ddp_error(DDP_ERR_INVALID, "reducer: finish called with %zu of %zu parameters "
                         "not ready", p->nparams - r->narrival, p->nparams);
    if (r->bufs == NULL)
        return ddp_error(DDP_ERR_INVALID, "reducer: no bucket buffers attached");
    /* The use flags go after the last bucket, like torch's local_used_map. */
    if (track_used && !r->used_launched) launch_used(r);
    /* Without use flags each bucket's copy-back overlaps the later buckets'
     * all-reduces; with them it must wait until the flags are known. */
    ddp_status st = wait_all(r, w, 1, !track_used);
    if (st != DDP_OK) return st;
    if (track_used && r->failed == DDP_OK)
        for (size_t b = 0; b < p->nbuckets; b++) copy_back_bucket(r, b, 1);
    return end_with_status(r);
}

const int32_t *ddp_reducer_global_used(const ddp_reducer *r) { return r->used_global; }

ddp_status ddp_reducer_drain(ddp_reducer *r, ddp_wait w) {
    if (r->bufs != NULL) {
        r->next_wait = 0;
        ddp_status st = wait_all(r, w, 0, 0);
        if (st != DDP_OK) return st;
    }
    r->failed = DDP_OK;
    ddp_reducer_end(r);
    return DDP_OK;
}
