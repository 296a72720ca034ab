/* ddp_resolve.h - host name resolution bounded by a deadline and an abort
 * flag, for ddp_sock_connect.
 *
 * getaddrinfo() cannot be interrupted, and with a dead DNS server it blocks
 * for resolv.conf's timeout times its attempts, per name, whatever our
 * deadline says. So a name that is not a numeric address is resolved on a
 * detached helper thread that owns its state jointly with the caller; the
 * caller stops waiting at its deadline or abort, and whichever side finishes
 * last frees the state, so a lookup that returns late leaks nothing.
 * Numeric addresses are parsed in place (no thread, no DNS).
 */
#ifndef DDP_RESOLVE_H
#define DDP_RESOLVE_H

#include <sys/socket.h>
#include "ddp_clock.h"
#include "ddp_status.h"

#define DDP_RESOLVE_MAX 16   /* addresses kept per name; more are ignored */

typedef struct ddp_addr {
    int family;              /* AF_INET or AF_INET6 */
    socklen_t len;
    struct sockaddr_storage sa;   /* port included */
} ddp_addr;

typedef struct ddp_addrs {
    int n;
    ddp_addr a[DDP_RESOLVE_MAX];
} ddp_addrs;

/* Resolve host:port for a TCP connect, in the resolver's order, before w's
 * deadline. Returns DDP_OK with out->n >= 1; DDP_ERR_CONNECT when the
 * resolver answered with an error (*gai_err = its EAI_* code, *sys_err =
 * errno for EAI_SYSTEM; message "cannot resolve ..."); DDP_ERR_TIMEOUT when
 * w expired first (message "resolving '<host>' took longer than N s: check
 * DNS ..."); DDP_ERR_ABORTED if w's flag was set. On failure out->n is 0. */
ddp_status ddp_resolve_tcp(const char *host, int port, ddp_wait w, ddp_addrs *out,
                           int *gai_err, int *sys_err);

/* Test hook replacing getaddrinfo (numeric addresses included): writes up to
 * max addresses (full socket addresses, port included) for host:port into
 * out and returns how many (>= 1), or returns -1 with *gai_err set to an
 * EAI_* code. It runs on the resolver thread and may block, like a hung DNS
 * server. NULL restores getaddrinfo. A lookup already started keeps the hook
 * it started with. */
typedef int (*ddp_resolve_hook)(const char *host, int port, ddp_addr *out, int max,
                                int *gai_err);
void ddp_resolve_set_hook(ddp_resolve_hook fn);

/* Resolver threads not yet finished, abandoned ones included (tests wait for
 * 0 before exiting so the leak checker sees their state freed). */
int ddp_resolve_running(void);

#endif
