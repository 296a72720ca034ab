/* ddp_resolve.c - name resolution with a deadline: getaddrinfo on a detached
 * helper thread that the caller can walk away from (see ddp_resolve.h).
 *
 * The job is shared by the caller and the thread with a count of two under
 * its mutex; each side drops its count when done with it and the last one
 * frees it. The thread never touches anything but the job, so the caller
 * may have returned (and its stack be gone) when a late lookup finishes.
 */
#include "ddp_resolve.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ddp_sock.h"

static _Atomic(ddp_resolve_hook) g_hook;
static atomic_int g_running;

void ddp_resolve_set_hook(ddp_resolve_hook fn) { atomic_store(&g_hook, fn); }

int ddp_resolve_running(void) { return atomic_load(&g_running); }

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;       /* signalled when done is set */
    int refs;                /* caller + thread, under mu */
    int done;
    ddp_resolve_hook hook;   /* NULL: getaddrinfo */
    char host[DDP_ADDR_MAX];
    int port;
    int flags;               /* extra getaddrinfo flags */
    int gai_err, sys_err;    /* results, valid once done */
    ddp_addrs addrs;
} job;

/* getaddrinfo (or the hook) for host:port into *out; returns 0 or an EAI_*
 * code (with *sys_err for EAI_SYSTEM). May block for as long as DNS likes. */
static int lookup(ddp_resolve_hook hook, const char *host, int port, int flags,
                  ddp_addrs *out, int *sys_err) {
    out->n = 0;
    *sys_err = 0;
    if (hook != NULL) {
        int g = EAI_FAIL;
        int n = hook(host, port, out->a, DDP_RESOLVE_MAX, &g);
        if (n < 1) return g != 0 ? g : EAI_FAIL;
        out->n = n > DDP_RESOLVE_MAX ? DDP_RESOLVE_MAX : n;
        return 0;
    }
    struct addrinfo hints, *res = NULL;
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV | flags;
    int g = getaddrinfo(host, portstr, &hints, &res);
    if (g != 0) {
        if (g == EAI_SYSTEM) *sys_err = errno;
        return g;
    }
    for (struct addrinfo *ai = res; ai != NULL && out->n < DDP_RESOLVE_MAX;
         ai = ai->ai_next) {
        if ((ai->ai_family != AF_INET && ai->ai_family != AF_INET6) ||
            ai->ai_addrlen > sizeof out->a[0].sa)
            continue;
        ddp_addr *a = &out->a[out->n++];
        a->family = ai->ai_family;
        a->len = (socklen_t)ai->ai_addrlen;
        memcpy(&a->sa, ai->ai_addr, ai->ai_addrlen);
    }
    freeaddrinfo(res);
    return out->n > 0 ? 0 : EAI_NONAME;
}

/* Drop one count of j; the last frees it. */
static void job_put(job *j) {
    pthread_mutex_lock(&j->mu);
    int last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (!last) return;
    pthread_cond_destroy(&j->cv);
    pthread_mutex_destroy(&j->mu);
    free(j);
}

static void *resolver_main(void *p) {
    job *j = p;
    ddp_addrs r;
    int sys_err = 0;
    int g = lookup(j->hook, j->host, j->port, j->flags, &r, &sys_err);
    pthread_mutex_lock(&j->mu);
    j->addrs = r;
    j->gai_err = g;
    j->sys_err = sys_err;
    j->done = 1;
    pthread_cond_signal(&j->cv);
    pthread_mutex_unlock(&j->mu);
    job_put(j);
    atomic_fetch_sub(&g_running, 1);   /* last: the job may be gone already */
    return NULL;
}

/* A new job with both counts taken, or NULL (out of memory). */
static job *job_new(ddp_resolve_hook hook, const char *host, int port) {
    job *j = calloc(1, sizeof *j);
    if (j == NULL) return NULL;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);   /* the clock of ddp_wait */
    pthread_cond_init(&j->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&j->mu, NULL);
    j->refs = 2;
    j->hook = hook;
    snprintf(j->host, sizeof j->host, "%s", host);
    j->port = port;
    return j;
}

/* Start j's thread; 0, or -1 if no thread could be made (j is then the
 * caller's alone, with refs 1). */
static int job_start(job *j) {
    pthread_attr_t at;
    pthread_t th;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    atomic_fetch_add(&g_running, 1);
    int r = pthread_create(&th, &at, resolver_main, j);
    pthread_attr_destroy(&at);
    if (r == 0) return 0;
    atomic_fetch_sub(&g_running, 1);
    j->refs = 1;
    return -1;
}

/* Wait for j within w, waking every slice for the abort flag. 1 if done,
 * 0 if w expired, -1 if aborted. */
static int job_wait(job *j, ddp_wait w) {
    pthread_mutex_lock(&j->mu);
    while (!j->done && !ddp_wait_aborted(w) && !ddp_wait_expired(w)) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_nsec += (long)ddp_wait_slice(w) * 1000000L;
        ts.tv_sec += ts.tv_nsec / 1000000000L;
        ts.tv_nsec %= 1000000000L;
        pthread_cond_timedwait(&j->cv, &j->mu, &ts);
    }
    int done = j->done;
    pthread_mutex_unlock(&j->mu);
    if (done) return 1;
    return ddp_wait_aborted(w) ? -1 : 0;
}

/* The status for resolver error g on host. */
static ddp_status gai_status(const char *host, int g, int sys_err) {
    return ddp_error(DDP_ERR_CONNECT, "cannot resolve host name '%s' (%s)", host,
                     g == EAI_SYSTEM ? strerror(sys_err) : gai_strerror(g));
}

ddp_status ddp_resolve_tcp(const char *host, int port, ddp_wait w, ddp_addrs *out,
                           int *gai_err, int *sys_err) {
    out->n = 0;
    *gai_err = 0;
    *sys_err = 0;
    if (strlen(host) >= DDP_ADDR_MAX)
        return ddp_error(DDP_ERR_INVALID, "host name of %zu characters is too long",
                         strlen(host));
    ddp_resolve_hook hook = atomic_load(&g_hook);
    if (hook == NULL) {
        /* A numeric address needs no DNS and cannot block: parse it here. */
        int g = lookup(NULL, host, port, AI_NUMERICHOST, out, sys_err);
        if (g == 0) return DDP_OK;
    }
    if (ddp_wait_aborted(w)) return ddp_error(DDP_ERR_ABORTED, "resolving '%s' aborted", host);
    job *j = job_new(hook, host, port);
    if (j == NULL) return ddp_error(DDP_ERR_NOMEM, "resolving '%s': out of memory", host);
    int64_t t0 = ddp_now_ms();
    int r;
    if (job_start(j) == 0) {
        r = job_wait(j, w);
    } else {
        /* No thread to spare: resolve here, unbounded, rather than fail. */
        j->gai_err = lookup(hook, host, port, 0, &j->addrs, &j->sys_err);
        r = 1;
    }
    ddp_status st = DDP_OK;
    if (r == 1) {
        /* done is set, so the thread no longer writes the results */
        *gai_err = j->gai_err;
        *sys_err = j->sys_err;
        if (j->gai_err == 0) *out = j->addrs;
        else st = gai_status(host, j->gai_err, j->sys_err);
    } else if (r < 0) {
        st = ddp_error(DDP_ERR_ABORTED, "resolving '%s' aborted", host);
    } else {
        st = ddp_error(DDP_ERR_TIMEOUT, "resolving '%s' took longer than %.1f s: check "
                       "DNS (the servers in /etc/resolv.conf, or an /etc/hosts entry), "
                       "or give an IP address", host,
                       (double)(ddp_now_ms() - t0) / 1000.0);
    }
    job_put(j);   /* the thread, if still resolving, frees j when it returns */
    return st;
}
