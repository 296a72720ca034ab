/* ddp_sock.h - TCP socket helpers with deadlines and abort flags.
 *
 * All sockets returned here are non-blocking, close-on-exec, and (for
 * connected TCP sockets) have TCP_NODELAY and short kernel keepalive set, so
 * that a peer whose host vanished (no FIN, no RST ever arrives) is noticed
 * within about PYDDP_PEER_DEAD_S seconds (ddp_sock_peer_silent covers the
 * case keepalive does not: data sent and never acknowledged). Every call that may block
 * takes a ddp_wait and polls in slices so that the abort flag is honoured.
 * On failure the thread's error message names the host:port involved.
 * Functions never close a descriptor they did not create.
 */
#ifndef DDP_SOCK_H
#define DDP_SOCK_H

#include <stddef.h>
#include <stdint.h>
#include "ddp_clock.h"
#include "ddp_status.h"

#define DDP_ADDR_MAX 256   /* enough for a host name or an IPv6 literal */

/* Connect to host:port (name or IPv4/IPv6 literal). Retries refused or
 * unreachable connections every ~100 ms until the deadline, since the peer
 * may not be listening yet. Each pass tries every address of the name, each
 * with a share of the time left (at least a couple of seconds), so one that
 * drops SYNs cannot starve the next. Name resolution is bounded by the
 * deadline too (ddp_resolve.h). On timeout: DDP_ERR_CONNECT with a message
 * that names host:port, the last errno and what to check (firewall, security
 * group, MASTER_ADDR/MASTER_PORT), or says that resolving the name took
 * longer than the wait (check DNS). DDP_ERR_ABORTED if w's flag is set. */
ddp_status ddp_sock_connect(const char *host, int port, ddp_wait w, int *fd_out);

/* Connect to a rank's data port at host:port, which was listening when the
 * rank published it: unlike ddp_sock_connect, a refusal is not retried (the
 * rank's process is gone, or it closed its process group): DDP_ERR_CLOSED
 * at once; no answer by w's deadline is DDP_ERR_CONNECT naming the port and
 * what may block it (a firewall or security-group rule, PYDDP_PORT_RANGE).
 * who names the rank in messages (ddp_sock_peer.c). */
ddp_status ddp_sock_connect_peer(const char *host, int port, ddp_wait w, const char *who,
                                 int *fd_out);

/* One pass over the addresses of a resolved name (ddp_resolve.h), each with
 * a share of w: a connected, tuned socket, or -1 with *err the last errno. */
struct ddp_addrs;
int ddp_sock_connect_addrs(const struct ddp_addrs *as, ddp_wait w, int *err);

/* Listen on bind_host (NULL or "" = all interfaces, IPv4 and IPv6 where
 * possible) at port. port 0 picks an ephemeral port, unless lo..hi is a
 * nonzero range, in which case the first free port in [lo, hi] is used.
 * *port_out receives the bound port. */
ddp_status ddp_sock_listen(const char *bind_host, int port, int lo, int hi,
                           int *fd_out, int *port_out);

/* Accept one connection on a listening socket before the deadline. */
ddp_status ddp_sock_accept(int lfd, ddp_wait w, int *fd_out);

/* Send or receive exactly n bytes, polling until done, the deadline passes
 * (DDP_ERR_TIMEOUT), the flag aborts (DDP_ERR_ABORTED) or the peer closes
 * or stops answering (DDP_ERR_CLOSED; ddp_sock_peer_silent is checked about
 * once a second while no byte moves). `what` names the peer in error messages (may be NULL). */
ddp_status ddp_sock_send_all(int fd, const void *buf, size_t n, ddp_wait w,
                             const char *what);
ddp_status ddp_sock_recv_all(int fd, void *buf, size_t n, ddp_wait w,
                             const char *what);

/* Receive at least min and at most cap bytes (min <= cap) into buf: whatever
 * the kernel holds once min have arrived, so that a reader of many small
 * messages makes one system call where it would make one per message. *got
 * is how many; waits and fails as ddp_sock_recv_all does. */
ddp_status ddp_sock_recv_atleast(int fd, void *buf, size_t min, size_t cap, size_t *got,
                                 ddp_wait w, const char *what);

/* Non-blocking progress: move as many bytes as the kernel takes now.
 * *done is advanced. Returns DDP_OK (possibly with no progress),
 * DDP_ERR_CLOSED on EOF/reset, DDP_ERR_SYS otherwise. When the kernel gave
 * the connection up (keepalive unanswered: ETIMEDOUT) the status is
 * DDP_ERR_CLOSED with ddp_sock_peer_dead_error's message and errno is left
 * ETIMEDOUT, so a caller that knows the peer's name can reword it. */
ddp_status ddp_sock_send_some(int fd, const void *buf, size_t n, size_t *done);
ddp_status ddp_sock_recv_some(int fd, void *buf, size_t n, size_t *done);

/* Kernel keepalive sized from PYDDP_PEER_DEAD_S (best effort; ddp_sock's
 * connect and accept apply it to every connection they make). */
void ddp_sock_set_keepalive(int fd);

/* PYDDP_PEER_DEAD_S: seconds without any answer from a peer's kernel after
 * which its host (or the network to it) is taken to be gone. */
int ddp_sock_peer_dead_s(void);

/* Whether the peer of connected TCP socket fd has stopped answering: this
 * side has data out that the peer's kernel has not acknowledged (or a
 * zero-window probe it has not answered) and nothing at all came back for
 * PYDDP_PEER_DEAD_S seconds, on two looks at least a second apart (*since,
 * 0 at first, keeps the first look; so a probe caught in flight is not a
 * death). A peer that is alive but stopped or slow is never dead here: its
 * kernel keeps acknowledging. Returns 1 if dead, else 0 (also for sockets
 * that are not TCP). Cheap (one getsockopt), but meant for idle waits. */
int ddp_sock_peer_silent(int fd, int64_t *since);

/* The message of a dead peer host: DDP_ERR_CLOSED with "no answer from
 * <what> for <N> s: the host or the network between us is down ...".
 * what: e.g. "rank 1 at 10.0.0.7" or "the store at 10.0.0.1:23456". */
ddp_status ddp_sock_peer_dead_error(const char *what);

/* socket() that returns a non-blocking, close-on-exec descriptor or -1
 * (errno set). */
int ddp_sock_open(int family, int type, int proto);

/* Set SO_SNDBUF and SO_RCVBUF (best effort). */
void ddp_sock_set_bufsize(int fd, int bytes);

/* The local IP address this host would use to reach host (UDP connect
 * trick; no packet is sent). Writes a numeric address into out. */
ddp_status ddp_sock_route_addr(const char *host, char *out, size_t outlen);

/* The first IPv4 (else IPv6) address of network interface ifname. */
ddp_status ddp_sock_ifname_addr(const char *ifname, char *out, size_t outlen);

/* Write "host:port" (IPv6 in brackets) into out. */
void ddp_sock_format_hostport(const char *host, int port, char *out, size_t outlen);

#endif
