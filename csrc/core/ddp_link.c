/* ddp_link.c - the transport-neutral drivers of ddp_link.h: turn the
 * transports' non-blocking send_some/recv_some into blocking transfers with
 * a deadline and an abort flag, several links at once.
 *
 * One engine (ddp_link_xfer) serves every caller: a single send or receive,
 * a ring step (send to the next rank while receiving from the previous one)
 * and the full-mesh exchanges of the collectives. It tries every unfinished
 * transfer, and only when none moved does it sleep in poll() on the links'
 * descriptors (slices of at most ddp_wait_slice, so the abort flag is seen
 * within 100 ms; a link striped over several sockets lists each socket that
 * still has bytes of its call to move, poll_fds), or spin and yield for
 * transports without a descriptor.
 * While nothing moves it asks the waiting links' check op, about once a
 * second, whether their peer still answers (a TCP peer whose host vanished),
 * and the wait's own check hook (ddp_clock.h), if any, every DDP_WAIT_SLICE_MS
 * once the spin is over.
 */
#include "ddp_link.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Transfers up to this many poll from a stack array (no malloc per call). */
#define STACK_FDS 16
/* Idle rounds for descriptor-less links: pause, then yield, then sleep. */
#define SPIN_PAUSE_ROUNDS 64
#define SPIN_YIELD_ROUNDS 4096
#define SPIN_SLEEP_NS 50000
/* Links that can park: yield this many rounds after spinning, then park. */
#define PARK_AFTER_YIELDS 16
#define PARK_US 1000
/* Idle rounds of a spinning wait between two reads of the clock. */
#define CLOCK_ROUNDS 16
/* How often an idle transfer asks its links' check op (ms). */
#define CHECK_EVERY_MS 1000

/* Back off one idle round for links that can only be polled by spinning:
 * spin briefly (a shared-memory peer usually answers within microseconds),
 * then yield the core, then sleep so a long wait does not burn a CPU. When
 * every waiting link is descriptor-less and `park` is one that can park,
 * sleep there instead: the peer wakes it as soon as it moves (only that
 * link's peer can, so with other links waiting too the nap stays short). */
static void spin_backoff(unsigned *idle, ddp_link *park, int park_alone) {
    unsigned n = (*idle)++;
    if (n < SPIN_PAUSE_ROUNDS) {
        ddp_cpu_relax();
    } else if (park && n >= SPIN_PAUSE_ROUNDS + PARK_AFTER_YIELDS) {
        park->ops->park(park, park_alone ? PARK_US : SPIN_SLEEP_NS / 1000);
    } else if (n < SPIN_YIELD_ROUNDS) {
        sched_yield();
    } else {
        struct timespec ts = {0, SPIN_SLEEP_NS};
        nanosleep(&ts, NULL);
    }
}

static const char *direction(const ddp_xfer *t) {
    return t->send ? "sending to" : "receiving from";
}

ddp_status ddp_link_direct_failed(const ddp_link *l, int send, ddp_status st) {
    return ddp_error_prefix(st, "%s %s: ", send ? "sending to" : "receiving from", l->desc);
}

/* A receive takes the bytes its link holds back (ddp_link_unread) first. */
static void take_held(ddp_link *l, ddp_xfer *t) {
    size_t k = t->len - t->done;
    if (k > l->held_len) k = l->held_len;
    memcpy((unsigned char *)t->dst + t->done, l->held, k);
    memmove(l->held, l->held + k, l->held_len - k);
    l->held_len -= k;
    t->done += k;
}

/* One non-blocking attempt on t. Sets *moved if bytes moved. On failure the
 * message is prefixed with the direction, the peer and the progress. */
static ddp_status xfer_try(ddp_xfer *t, int *moved) {
    ddp_link *l = t->link;
    size_t before = t->done;
    if (t->peek) { /* direct access: only whether want bytes are there */
        const void *rp;
        void *sp;
        size_t got = 0;
        ddp_status st = t->send ? l->ops->tx_reserve(l, t->want, &sp, &got)
                                : l->ops->rx_peek(l, t->want, &rp, &got);
        if (st == DDP_OK && got >= t->want) {
            t->done = t->len;
            *moved = 1;
        }
        return st == DDP_OK ? st : ddp_link_direct_failed(l, t->send, st);
    }
    if (!t->send && l->held_len > 0) {
        take_held(l, t);
        *moved = 1;
        if (t->done >= t->len) return DDP_OK;
    }
    ddp_status st = t->send ? l->ops->send_some(l, t->src, t->len, &t->done)
                            : l->ops->recv_some(l, t->dst, t->len, &t->done);
    if (t->done != before) *moved = 1;
    if (st != DDP_OK)
        ddp_error_prefix(st, "%s %s (%zu of %zu bytes done): ", direction(t), l->desc,
                         t->done, t->len);
    return st;
}

/* Descriptors to poll, on the stack up to STACK_FDS, else on the heap. */
typedef struct fdset {
    struct pollfd *fds;
    int cap;
    struct pollfd stack[STACK_FDS];
} fdset;

/* Room for at least need entries, keeping the first `keep`. */
static ddp_status fdset_reserve(fdset *s, int need, int keep) {
    if (need <= s->cap) return DDP_OK;
    int cap = need * 2;
    struct pollfd *p = malloc((size_t)cap * sizeof *p);
    if (p == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory polling %d descriptors", need);
    memcpy(p, s->fds, (size_t)keep * sizeof *p);
    if (s->fds != s->stack) free(s->fds);
    s->fds = p;
    s->cap = cap;
    return DDP_OK;
}

/* Append the descriptors of transfer t's link to s->fds[0..*nfds) (several
 * for a link striped over several sockets: poll_fds); *none = 1 and nothing
 * appended when the link has no descriptor (it must be spun on). */
static ddp_status fds_of(const ddp_xfer *t, fdset *s, int *nfds, int *none) {
    ddp_link *l = t->link;
    *none = 0;
    if (l->ops->poll_fds == NULL) {
        int fd = l->ops->wait_fd(l);
        if (fd < 0) return (*none = 1), DDP_OK;
        ddp_status st = fdset_reserve(s, *nfds + 1, *nfds);
        if (st != DDP_OK) return st;
        s->fds[(*nfds)++] = (struct pollfd){fd, t->send ? POLLOUT : POLLIN, 0};
        return DDP_OK;
    }
    for (;;) {
        int room = s->cap - *nfds;
        int k = l->ops->poll_fds(l, t->send, s->fds + *nfds, room);
        if (k <= room) {
            *nfds += k;
            return DDP_OK;
        }
        ddp_status st = fdset_reserve(s, *nfds + k, *nfds);
        if (st != DDP_OK) return st;
    }
}

/* Sleep until some unfinished transfer's link is ready or a slice passes. */
static ddp_status xfer_wait(ddp_xfer *x, int n, fdset *fs, ddp_wait w, unsigned *idle) {
    int nfds = 0, spin = 0, park_alone = 1;
    ddp_link *park = NULL;
    ddp_status st;
    for (int i = 0; i < n; i++) {
        if (x[i].parked || x[i].done >= x[i].len) continue;
        int none = 0;
        if ((st = fds_of(&x[i], fs, &nfds, &none)) != DDP_OK) return st;
        if (none) {
            spin = 1;
            if (park == NULL && x[i].link->ops->park) park = x[i].link;
            else if (x[i].link != park) park_alone = 0;
        }
    }
    if (spin) {
        /* Descriptor links are retried on the next round anyway; parking
         * would only delay them, so park only when there are none. */
        spin_backoff(idle, nfds == 0 ? park : NULL, park_alone);
        return DDP_OK;
    }
    if (poll(fs->fds, (nfds_t)nfds, ddp_wait_slice(w)) < 0 && errno != EINTR)
        return ddp_error(DDP_ERR_SYS, "poll() on %d descriptors failed: %s", nfds,
                         strerror(errno));
    return DDP_OK;
}

/* Ask the check op of every link with an unfinished transfer; the first
 * failure is prefixed like xfer_try's and returned. */
static ddp_status xfer_check(ddp_xfer *x, int n) {
    for (int i = 0; i < n; i++) {
        ddp_xfer *t = &x[i];
        if (t->parked || t->done >= t->len || t->link->ops->check == NULL) continue;
        ddp_status st = t->link->ops->check(t->link);
        if (st != DDP_OK)
            return ddp_error_prefix(st, "%s %s (%zu of %zu bytes done): ", direction(t),
                                    t->link->desc, t->done, t->len);
    }
    return DDP_OK;
}

static ddp_status xfer_stuck(ddp_status st, const ddp_xfer *t, int64_t start) {
    const char *peer = t->link->desc;
    if (st == DDP_ERR_ABORTED)
        return ddp_error(st, "aborted while %s %s (%zu of %zu bytes done)", direction(t), peer,
                         t->done, t->len);
    return ddp_error(st, "timed out after %lld ms %s %s (%zu of %zu bytes done); check that "
                     "%s is alive and made the same call, or raise the timeout",
                     (long long)(ddp_now_ms() - start), direction(t), peer, t->done, t->len,
                     peer);
}

/* The transfer that decides whether the drive is over, for its messages:
 * NULL when it is over (all: every transfer reached its want; any: one did,
 * *which = its index), else the first one still waited for. Any mode skips
 * dropped (parked) transfers; *alive counts the others. */
static const ddp_xfer *xfer_unmet(const ddp_xfer *x, int n, int any, int *which, int *alive) {
    const ddp_xfer *unmet = NULL;
    *alive = 0;
    for (int i = 0; i < n; i++) {
        if (any && x[i].parked) continue;
        ++*alive;
        if (x[i].done >= x[i].want) {
            if (any) return (*which = i), NULL;
        } else if (!unmet) {
            unmet = &x[i];
        }
    }
    return unmet;
}

/* The engine of ddp_link_xfer (any = 0) and ddp_link_xfer_any (any = 1). */
static ddp_status xfer_drive(ddp_xfer *x, int n, ddp_wait w, int any, int *which) {
    fdset fs;
    fs.fds = fs.stack;
    fs.cap = STACK_FDS;
    const int64_t start = ddp_now_ms();
    int64_t checked = start; /* last progress (seen when idle) or check */
    int64_t hooked = start;  /* last call of w.check */
    int progressed = 0, alive = 0;
    unsigned idle = 0;
    ddp_status st = DDP_OK, dropped = DDP_OK;

    for (;;) {
        int moved = 0;
        for (int i = 0; i < n; i++) {
            ddp_xfer *t = &x[i];
            if (t->parked) {
                if (any || t->done >= t->want) continue;
                t->parked = 0; /* needed now: retrying reports the failure afresh */
            }
            if (t->done >= t->len) continue;
            st = xfer_try(t, &moved);
            if (st == DDP_OK) continue;
            if (any) {          /* dropped; the others may still deliver */
                t->parked = 1;
                dropped = st;
                st = DDP_OK;
                continue;
            }
            if (t->done < t->want) goto out;
            /* Failed after giving this call what it wanted (e.g. a peer that
             * sent its header and closed): let the other transfers finish so
             * the caller can inspect what arrived. */
            t->parked = 1;
            st = DDP_OK;
        }
        const ddp_xfer *unmet = xfer_unmet(x, n, any, which, &alive);
        if (any && alive == 0) {    /* every transfer failed: report the last failure */
            st = dropped != DDP_OK ? dropped
                                   : ddp_error(DDP_ERR_INTERNAL, "ddp_link_xfer_any: every "
                                               "transfer had failed before the call");
            goto out;
        }
        if (!unmet) goto out;
        if (ddp_wait_aborted(w)) {
            st = xfer_stuck(DDP_ERR_ABORTED, unmet, start);
            goto out;
        }
        /* The clock once a round, and while spinning only every few rounds
         * (a spin round is a few hundred cycles; the clock is not free). */
        if (!moved && idle % CLOCK_ROUNDS != 0) {
            if ((st = xfer_wait(x, n, &fs, w, &idle)) != DDP_OK) goto out;
            continue;
        }
        const int64_t now = ddp_now_ms();
        if (w.deadline_ms != DDP_NO_DEADLINE && now >= w.deadline_ms) {
            st = xfer_stuck(DDP_ERR_TIMEOUT, unmet, start);
            goto out;
        }
        if (moved) {
            idle = 0;
            progressed = 1;
            continue;
        }
        if (progressed) { /* idle again: the liveness checks count from here */
            progressed = 0;
            checked = now;
        } else if (now - checked >= CHECK_EVERY_MS) {
            checked = now;
            if ((st = xfer_check(x, n)) != DDP_OK) goto out;
        }
        if (w.check && now - hooked >= DDP_WAIT_SLICE_MS) {   /* past any spin */
            hooked = now;
            if (w.check(w.check_ctx)) {
                st = xfer_stuck(DDP_ERR_ABORTED, unmet, start);
                goto out;
            }
        }
        if ((st = xfer_wait(x, n, &fs, w, &idle)) != DDP_OK) goto out;
    }
out:
    if (fs.fds != fs.stack) free(fs.fds);
    return st;
}

ddp_status ddp_link_xfer(ddp_xfer *x, int n, ddp_wait w) {
    return xfer_drive(x, n, w, 0, NULL);
}

ddp_status ddp_link_xfer_any(ddp_xfer *x, int n, ddp_wait w, int *which) {
    *which = -1;
    if (n <= 0) return ddp_error(DDP_ERR_INTERNAL, "ddp_link_xfer_any without transfers");
    return xfer_drive(x, n, w, 1, which);
}

int ddp_link_direct(const ddp_link *l) {
    return l != NULL && l->ops->rx_peek != NULL && l->held_len == 0;
}

ddp_status ddp_link_wait_direct(ddp_link *rx, size_t rmin, ddp_link *tx, size_t tmin,
                                ddp_wait w) {
    ddp_xfer x[2];
    int n = 0;
    if (tx)
        x[n++] = (ddp_xfer){.link = tx, .send = 1, .peek = 1, .len = tmin, .want = tmin};
    if (rx)
        x[n++] = (ddp_xfer){.link = rx, .send = 0, .peek = 1, .len = rmin, .want = rmin};
    return ddp_link_xfer(x, n, w);
}

ddp_status ddp_link_direct_align(ddp_link *tx, ddp_link *rx, size_t align, ddp_wait w) {
    if (tx && tx->ops->direct_pos == NULL) tx = NULL;
    if (rx && rx->ops->direct_pos == NULL) rx = NULL;
    if (rx && rx->held_len > 0)
        return ddp_error(DDP_ERR_INTERNAL, "aligning the stream from %s with %zu bytes held "
                         "back", rx->desc, rx->held_len);
    size_t tpad = tx ? (size_t)(-tx->ops->direct_pos(tx, 1) & (align - 1)) : 0;
    size_t rpad = rx ? (size_t)(-rx->ops->direct_pos(rx, 0) & (align - 1)) : 0;
    while (tpad > 0 || rpad > 0) {
        const void *rp;
        void *tp;
        size_t rn = 0, tn = 0;
        ddp_status st = DDP_OK;
        if (tpad > 0 && (st = ddp_link_tx_reserve(tx, 1, &tp, &tn)) == DDP_OK && tn > 0) {
            if (tn > tpad) tn = tpad;
            memset(tp, 0, tn);
            tx->ops->tx_commit(tx, tn);
            tpad -= tn;
        }
        if (st == DDP_OK && rpad > 0 && (st = ddp_link_rx_peek(rx, 1, &rp, &rn)) == DDP_OK &&
            rn > 0) {
            if (rn > rpad) rn = rpad;
            rx->ops->rx_consume(rx, rn);
            rpad -= rn;
        }
        if (st == DDP_OK && (tpad > 0 || rpad > 0) && tn == 0 && rn == 0)
            st = ddp_link_wait_direct(rpad ? rx : NULL, 1, tpad ? tx : NULL, 1, w);
        if (st != DDP_OK) return st;
    }
    return DDP_OK;
}

ddp_status ddp_link_unread(ddp_link *l, const void *buf, size_t n) {
    if (n == 0) return DDP_OK;
    if (n > DDP_LINK_HELD_MAX - l->held_len)
        return ddp_error(DDP_ERR_INTERNAL, "cannot hand %zu bytes back to the link to %s: it "
                         "holds %zu of at most %d", n, l->desc, l->held_len, DDP_LINK_HELD_MAX);
    memmove(l->held + n, l->held, l->held_len);
    memcpy(l->held, buf, n);
    l->held_len += n;
    return DDP_OK;
}

ddp_status ddp_link_sendrecv(ddp_link *sl, const void *sbuf, size_t sn, ddp_link *rl,
                             void *rbuf, size_t rn, ddp_wait w) {
    ddp_xfer x[2];
    int n = 0;
    if (sn > 0)
        x[n++] = (ddp_xfer){.link = sl, .send = 1, .src = sbuf, .len = sn, .want = sn};
    if (rn > 0)
        x[n++] = (ddp_xfer){.link = rl, .send = 0, .dst = rbuf, .len = rn, .want = rn};
    return ddp_link_xfer(x, n, w);
}

ddp_status ddp_link_send(ddp_link *l, const void *buf, size_t n, ddp_wait w) {
    return ddp_link_sendrecv(l, buf, n, NULL, NULL, 0, w);
}

ddp_status ddp_link_recv(ddp_link *l, void *buf, size_t n, ddp_wait w) {
    return ddp_link_sendrecv(NULL, NULL, 0, l, buf, n, w);
}

void ddp_link_shutdown(ddp_link *l) {
    if (l) l->ops->shutdown(l);
}

void ddp_link_free(ddp_link *l) {
    if (!l) return;
    l->ops->destroy(l);
    free(l);
}
