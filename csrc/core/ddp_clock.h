/* ddp_clock.h - monotonic time, deadlines and abort flags.
 *
 * Every blocking wait in the core takes a ddp_wait: an absolute deadline on
 * the monotonic clock plus an optional abort flag. Waits sleep in slices of at
 * most DDP_WAIT_SLICE_MS so that setting the flag (from another thread, a
 * signal handler or Python's Ctrl-C path) returns control within that slice.
 *
 * A wait may also carry a check hook: for a thread that waits in the core
 * itself and must still notice something only it can see (Python's Ctrl-C
 * on the main thread, which needs the GIL). Waits that park ask it at most
 * every DDP_WAIT_SLICE_MS, never while spinning; nonzero ends the wait with
 * DDP_ERR_ABORTED. ddp_wait_for leaves it unset.
 */
#ifndef DDP_CLOCK_H
#define DDP_CLOCK_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#define DDP_NO_DEADLINE INT64_MAX
#define DDP_WAIT_SLICE_MS 100

typedef struct ddp_wait {
    int64_t deadline_ms;        /* absolute, ddp_now_ms() scale */
    const atomic_int *abort;    /* may be NULL; nonzero means abort */
    int (*check)(void *ctx);    /* may be NULL: the check hook (see above) */
    void *check_ctx;
} ddp_wait;

/* Milliseconds on CLOCK_MONOTONIC. */
int64_t ddp_now_ms(void);
/* Microseconds on CLOCK_MONOTONIC (for benchmarks and spin loops). */
int64_t ddp_now_us(void);

/* A wait that ends timeout_ms from now (timeout_ms < 0: never). */
ddp_wait ddp_wait_for(int64_t timeout_ms, const atomic_int *abort);

/* Milliseconds left, clamped to [0, DDP_WAIT_SLICE_MS]: the timeout to pass
 * to one poll() call. */
int ddp_wait_slice(ddp_wait w);

/* Milliseconds left (0 if passed; INT64_MAX if none). */
int64_t ddp_wait_remaining(ddp_wait w);

/* 1 if the deadline passed, 0 otherwise. */
int ddp_wait_expired(ddp_wait w);

/* 1 if the abort flag is set. */
int ddp_wait_aborted(ddp_wait w);

/* One slice of a wait on a condition variable (default attributes, so
 * CLOCK_REALTIME) with mu held: returns after a signal, a spurious wake-up
 * or at most ddp_wait_slice(w) ms, so the caller's loop re-checks its
 * condition, w's deadline and abort flag. */
void ddp_wait_cond(pthread_cond_t *cv, pthread_mutex_t *mu, ddp_wait w);

/* One spin-wait step: tells the CPU this thread is busy-waiting. */
static inline void ddp_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

#endif
