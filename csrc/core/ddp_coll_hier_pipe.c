/* ddp_coll_hier_pipe.c - the sliced hierarchical all-reduce (equal hosts)
 * as a two-stage pipeline, so that the work within a host and the transfer
 * between hosts overlap instead of adding up.
 *
 * The buffer is cut into pieces. For each piece, the calling thread runs the
 * host stage (reduce-scatter over the host's ranks before, all-gather
 * after) and a second thread runs the rail stage (all-reduce of this rank's
 * slice of the piece with its counterparts on the other hosts). The host
 * stage uses only same-host links and the rail stage only links to other
 * hosts, so each link is still used by one thread at a time. The schedules
 * are fixed, the same on every rank whatever the timing, so that the byte
 * streams on every link stay in step:
 *
 *   host thread:  RS(0) RS(1) AG(0) RS(2) AG(1) ... RS(n-1) AG(n-2) AG(n-1)
 *   rail thread:  AR(0) AR(1) ... AR(n-1)      (AR(k) after RS(k), AG(k) after AR(k))
 *
 * Waits between the two threads have the call's deadline and abort flag. The
 * first failure in either thread is kept (its message too) and shuts this
 * rank's links down, so the other thread, and the peers, fail fast instead of
 * waiting for the deadline, as the communicator does after any failure.
 */
#include "ddp_coll_internal.h"

#include <pthread.h>
#include <stdio.h>

#define PIPE_MIN_PIECE_BYTES ((size_t)1 << 20) /* smaller pieces cost more than they hide */
#define PIPE_MAX_PIECES 8

typedef struct hpipe {
    ddp_group *g;
    const ddp_coll_args *a;
    ddp_wait w;
    size_t npieces, piece; /* pieces, elements per piece (the last may be shorter) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    size_t host_done;      /* pieces whose host reduce-scatter finished (mu) */
    size_t rail_done;      /* pieces whose rail all-reduce finished (mu) */
    int failed;            /* (mu) */
    ddp_status st;
    char msg[1024];
} hpipe;

static void piece_range(const hpipe *p, size_t k, size_t *off, size_t *len) {
    *off = k * p->piece;
    *len = k + 1 < p->npieces ? p->piece : p->a->count - *off;
}

/* Record the first failure (with this thread's message) and shut this
 * rank's links down so that everything else in flight fails fast. */
static void pipe_fail(hpipe *p, ddp_status st) {
    pthread_mutex_lock(&p->mu);
    if (!p->failed) {
        p->failed = 1;
        p->st = st;
        snprintf(p->msg, sizeof p->msg, "%s", ddp_last_error());
    }
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int r = 0; r < p->g->size; r++)
        if (p->g->links[r]) ddp_link_shutdown(p->g->links[r]);
}

static void pipe_advance(hpipe *p, size_t *counter) {
    pthread_mutex_lock(&p->mu);
    (*counter)++;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* Wait until *counter >= want. 0 when it is; 1 when the pipeline failed
 * (already recorded, by whichever thread failed, or here on the deadline
 * or the abort flag). */
static int pipe_wait(hpipe *p, const size_t *counter, size_t want, const char *what) {
    ddp_status st = DDP_OK;
    pthread_mutex_lock(&p->mu);
    while (*counter < want && !p->failed) {
        if (ddp_wait_aborted(p->w)) {
            st = ddp_error(DDP_ERR_ABORTED, "aborted while waiting for %s", what);
            break;
        }
        if (ddp_wait_expired(p->w)) {
            st = ddp_error(DDP_ERR_TIMEOUT, "timed out waiting for %s", what);
            break;
        }
        ddp_wait_cond(&p->cv, &p->mu, p->w);
    }
    int failed = p->failed;
    pthread_mutex_unlock(&p->mu);
    if (st != DDP_OK) pipe_fail(p, st);
    return failed || st != DDP_OK;
}

/* Rail stage of piece k: all-reduce this rank's slice of it across hosts,
 * finishing (AVG's division by the whole group) the sub-block it owns. */
static ddp_status rail_piece(hpipe *p, size_t k) {
    ddp_hier *h = p->g->hier;
    const ddp_coll_args *a = p->a;
    const size_t es = ddp_dtype_size(a->dtype);
    size_t poff, plen, off, len, roff, rlen;
    piece_range(p, k, &poff, &plen);
    ddp_coll_block(plen, h->per_host, h->lrank, &off, &len);
    char *slice = (char *)a->buf + (poff + off) * es;
    ddp_status st = ddp_coll_ring_rs_inplace(&h->rail, a->dtype, a->op, slice, len, p->w);
    if (st != DDP_OK) return st;
    ddp_coll_block(len, p->g->nhosts, h->myhost, &roff, &rlen);
    ddp_coll_wire_store(a->dtype, a->op, slice + roff * es, slice + roff * es, rlen,
                        p->g->size);
    return ddp_coll_ring_ag_inplace(&h->rail, slice, len, es, p->w);
}

static void *rail_main(void *arg) {
    hpipe *p = arg;
    for (size_t k = 0; k < p->npieces; k++) {
        if (pipe_wait(p, &p->host_done, k + 1, "this host's reduce-scatter")) return NULL;
        ddp_status st = rail_piece(p, k);
        if (st != DDP_OK) {
            pipe_fail(p, st);
            return NULL;
        }
        pipe_advance(p, &p->rail_done);
    }
    return NULL;
}

static ddp_status host_stage(hpipe *p, size_t k, int gather) {
    ddp_hier *h = p->g->hier;
    const size_t es = ddp_dtype_size(p->a->dtype);
    size_t off, len;
    piece_range(p, k, &off, &len);
    char *base = (char *)p->a->buf + off * es;
    return gather ? ddp_coll_ring_ag_inplace(&h->local, base, len, es, p->w)
                  : ddp_coll_ring_rs_inplace(&h->local, p->a->dtype, p->a->op, base, len, p->w);
}

/* The host thread's schedule (see the header); returns when done or failed. */
static void host_main(hpipe *p) {
    ddp_status st;
    for (size_t k = 0; k <= p->npieces; k++) {
        if (k < p->npieces) {
            if ((st = host_stage(p, k, 0)) != DDP_OK) {
                pipe_fail(p, st);
                return;
            }
            pipe_advance(p, &p->host_done);
        }
        if (k == 0) continue;
        if (pipe_wait(p, &p->rail_done, k, "the all-reduce across hosts")) return;
        if ((st = host_stage(p, k - 1, 1)) != DDP_OK) {
            pipe_fail(p, st);
            return;
        }
    }
}

/* How many pieces a buffer of count elements of es bytes is cut into. */
static size_t pieces_for(size_t count, size_t es) {
    size_t n = count * es / PIPE_MIN_PIECE_BYTES;
    return n < 1 ? 1 : n > PIPE_MAX_PIECES ? PIPE_MAX_PIECES : n;
}

ddp_status ddp_coll_hier_pipeline(ddp_group *g, const ddp_coll_args *a, ddp_wait w) {
    const size_t npieces = pieces_for(a->count, ddp_dtype_size(a->dtype));
    hpipe p = {.g = g, .a = a, .w = w, .npieces = npieces};
    p.piece = (a->count + npieces - 1) / npieces;
    p.npieces = (a->count + p.piece - 1) / p.piece;
    if (p.npieces <= 1) { /* one piece: nothing to overlap, no thread */
        ddp_status st = host_stage(&p, 0, 0);
        if (st == DDP_OK) st = rail_piece(&p, 0);
        return st == DDP_OK ? host_stage(&p, 0, 1) : st;
    }
    /* Links are made before the rail thread starts: both threads then only
     * read the views' link arrays. */
    ddp_status st = ddp_coll_ring_need(&g->hier->local, w);
    if (st == DDP_OK) st = ddp_coll_ring_need(&g->hier->rail, w);
    if (st != DDP_OK) return st;
    pthread_mutex_init(&p.mu, NULL);
    pthread_cond_init(&p.cv, NULL);
    pthread_t rail;
    if (pthread_create(&rail, NULL, rail_main, &p) != 0) {
        st = ddp_error(DDP_ERR_SYS, "could not start the thread for the all-reduce across "
                       "hosts");
    } else {
        host_main(&p);
        pthread_join(rail, NULL);
        if (p.failed) st = ddp_error(p.st, "%s", p.msg);
    }
    pthread_mutex_destroy(&p.mu);
    pthread_cond_destroy(&p.cv);
    return st;
}
