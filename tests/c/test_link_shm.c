/* test_link_shm.c - unit tests of the shared-memory link between two forked
 * processes: the name hand-off and immediate unlink, exact byte streams of
 * many sizes across ring wrap-around, simultaneous transfers both ways much
 * larger than the ring, small and large sends back to back (ring and
 * single-copy descriptor paths interleaved in one stream), each with the
 * single-copy path on and off (PYDDP_SHM_CMA), deadlines and abort flags, a peer that shuts down,
 * a peer killed with SIGKILL (must fail within seconds, not at the
 * deadline; also one killed with its buffer offered for the single copy: a
 * closed link, not a system error), a peer that overwrites the segment header's ring size after
 * setup or its ring counter (no overrun: the capacity comes from the
 * mapping; a bad counter is DDP_ERR_PROTOCOL), and that nothing is left in
 * /dev/shm. Prints (never asserts)
 * the ping-pong latency and one-way bandwidth it sees. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ddp_link_shm.h"
#include "ddp_link_shm_int.h" /* the segment layout, to corrupt it as a bad peer would */
#include "ddp_settings.h"
#include "testutil.h"

#define RING (64u << 10)
#define W(ms) ddp_wait_for((ms), NULL)

typedef int (*child_fn)(ddp_link *l);

/* Set by a test: the child overwrites the header's ring_bytes with a huge
 * value once it has mapped (and validated) the segment, before either side
 * makes its link. */
static int corrupt_ring_bytes;
/* In the child: its mapping of the segment's header (for corrupt_head_child). */
static shm_hdr *child_hdr;

/* Fill with a pattern that differs per offset and per seed. */
static void pattern(unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)((i * 2654435761u) >> 13 ^ seed);
}

static int shm_name_exists(const char *name) {
    char path[128];
    struct stat sb;
    snprintf(path, sizeof path, "/dev/shm%s", name);
    return stat(path, &sb) == 0;
}

/* Create a segment, fork a child that maps it by name and acks over a
 * socketpair (the stand-in for the TCP link), unlink at once, and return
 * the parent's link. The child runs fn on its own link and exits with fn's
 * result. */
static ddp_link *start_pair(size_t ring, child_fn fn, pid_t *child) {
    int sv[2];
    T_ASSERT(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    char name[DDP_SHM_NAME_MAX];
    ddp_shm_seg *seg = NULL;
    T_OK(ddp_shm_seg_create(ring, name, &seg));
    T_ASSERT(shm_name_exists(name));
    pid_t pid = fork();
    T_ASSERT(pid >= 0);
    if (pid == 0) {
        close(sv[0]);
        ddp_shm_seg_close(seg);   /* map it again by name, as a peer process would */
        ddp_link *tcp = ddp_link_tcp_new(sv[1], 0, "parent");
        ddp_shm_seg *mine = NULL;
        if (ddp_shm_seg_open(name, &mine) != DDP_OK) _exit(90);
        if (corrupt_ring_bytes) ddp_le_put64(mine->hdr->ring_bytes, (uint64_t)1 << 40);
        child_hdr = mine->hdr;
        if (ddp_link_send(tcp, "k", 1, W(5000)) != DDP_OK) _exit(91);
        ddp_link *l = ddp_link_shm_new(mine, 1, tcp, 0, "rank 0 (parent)");
        int rc = fn(l);
        ddp_link_free(l);
        _exit(rc);
    }
    close(sv[1]);
    ddp_link *tcp = ddp_link_tcp_new(sv[0], 1, "child");
    char ack = 0;
    T_OK(ddp_link_recv(tcp, &ack, 1, W(5000)));
    T_ASSERT(ack == 'k');
    ddp_shm_unlink(name);
    T_ASSERT(!shm_name_exists(name));   /* a killed job leaves nothing behind */
    *child = pid;
    return ddp_link_shm_new(seg, 0, tcp, 1, "rank 1 (child)");
}

static void end_pair(ddp_link *l, pid_t child, int want_exit) {
    ddp_link_free(l);
    int ws = 0;
    T_ASSERT(waitpid(child, &ws, 0) == child);
    T_ASSERT(WIFEXITED(ws) && WEXITSTATUS(ws) == want_exit);
}

/* ---- stream correctness -------------------------------------------- */

static const size_t SIZES[] = {1, 7, 8, 4095, 4096, 65535, 65536, 65537, 100000,
                               3 * RING + 5, 1u << 20};
#define NSIZES (sizeof SIZES / sizeof SIZES[0])

/* Echo every message back with each byte plus one. */
static int echo_child(ddp_link *l) {
    unsigned char *buf = malloc(1u << 20);
    for (size_t k = 0; k < NSIZES; k++) {
        if (ddp_link_recv(l, buf, SIZES[k], W(10000)) != DDP_OK) return 1;
        for (size_t i = 0; i < SIZES[k]; i++) buf[i]++;
        if (ddp_link_send(l, buf, SIZES[k], W(10000)) != DDP_OK) return 2;
    }
    free(buf);
    return 0;
}

static void test_stream_sizes(void) {
    pid_t child;
    ddp_link *l = start_pair(RING, echo_child, &child);
    T_ASSERT(strcmp(l->ops->name, "shm") == 0);
    unsigned char *out = malloc(1u << 20), *in = malloc(1u << 20);
    for (size_t k = 0; k < NSIZES; k++) {
        pattern(out, SIZES[k], (unsigned)k);
        T_OK(ddp_link_send(l, out, SIZES[k], W(10000)));
        T_OK(ddp_link_recv(l, in, SIZES[k], W(10000)));
        for (size_t i = 0; i < SIZES[k]; i++) T_ASSERT(in[i] == (unsigned char)(out[i] + 1));
    }
    free(out);
    free(in);
    end_pair(l, child, 0);
}

/* Both sides send 8 MiB while receiving 8 MiB through a 64 KiB ring: only
 * works if the driver keeps both directions moving. */
#define BIDIR (8u << 20)
static int bidir_child(ddp_link *l) {
    unsigned char *out = malloc(BIDIR), *in = malloc(BIDIR), *want = malloc(BIDIR);
    pattern(out, BIDIR, 2);
    pattern(want, BIDIR, 1);
    int rc = ddp_link_sendrecv(l, out, BIDIR, l, in, BIDIR, W(20000)) != DDP_OK ? 1
             : memcmp(in, want, BIDIR) != 0                            ? 2
                                                                       : 0;
    free(out);
    free(in);
    free(want);
    return rc;
}

static void test_bidirectional(void) {
    pid_t child;
    ddp_link *l = start_pair(RING, bidir_child, &child);
    unsigned char *out = malloc(BIDIR), *in = malloc(BIDIR), *want = malloc(BIDIR);
    pattern(out, BIDIR, 1);
    pattern(want, BIDIR, 2);
    T_OK(ddp_link_sendrecv(l, out, BIDIR, l, in, BIDIR, W(20000)));
    T_ASSERT(memcmp(in, want, BIDIR) == 0);
    free(out);
    free(in);
    free(want);
    end_pair(l, child, 0);
}

/* Four sends back to back, small (ring) and large (descriptor) alternating,
 * taken by one receive: the stream must stay in order across the paths. */
static const size_t BURST[] = {100, 300000, 7, 1u << 20};
#define BURST_TOTAL (100 + 300000 + 7 + (1u << 20))

static int burst_child(ddp_link *l) {
    unsigned char *in = malloc(BURST_TOTAL), *want = malloc(BURST_TOTAL);
    size_t off = 0;
    for (size_t k = 0; k < 4; k++) {
        pattern(want + off, BURST[k], (unsigned)(10 + k));
        off += BURST[k];
    }
    int rc = ddp_link_recv(l, in, BURST_TOTAL, W(10000)) != DDP_OK ? 1
             : memcmp(in, want, BURST_TOTAL) != 0                ? 2
             : ddp_link_send(l, "k", 1, W(5000)) != DDP_OK        ? 3
                                                                  : 0;
    free(in);
    free(want);
    return rc;
}

static void test_mixed_burst(void) {
    pid_t child;
    ddp_link *l = start_pair(RING, burst_child, &child);
    unsigned char *buf = malloc(1u << 20);
    for (size_t k = 0; k < 4; k++) {
        pattern(buf, BURST[k], (unsigned)(10 + k));
        T_OK(ddp_link_send(l, buf, BURST[k], W(10000)));
    }
    char ack = 0;
    T_OK(ddp_link_recv(l, &ack, 1, W(10000)));
    T_ASSERT(ack == 'k');
    free(buf);
    end_pair(l, child, 0);
}

/* ---- figures (printed, not asserted) ------------------------------- */

#define PINGS 2000
#define BULK (64u << 20)
#define BULK_REPS 4
static int perf_child(ddp_link *l) {
    char b[8];
    for (int i = 0; i < PINGS; i++)
        if (ddp_link_recv(l, b, 8, W(10000)) || ddp_link_send(l, b, 8, W(10000))) return 1;
    unsigned char *buf = malloc(BULK);
    memset(buf, 0, BULK);   /* page faults are not the link's cost */
    int rc = 0;
    for (int i = 0; i < BULK_REPS && rc == 0; i++)
        rc = ddp_link_recv(l, buf, BULK, W(20000)) || ddp_link_send(l, "d", 1, W(5000));
    free(buf);
    return rc;
}

static void test_figures(void) {
    pid_t child;
    ddp_link *l = start_pair(ddp_shm_ring_bytes(), perf_child, &child);
    char b[8] = "pingpong";
    int64_t t0 = ddp_now_us();
    for (int i = 0; i < PINGS; i++) {
        T_OK(ddp_link_send(l, b, 8, W(10000)));
        T_OK(ddp_link_recv(l, b, 8, W(10000)));
    }
    int64_t t1 = ddp_now_us();
    unsigned char *buf = malloc(BULK);
    memset(buf, 1, BULK);
    int64_t best = INT64_MAX;
    for (int i = 0; i < BULK_REPS; i++) {
        int64_t t2 = ddp_now_us();
        T_OK(ddp_link_send(l, buf, BULK, W(20000)));
        T_OK(ddp_link_recv(l, b, 1, W(5000)));
        if (ddp_now_us() - t2 < best) best = ddp_now_us() - t2;
    }
    free(buf);
    printf("  shm link: 8-byte round trip %.2f us, %u MiB one way %.2f GB/s (ring %zu KiB)\n",
           (double)(t1 - t0) / PINGS, BULK >> 20, BULK / 1e3 / (double)best,
           ddp_shm_ring_bytes() >> 10);
    end_pair(l, child, 0);
}

/* ---- failures ------------------------------------------------------ */

/* Never touches its link (the parent kills it). */
static int sleeping_child(ddp_link *l) {
    (void)l;
    sleep(30);
    return 0;
}

static void kill_pair(ddp_link *l, pid_t child) {
    ddp_link_free(l);
    T_ASSERT(kill(child, SIGKILL) == 0);
    int ws = 0;
    T_ASSERT(waitpid(child, &ws, 0) == child && WIFSIGNALED(ws));
}

static void test_deadline_abort_local_shutdown(void) {
    pid_t child;
    ddp_link *l = start_pair(RING, sleeping_child, &child);
    char b[4];
    int64_t t0 = ddp_now_ms();
    T_STATUS(ddp_link_recv(l, b, 4, W(200)), DDP_ERR_TIMEOUT);
    T_ASSERT(ddp_now_ms() - t0 >= 190);
    T_ASSERT(strstr(ddp_last_error(), "rank 1 (child)") != NULL);
    atomic_int flag = 1;
    T_STATUS(ddp_link_recv(l, b, 4, ddp_wait_for(-1, &flag)), DDP_ERR_ABORTED);
    /* A full ring towards a quiet peer times out too, not blocks. */
    unsigned char *big = calloc(1, 4 * RING);
    ddp_status st = ddp_link_send(l, big, 4 * RING, W(200));
    free(big);
    T_STATUS(st, DDP_ERR_TIMEOUT);
    ddp_link_shutdown(l);
    T_STATUS(ddp_link_recv(l, b, 4, W(1000)), DDP_ERR_ABORTED);
    T_STATUS(ddp_link_send(l, b, 4, W(1000)), DDP_ERR_ABORTED);
    T_ASSERT(strstr(ddp_last_error(), "shut down on this rank") != NULL);
    kill_pair(l, child);
}

/* The communicator aborts from another thread while its worker is blocked
 * in a receive (and parked on the futex): the receive ends at once with
 * DDP_ERR_ABORTED. Under ThreadSanitizer this is the link's cross-thread
 * path. */
static void *shutdown_later(void *arg) {
    usleep(150 * 1000);
    ddp_link_shutdown(arg);
    return NULL;
}

static void test_shutdown_from_another_thread(void) {
    pid_t child;
    ddp_link *l = start_pair(RING, sleeping_child, &child);
    pthread_t t;
    T_ASSERT(pthread_create(&t, NULL, shutdown_later, l) == 0);
    char b[4];
    int64_t t0 = ddp_now_ms();
    T_STATUS(ddp_link_recv(l, b, 4, W(20000)), DDP_ERR_ABORTED);
    T_ASSERT(ddp_now_ms() - t0 < 5000);
    T_ASSERT(pthread_join(t, NULL) == 0);
    kill_pair(l, child);
}

/* Sends 3 bytes, then shuts its link down and waits to be reaped. */
static int closing_child(ddp_link *l) {
    if (ddp_link_send(l, "abc", 3, W(5000)) != DDP_OK) return 1;
    ddp_link_shutdown(l);
    sleep(2);
    return 0;
}

static void test_peer_shutdown(void) {
    pid_t child;
    ddp_link *l = start_pair(RING, closing_child, &child);
    char b[8] = {0};
    /* The bytes sent before the shutdown still arrive; then CLOSED, fast. */
    int64_t t0 = ddp_now_ms();
    T_STATUS(ddp_link_recv(l, b, 8, W(10000)), DDP_ERR_CLOSED);
    T_ASSERT(ddp_now_ms() - t0 < 5000);
    T_ASSERT(strstr(ddp_last_error(), "rank 1 (child)") != NULL);
    T_ASSERT(strcmp(b, "abc") == 0);
    end_pair(l, child, 0);
}

/* SIGKILL leaves the shared flags untouched: only the socket tells. */
static void test_peer_killed(void) {
    pid_t child;
    ddp_link *l = start_pair(RING, sleeping_child, &child);
    usleep(100 * 1000);
    T_ASSERT(kill(child, SIGKILL) == 0);
    char b[4];
    int64_t t0 = ddp_now_ms();
    T_STATUS(ddp_link_recv(l, b, 4, W(20000)), DDP_ERR_CLOSED);
    T_ASSERT(ddp_now_ms() - t0 < 5000);
    ddp_link_free(l);
    int ws = 0;
    T_ASSERT(waitpid(child, &ws, 0) == child && WIFSIGNALED(ws));
}

/* Sends 1 MiB, which the parent copies straight out of this process where the
 * machine allows it (the single-copy path), and stays in the send until killed. */
static int big_send_child(ddp_link *l) {
    char *buf = calloc(1, 1u << 20);
    if (buf == NULL) return 1;
    ddp_link_send(l, buf, 1u << 20, W(20000));
    free(buf);
    return 0;
}

/* The sender is killed (and reaped) with its buffer offered: the receive fails
 * as a closed link, naming the peer that went away, not as a system error. */
static void test_peer_killed_mid_copy(void) {
    setenv("PYDDP_SHM_CMA", "1", 1);
    ddp_settings_reload();
    pid_t child;
    ddp_link *l = start_pair(RING, big_send_child, &child);
    usleep(200 * 1000);
    T_ASSERT(kill(child, SIGKILL) == 0);
    int ws = 0;
    T_ASSERT(waitpid(child, &ws, 0) == child && WIFSIGNALED(ws));
    char *b = malloc(1u << 20);
    T_ASSERT(b != NULL);
    T_STATUS(ddp_link_recv(l, b, 1u << 20, W(20000)), DDP_ERR_CLOSED);
    T_ASSERT(strstr(ddp_last_error(), "process_vm_readv failed") == NULL);
    free(b);
    ddp_link_free(l);
    unsetenv("PYDDP_SHM_CMA");
    ddp_settings_reload();
}

/* A peer that rewrites the header's ring size after setup changes nothing:
 * both sides stream correctly (the old code took the capacity from the
 * header and wrote far past the mapping). */
static void test_corrupt_ring_bytes(void) {
    corrupt_ring_bytes = 1;
    test_stream_sizes();
    corrupt_ring_bytes = 0;
}

/* The child pushes its producer counter (ring 1) far past anything written:
 * the parent's receive must fail with DDP_ERR_PROTOCOL, not copy out of
 * bounds or hang. */
static int corrupt_head_child(ddp_link *l) {
    (void)l;
    atomic_store(&child_hdr->ring[1].head, (uint64_t)1 << 40);
    atomic_fetch_add(&child_hdr->bell[0], 1u); /* the parent may be parked: it polls anyway */
    sleep(2); /* stay alive, so that only the counter tells */
    return 0;
}

static void test_corrupt_counter(void) {
    pid_t child;
    ddp_link *l = start_pair(RING, corrupt_head_child, &child);
    char b[64];
    int64_t t0 = ddp_now_ms();
    T_STATUS(ddp_link_recv(l, b, sizeof b, W(10000)), DDP_ERR_PROTOCOL);
    T_ASSERT(ddp_now_ms() - t0 < 5000);
    T_ASSERT(strstr(ddp_last_error(), "inconsistent") != NULL);
    end_pair(l, child, 0);
}

static void test_bad_inputs(void) {
    const char *old = getenv("PYDDP_SHM_RING_BYTES");
    char *saved = old ? strdup(old) : NULL;
    ddp_shm_seg *s = NULL;
    char name[DDP_SHM_NAME_MAX];
    T_STATUS(ddp_shm_seg_create(1000, name, &s), DDP_ERR_INVALID);
    T_STATUS(ddp_shm_seg_open("/pyddp-no-such-segment", &s), DDP_ERR_SYS);
    T_ASSERT(strstr(ddp_last_error(), "/pyddp-no-such-segment") != NULL);
    /* settings are parsed once: reload after each change */
    setenv("PYDDP_SHM_RING_BYTES", "100000", 1);
    ddp_settings_reload();
    T_ASSERT(ddp_shm_ring_bytes() == 131072);
    setenv("PYDDP_SHM_RING_BYTES", "junk", 1);
    ddp_settings_reload();
    T_ASSERT(ddp_shm_ring_bytes() == DDP_SHM_RING_DEFAULT);
    setenv("PYDDP_SHM_RING_BYTES", "1", 1); /* clamped to the minimum */
    ddp_settings_reload();
    T_ASSERT(ddp_shm_ring_bytes() == 64u << 10);
    if (saved) setenv("PYDDP_SHM_RING_BYTES", saved, 1);
    else unsetenv("PYDDP_SHM_RING_BYTES");
    ddp_settings_reload();
    free(saved);
}

int main(void) {
    test_bad_inputs();
    /* Both ways of moving bytes: single copy out of the sender's memory where
     * this machine allows it, and the ring everywhere. */
    const char *modes[] = {"1", "0"};
    for (int m = 0; m < 2; m++) {
        setenv("PYDDP_SHM_CMA", modes[m], 1);
        ddp_settings_reload();
        test_stream_sizes();
        test_bidirectional();
        test_mixed_burst();
    }
    unsetenv("PYDDP_SHM_CMA");
    ddp_settings_reload();
    test_corrupt_ring_bytes();
    test_corrupt_counter();
    test_deadline_abort_local_shutdown();
    test_shutdown_from_another_thread();
    test_peer_shutdown();
    test_peer_killed();
    test_peer_killed_mid_copy();
    test_figures();
    printf("test_link_shm: ok\n");
    return 0;
}
