/* ddp_reducer.h - gradient bucketing for data-parallel training.
 *
 * Three layers, each usable without the next:
 *
 * 1. Planning (ddp_reducer_plan.c). Parameters are described only by element
 *    count, dtype and a device key, so the plan is the same for CPU arrays,
 *    GPU arrays or anything else. Parameters are taken in the order their
 *    gradients are expected to become ready (by default the reverse of
 *    registration order; after the first iteration, the order observed on
 *    rank 0) and packed into buckets of one (dtype, device) each. A bucket
 *    closes once it holds at least its cap in bytes: the first bucket of
 *    each (dtype, device) is capped at first_cap_bytes (1 MiB in DDP) so the
 *    first all-reduce starts early, later ones at cap_bytes (bucket_cap_mb).
 *    Buckets are numbered in the order their first member becomes ready, and
 *    every rank computes the same plan from the same inputs.
 *    With a reduce dtype (float16 or bfloat16), float32/float64 parameters
 *    get buckets of that dtype: caps count its bytes, the data path narrows
 *    gradients on the way in and widens averages on the way out
 *    (ddp_plan_bucket_rule says how each bucket is reduced).
 *
 * 2. Readiness bookkeeping (ddp_reducer.c). One synced iteration runs
 *    begin -> mark_ready per parameter -> (launch buckets) -> end. A bucket
 *    is launchable once all its parameters are ready AND every earlier bucket
 *    was handed out, so all ranks launch their all-reduces in bucket order no
 *    matter in which order gradients arrive. It also records the arrival
 *    order (for the one-time rebuild) and which parameters were used since
 *    the last synced iteration (for find_unused_parameters). Beside it, in
 *    the same file, DDP's per-gradient rules (ddp_grad_rules: counts, the
 *    first gradient, static_graph's learned counts, the second-gradient
 *    error) decide when a parameter is ready; every front-end path asks them.
 *
 * 3. The data path for buffers the CPU can read and write
 *    (ddp_reducer_data.c): copy each ready gradient into its bucket slot,
 *    launch each launchable bucket's averaged all-reduce through a small ops
 *    table (ddp_reducer_pg_ops submits it through a process group's ddp_pg
 *    table; the CPU communicator queues it on its worker thread, so
 *    communication overlaps the rest of backward), then at the end wait for
 *    all of them and copy the averages back into the gradient arrays.
 *
 * Threads: a ddp_reducer is used by one thread at a time (the caller's; the
 * Python layer holds the GIL or owns the object). Bucket buffers and
 * gradient/copy-back pointers are borrowed: the caller keeps them alive and
 * unmoved until the iteration that uses them has finished or been drained.
 */
#ifndef DDP_REDUCER_H
#define DDP_REDUCER_H

#include <stddef.h>
#include <stdint.h>
#include "ddp_clock.h"
#include "ddp_pg.h"
#include "ddp_dtype.h"
#include "ddp_status.h"

#define DDP_REDUCER_FIRST_BUCKET_BYTES ((size_t)1 << 20)

/* ---- 1. planning ----------------------------------------------------- */

typedef struct ddp_plan_param {
    size_t numel;      /* elements */
    ddp_dtype dtype;
    int device;        /* opaque key: params on different devices never share a bucket */
} ddp_plan_param;

/* A bucket plan. All arrays are owned by the plan (ddp_plan_free). */
typedef struct ddp_plan {
    size_t nparams, nbuckets;
    size_t *bucket_begin;    /* [nbuckets + 1]: bucket b holds members[begin[b] .. begin[b+1]) */
    size_t *members;         /* [nparams]: parameter indices, bucket by bucket, ready order */
    size_t *bucket_numel;    /* [nbuckets] elements */
    ddp_dtype *bucket_dtype; /* [nbuckets] the buckets' own (wire) dtype */
    ddp_dtype *bucket_grad_dtype; /* [nbuckets] its gradients' dtype: bucket_dtype, or
                                   * float32/float64 narrowed to a reduce dtype */
    int *bucket_device;      /* [nbuckets] */
    size_t *param_bucket;    /* [nparams]: the bucket of parameter i */
    size_t *param_offset;    /* [nparams]: element offset of parameter i in its bucket */
    size_t *param_numel;     /* [nparams]: elements of parameter i */
} ddp_plan;

/* Plan buckets for n parameters. order: the parameter indices in expected
 * ready order (a permutation of 0..n-1), or NULL for n-1, n-2, ..., 0.
 * Caps are in bytes and must be > 0. On failure (DDP_ERR_INVALID for a bad
 * order, cap or dtype; DDP_ERR_NOMEM) *out is zeroed and owns nothing. */
ddp_status ddp_plan_buckets(const ddp_plan_param *params, size_t n, const size_t *order,
                            size_t first_cap_bytes, size_t cap_bytes, ddp_plan *out);

/* No reduce dtype: every gradient is reduced in its own dtype. */
#define DDP_REDUCE_NATIVE DDP_DTYPE_COUNT

/* ddp_plan_buckets with a reduce dtype: DDP_FLOAT16 or DDP_BFLOAT16 puts
 * float32/float64 parameters in buckets of that dtype (their bytes, in it,
 * count against the caps), float16/bfloat16 parameters in buckets of their
 * own; DDP_REDUCE_NATIVE is ddp_plan_buckets. DDP_ERR_INVALID for another
 * reduce dtype, DDP_ERR_TYPE for a parameter that is not floating point
 * when a reduce dtype is given. */
ddp_status ddp_plan_buckets_as(const ddp_plan_param *params, size_t n, const size_t *order,
                               size_t first_cap_bytes, size_t cap_bytes, ddp_dtype reduce_dtype,
                               ddp_plan *out);

/* Free a plan's arrays and zero it. Safe on a zeroed plan. */
void ddp_plan_free(ddp_plan *p);

/* How bucket b of a plan is reduced across world_size ranks: the one
 * statement of the bucket data rule, which the CPU data path follows and the
 * generic (array library / NCCL) path asks for. A narrowed bucket
 * (bucket_grad_dtype != bucket_dtype) rounds each gradient once to the
 * bucket's dtype on the way in and widens the average on the way out; a
 * float16 one divides each gradient by world_size first and is all-reduced
 * with SUM (the sum is then the average, and cannot overflow where the
 * gradients do not, as torch's fp16_compress_hook); every other bucket holds
 * the gradients themselves and is all-reduced with AVG. */
typedef struct ddp_bucket_rule {
    int narrow;         /* round to bucket_dtype on the way in, widen on the way out */
    int divisor;        /* divide each gradient by this on the way in (1: not at all) */
    ddp_redop op;       /* DDP_SUM over divided slots, else DDP_AVG */
} ddp_bucket_rule;

/* The rule of bucket b (< nbuckets) for world_size >= 1 ranks. */
ddp_bucket_rule ddp_plan_bucket_rule(const ddp_plan *p, size_t b, int world_size);

/* ---- 2. readiness ---------------------------------------------------- */

typedef struct ddp_reducer ddp_reducer;

/* Take ownership of *plan (which is zeroed) and build a reducer for it.
 * On failure the plan is freed and *out is NULL. */
ddp_status ddp_reducer_create(ddp_plan *plan, ddp_reducer **out);

/* Free everything. The caller drains first if work may be in flight
 * (ddp_reducer_pending); NULL is a no-op. */
void ddp_reducer_destroy(ddp_reducer *r);

const ddp_plan *ddp_reducer_plan(const ddp_reducer *r);

/* Start a synced iteration: no parameter ready, no bucket launched.
 * DDP_ERR_INVALID if the previous iteration has not ended. */
ddp_status ddp_reducer_begin(ddp_reducer *r);

/* 1 between begin and end. */
int ddp_reducer_in_iteration(const ddp_reducer *r);

/* Mark parameter i ready (bookkeeping only). Returns in *first, *count the
 * range of buckets that may now be launched, in order (count may be 0).
 * DDP_ERR_INVALID, changing nothing, if i is out of range, no iteration is
 * running, or i is already ready in this iteration. */
ddp_status ddp_reducer_mark_ready(ddp_reducer *r, size_t i, size_t *first, size_t *count);

/* Record that parameter i received a gradient (also outside synced
 * iterations, e.g. under no_sync); cleared when a synced iteration ends. */
void ddp_reducer_note_used(ddp_reducer *r, size_t i);

/* The local use flags since the last synced iteration ended ([nparams]). */
const int32_t *ddp_reducer_local_used(const ddp_reducer *r);

/* Write up to cap indices of parameters not ready yet (registration order)
 * to out; returns how many there are in total. */
size_t ddp_reducer_unready(const ddp_reducer *r, size_t *out, size_t cap);

/* Write the indices of parameters marked ready in this (or the last)
 * iteration, in the order they were marked, to out (cap >= nparams);
 * returns their number. */
size_t ddp_reducer_arrival(const ddp_reducer *r, size_t *out, size_t cap);

/* End the iteration (bookkeeping only): clears the local use flags. */
void ddp_reducer_end(ddp_reducer *r);

/* ---- 2b. DDP's per-gradient rules ------------------------------------ */

/* The one owner of the rules that turn "parameter i's gradient was
 * accumulated" into what DDP does with it (torch's semantics): whether a
 * synced backward is expected, the first gradient of that backward (after
 * which the front-end runs the end-of-backward step), each parameter's
 * gradient count in it, the use flags of find_unused_parameters (noted in
 * the reducer), and for static_graph the counts learned in the first synced
 * iteration and checked in every later one. It lives apart from the reducer
 * because it outlives it: DDP re-plans its buckets once (a new reducer),
 * while a static graph's learned counts stay. Errors of the model (a second
 * gradient, a graph that is not static, unused parameters) are verdicts, not
 * statuses: the front-end words them, naming the parameters. One thread at a
 * time (the Python layer holds the GIL). */
typedef struct ddp_grad_rules ddp_grad_rules;

/* Rules for n parameters. static_graph: the graph is the same every
 * iteration (learned in the first synced one). find_unused: parameters may
 * get no gradient (find_unused_parameters without static_graph; with
 * static_graph the first iteration tracks use and later ones need not).
 * DDP_ERR_NOMEM with *out NULL. */
ddp_status ddp_grad_rules_create(size_t n, int static_graph, int find_unused,
                                 ddp_grad_rules **out);
void ddp_grad_rules_destroy(ddp_grad_rules *s);

/* A synced backward is expected (the forward ran with gradients enabled,
 * outside no_sync): every count 0, no gradient arrived yet. */
void ddp_grad_rules_begin(ddp_grad_rules *s);

/* No synced backward is expected any more (it ended, or DDP is gone). */
void ddp_grad_rules_stop(ddp_grad_rules *s);

/* 1 while a synced backward is expected. */
int ddp_grad_rules_expecting(const ddp_grad_rules *s);

/* 1 if a gradient arriving now matters at all: a synced backward is
 * expected, or use is tracked (find_unused, or a static graph's first
 * iteration, where gradients under no_sync count as use too). */
int ddp_grad_rules_listening(const ddp_grad_rules *s);

/* 1 for a static graph whose counts are not learned yet. */
int ddp_grad_rules_learning(const ddp_grad_rules *s);

typedef enum ddp_grad_action {
    DDP_GRAD_IGNORE = 0,    /* no synced backward expected: nothing to reduce */
    DDP_GRAD_WAIT,          /* counted, not final yet (static graph: more to come, or
                             * its first iteration, which reduces at the end) */
    DDP_GRAD_READY,         /* final for this backward: hand it to the data path */
    DDP_GRAD_SECOND,        /* error: a second gradient in one backward, no static_graph */
    DDP_GRAD_TOO_MANY       /* error: static_graph, more gradients than in iteration 1 */
} ddp_grad_action;

typedef struct ddp_grad_verdict {
    ddp_grad_action action;
    int first;              /* the first gradient of this synced backward */
    int premark;            /* static graph: hand the never-used parameters
                             * (ddp_grad_rules_never_used) to the data path first */
    int32_t count;          /* parameter i's gradients in this backward, this one included */
    int32_t expected;       /* static graph (learned): its count in iteration 1; else 1 */
} ddp_grad_verdict;

/* Parameter i's gradient was accumulated; has_grad: it is not None (a hook
 * may run for a parameter whose gradient was reset). Notes its use in r when
 * use is tracked (r may be NULL: nothing noted), then, in an expected synced
 * backward, counts it and decides (*v). DDP_ERR_INVALID, nothing changed,
 * for i out of range. */
ddp_status ddp_grad_rules_on_grad(ddp_grad_rules *s, ddp_reducer *r, size_t i, int has_grad,
                                  ddp_grad_verdict *v);

typedef enum ddp_grad_end_outcome {
    DDP_GRAD_END_OK = 0,        /* hand the listed parameters in, in order, then finish */
    DDP_GRAD_END_UNUSED,        /* error: the listed parameters got no gradient */
    DDP_GRAD_END_STATIC_UNUSED  /* error: ... though they did in a static graph's first
                                 * iteration */
} ddp_grad_end_outcome;

typedef struct ddp_grad_end {
    ddp_grad_end_outcome outcome;
    size_t n;                   /* indices written to the caller's array */
    int track_used;             /* finish with the use flags (ddp_reducer_finish) */
} ddp_grad_end;

/* The synced backward is over (stops expecting): which parameters that are
 * not ready in r still have to be handed to the data path (as their current
 * gradient or zeros), in which order, or which ones make it an error.
 * find_unused: every unready one, registration order; a static graph's
 * first iteration: every parameter, in the order its first gradient arrived,
 * then those that got none. idx holds n >= nparams entries. */
void ddp_grad_rules_end(ddp_grad_rules *s, const ddp_reducer *r, size_t *idx,
                        ddp_grad_end *out);

/* After the first synced iteration of a static graph finished without
 * error: its counts become the expected ones. Returns 1 if it learned them
 * now, 0 otherwise (not a static graph, or learned before). */
int ddp_grad_rules_learn(ddp_grad_rules *s);

/* Write the parameters a learned static graph never gives a gradient
 * (expected count 0) to idx (n >= nparams entries); returns how many. */
size_t ddp_grad_rules_never_used(const ddp_grad_rules *s, size_t *idx);

/* Parameter i's gradients in the current (or last) synced backward. */
int32_t ddp_grad_rules_count(const ddp_grad_rules *s, size_t i);

/* ---- 3. CPU data path ------------------------------------------------ */

/* How the data path starts and finishes an in-place all-reduce. wait sets
 * *done = 1 and returns the operation's status once it finished, or sets
 * *done = 0 when w expired or was aborted first (the operation still runs).
 * A launched handle is released exactly once, after it is done. */
typedef struct ddp_reducer_ops {
    ddp_status (*launch)(void *ctx, void *buf, size_t count, ddp_dtype t, ddp_redop op,
                         void **handle);
    ddp_status (*wait)(void *ctx, void *handle, ddp_wait w, int *done);
    void (*release)(void *ctx, void *handle);
} ddp_reducer_ops;

/* Ops over a process group: ctx is a ddp_pg* (borrowed: the caller keeps
 * the ddp_pg, and a reference on its communicator, valid while attached).
 * Each launch is a ddp_pg_submit with the communicator's default timeout. */
extern const ddp_reducer_ops ddp_reducer_pg_ops;

/* Give the reducer its bucket buffers (bufs[b] holds bucket_numel[b]
 * elements of bucket_dtype[b]; borrowed) and the ops that reduce them across
 * world_size ranks. Each bucket is filled and all-reduced as
 * ddp_plan_bucket_rule says. With world_size 1 the data path moves nothing:
 * the average over one rank is the gradient itself. DDP_ERR_INVALID if an
 * iteration is running or a buffer is NULL. */
ddp_status ddp_reducer_attach(ddp_reducer *r, void *const *bufs, const ddp_reducer_ops *ops,
                              void *ctx, int world_size);

/* The address of parameter i's slot in its bucket (NULL before attach). */
void *ddp_reducer_slot(const ddp_reducer *r, size_t i);

/* Parameter i's gradient is ready: copy grad (numel elements of dtype t,
 * the bucket's bucket_grad_dtype; NULL means zeros) into its slot unless it
 * already is the slot (narrowed and divided as ddp_plan_bucket_rule says),
 * mark it ready, and launch every bucket that became
 * launchable. copy_back: where finish writes the averaged gradient, in dtype
 * t (NULL: nowhere; the slot itself: no copy needed). With world size 1 and
 * copy_back == grad nothing is copied, so the gradient stays exact. Wrong dtype or size gives DDP_ERR_TYPE / DDP_ERR_INVALID with
 * nothing changed. A failed launch is returned and also remembered, so
 * finish reports it too. */
ddp_status ddp_reducer_ready(ddp_reducer *r, size_t i, const void *grad, ddp_dtype t,
                             size_t numel, void *copy_back);

/* Number of launched all-reduces not yet waited for. */
size_t ddp_reducer_pending(const ddp_reducer *r);

/* Finish the iteration. Requires every parameter ready (DDP_ERR_INVALID
 * otherwise, nothing changed). With track_used, the local use flags are
 * all-reduced (sum) after the buckets. Then waits, in bucket order, for
 * every all-reduce; if w expires or is aborted first it returns
 * DDP_ERR_TIMEOUT / DDP_ERR_ABORTED and may simply be called again. Each
 * average goes to its copy_back destination: without track_used as soon as
 * its bucket is done (overlapping the later buckets), with it once the use
 * flags are known, skipping parameters that no rank used. After a failure
 * nothing more is copied. Ends the iteration once everything is done and
 * returns the first error, naming the bucket. */
ddp_status ddp_reducer_finish(ddp_reducer *r, int track_used, ddp_wait w);

/* After a successful finish with track_used: how many ranks used parameter
 * i ([nparams]; all 1 with world size 1). */
const int32_t *ddp_reducer_global_used(const ddp_reducer *r);

/* Wait for and release every launched all-reduce, ignoring their results,
 * then end the iteration without copying anything back. For error paths:
 * break the communicator first if peers may never join. Returns
 * DDP_ERR_TIMEOUT / DDP_ERR_ABORTED (call again) if w ends first. */
ddp_status ddp_reducer_drain(ddp_reducer *r, ddp_wait w);

#endif
