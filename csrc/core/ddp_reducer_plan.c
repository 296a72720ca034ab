/* ddp_reducer_plan.c - bucket planning: which parameters share a bucket and
 * where each one sits (contract in ddp_reducer.h).
 *
 * The rule follows torch's compute_bucket_assignment_by_size so that bucket
 * boundaries, and hence the amount of overlap, behave like torch's DDP: walk
 * the parameters in expected ready order; each (dtype, device) key has one
 * open bucket; a parameter joins its key's open bucket (opening one if
 * needed), and the bucket closes as soon as its size reaches the key's
 * current cap. Each key's first bucket uses the small first cap. Buckets are
 * numbered when they open, which is exactly "sorted by their first member's
 * position", the order in which they can become ready. With a reduce dtype
 * the keys stay (gradient dtype, device), but a float32/float64 key's
 * buckets are of the reduce dtype, and their bytes are counted in it.
 * ddp_plan_bucket_rule states how each bucket is then reduced.
 */
#include "ddp_reducer.h"

#include "ddp_dtype_cast.h"

#include <stdlib.h>
#include <string.h>

void ddp_plan_free(ddp_plan *p) {
    if (p == NULL) return;
    free(p->bucket_begin);
    free(p->members);
    free(p->bucket_numel);
    free(p->bucket_dtype);
    free(p->bucket_grad_dtype);
    free(p->bucket_device);
    free(p->param_bucket);
    free(p->param_offset);
    free(p->param_numel);
    memset(p, 0, sizeof *p);
}

/* The expected ready order as an owned array: order[] checked to be a
 * permutation of 0..n-1, or the reverse of registration order. */
static ddp_status ready_sequence(const size_t *order, size_t n, size_t **out) {
    size_t *seq = malloc((n ? n : 1) * sizeof *seq);
    uint8_t *seen = calloc(n ? n : 1, 1);
    if (seq == NULL || seen == NULL) {
        free(seq);
        free(seen);
        return ddp_error(DDP_ERR_NOMEM, "bucket planning: out of memory for %zu parameters", n);
    }
    for (size_t k = 0; k < n; k++) {
        size_t i = order ? order[k] : n - 1 - k;
        if (i >= n || seen[i]) {
            free(seq);
            free(seen);
            return ddp_error(DDP_ERR_INVALID, "bucket planning: the parameter order is not a "
                             "permutation of 0..%zu (entry %zu is %zu)", n - 1, k, i);
        }
        seen[i] = 1;
        seq[k] = i;
    }
    free(seen);
    *out = seq;
    return DDP_OK;
}

/* Per-(dtype, device) planning state: the open bucket and how many buckets
 * of this key closed so far (the first one gets the small cap). */
typedef struct plan_key {
    ddp_dtype dtype;
    int device;
    size_t open;        /* bucket index, or SIZE_MAX when none is open */
    size_t open_bytes;
    size_t closed;
} plan_key;

static ddp_status plan_alloc(ddp_plan *p, size_t n) {
    size_t m = n ? n : 1;  /* at most one bucket per parameter */
    p->nparams = n;
    p->bucket_begin = calloc(m + 1, sizeof *p->bucket_begin);
    p->members = malloc(m * sizeof *p->members);
    p->bucket_numel = calloc(m, sizeof *p->bucket_numel);
    p->bucket_dtype = malloc(m * sizeof *p->bucket_dtype);
    p->bucket_grad_dtype = malloc(m * sizeof *p->bucket_grad_dtype);
    p->bucket_device = malloc(m * sizeof *p->bucket_device);
    p->param_bucket = malloc(m * sizeof *p->param_bucket);
    p->param_offset = malloc(m * sizeof *p->param_offset);
    p->param_numel = malloc(m * sizeof *p->param_numel);
    if (!p->bucket_begin || !p->members || !p->bucket_numel || !p->bucket_dtype ||
        !p->bucket_grad_dtype || !p->bucket_device || !p->param_bucket || !p->param_offset ||
        !p->param_numel)
        return ddp_error(DDP_ERR_NOMEM, "bucket planning: out of memory for %zu parameters", n);
    return DDP_OK;
}

/* Find or add the key of (dtype, device) among keys[0..*nkeys). */
static plan_key *key_for(plan_key *keys, size_t *nkeys, ddp_dtype t, int device) {
    for (size_t k = 0; k < *nkeys; k++)
        if (keys[k].dtype == t && keys[k].device == device) return &keys[k];
    plan_key *k = &keys[(*nkeys)++];
    k->dtype = t;
    k->device = device;
    k->open = SIZE_MAX;
    k->open_bytes = 0;
    k->closed = 0;
    return k;
}

ddp_status ddp_plan_buckets(const ddp_plan_param *params, size_t n, const size_t *order,
                            size_t first_cap_bytes, size_t cap_bytes, ddp_plan *out) {
    return ddp_plan_buckets_as(params, n, order, first_cap_bytes, cap_bytes, DDP_REDUCE_NATIVE,
                               out);
}

/* The dtype parameter i's gradient is reduced in (checked by the caller). */
static ddp_dtype wire_dtype(ddp_dtype t, ddp_dtype reduce) {
    return ddp_cast_narrows(t, reduce) ? reduce : t;
}

/* DDP_OK if reduce is a valid reduce dtype for every parameter. */
static ddp_status check_reduce(const ddp_plan_param *params, size_t n, ddp_dtype reduce) {
    if (reduce == DDP_REDUCE_NATIVE) return DDP_OK;
    if (reduce != DDP_FLOAT16 && reduce != DDP_BFLOAT16)
        return ddp_error(DDP_ERR_INVALID, "bucket planning: the reduce dtype must be float16 "
                         "or bfloat16 (got code %d)", (int)reduce);
    for (size_t i = 0; i < n; i++) {
        ddp_dtype t = params[i].dtype;
        if (t != DDP_FLOAT16 && t != DDP_BFLOAT16 && t != DDP_FLOAT32 && t != DDP_FLOAT64)
            return ddp_error(DDP_ERR_TYPE, "bucket planning: parameter %zu is %s; a reduce "
                             "dtype (%s) applies to floating-point gradients only", i,
                             ddp_dtype_name(t), ddp_dtype_name(reduce));
    }
    return DDP_OK;
}

ddp_status ddp_plan_buckets_as(const ddp_plan_param *params, size_t n, const size_t *order,
                               size_t first_cap_bytes, size_t cap_bytes, ddp_dtype reduce_dtype,
                               ddp_plan *out) {
    memset(out, 0, sizeof *out);
    if (first_cap_bytes == 0 || cap_bytes == 0)
        return ddp_error(DDP_ERR_INVALID, "bucket planning: bucket caps must be positive "
                         "(got first %zu bytes, then %zu bytes); check bucket_cap_mb > 0",
                         first_cap_bytes, cap_bytes);
    for (size_t i = 0; i < n; i++)
        if ((unsigned)params[i].dtype >= DDP_DTYPE_COUNT)
            return ddp_error(DDP_ERR_INVALID, "bucket planning: parameter %zu has an unknown "
                             "dtype code %d", i, (int)params[i].dtype);
    ddp_status st = check_reduce(params, n, reduce_dtype);
    if (st != DDP_OK) return st;
    size_t *seq = NULL;
    st = ready_sequence(order, n, &seq);
    if (st != DDP_OK) return st;
    plan_key *keys = malloc((n ? n : 1) * sizeof *keys);
    if (keys == NULL) {
        free(seq);
        return ddp_error(DDP_ERR_NOMEM, "bucket planning: out of memory");
    }
    if ((st = plan_alloc(out, n)) != DDP_OK) {
        free(seq);
        free(keys);
        ddp_plan_free(out);
        return st;
    }
    size_t nkeys = 0, nb = 0;
    /* Pass 1: assign buckets and offsets in ready order. */
    for (size_t k = 0; k < n; k++) {
        size_t i = seq[k];
        plan_key *key = key_for(keys, &nkeys, params[i].dtype, params[i].device);
        if (key->open == SIZE_MAX) {
            key->open = nb++;
            key->open_bytes = 0;
            out->bucket_dtype[key->open] = wire_dtype(params[i].dtype, reduce_dtype);
            out->bucket_grad_dtype[key->open] = params[i].dtype;
            out->bucket_device[key->open] = params[i].device;
        }
        size_t b = key->open;
        out->param_bucket[i] = b;
        out->param_offset[i] = out->bucket_numel[b];
        out->param_numel[i] = params[i].numel;
        out->bucket_numel[b] += params[i].numel;
        key->open_bytes += params[i].numel * ddp_dtype_size(out->bucket_dtype[b]);
        size_t cap = key->closed == 0 ? first_cap_bytes : cap_bytes;
        if (key->open_bytes >= cap) {
            key->open = SIZE_MAX;
            key->closed++;
        }
    }
    out->nbuckets = nb;
    /* Pass 2: members grouped by bucket (a counting sort that keeps ready
     * order inside each bucket, matching the offsets). */
    for (size_t i = 0; i < n; i++) out->bucket_begin[out->param_bucket[i] + 1]++;
    for (size_t b = 0; b < nb; b++) out->bucket_begin[b + 1] += out->bucket_begin[b];
    size_t *fill = calloc(nb ? nb : 1, sizeof *fill);
    if (fill == NULL) {
        free(seq);
        free(keys);
        ddp_plan_free(out);
        return ddp_error(DDP_ERR_NOMEM, "bucket planning: out of memory");
    }
    for (size_t k = 0; k < n; k++) {
        size_t b = out->param_bucket[seq[k]];
        out->members[out->bucket_begin[b] + fill[b]++] = seq[k];
    }
    free(fill);
    free(seq);
    free(keys);
    return DDP_OK;
}

ddp_bucket_rule ddp_plan_bucket_rule(const ddp_plan *p, size_t b, int world_size) {
    ddp_bucket_rule rule = {0, 1, DDP_AVG};
    rule.narrow = p->bucket_grad_dtype[b] != p->bucket_dtype[b];
    if (rule.narrow && p->bucket_dtype[b] == DDP_FLOAT16) {
        /* divided slots: their sum across ranks is the mean */
        rule.divisor = world_size > 1 ? world_size : 1;
        rule.op = DDP_SUM;
    }
    return rule;
}
