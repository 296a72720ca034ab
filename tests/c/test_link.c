/* test_link.c - the link drivers over the TCP link (on socketpairs): large
 * transfers both ways at once on one link, the spinning path for links
 * without a descriptor, parked transfers, and the statuses for a closed
 * peer, a local shutdown, a deadline and the abort flag. */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "coll_harness.h"

enum { BIG = 8 << 20 }; /* far beyond the socket buffers */

static unsigned char pattern(int rank, size_t i) { return (unsigned char)(i * 31 + (size_t)rank * 7); }

/* Both ranks send BIG bytes to each other at the same time on one link:
 * only a driver that moves both directions together completes this. */
static void swap_rank(hworld *w, int r, void *arg) {
    (void)arg;
    unsigned char *out = malloc(BIG), *in = malloc(BIG);
    T_ASSERT(out && in);
    for (size_t i = 0; i < BIG; i++) out[i] = pattern(r, i);
    ddp_link *l = w->links[r][1 - r];
    T_OK(ddp_link_sendrecv(l, out, BIG, l, in, BIG, ddp_wait_for(H_DEADLINE_MS, NULL)));
    for (size_t i = 0; i < BIG; i++) T_ASSERT(in[i] == pattern(1 - r, i));
    /* and one-way blocking calls */
    if (r == 0) T_OK(ddp_link_send(l, out, 1000, ddp_wait_for(H_DEADLINE_MS, NULL)));
    else T_OK(ddp_link_recv(l, in, 1000, ddp_wait_for(H_DEADLINE_MS, NULL)));
    if (r == 1)
        for (size_t i = 0; i < 1000; i++) T_ASSERT(in[i] == pattern(0, i));
    free(out);
    free(in);
}

static void test_transfers(void) {
    for (int nofd = 0; nofd <= 1; nofd++) {
        hworld w;
        hworld_init(&w, 2, 0, 0);
        if (nofd) /* both ends must spin: no descriptor to poll */
            for (int r = 0; r < 2; r++) w.links[r][1 - r] = hwrap_new(w.links[r][1 - r], SIZE_MAX, 1);
        hrun(&w, swap_rank, NULL);
        hworld_free(&w);
    }
    printf("transfers (poll and spin): ok\n");
}

/* A peer sends 32 bytes and closes: a transfer that wanted only those 32
 * succeeds (the failure is parked), and asking for the rest reports it. */
static void test_parked_and_closed(void) {
    hworld w;
    hworld_init(&w, 2, 0, 0);
    unsigned char hdr[32] = {1, 2, 3}, buf[100];
    ddp_wait wt = ddp_wait_for(H_DEADLINE_MS, NULL);
    T_OK(ddp_link_send(w.links[0][1], hdr, sizeof hdr, wt));
    ddp_link_shutdown(w.links[0][1]);
    ddp_xfer x = {.link = w.links[1][0], .send = 0, .dst = buf, .len = sizeof buf, .want = 32};
    T_OK(ddp_link_xfer(&x, 1, wt));
    T_ASSERT(x.done == 32 && memcmp(buf, hdr, 32) == 0);
    x.want = x.len;
    T_STATUS(ddp_link_xfer(&x, 1, wt), DDP_ERR_CLOSED);
    T_ASSERT(strstr(ddp_last_error(), "receiving from rank 0 (socketpair) (32 of 100 bytes done)"));
    T_STATUS(ddp_link_send(w.links[1][0], buf, 10, wt), DDP_ERR_CLOSED);
    T_ASSERT(strstr(ddp_last_error(), "sending to rank 0"));
    /* this rank's own shutdown is an abort, not the peer's doing */
    T_STATUS(ddp_link_send(w.links[0][1], buf, 10, wt), DDP_ERR_ABORTED);
    T_ASSERT(strstr(ddp_last_error(), "shut down on this rank"));
    T_OK(ddp_link_sendrecv(w.links[0][1], buf, 0, w.links[0][1], buf, 0, wt)); /* nothing to do */
    hworld_free(&w);
    printf("parked and closed: ok\n");
}

/* Nothing ever arrives: the deadline and the abort flag end the wait, on
 * the poll path and on the spin path. */
static void test_deadline_and_abort(void) {
    for (int nofd = 0; nofd <= 1; nofd++) {
        hworld w;
        hworld_init(&w, 2, 0, 0);
        if (nofd) w.links[1][0] = hwrap_new(w.links[1][0], SIZE_MAX, 1);
        char buf[8];
        int64_t t0 = ddp_now_ms();
        T_STATUS(ddp_link_recv(w.links[1][0], buf, sizeof buf, ddp_wait_for(150, NULL)),
                 DDP_ERR_TIMEOUT);
        int64_t ms = ddp_now_ms() - t0;
        T_ASSERT(ms >= 150 && ms < H_DEADLINE_MS / 4);
        T_ASSERT(strstr(ddp_last_error(), "timed out after") &&
                 strstr(ddp_last_error(), "receiving from rank 0 (socketpair) (0 of 8 bytes"));
        atomic_int abort_flag = 1;
        T_STATUS(ddp_link_recv(w.links[1][0], buf, sizeof buf, ddp_wait_for(-1, &abort_flag)),
                 DDP_ERR_ABORTED);
        T_ASSERT(strstr(ddp_last_error(), "aborted while receiving from rank 0"));
        hworld_free(&w);
    }
    printf("deadline and abort: ok\n");
}

int main(void) {
    test_transfers();
    test_parked_and_closed();
    test_deadline_and_abort();
    printf("test_link: ok\n");
    return 0;
}
