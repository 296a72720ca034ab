/* test_coll_slice.c - the all-reduce of a group on one host, slice by slice
 * (ddp_coll_slice.c), with threads as ranks over shared-memory links:
 *   - results against a reference computed here in double (sums, maxima and
 *     products of small integers, exact in every dtype used; AVG of float32
 *     and float64 as the reference's own division), for 2, 3 and 5 ranks,
 *     counts from one element to several slices per block with remainders,
 *     and every rank's bytes identical;
 *   - every rank direct, on rings of exactly two slices (the least direct
 *     takes): no single-copy descriptor was ever posted (each byte went
 *     through the rings, combined where it lay);
 *   - mixed: one pair's rings of 64 KiB, too small for direct, so its two
 *     ranks run the same stream staged (their large sends posted as
 *     process_vm_readv descriptors, which a direct successor takes through
 *     its bounce area) while the others run direct; and TCP links (every
 *     rank staged): the same results;
 *   - a rank that dies in the middle (its links shut down) fails the others
 *     within seconds; the direct wait ends at its deadline, on its abort
 *     flag, and when the peer closed.
 */
#include <math.h>
#include <string.h>
#include <unistd.h>

#define H_MAXR 5
#include "coll_harness.h"
#include "ddp_link_shm.h"
#include "ddp_link_shm_int.h" /* to see whether a link posted descriptors */

/* Replace every link of w (socketpairs, kept for liveness) by a shared-memory
 * link with rings of `ring` bytes, except the pair (small, small + 1) whose
 * rings are 64 KiB (small < 0: none); rank i < j creates the pair's segment. */
static void shm_world(hworld *w, size_t ring, int small) {
    for (int i = 0; i < w->n; i++) {
        for (int j = i + 1; j < w->n; j++) {
            char name[DDP_SHM_NAME_MAX], desc[64];
            ddp_shm_seg *a = NULL, *b = NULL;
            T_OK(ddp_shm_seg_create(i == small && j == small + 1 ? 64 << 10 : ring, name, &a));
            T_OK(ddp_shm_seg_open(name, &b));
            ddp_shm_unlink(name);
            snprintf(desc, sizeof desc, "rank %d (shm)", j);
            T_ASSERT((w->links[i][j] = ddp_link_shm_new(a, 0, w->links[i][j], j, desc)));
            snprintf(desc, sizeof desc, "rank %d (shm)", i);
            T_ASSERT((w->links[j][i] = ddp_link_shm_new(b, 1, w->links[j][i], i, desc)));
        }
    }
    for (int r = 0; r < w->n; r++) w->g[r].nhosts = 1;   /* one host, as a communicator's */
}

static uint64_t descriptors_posted(ddp_link *l) {
    return strcmp(l->ops->name, "shm") == 0 ? ((shm_impl *)l->impl)->desc_seq : 0;
}

static double input(int r, size_t i) { return (double)((i * 7 + (size_t)r * 3) % 11) - 3.0; }

static void put(ddp_dtype t, void *buf, size_t i, double v) {
    switch (t) {
    case DDP_FLOAT32: ((float *)buf)[i] = (float)v; break;
    case DDP_FLOAT64: ((double *)buf)[i] = v; break;
    case DDP_INT32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case DDP_INT8: ((int8_t *)buf)[i] = (int8_t)v; break;
    case DDP_FLOAT16: ((uint16_t *)buf)[i] = ddp_float_to_half((float)v); break;
    case DDP_BFLOAT16: ((uint16_t *)buf)[i] = ddp_float_to_bf16((float)v); break;
    default: T_ASSERT(0);
    }
}

static double get(ddp_dtype t, const void *buf, size_t i) {
    switch (t) {
    case DDP_FLOAT32: return ((const float *)buf)[i];
    case DDP_FLOAT64: return ((const double *)buf)[i];
    case DDP_INT32: return ((const int32_t *)buf)[i];
    case DDP_INT8: return ((const int8_t *)buf)[i];
    case DDP_FLOAT16: return ddp_half_to_float(((const uint16_t *)buf)[i]);
    case DDP_BFLOAT16: return ddp_bf16_to_float(((const uint16_t *)buf)[i]);
    default: T_ASSERT(0);
    }
    return 0;
}

static double want(ddp_dtype t, ddp_redop op, int n, size_t i) {
    double acc = input(0, i);
    for (int r = 1; r < n; r++) {
        double v = input(r, i);
        acc = op == DDP_MAX ? (v > acc ? v : acc) : op == DDP_PRODUCT ? acc * v : acc + v;
    }
    if (op == DDP_AVG) return t == DDP_FLOAT32 ? (double)((float)acc / (float)n) : acc / n;
    return acc;
}

typedef struct job {
    ddp_dtype t;
    ddp_redop op;
    size_t count;
    ddp_status expect;   /* DDP_OK, or what a run with a dying rank must end in */
} job;

static void all_reduce_rank(hworld *w, int r, void *arg) {
    const job *j = arg;
    const size_t es = ddp_dtype_size(j->t);
    char *buf = malloc(j->count * es + 1);
    T_ASSERT(buf);
    for (size_t i = 0; i < j->count; i++) put(j->t, buf, i, input(r, i));
    ddp_coll_args a = {.kind = DDP_COLL_ALLREDUCE, .dtype = j->t, .op = j->op,
                       .count = j->count, .buf = buf};
    T_OK(hcoll(w, r, &a));
    for (size_t i = 0; i < j->count; i++) {
        double got = get(j->t, buf, i), exp = want(j->t, j->op, w->n, i);
        if (!(got == exp || (j->op == DDP_AVG && fabs(got - exp) <= 1e-12 * fabs(exp)))) {
            fprintf(stderr, "rank %d of %d: %s %s count %zu: element %zu is %g, want %g\n", r,
                    w->n, ddp_dtype_name(j->t), ddp_redop_name(j->op), j->count, i, got, exp);
            exit(1);
        }
    }
    w->shared[r] = buf;
    pthread_barrier_wait(&w->bar);
    if (r == 0)
        for (int p = 1; p < w->n; p++)
            T_ASSERT(memcmp(w->shared[0], w->shared[p], j->count * es) == 0);
    pthread_barrier_wait(&w->bar);
    free(buf);
}

/* The slices take calls of 512 KiB and more: the large counts are that much
 * in every dtype; the small ones run on the latency path, the middle one on
 * the block ring (with single-copy descriptors), beside them. */
static const size_t COUNTS[] = {1, 3, 4097, 524288 + 3, 262144 * 3 + 1, 65536 + 5};
#define NO_DESCRIPTORS 5   /* the counts before this index post none */

/* Every dtype, op and count on one world (the first ncounts of COUNTS);
 * returns descriptors posted in all. Under ThreadSanitizer, whose point is the
 * threads' interleavings (the same for every dtype and op, and ten times
 * slower per byte), two dtypes of different element sizes and SUM and AVG
 * only: the ASan build runs the whole matrix. */
static uint64_t run_all(hworld *w, size_t ncounts) {
#ifdef __SANITIZE_THREAD__
    static const ddp_dtype types[] = {DDP_FLOAT32, DDP_INT8};
    const int every_op = 0;
#else
    static const ddp_dtype types[] = {DDP_FLOAT32, DDP_FLOAT64, DDP_INT32, DDP_INT8,
                                      DDP_FLOAT16, DDP_BFLOAT16};
    const int every_op = 1;
#endif
    for (size_t c = 0; c < ncounts; c++) {
        for (size_t k = 0; k < sizeof types / sizeof *types; k++) {
            job j = {types[k], DDP_SUM, COUNTS[c], DDP_OK};
            hrun(w, all_reduce_rank, &j);
            if (!every_op) {
                if (types[k] == DDP_FLOAT32) {
                    j.op = DDP_AVG;
                    hrun(w, all_reduce_rank, &j);
                }
                continue;
            }
            j.op = DDP_MAX;
            hrun(w, all_reduce_rank, &j);
            if (types[k] == DDP_FLOAT32 || types[k] == DDP_FLOAT64) {
                j.op = DDP_AVG;
                hrun(w, all_reduce_rank, &j);
            }
            if (types[k] == DDP_INT32 || types[k] == DDP_FLOAT64) {
                j.op = DDP_PRODUCT;
                hrun(w, all_reduce_rank, &j);
            }
        }
    }
    uint64_t posted = 0;
    for (int r = 0; r < w->n; r++)
        for (int p = 0; p < w->n; p++)
            if (p != r) posted += descriptors_posted(w->links[r][p]);
    return posted;
}

static void test_worlds(void) {
    for (int n = 2; n <= 5; n += n == 3 ? 2 : 1) {
        hworld w;
        /* rings of two slices: the least the direct way takes, where its
         * early push of the next slice leaves no room to spare */
        hworld_init(&w, n, 64 << 10, 256 << 10);
        shm_world(&w, 512 << 10, -1);
        T_ASSERT(run_all(&w, NO_DESCRIPTORS) == 0);   /* every byte through the rings */
        hworld_free(&w);
        printf("slice: %d ranks direct ok\n", n);

        /* ranks n-2 and n-1 staged (their pair's ring is too small), the
         * others direct; with 3 or more, rank 0 takes staged rank n-1's
         * large sends (descriptors) through its bounce area */
        hworld_init(&w, n, 64 << 10, 256 << 10);
        shm_world(&w, 1 << 20, n - 2);
        T_ASSERT(run_all(&w, sizeof COUNTS / sizeof *COUNTS) > 0);
        hworld_free(&w);
        printf("slice: %d ranks, two staged, ok\n", n);

        hworld_init(&w, n, 64 << 10, 256 << 10);   /* TCP links: every rank staged */
        for (int r = 0; r < n; r++) w.g[r].nhosts = 1;
        run_all(&w, sizeof COUNTS / sizeof *COUNTS);
        hworld_free(&w);
        printf("slice: %d ranks over TCP (all staged) ok\n", n);
    }
}

/* Rank 2 leaves in the middle of a large all-reduce (its links shut down
 * from another thread while it runs): the others fail fast. */
typedef struct call {
    hworld *w;
    int r;
    ddp_status st;
} call;

static void *call_main(void *arg) {
    call *c = arg;
    const size_t count = (size_t)16 << 20;
    float *buf = calloc(count, sizeof *buf);
    T_ASSERT(buf);
    ddp_coll_args a = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_SUM,
                       .count = count, .buf = buf};
    c->st = hcoll(c->w, c->r, &a);
    free(buf);
    return NULL;
}

static void dying_rank(hworld *w, int r, void *arg) {
    (void)arg;
    call c = {w, r, DDP_OK};
    pthread_t t;
    int64_t t0 = ddp_now_ms();
    T_ASSERT(pthread_create(&t, NULL, call_main, &c) == 0);
    if (r == 2) {
        usleep(30000);
        hbreak(w, r);
    }
    T_ASSERT(pthread_join(t, NULL) == 0);
    T_ASSERT(c.st == DDP_ERR_CLOSED || c.st == DDP_ERR_ABORTED);
    T_ASSERT(ddp_now_ms() - t0 < 10000);
}

static atomic_int stop_flag;

static void *raise_flag(void *arg) {
    (void)arg;
    usleep(200000);
    atomic_store(&stop_flag, 1);
    return NULL;
}

/* The direct wait itself: its deadline, its abort flag, a peer that closed. */
static void test_direct_wait(void) {
    hworld w;
    hworld_init(&w, 2, 64 << 10, 256 << 10);
    shm_world(&w, 1 << 20, -1);
    ddp_link *l = w.links[0][1];
    T_ASSERT(ddp_link_direct(l));
    int64_t t0 = ddp_now_ms();
    T_STATUS(ddp_link_wait_direct(l, 4, NULL, 0, ddp_wait_for(300, NULL)), DDP_ERR_TIMEOUT);
    T_ASSERT(ddp_now_ms() - t0 < 5000);
    pthread_t t;
    T_ASSERT(pthread_create(&t, NULL, raise_flag, NULL) == 0);
    T_STATUS(ddp_link_wait_direct(l, 4, NULL, 0, ddp_wait_for(60000, &stop_flag)),
             DDP_ERR_ABORTED);
    T_ASSERT(pthread_join(t, NULL) == 0);
    /* room to send is there at once; then the peer closes: waiting to receive fails */
    T_OK(ddp_link_wait_direct(NULL, 0, l, 16, ddp_wait_for(1000, NULL)));
    ddp_link_shutdown(w.links[1][0]);
    t0 = ddp_now_ms();
    T_STATUS(ddp_link_wait_direct(l, 4, NULL, 0, ddp_wait_for(60000, NULL)), DDP_ERR_CLOSED);
    T_ASSERT(ddp_now_ms() - t0 < 5000);
    /* the direct ops themselves name the peer that left, as the wait does */
    char msg[512];
    ddp_copy_error(msg, sizeof msg);
    T_ASSERT(strstr(msg, "receiving from rank 1 (shm)"));
    const void *rp;
    void *tp;
    size_t got;
    T_STATUS(ddp_link_rx_peek(l, 4, &rp, &got), DDP_ERR_CLOSED);
    ddp_copy_error(msg, sizeof msg);
    T_ASSERT(strstr(msg, "receiving from rank 1 (shm): the peer closed"));
    T_STATUS(ddp_link_tx_reserve(l, 4, &tp, &got), DDP_ERR_CLOSED);
    ddp_copy_error(msg, sizeof msg);
    T_ASSERT(strstr(msg, "sending to rank 1 (shm): the peer closed"));
    hworld_free(&w);
    printf("slice: direct waits (deadline, abort flag, closed peer): ok\n");
}

static void test_failures(void) {
    hworld w;
    hworld_init(&w, 3, 64 << 10, 256 << 10);
    shm_world(&w, 1 << 20, -1);
    hrun(&w, dying_rank, NULL);
    hworld_free(&w);
    printf("slice: a rank that dies mid-call fails the others fast: ok\n");
    test_direct_wait();
}

int main(void) {
    test_worlds();
    test_failures();
    printf("test_coll_slice: ok\n");
    return 0;
}
