/* ddp_reducer.c - readiness bookkeeping of the gradient reducer (contract in
 * ddp_reducer.h): which parameters are ready in this iteration, which
 * buckets may be launched (strictly in bucket order, so every rank issues
 * the same sequence of all-reduces), the order gradients arrived in, and the
 * use flags behind find_unused_parameters. No data moves here; the CPU data
 * path (ddp_reducer_data.c) and the Python generic path both build on it.
 *
 * Beside it, DDP's per-gradient rules (ddp_grad_rules), which decide when a
 * parameter becomes ready: the expected synced backward and its first
 * gradient, per-parameter counts, static_graph's counts (learned in the
 * first synced iteration, checked afterwards), the second-gradient and
 * unused-parameter verdicts, and what the end of backward hands in. Both the
 * C gradient hook and the Python path ask them (csrc/py/py_grad_hooks.c).
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

/* ---- DDP's per-gradient rules ------------------------------------------ */

struct ddp_grad_rules {
    size_t n;
    int static_graph, find_unused;
    int expect;               /* a synced backward is expected */
    int started;              /* a gradient arrived in it */
    int learned;              /* static graph: expected[] holds iteration 1's counts */
    int32_t *count;           /* [n] gradients in the current synced backward */
    int32_t *expected;        /* [n] static graph, learned: the counts of iteration 1 */
    size_t *seen;             /* [n] static graph, learning: first-gradient order */
    size_t nseen;
};

ddp_status ddp_grad_rules_create(size_t n, int static_graph, int find_unused,
                                 ddp_grad_rules **out) {
    *out = NULL;
    ddp_grad_rules *s = calloc(1, sizeof *s);
    size_t m = n ? n : 1;
    if (s != NULL) {
        s->count = calloc(m, sizeof *s->count);
        s->expected = calloc(m, sizeof *s->expected);
        s->seen = calloc(m, sizeof *s->seen);
    }
    if (s == NULL || !s->count || !s->expected || !s->seen) {
        ddp_grad_rules_destroy(s);
        return ddp_error(DDP_ERR_NOMEM, "DDP: out of memory for the gradient rules of %zu "
                         "parameters", n);
    }
    s->n = n;
    s->static_graph = static_graph != 0;
    s->find_unused = find_unused != 0 && !static_graph;
    *out = s;
    return DDP_OK;
}

void ddp_grad_rules_destroy(ddp_grad_rules *s) {
    if (s == NULL) return;
    free(s->count);
    free(s->expected);
    free(s->seen);
    free(s);
}

void ddp_grad_rules_begin(ddp_grad_rules *s) {
    memset(s->count, 0, s->n * sizeof *s->count);
    s->nseen = 0;
    s->started = 0;
    s->expect = 1;
}

void ddp_grad_rules_stop(ddp_grad_rules *s) { s->expect = 0; }

int ddp_grad_rules_expecting(const ddp_grad_rules *s) { return s->expect; }

int ddp_grad_rules_learning(const ddp_grad_rules *s) {
    return s->static_graph && !s->learned;
}

/* Use is noted for find_unused, and in a static graph's first iteration. */
static int tracks_use(const ddp_grad_rules *s) {
    return s->find_unused || ddp_grad_rules_learning(s);
}

int ddp_grad_rules_listening(const ddp_grad_rules *s) { return s->expect || tracks_use(s); }

ddp_status ddp_grad_rules_on_grad(ddp_grad_rules *s, ddp_reducer *r, size_t i, int has_grad,
                                  ddp_grad_verdict *v) {
    memset(v, 0, sizeof *v);
    v->action = DDP_GRAD_IGNORE;
    v->expected = 1;
    if (i >= s->n)
        return ddp_error(DDP_ERR_INVALID, "DDP: gradient of parameter %zu, but there are %zu",
                         i, s->n);
    if (has_grad && r != NULL && tracks_use(s)) ddp_reducer_note_used(r, i);
    if (!s->expect) return DDP_OK;
    v->first = !s->started;
    s->started = 1;
    v->count = ++s->count[i];
    if (!s->static_graph) {
        v->action = v->count > 1 ? DDP_GRAD_SECOND : DDP_GRAD_READY;
        return DDP_OK;
    }
    if (!s->learned) {            /* iteration 1 of a static graph reduces at the end */
        if (v->count == 1) s->seen[s->nseen++] = i;
        v->action = DDP_GRAD_WAIT;
        return DDP_OK;
    }
    v->premark = v->first;        /* parameters the static graph never uses */
    v->expected = s->expected[i];
    v->action = v->count > v->expected ? DDP_GRAD_TOO_MANY
              : v->count < v->expected ? DDP_GRAD_WAIT : DDP_GRAD_READY;
    return DDP_OK;
}

void ddp_grad_rules_end(ddp_grad_rules *s, const ddp_reducer *r, size_t *idx,
                        ddp_grad_end *out) {
    int learning = ddp_grad_rules_learning(s);
    s->expect = 0;
    out->outcome = DDP_GRAD_END_OK;
    out->track_used = s->find_unused || learning;
    out->n = ddp_reducer_unready(r, idx, s->n);
    if (out->n == 0 || s->find_unused) return;
    if (!learning) {
        out->outcome = s->static_graph ? DDP_GRAD_END_STATIC_UNUSED : DDP_GRAD_END_UNUSED;
        return;
    }
    /* Every unready parameter: first those seen, in arrival order, then the
     * rest in registration order. */
    const uint8_t *ready = r->in_iter ? r->ready : NULL;   /* NULL: none is ready */
    size_t k = 0;
    for (size_t j = 0; j < s->nseen; j++)
        if (ready == NULL || !ready[s->seen[j]]) idx[k++] = s->seen[j];
    for (size_t i = 0; i < s->n; i++)
        if ((ready == NULL || !ready[i]) && s->count[i] == 0) idx[k++] = i;
    out->n = k;
}

int ddp_grad_rules_learn(ddp_grad_rules *s) {
    if (!ddp_grad_rules_learning(s)) return 0;
    memcpy(s->expected, s->count, s->n * sizeof *s->count);
    s->learned = 1;
    return 1;
}

size_t ddp_grad_rules_never_used(const ddp_grad_rules *s, size_t *idx) {
    size_t k = 0;
    if (!s->learned) return 0;
    for (size_t i = 0; i < s->n; i++)
        if (s->expected[i] == 0) idx[k++] = i;
    return k;
}

int32_t ddp_grad_rules_count(const ddp_grad_rules *s, size_t i) {
    return i < s->n ? s->count[i] : 0;
}
