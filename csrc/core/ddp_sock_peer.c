/* ddp_sock_peer.c - connecting to another rank's data port.
 *
 * A rank's data port is listening before its address is published, so the
 * only reasons a connection to it fails are that the rank is gone (refused:
 * reported at once, not retried until the deadline as a connection to a
 * store that may not be up yet is) or that the network drops the packets (a
 * firewall, a security group, an unreachable host: reported at the
 * deadline, naming the port and what to open).
 */
#include <errno.h>
#include <string.h>
#include <time.h>

#include "ddp_resolve.h"
#include "ddp_sock.h"

ddp_status ddp_sock_connect_peer(const char *host, int port, ddp_wait w, const char *who,
                                 int *fd_out) {
    char hp[DDP_ADDR_MAX + 16];
    int64_t start = ddp_now_ms();
    int err = 0;
    *fd_out = -1;
    ddp_sock_format_hostport(host, port, hp, sizeof hp);
    for (;;) {
        ddp_addrs as;
        int gai = 0, sys_err = 0;
        ddp_status st = ddp_resolve_tcp(host, port, w, &as, &gai, &sys_err);
        if (st == DDP_ERR_ABORTED || st == DDP_ERR_INVALID || st == DDP_ERR_NOMEM)
            return ddp_error_prefix(st, "connect to %s: ", hp);
        if (st == DDP_OK) {
            int fd = ddp_sock_connect_addrs(&as, w, &err);
            if (fd >= 0) {
                *fd_out = fd;
                return DDP_OK;
            }
            if (err == ECONNREFUSED)
                return ddp_error(DDP_ERR_CLOSED, "%s refused the connection to its data port "
                                 "%s: its process has exited or closed the process group",
                                 who, hp);
        }
        if (ddp_wait_aborted(w)) return ddp_error(DDP_ERR_ABORTED, "connect to %s aborted", hp);
        if (ddp_wait_expired(w)) break;
        int slice = ddp_wait_slice(w);   /* unreachable now: the route may come back */
        struct timespec ts = {slice / 1000, (long)(slice % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    return ddp_error(DDP_ERR_CONNECT, "could not connect to %s's data port %s within %.1f s "
                     "(last error: %s). Check that a firewall or cloud security-group rule "
                     "allows TCP between the nodes on the ports pyddp uses (PYDDP_PORT_RANGE, "
                     "or any port if it is unset).", who, hp,
                     (double)(ddp_now_ms() - start) / 1000.0, err ? strerror(err) : "none");
}
