/* test_reducer_rules.c - unit tests of DDP's per-gradient rules
 * (ddp_grad_rules, csrc/core/ddp_reducer.c) and of the bucket data rule
 * (ddp_plan_bucket_rule): counts and the first gradient of a synced
 * backward, the second-gradient verdict, find_unused_parameters' use flags
 * and end-of-backward list, static_graph's learning, checking and
 * pre-marking, and how each bucket is narrowed, divided and all-reduced.
 * Bookkeeping only: no data path, no communicator. */
#include <stdlib.h>
#include <string.h>

#include "ddp_reducer.h"
#include "testutil.h"

#define NP 4

/* A reducer over NP float32 parameters of 1000 elements, one bucket each
 * (the caps are tiny), and rules in the given modes. */
static void make(int static_graph, int find_unused, ddp_reducer **r, ddp_grad_rules **s) {
    ddp_plan_param ps[NP];
    for (size_t i = 0; i < NP; i++) ps[i] = (ddp_plan_param){1000, DDP_FLOAT32, -1};
    ddp_plan plan;
    T_OK(ddp_plan_buckets(ps, NP, NULL, 4, 4, &plan));
    T_OK(ddp_reducer_create(&plan, r));
    T_OK(ddp_grad_rules_create(NP, static_graph, find_unused, s));
}

static void drop(ddp_reducer *r, ddp_grad_rules *s) {
    ddp_grad_rules_destroy(s);
    ddp_reducer_destroy(r);
}

/* on_grad, returning its verdict. */
static ddp_grad_verdict grad(ddp_grad_rules *s, ddp_reducer *r, size_t i, int has_grad) {
    ddp_grad_verdict v;
    T_OK(ddp_grad_rules_on_grad(s, r, i, has_grad, &v));
    return v;
}

/* What the front-end does with READY: mark the parameter ready. */
static void mark(ddp_reducer *r, size_t i) {
    size_t f, c;
    T_OK(ddp_reducer_mark_ready(r, i, &f, &c));
}

static void test_plain(void) {
    ddp_reducer *r;
    ddp_grad_rules *s;
    make(0, 0, &r, &s);
    T_ASSERT(!ddp_grad_rules_listening(s) && !ddp_grad_rules_learning(s));
    /* No synced backward expected (no_sync, evaluation): ignored, not counted. */
    ddp_grad_verdict v = grad(s, r, 2, 1);
    T_ASSERT(v.action == DDP_GRAD_IGNORE && !v.first && v.count == 0);
    T_ASSERT(ddp_grad_rules_count(s, 2) == 0 && ddp_reducer_local_used(r)[2] == 0);
    for (int iter = 0; iter < 2; iter++) {
        T_OK(ddp_reducer_begin(r));
        ddp_grad_rules_begin(s);
        T_ASSERT(ddp_grad_rules_expecting(s) && ddp_grad_rules_listening(s));
        for (size_t k = 0; k < NP; k++) {
            size_t i = NP - 1 - k;
            v = grad(s, r, i, 1);
            T_ASSERT(v.action == DDP_GRAD_READY && v.first == (k == 0) && v.count == 1);
            T_ASSERT(!v.premark && v.expected == 1);
            mark(r, i);
        }
        size_t idx[NP];
        ddp_grad_end e;
        ddp_grad_rules_end(s, r, idx, &e);
        T_ASSERT(e.outcome == DDP_GRAD_END_OK && e.n == 0 && !e.track_used);
        T_ASSERT(!ddp_grad_rules_expecting(s));
        T_ASSERT(ddp_grad_rules_learn(s) == 0);
        ddp_reducer_end(r);
    }
    /* The use flags are not noted without find_unused. */
    T_ASSERT(ddp_reducer_local_used(r)[0] == 0);
    drop(r, s);
}

static void test_second_gradient(void) {
    ddp_reducer *r;
    ddp_grad_rules *s;
    make(0, 1, &r, &s);     /* find_unused does not allow a second gradient either */
    T_OK(ddp_reducer_begin(r));
    ddp_grad_rules_begin(s);
    T_ASSERT(grad(s, r, 1, 1).action == DDP_GRAD_READY);
    mark(r, 1);
    ddp_grad_verdict v = grad(s, r, 1, 1);
    T_ASSERT(v.action == DDP_GRAD_SECOND && v.count == 2 && !v.first);
    /* A new backward starts the counts again. */
    ddp_reducer_end(r);
    T_OK(ddp_reducer_begin(r));
    ddp_grad_rules_begin(s);
    v = grad(s, r, 1, 1);
    T_ASSERT(v.action == DDP_GRAD_READY && v.first && v.count == 1);
    /* Out of range: refused, nothing counted. */
    T_STATUS(ddp_grad_rules_on_grad(s, r, NP, 1, &v), DDP_ERR_INVALID);
    drop(r, s);
}

static void test_find_unused(void) {
    ddp_reducer *r;
    ddp_grad_rules *s;
    make(0, 1, &r, &s);
    T_ASSERT(ddp_grad_rules_listening(s) && !ddp_grad_rules_expecting(s));
    /* Under no_sync: ignored, but a gradient counts as use (None does not). */
    T_ASSERT(grad(s, r, 0, 1).action == DDP_GRAD_IGNORE);
    T_ASSERT(grad(s, r, 3, 0).action == DDP_GRAD_IGNORE);
    T_ASSERT(ddp_reducer_local_used(r)[0] == 1 && ddp_reducer_local_used(r)[3] == 0);
    T_OK(ddp_reducer_begin(r));
    ddp_grad_rules_begin(s);
    T_ASSERT(grad(s, r, 2, 1).action == DDP_GRAD_READY);
    mark(r, 2);
    size_t idx[NP];
    ddp_grad_end e;
    ddp_grad_rules_end(s, r, idx, &e);
    /* Every unready parameter is handed in, registration order; use is tracked. */
    T_ASSERT(e.outcome == DDP_GRAD_END_OK && e.track_used && e.n == 3);
    T_ASSERT(idx[0] == 0 && idx[1] == 1 && idx[2] == 3);
    T_ASSERT(ddp_reducer_local_used(r)[2] == 1);
    T_ASSERT(!ddp_grad_rules_expecting(s));
    drop(r, s);
}

static void test_unused_error(void) {
    ddp_reducer *r;
    ddp_grad_rules *s;
    make(0, 0, &r, &s);
    T_OK(ddp_reducer_begin(r));
    ddp_grad_rules_begin(s);
    for (size_t i = 0; i < 2; i++) {
        T_ASSERT(grad(s, r, i, 1).action == DDP_GRAD_READY);
        mark(r, i);
    }
    size_t idx[NP];
    ddp_grad_end e;
    ddp_grad_rules_end(s, r, idx, &e);
    T_ASSERT(e.outcome == DDP_GRAD_END_UNUSED && e.n == 2 && idx[0] == 2 && idx[1] == 3);
    T_ASSERT(!e.track_used);
    drop(r, s);
}

/* A static graph: parameter 3 never used, parameter 1 twice per backward
 * (reentrant checkpointing), 0 and 2 once. */
static void static_backward(ddp_grad_rules *s, ddp_reducer *r, int learned) {
    const size_t seq[] = {2, 1, 0, 1};
    for (size_t k = 0; k < 4; k++) {
        ddp_grad_verdict v = grad(s, r, seq[k], 1);
        T_ASSERT(v.first == (k == 0));
        if (!learned) {
            T_ASSERT(v.action == DDP_GRAD_WAIT && !v.premark);
            continue;
        }
        T_ASSERT(v.premark == (k == 0));
        if (v.premark) {
            size_t idx[NP];
            T_ASSERT(ddp_grad_rules_never_used(s, idx) == 1 && idx[0] == 3);
            mark(r, 3);
        }
        int final = seq[k] != 1 || k == 3;
        T_ASSERT(v.action == (final ? DDP_GRAD_READY : DDP_GRAD_WAIT));
        T_ASSERT(v.expected == (seq[k] == 1 ? 2 : 1));
        if (final) mark(r, seq[k]);
    }
}

static void test_static_graph(void) {
    ddp_reducer *r;
    ddp_grad_rules *s;
    make(1, 1, &r, &s);     /* find_unused is moot with static_graph */
    T_ASSERT(ddp_grad_rules_learning(s) && ddp_grad_rules_listening(s));
    size_t idx[NP];
    T_ASSERT(ddp_grad_rules_never_used(s, idx) == 0);
    /* Iteration 1: everything waits; the end hands in every parameter, those
     * seen in arrival order, then the unused one; use is tracked. */
    T_OK(ddp_reducer_begin(r));
    ddp_grad_rules_begin(s);
    static_backward(s, r, 0);
    ddp_grad_end e;
    ddp_grad_rules_end(s, r, idx, &e);
    T_ASSERT(e.outcome == DDP_GRAD_END_OK && e.track_used && e.n == NP);
    T_ASSERT(idx[0] == 2 && idx[1] == 1 && idx[2] == 0 && idx[3] == 3);
    for (size_t k = 0; k < NP; k++) mark(r, idx[k]);
    ddp_reducer_end(r);
    /* A failed finish would not learn; a successful one learns once. */
    T_ASSERT(ddp_grad_rules_learn(s) == 1 && ddp_grad_rules_learn(s) == 0);
    T_ASSERT(!ddp_grad_rules_learning(s) && !ddp_grad_rules_listening(s));
    /* Later iterations: ready as soon as the learned count is reached. */
    for (int iter = 0; iter < 2; iter++) {
        T_OK(ddp_reducer_begin(r));
        ddp_grad_rules_begin(s);
        static_backward(s, r, 1);
        ddp_grad_rules_end(s, r, idx, &e);
        T_ASSERT(e.outcome == DDP_GRAD_END_OK && e.n == 0 && !e.track_used);
        ddp_reducer_end(r);
    }
    /* More gradients than learned: the verdict says so, with both counts. */
    T_OK(ddp_reducer_begin(r));
    ddp_grad_rules_begin(s);
    ddp_grad_verdict v = grad(s, r, 0, 1);
    T_ASSERT(v.action == DDP_GRAD_READY && v.premark);
    mark(r, 3);
    mark(r, 0);
    v = grad(s, r, 0, 1);
    T_ASSERT(v.action == DDP_GRAD_TOO_MANY && v.count == 2 && v.expected == 1);
    /* A gradient for the never-used parameter is one too many as well. */
    v = grad(s, r, 3, 1);
    T_ASSERT(v.action == DDP_GRAD_TOO_MANY && v.count == 1 && v.expected == 0);
    ddp_reducer_end(r);
    /* Fewer gradients than learned: the end names the parameters left. */
    T_OK(ddp_reducer_begin(r));
    ddp_grad_rules_begin(s);
    T_ASSERT(grad(s, r, 2, 1).action == DDP_GRAD_READY);
    mark(r, 3);
    mark(r, 2);
    T_ASSERT(grad(s, r, 1, 1).action == DDP_GRAD_WAIT);
    ddp_grad_rules_end(s, r, idx, &e);
    T_ASSERT(e.outcome == DDP_GRAD_END_STATIC_UNUSED && e.n == 2);
    T_ASSERT(idx[0] == 0 && idx[1] == 1 && !e.track_used);
    drop(r, s);
}

static void test_static_learning_notes_use(void) {
    ddp_reducer *r;
    ddp_grad_rules *s;
    make(1, 0, &r, &s);
    /* Before the first synced iteration (no_sync), use is noted. */
    T_ASSERT(grad(s, r, 1, 1).action == DDP_GRAD_IGNORE);
    T_ASSERT(ddp_reducer_local_used(r)[1] == 1);
    /* An iteration that never finished (its finish failed) is learned again. */
    T_OK(ddp_reducer_begin(r));
    ddp_grad_rules_begin(s);
    T_ASSERT(grad(s, r, 0, 1).action == DDP_GRAD_WAIT);
    ddp_grad_rules_stop(s);
    T_ASSERT(grad(s, r, 0, 1).action == DDP_GRAD_IGNORE);
    ddp_reducer_end(r);
    T_ASSERT(ddp_grad_rules_learning(s));
    /* Rules without a reducer note nothing and still decide. */
    ddp_grad_rules_begin(s);
    T_ASSERT(grad(s, NULL, 0, 1).action == DDP_GRAD_WAIT);
    drop(r, s);
}

static void test_bucket_rule(void) {
    ddp_plan_param ps[] = {{10, DDP_FLOAT32, -1}, {10, DDP_FLOAT16, -1},
                           {10, DDP_BFLOAT16, -1}, {10, DDP_FLOAT64, -1}};
    ddp_plan p;
    const ddp_dtype reduce[] = {DDP_REDUCE_NATIVE, DDP_FLOAT16, DDP_BFLOAT16};
    for (size_t k = 0; k < 3; k++) {
        T_OK(ddp_plan_buckets_as(ps, 4, NULL, 1, 1, reduce[k], &p));
        T_ASSERT(p.nbuckets == 4);
        for (size_t b = 0; b < p.nbuckets; b++) {
            int wide = p.bucket_grad_dtype[b] == DDP_FLOAT32 ||
                       p.bucket_grad_dtype[b] == DDP_FLOAT64;
            int narrow = reduce[k] != DDP_REDUCE_NATIVE && wide;
            int divides = narrow && reduce[k] == DDP_FLOAT16;
            for (int world = 1; world <= 3; world++) {
                ddp_bucket_rule rule = ddp_plan_bucket_rule(&p, b, world);
                T_ASSERT(rule.narrow == narrow);
                T_ASSERT(rule.divisor == (divides ? world : 1));
                T_ASSERT(rule.op == (divides ? DDP_SUM : DDP_AVG));
            }
        }
        ddp_plan_free(&p);
    }
}

int main(void) {
    test_plain();
    test_second_gradient();
    test_find_unused();
    test_unused_error();
    test_static_graph();
    test_static_learning_notes_use();
    test_bucket_rule();
    printf("test_reducer_rules: all passed\n");
    return 0;
}
