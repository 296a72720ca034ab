/* test_reducer.c - unit tests of the gradient reducer: bucket planning
 * against hand-computed plans and structural invariants, readiness and
 * in-order launching, and the CPU data path with simulated ranks (a fake
 * ops table that reduces once every rank has launched the same bucket, so
 * ordering mistakes show up as mismatches) and with real communicators
 * (threads as ranks over loopback). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp_comm.h"
#include "ddp_reducer.h"
#include "ddp_store.h"
#include "testutil.h"

#define F32(n) {(n), DDP_FLOAT32, -1}
#define KB(n) ((size_t)(n) * 1024)

/* ---- planning --------------------------------------------------------- */

/* Every parameter sits in exactly one bucket of its dtype and device, slots
 * tile each bucket without gaps in member order, and every bucket but the
 * last of its key reached its cap while holding less before its last member. */
static void check_plan_invariants(const ddp_plan_param *ps, size_t n, const ddp_plan *p,
                                  size_t first_cap, size_t cap) {
    T_ASSERT(p->nparams == n);
    T_ASSERT(p->bucket_begin[0] == 0 && p->bucket_begin[p->nbuckets] == n);
    int *seen = calloc(n + 1, sizeof *seen);
    for (size_t b = 0; b < p->nbuckets; b++) {
        size_t off = 0, bytes = 0, last = 0;
        T_ASSERT(p->bucket_begin[b + 1] > p->bucket_begin[b]);
        for (size_t k = p->bucket_begin[b]; k < p->bucket_begin[b + 1]; k++) {
            size_t i = p->members[k];
            T_ASSERT(i < n && !seen[i]);
            seen[i] = 1;
            T_ASSERT(p->param_bucket[i] == b && p->param_offset[i] == off);
            T_ASSERT(p->param_numel[i] == ps[i].numel);
            T_ASSERT(ps[i].dtype == p->bucket_dtype[b] && ps[i].device == p->bucket_device[b]);
            off += ps[i].numel;
            last = ps[i].numel * ddp_dtype_size(ps[i].dtype);
            bytes += last;
        }
        T_ASSERT(off == p->bucket_numel[b]);
        /* Is this the last bucket of its key? */
        int later = 0, earlier = 0;
        for (size_t c = 0; c < p->nbuckets; c++)
            if (p->bucket_dtype[c] == p->bucket_dtype[b] &&
                p->bucket_device[c] == p->bucket_device[b]) {
                later |= c > b;
                earlier |= c < b;
            }
        size_t lim = earlier ? cap : first_cap;
        if (later) T_ASSERT(bytes >= lim);
        T_ASSERT(bytes - last < lim);
    }
    free(seen);
}

static void test_plan_default_order(void) {
    /* float32 parameters, registration order; caps 4 KiB then 8 KiB. Ready
     * order is 5,4,3,2,1,0. Hand plan: bucket 0 = {5 (512 B), 4 (2 KiB),
     * 3 (4 KiB)} closes at 6.5 KiB >= 4 KiB; bucket 1 = {2 (4 KiB),
     * 1 (4 KiB)} closes at 8 KiB; bucket 2 = {0}. */
    ddp_plan_param ps[] = {F32(10), F32(1024), F32(1024), F32(1024), F32(512), F32(128)};
    ddp_plan p;
    T_OK(ddp_plan_buckets(ps, 6, NULL, KB(4), KB(8), &p));
    T_ASSERT(p.nbuckets == 3);
    size_t want_members[] = {5, 4, 3, 2, 1, 0};
    size_t want_begin[] = {0, 3, 5, 6};
    for (int k = 0; k < 6; k++) T_ASSERT(p.members[k] == want_members[k]);
    for (int b = 0; b < 4; b++) T_ASSERT(p.bucket_begin[b] == want_begin[b]);
    T_ASSERT(p.param_offset[5] == 0 && p.param_offset[4] == 128 && p.param_offset[3] == 640);
    T_ASSERT(p.bucket_numel[0] == 1664 && p.bucket_numel[1] == 2048 && p.bucket_numel[2] == 10);
    check_plan_invariants(ps, 6, &p, KB(4), KB(8));
    ddp_plan_free(&p);
    ddp_plan_free(&p);  /* idempotent on a zeroed plan */
}

static void test_plan_mixed_keys(void) {
    /* float64 and float32 interleaved, and a parameter on another device.
     * Ready order (reverse): 6 f32, 5 f64, 4 f32(dev 0), 3 f64, 2 f32, 1 f64,
     * 0 f32. Caps 1 KiB / 2 KiB. f32 key: {6:1 KiB} closes; {2:1 KiB, 0:1 KiB}
     * closes at 2 KiB. f64 key: {5:512 B, 3:512 B} closes at 1 KiB; {1}.
     * device 0 key: {4}. Buckets numbered by first member: 6 ->b0, 5 ->b1,
     * 4 ->b2, 2 ->b3, 1 ->b4. */
    ddp_plan_param ps[] = {
        F32(256), {128, DDP_FLOAT64, -1}, F32(256), {64, DDP_FLOAT64, -1},
        {256, DDP_FLOAT32, 0}, {64, DDP_FLOAT64, -1}, F32(256)};
    ddp_plan p;
    T_OK(ddp_plan_buckets(ps, 7, NULL, KB(1), KB(2), &p));
    T_ASSERT(p.nbuckets == 5);
    size_t want_bucket[] = {3, 4, 3, 1, 2, 1, 0};
    for (int i = 0; i < 7; i++) T_ASSERT(p.param_bucket[i] == want_bucket[i]);
    T_ASSERT(p.bucket_dtype[1] == DDP_FLOAT64 && p.bucket_device[2] == 0);
    T_ASSERT(p.param_offset[0] == 256 && p.param_offset[3] == 64);
    check_plan_invariants(ps, 7, &p, KB(1), KB(2));
    ddp_plan_free(&p);
}

static void test_plan_explicit_order_and_errors(void) {
    ddp_plan_param ps[] = {F32(300), F32(300), F32(300), F32(300)};
    size_t order[] = {1, 3, 0, 2};
    ddp_plan p;
    T_OK(ddp_plan_buckets(ps, 4, order, 1200, 2400, &p));
    /* 1 (1200 B) closes bucket 0; {3, 0} = 2400 B closes bucket 1; {2}. */
    T_ASSERT(p.nbuckets == 3 && p.members[0] == 1 && p.members[1] == 3 && p.members[2] == 0);
    T_ASSERT(p.param_offset[0] == 300 && p.param_bucket[2] == 2);
    ddp_plan_free(&p);

    size_t dup[] = {1, 1, 0, 2};
    T_STATUS(ddp_plan_buckets(ps, 4, dup, 1200, 2400, &p), DDP_ERR_INVALID);
    T_ASSERT(p.nbuckets == 0 && p.members == NULL);
    size_t range[] = {1, 4, 0, 2};
    T_STATUS(ddp_plan_buckets(ps, 4, range, 1200, 2400, &p), DDP_ERR_INVALID);
    T_STATUS(ddp_plan_buckets(ps, 4, NULL, 0, 2400, &p), DDP_ERR_INVALID);
    ddp_plan_param badt[] = {{4, (ddp_dtype)99, -1}};
    T_STATUS(ddp_plan_buckets(badt, 1, NULL, 10, 10, &p), DDP_ERR_INVALID);
    T_OK(ddp_plan_buckets(ps, 0, NULL, 10, 10, &p));
    T_ASSERT(p.nbuckets == 0);
    ddp_plan_free(&p);

    /* A large random-ish plan keeps the invariants. */
    enum { N = 200 };
    ddp_plan_param big[N];
    for (int i = 0; i < N; i++) {
        big[i].numel = (size_t)((i * 7919) % 5000) + 1;
        big[i].dtype = (i % 3 == 0) ? DDP_FLOAT64 : (i % 5 == 0) ? DDP_BFLOAT16 : DDP_FLOAT32;
        big[i].device = (i % 11 == 0) ? 1 : -1;
    }
    T_OK(ddp_plan_buckets(big, N, NULL, KB(16), KB(64), &p));
    check_plan_invariants(big, N, &p, KB(16), KB(64));
    ddp_plan_free(&p);
}

/* ---- readiness -------------------------------------------------------- */

static void test_readiness_order(void) {
    /* Caps of one element each: every parameter is its own bucket; ready
     * order 3,2,1,0, so bucket b holds parameter 3-b. */
    ddp_plan_param ps[] = {F32(1), F32(1), F32(1), F32(1)};
    ddp_plan p;
    T_OK(ddp_plan_buckets(ps, 4, NULL, 1, 1, &p));
    ddp_reducer *r;
    T_OK(ddp_reducer_create(&p, &r));
    T_ASSERT(p.members == NULL);  /* ownership moved */
    size_t first, count, idx[8];
    T_STATUS(ddp_reducer_mark_ready(r, 0, &first, &count), DDP_ERR_INVALID);  /* no iteration */
    T_OK(ddp_reducer_begin(r));
    T_STATUS(ddp_reducer_begin(r), DDP_ERR_INVALID);
    /* Bucket 2 (param 1) completes first: nothing may launch yet. */
    T_OK(ddp_reducer_mark_ready(r, 1, &first, &count));
    T_ASSERT(count == 0);
    T_OK(ddp_reducer_mark_ready(r, 3, &first, &count));
    T_ASSERT(first == 0 && count == 1);
    T_OK(ddp_reducer_mark_ready(r, 2, &first, &count));   /* releases buckets 1 and 2 */
    T_ASSERT(first == 1 && count == 2);
    T_STATUS(ddp_reducer_mark_ready(r, 2, &first, &count), DDP_ERR_INVALID);
    T_STATUS(ddp_reducer_mark_ready(r, 9, &first, &count), DDP_ERR_INVALID);
    T_ASSERT(ddp_reducer_unready(r, idx, 8) == 1 && idx[0] == 0);
    T_OK(ddp_reducer_mark_ready(r, 0, &first, &count));
    T_ASSERT(first == 3 && count == 1);
    T_ASSERT(ddp_reducer_arrival(r, idx, 8) == 4);
    T_ASSERT(idx[0] == 1 && idx[1] == 3 && idx[2] == 2 && idx[3] == 0);
    ddp_reducer_note_used(r, 2);
    T_ASSERT(ddp_reducer_local_used(r)[2] == 1 && ddp_reducer_local_used(r)[0] == 0);
    ddp_reducer_end(r);
    T_ASSERT(!ddp_reducer_in_iteration(r) && ddp_reducer_local_used(r)[2] == 0);
    T_OK(ddp_reducer_begin(r));
    T_ASSERT(ddp_reducer_unready(r, idx, 2) == 4 && idx[0] == 0 && idx[1] == 1);
    ddp_reducer_destroy(r);
}

/* ---- simulated ranks -------------------------------------------------- */

/* A world of R ranks in one thread: launch k of every rank forms one
 * collective; it runs (AVG or SUM) once all R ranks launched it, after
 * checking that all of them passed the same count and dtype. */
enum { MAXR = 4, MAXOPS = 64 };
typedef struct sim_op {
    void *buf[MAXR];
    size_t count[MAXR];
    ddp_dtype dtype[MAXR];
    ddp_redop op;
    int launched, done;
    ddp_status st;
} sim_op;
typedef struct sim_world {
    int size;
    sim_op ops[MAXOPS];
    int nlaunch[MAXR];
    int fail_launch_at;      /* this rank-0 launch number fails, -1 none */
} sim_world;
typedef struct sim_rank { sim_world *w; int rank; } sim_rank;

static void sim_run(sim_op *o, int size) {
    o->done = 1;
    for (int r = 1; r < size; r++)
        if (o->count[r] != o->count[0] || o->dtype[r] != o->dtype[0]) {
            o->st = ddp_error(DDP_ERR_MISMATCH, "ranks launched different buckets");
            return;
        }
    for (size_t e = 0; e < o->count[0]; e++) {
        if (o->dtype[0] == DDP_FLOAT32) {
            float s = 0;
            for (int r = 0; r < size; r++) s += ((float *)o->buf[r])[e];
            if (o->op == DDP_AVG) s /= (float)size;
            for (int r = 0; r < size; r++) ((float *)o->buf[r])[e] = s;
        } else {
            int32_t s = 0;
            for (int r = 0; r < size; r++) s += ((int32_t *)o->buf[r])[e];
            for (int r = 0; r < size; r++) ((int32_t *)o->buf[r])[e] = s;
        }
    }
}

static ddp_status sim_launch(void *ctx, void *buf, size_t count, ddp_dtype t, ddp_redop op,
                             void **handle) {
    sim_rank *sr = ctx;
    sim_world *w = sr->w;
    int k = w->nlaunch[sr->rank];
    if (sr->rank == 0 && k == w->fail_launch_at) {
        w->fail_launch_at = -1;   /* fail once */
        return ddp_error(DDP_ERR_CLOSED, "simulated peer failure");
    }
    T_ASSERT(k < MAXOPS);
    w->nlaunch[sr->rank]++;
    sim_op *o = &w->ops[k];
    o->buf[sr->rank] = buf;
    o->count[sr->rank] = count;
    o->dtype[sr->rank] = t;
    o->op = op;
    if (++o->launched == w->size) sim_run(o, w->size);
    *handle = o;
    return DDP_OK;
}

static ddp_status sim_wait(void *ctx, void *handle, ddp_wait wt, int *done) {
    (void)ctx;
    (void)wt;
    sim_op *o = handle;
    *done = o->done;   /* one thread: an op not yet complete would hang */
    if (!o->done) return DDP_ERR_TIMEOUT;
    if (o->st != DDP_OK) ddp_error(o->st, "simulated collective failed");
    return o->st;
}

static void sim_release(void *ctx, void *handle) { (void)ctx; (void)handle; }

static const ddp_reducer_ops sim_ops = {sim_launch, sim_wait, sim_release};

/* Parameters of the data-path tests: 5 float32 tensors; caps 32 B / 64 B
 * give 4 buckets: {4}, {3}, {2, 1}, {0}. */
static const size_t SIM_NUMEL[5] = {7, 16, 3, 40, 9};

typedef struct sim_model {
    ddp_reducer *r;
    float *bucket_mem;
    float grad[5][40];
    float out[5][40];       /* copy-back targets */
} sim_model;

static void sim_model_init(sim_model *m, sim_rank *ctx, int world) {
    memset(m, 0, sizeof *m);
    ddp_plan_param ps[5];
    for (int i = 0; i < 5; i++) ps[i] = (ddp_plan_param)F32(SIM_NUMEL[i]);
    ddp_plan p;
    T_OK(ddp_plan_buckets(ps, 5, NULL, 32, 64, &p));
    T_OK(ddp_reducer_create(&p, &m->r));
    const ddp_plan *pl = ddp_reducer_plan(m->r);
    m->bucket_mem = calloc(80, sizeof(float));
    void *bufs[8];
    size_t off = 0;
    for (size_t b = 0; b < pl->nbuckets; b++) {
        bufs[b] = m->bucket_mem + off;
        off += pl->bucket_numel[b];
    }
    T_OK(ddp_reducer_attach(m->r, bufs, &sim_ops, ctx, world));
}

static void sim_model_free(sim_model *m) {
    ddp_reducer_destroy(m->r);
    free(m->bucket_mem);
}

/* A world of size ranks, each with its model attached to the simulated ops. */
static void sim_setup(sim_world *w, int size, sim_rank *ctx, sim_model *m) {
    memset(w, 0, sizeof *w);
    w->size = size;
    w->fail_launch_at = -1;
    for (int r = 0; r < size; r++) {
        ctx[r] = (sim_rank){w, r};
        sim_model_init(&m[r], &ctx[r], size);
    }
}

static float gval(int rank, int i, size_t e) { return (float)(rank * 100 + i * 10) + (float)e * 0.25f; }

static void test_sim_average(void) {
    enum { R = 3 };
    sim_world w;
    sim_rank ctx[R];
    sim_model m[R];
    sim_setup(&w, R, ctx, m);
    for (int r = 0; r < R; r++) T_ASSERT(ddp_reducer_plan(m[r].r)->nbuckets == 4);
    /* Each rank marks its gradients in a different order; parameter 2 is
     * unused on rank 1 (zeros) and parameter 0 on every rank. */
    const int orders[R][5] = {{4, 3, 2, 1, 0}, {0, 1, 2, 3, 4}, {2, 4, 0, 3, 1}};
    for (int r = 0; r < R; r++) {
        T_OK(ddp_reducer_begin(m[r].r));
        for (int k = 0; k < 5; k++) {
            int i = orders[r][k];
            for (size_t e = 0; e < SIM_NUMEL[i]; e++) {
                m[r].grad[i][e] = gval(r, i, e);
                m[r].out[i][e] = -1.0f;
            }
            int unused = i == 0 || (i == 2 && r == 1);
            if (!unused) ddp_reducer_note_used(m[r].r, (size_t)i);
            T_OK(ddp_reducer_ready(m[r].r, (size_t)i, unused ? NULL : m[r].grad[i], DDP_FLOAT32,
                                   SIM_NUMEL[i], m[r].out[i]));
        }
    }
    /* The use flags are reduced at finish: ranks that finish before the
     * last one launched them see an unfinished wait and call again. */
    for (int r = 0; r < R; r++)
        T_STATUS(ddp_reducer_finish(m[r].r, 1, ddp_wait_for(0, NULL)),
                 r == R - 1 ? DDP_OK : DDP_ERR_TIMEOUT);
    for (int r = 0; r < R; r++) {
        if (r < R - 1) T_OK(ddp_reducer_finish(m[r].r, 1, ddp_wait_for(0, NULL)));
        T_ASSERT(ddp_reducer_pending(m[r].r) == 0 && !ddp_reducer_in_iteration(m[r].r));
        const int32_t *gu = ddp_reducer_global_used(m[r].r);
        T_ASSERT(gu[0] == 0 && gu[2] == 2 && gu[1] == 3);
        for (int i = 0; i < 5; i++)
            for (size_t e = 0; e < SIM_NUMEL[i]; e++) {
                float want;
                if (i == 0) {
                    want = -1.0f;   /* no rank used it: untouched */
                } else {
                    float s = 0;
                    for (int q = 0; q < R; q++) s += (i == 2 && q == 1) ? 0.0f : gval(q, i, e);
                    want = s / (float)R;
                }
                T_ASSERT(m[r].out[i][e] == want);
            }
    }
    /* Every rank launched every bucket plus the use flags, in one order. */
    size_t nb = ddp_reducer_plan(m[0].r)->nbuckets;
    for (int r = 0; r < R; r++) T_ASSERT(w.nlaunch[r] == (int)nb + 1);
    for (int r = 0; r < R; r++) sim_model_free(&m[r]);
}

static void test_sim_waits_and_errors(void) {
    enum { R = 2 };
    sim_world w;
    sim_rank ctx[R];
    sim_model m[R];
    sim_setup(&w, R, ctx, m);
    for (int r = 0; r < R; r++) T_OK(ddp_reducer_begin(m[r].r));
    /* Rank 0 finishes before rank 1 launched anything: not all ready yet. */
    for (int i = 0; i < 4; i++)
        T_OK(ddp_reducer_ready(m[0].r, (size_t)i, m[0].grad[i], DDP_FLOAT32, SIM_NUMEL[i], NULL));
    T_STATUS(ddp_reducer_finish(m[0].r, 0, ddp_wait_for(0, NULL)), DDP_ERR_INVALID);
    T_STATUS(ddp_reducer_ready(m[0].r, 4, m[0].grad[4], DDP_FLOAT64, 9, NULL), DDP_ERR_TYPE);
    T_STATUS(ddp_reducer_ready(m[0].r, 4, m[0].grad[4], DDP_FLOAT32, 8, NULL), DDP_ERR_INVALID);
    T_STATUS(ddp_reducer_ready(m[0].r, 3, m[0].grad[3], DDP_FLOAT32, 40, NULL), DDP_ERR_INVALID);
    T_OK(ddp_reducer_ready(m[0].r, 4, m[0].grad[4], DDP_FLOAT32, 9, NULL));
    /* The peer has not launched: the wait ends unfinished, then resumes. */
    T_STATUS(ddp_reducer_finish(m[0].r, 0, ddp_wait_for(0, NULL)), DDP_ERR_TIMEOUT);
    T_ASSERT(ddp_reducer_in_iteration(m[0].r));
    for (int i = 4; i >= 0; i--)
        T_OK(ddp_reducer_ready(m[1].r, (size_t)i, m[1].grad[i], DDP_FLOAT32, SIM_NUMEL[i], NULL));
    T_OK(ddp_reducer_finish(m[0].r, 0, ddp_wait_for(0, NULL)));
    T_OK(ddp_reducer_finish(m[1].r, 0, ddp_wait_for(0, NULL)));

    /* A launch failure is reported by ready and again, with the bucket, by
     * finish; the iteration still ends. */
    w.fail_launch_at = w.nlaunch[0] + 1;
    T_OK(ddp_reducer_begin(m[0].r));
    ddp_status st = DDP_OK;
    for (int i = 4; i >= 0 && st == DDP_OK; i--)
        st = ddp_reducer_ready(m[0].r, (size_t)i, NULL, DDP_FLOAT32, 0, NULL);
    T_ASSERT(st == DDP_ERR_CLOSED);
    T_ASSERT(strstr(ddp_last_error(), "bucket 1 of") != NULL);
    size_t idx[8];
    size_t left = ddp_reducer_unready(m[0].r, idx, 8);
    for (size_t k = 0; k < left; k++)
        T_OK(ddp_reducer_ready(m[0].r, idx[k], NULL, DDP_FLOAT32, 0, NULL));
    /* Rank 1 never joins bucket 0 in this test, so drain rather than finish. */
    T_STATUS(ddp_reducer_drain(m[0].r, ddp_wait_for(0, NULL)), DDP_ERR_TIMEOUT);
    for (int k = w.nlaunch[1]; k < w.nlaunch[0]; k++)
        sim_run(&w.ops[k], 1);   /* let the stranded ops complete */
    T_OK(ddp_reducer_drain(m[0].r, ddp_wait_for(0, NULL)));
    T_ASSERT(!ddp_reducer_in_iteration(m[0].r) && ddp_reducer_pending(m[0].r) == 0);
    for (int r = 0; r < R; r++) sim_model_free(&m[r]);
}

static void test_world_one(void) {
    sim_model m;
    sim_model_init(&m, NULL, 1);
    T_ASSERT(ddp_reducer_attach(m.r, (void *[]){NULL}, NULL, NULL, 2) == DDP_ERR_INVALID);
    T_OK(ddp_reducer_begin(m.r));
    for (int i = 4; i >= 0; i--) {
        for (size_t e = 0; e < SIM_NUMEL[i]; e++) m.grad[i][e] = gval(0, i, e);
        /* parameter 1 uses the slot as its gradient (bucket view), 3 copies
         * back elsewhere, the rest in place */
        void *slot = ddp_reducer_slot(m.r, (size_t)i);
        if (i == 1) memcpy(slot, m.grad[1], SIM_NUMEL[1] * sizeof(float));
        const void *g = i == 1 ? slot : m.grad[i];
        void *cb = i == 3 ? (void *)m.out[3] : i == 1 ? slot : m.grad[i];
        ddp_reducer_note_used(m.r, (size_t)i);
        T_OK(ddp_reducer_ready(m.r, (size_t)i, g, DDP_FLOAT32, SIM_NUMEL[i], cb));
    }
    T_ASSERT(ddp_reducer_pending(m.r) == 0);
    T_OK(ddp_reducer_finish(m.r, 1, ddp_wait_for(0, NULL)));
    for (size_t e = 0; e < SIM_NUMEL[3]; e++) T_ASSERT(m.out[3][e] == gval(0, 3, e));
    for (size_t e = 0; e < SIM_NUMEL[1]; e++)
        T_ASSERT(((float *)ddp_reducer_slot(m.r, 1))[e] == gval(0, 1, e));
    T_ASSERT(ddp_reducer_global_used(m.r)[4] == 1);
    sim_model_free(&m);
}

/* ---- real communicators (threads as ranks over loopback) -------------- */

enum { CR = 3, CITERS = 4, CN = 6 };
static const size_t CNUMEL[CN] = {1000, 70000, 5, 300000, 17, 4096};
static int g_store_port;

typedef struct comm_rank { int rank; int ok; } comm_rank;

static void *comm_rank_main(void *arg) {
    comm_rank *cr = arg;
    ddp_store *store;
    T_OK(ddp_store_connect("127.0.0.1", g_store_port, ddp_wait_for(10000, NULL), &store));
    ddp_comm_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.rank = cr->rank;
    cfg.size = CR;
    cfg.prefix = "/pyddp/test_reducer/0/0";
    cfg.advertise_host = "127.0.0.1";
    cfg.bind_host = "127.0.0.1";
    cfg.timeout_ms = 20000;
    cfg.version = "test";
    cfg.host_id = "test-host";
    ddp_comm *comm;
    T_OK(ddp_comm_create(&cfg, store, &comm));
    ddp_plan_param ps[CN];
    size_t total = 0;
    for (int i = 0; i < CN; i++) {
        ps[i] = (ddp_plan_param)F32(CNUMEL[i]);
        total += CNUMEL[i];
    }
    ddp_plan p;
    T_OK(ddp_plan_buckets(ps, CN, NULL, KB(64), KB(512), &p));
    ddp_reducer *r;
    T_OK(ddp_reducer_create(&p, &r));
    const ddp_plan *pl = ddp_reducer_plan(r);
    float *mem = malloc(total * sizeof(float));
    float *grads = malloc(total * sizeof(float));
    void *bufs[CN];
    size_t off = 0;
    for (size_t b = 0; b < pl->nbuckets; b++) {
        bufs[b] = mem + off;
        off += pl->bucket_numel[b];
    }
    ddp_pg pg = ddp_comm_pg(comm);   /* the reducer launches through the ddp_pg table */
    T_OK(ddp_reducer_attach(r, bufs, &ddp_reducer_pg_ops, &pg, CR));
    for (int it = 0; it < CITERS; it++) {
        T_OK(ddp_reducer_begin(r));
        size_t goff[CN];
        off = 0;
        for (int i = 0; i < CN; i++) {
            goff[i] = off;
            for (size_t e = 0; e < CNUMEL[i]; e++)
                grads[off + e] = (float)((cr->rank + 1) * (i + 1) + it) + (float)(e % 7);
            off += CNUMEL[i];
        }
        for (int k = 0; k < CN; k++) {
            int i = (k + cr->rank + it) % CN;   /* rank- and iteration-dependent order */
            T_OK(ddp_reducer_ready(r, (size_t)i, grads + goff[i], DDP_FLOAT32, CNUMEL[i],
                                   grads + goff[i]));
        }
        T_OK(ddp_reducer_finish(r, 0, ddp_wait_for(20000, NULL)));
        for (int i = 0; i < CN; i++)
            for (size_t e = 0; e < CNUMEL[i]; e += 97) {
                float s = 0;
                for (int q = 0; q < CR; q++) s += (float)((q + 1) * (i + 1) + it) + (float)(e % 7);
                float want = s / (float)CR, got = grads[goff[i] + e];
                T_ASSERT(got - want < 1e-4f && want - got < 1e-4f);
            }
    }
    ddp_reducer_destroy(r);
    ddp_comm_destroy(comm);
    ddp_store_close(store);
    free(mem);
    free(grads);
    cr->ok = 1;
    return NULL;
}

static void test_real_comm(void) {
    ddp_store_server *srv;
    T_OK(ddp_store_server_start("127.0.0.1", 0, &srv, &g_store_port));
    pthread_t th[CR];
    comm_rank cr[CR];
    for (int r = 0; r < CR; r++) {
        cr[r] = (comm_rank){r, 0};
        T_ASSERT(pthread_create(&th[r], NULL, comm_rank_main, &cr[r]) == 0);
    }
    for (int r = 0; r < CR; r++) {
        pthread_join(th[r], NULL);
        T_ASSERT(cr[r].ok);
    }
    ddp_store_server_stop(srv);
}

int main(void) {
    test_plan_default_order();
    test_plan_mixed_keys();
    test_plan_explicit_order_and_errors();
    test_readiness_order();
    test_sim_average();
    test_sim_waits_and_errors();
    test_world_one();
    test_real_comm();
    printf("test_reducer: all passed\n");
    return 0;
}
