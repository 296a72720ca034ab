/* ddp_reducer.c - readiness bookkeeping of the gradient reducer (contract in
 * ddp_reducer.h): which parameters are ready in this iteration, which
 * buckets may be launched (strictly in bucket order, so every rank issues
 * the same sequence of all-reduces), the order gradients arrived in, and the
 * use flags behind find_unused_parameters. No data moves here; the CPU data
 * path (ddp_reducer_data.c) and the Python generic path both build on it.
 */
#include "ddp_reducer_int.h"

#include <stdlib.h>
#include <string.h>

ddp_status ddp_reducer_create(ddp_plan *plan, ddp_reducer **out) {
    *out = NULL;
    ddp_reducer *r = calloc(1, sizeof *r);
    if (r == NULL) {
        ddp_plan_free(plan);
        return ddp_error(DDP_ERR_NOMEM, "reducer: out of memory");
    }
    r->plan = *plan;
    memset(plan, 0, sizeof *plan);
    size_t n = r->plan.nparams ? r->plan.nparams : 1;
    size_t nb = r->plan.nbuckets ? r->plan.nbuckets : 1;
    r->ready = calloc(n, 1);
    r->pending = calloc(nb, sizeof *r->pending);
    r->arrival = calloc(n, sizeof *r->arrival);
    r->used = calloc(n, sizeof *r->used);
    r->used_global = calloc(n, sizeof *r->used_global);
    r->works = calloc(nb, sizeof *r->works);
    r->copy_back = calloc(n, sizeof *r->copy_back);
    if (!r->ready || !r->pending || !r->arrival || !r->used || !r->used_global || !r->works ||
        !r->copy_back) {
        ddp_reducer_destroy(r);
        return ddp_error(DDP_ERR_NOMEM, "reducer: out of memory for %zu parameters", n);
    }
    *out = r;
    return DDP_OK;
}

void ddp_reducer_destroy(ddp_reducer *r) {
    if (r == NULL) return;
    ddp_plan_free(&r->plan);
    free(r->ready);
    free(r->pending);
    free(r->arrival);
    free(r->used);
    free(r->used_global);
    free(r->works);
    free(r->copy_back);
    free(r->bufs);
    free(r);
}

const ddp_plan *ddp_reducer_plan(const ddp_reducer *r) { return &r->plan; }

ddp_status ddp_reducer_begin(ddp_reducer *r) {
    if (r->in_iter)
        return ddp_error(DDP_ERR_INVALID, "reducer: a new iteration started before the "
                         "previous one finished its gradient reduction");
    memset(r->ready, 0, r->plan.nparams);
    for (size_t b = 0; b < r->plan.nbuckets; b++)
        r->pending[b] = r->plan.bucket_begin[b + 1] - r->plan.bucket_begin[b];
    memset(r->copy_back, 0, r->plan.nparams * sizeof *r->copy_back);
    r->next_launch = 0;
    r->next_wait = 0;
    r->narrival = 0;
    r->used_launched = 0;
    r->failed = DDP_OK;
    r->failed_msg[0] = '\0';
    r->in_iter = 1;
    return DDP_OK;
}

int ddp_reducer_in_iteration(const ddp_reducer *r) { return r->in_iter; }

ddp_status ddp_reducer_mark_ready(ddp_reducer *r, size_t i, size_t *first, size_t *count) {
    *first = r->next_launch;
    *count = 0;
    if (!r->in_iter)
        return ddp_error(DDP_ERR_INVALID, "reducer: parameter %zu marked ready outside a "
                         "synced iteration", i);
    if (i >= r->plan.nparams)
        return ddp_error(DDP_ERR_INVALID, "reducer: parameter index %zu out of range (%zu "
                         "parameters)", i, r->plan.nparams);
    if (r->ready[i])
        return ddp_error(DDP_ERR_INVALID, "reducer: parameter %zu was marked ready twice in "
                         "one iteration (its gradient was produced twice in one backward "
                         "pass)", i);
    r->ready[i] = 1;
    r->arrival[r->narrival++] = i;
    r->pending[r->plan.param_bucket[i]]--;
    /* Launch in order: stop at the first bucket that still waits for a
     * gradient, even if later ones are complete. */
    while (r->next_launch < r->plan.nbuckets && r->pending[r->next_launch] == 0)
        r->next_launch++;
    *count = r->next_launch - *first;
    return DDP_OK;
}

void ddp_reducer_note_used(ddp_reducer *r, size_t i) {
    if (i < r->plan.nparams) r->used[i] = 1;
}

const int32_t *ddp_reducer_local_used(const ddp_reducer *r) { return r->used; }

size_t ddp_reducer_unready(const ddp_reducer *r, size_t *out, size_t cap) {
    size_t k = 0;
    for (size_t i = 0; i < r->plan.nparams; i++) {
        if (r->in_iter && r->ready[i]) continue;
        if (k < cap) out[k] = i;
        k++;
    }
    return k;
}

size_t ddp_reducer_arrival(const ddp_reducer *r, size_t *out, size_t cap) {
    size_t k = r->narrival < cap ? r->narrival : cap;
    memcpy(out, r->arrival, k * sizeof *out);
    return r->narrival;
}

void ddp_reducer_end(ddp_reducer *r) {
    r->in_iter = 0;
    memset(r->used, 0, r->plan.nparams * sizeof *r->used);
}

void ddp_reducer_fail(ddp_reducer *r, ddp_status st) {
    if (r->failed != DDP_OK) return;
    r->failed = st;
    ddp_copy_error(r->failed_msg, sizeof r->failed_msg);
}
