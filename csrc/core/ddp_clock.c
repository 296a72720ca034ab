/* ddp_clock.c - monotonic clock and deadline arithmetic. */
#include "ddp_clock.h"

#include <time.h>

int64_t ddp_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t ddp_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

ddp_wait ddp_wait_for(int64_t timeout_ms, const atomic_int *abort) {
    ddp_wait w;
    w.deadline_ms = timeout_ms < 0 ? DDP_NO_DEADLINE : ddp_now_ms() + timeout_ms;
    w.abort = abort;
    w.check = NULL;
    w.check_ctx = NULL;
    return w;
}

int64_t ddp_wait_remaining(ddp_wait w) {
    if (w.deadline_ms == DDP_NO_DEADLINE) return INT64_MAX;
    int64_t left = w.deadline_ms - ddp_now_ms();
    return left > 0 ? left : 0;
}

int ddp_wait_slice(ddp_wait w) {
    int64_t left = ddp_wait_remaining(w);
    return left > DDP_WAIT_SLICE_MS ? DDP_WAIT_SLICE_MS : (int)left;
}

int ddp_wait_expired(ddp_wait w) {
    return w.deadline_ms != DDP_NO_DEADLINE && ddp_now_ms() >= w.deadline_ms;
}

int ddp_wait_aborted(ddp_wait w) {
    return w.abort != NULL && atomic_load_explicit(w.abort, memory_order_relaxed) != 0;
}

void ddp_wait_cond(pthread_cond_t *cv, pthread_mutex_t *mu, ddp_wait w) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += (long)ddp_wait_slice(w) * 1000000L;
    ts.tv_sec += ts.tv_nsec / 1000000000L;
    ts.tv_nsec %= 1000000000L;
    pthread_cond_timedwait(cv, mu, &ts);
}
