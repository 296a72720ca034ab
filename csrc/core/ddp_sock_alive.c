/* ddp_sock_alive.c - noticing a peer whose host vanished: the keepalive every
 * connection of ddp_sock.c gets, the TCP_INFO check of data that was never
 * acknowledged, and the message that names what happened (ddp_sock.h).
 *
 * A host that vanishes (a reclaimed VM, a partition) sends no FIN and no
 * RST, so without these a wait on it lasts until the group timeout. Both
 * mechanisms rest on the peer's kernel, not its process, so a peer that is
 * stopped or busy is never taken for dead.
 */
#include "ddp_sock.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string.h>
#include <sys/socket.h>

#include "ddp_settings.h"

int ddp_sock_peer_dead_s(void) {
    return (int)ddp_setting_int("PYDDP_PEER_DEAD_S"); /* bounded to 2..86400 */
}

/* Keepalive so that an idle connection to a vanished host fails within
 * about PYDDP_PEER_DEAD_S: the first probe after a third of it without
 * traffic, then probes that fill the rest. TCP_USER_TIMEOUT is deliberately
 * not used: Linux (5.11 and later) also applies it to a receive window that
 * stays closed, so a live peer that does not read for that long (rank 0
 * writing a checkpoint while the others send to it) would be cut off.
 * Unacknowledged data is watched by ddp_sock_peer_silent instead. Best
 * effort: a failure leaves the kernel's defaults. */
void ddp_sock_set_keepalive(int fd) {
    int one = 1, dead = ddp_sock_peer_dead_s();
    int idle = dead / 3 > 0 ? dead / 3 : 1;
    int intvl = (dead - idle) / 4 > 0 ? (dead - idle) / 4 : 1;
    int cnt = (dead - idle) / intvl > 0 ? (dead - idle) / intvl : 1;
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
#ifdef TCP_KEEPIDLE
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
#endif
}

ddp_status ddp_sock_peer_dead_error(const char *what) {
    return ddp_error(DDP_ERR_CLOSED, "no answer from %s for %d s: the host or the network "
                     "between us is down (not even its kernel acknowledged what was sent or "
                     "answered keepalive probes; PYDDP_PEER_DEAD_S sets how long to wait)",
                     what ? what : "the peer", ddp_sock_peer_dead_s());
}

int ddp_sock_peer_silent(int fd, int64_t *since) {
#if defined(__linux__) && defined(TCP_INFO)
    struct tcp_info ti;
    socklen_t len = sizeof ti;
    memset(&ti, 0, sizeof ti);
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) < 0 || len < sizeof ti) return 0;
    int64_t dead_ms = (int64_t)ddp_sock_peer_dead_s() * 1000;
    int waiting = ti.tcpi_state == 1 /* TCP_ESTABLISHED */ &&
                  (ti.tcpi_unacked > 0 || ti.tcpi_probes > 0);
    if (!waiting || (int64_t)ti.tcpi_last_ack_recv < dead_ms) {
        *since = 0;
        return 0;
    }
    int64_t now = ddp_now_ms();
    if (*since == 0) *since = now;
    return now - *since >= 1000;
#else
    (void)fd;
    (void)since;
    return 0;
#endif
}
