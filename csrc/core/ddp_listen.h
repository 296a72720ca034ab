/* ddp_listen.h - the process's one data port: a listening socket shared by
 * every communicator of the process, and the acceptor threads that serve it.
 *
 * A communicator registers (its group tag and its rank in that group) when
 * it rendezvouses and publishes the port it gets; a connecting peer's hello
 * names the tag and the rank it wants (ddp_hello.h), and an acceptor thread
 * hands the connection to that communicator's serve function. So a process
 * holds one port however many groups it makes (a standalone group beside
 * another backend's, torch's backend groups, an in-place elastic rank), and
 * C thread-ranks of one process share it too. Registrations with another
 * bind address, or a port range the open port is not in, get a listener of
 * their own.
 *
 * The acceptor threads block in poll() on the socket and a wake pipe, with no
 * timeout: nothing runs while nobody connects, and stopping wakes them at
 * once. A forked child closes its copies of the sockets before it returns
 * from fork() (pthread_atfork), so a child never holds the parent's port:
 * a peer dialing a parent that died is refused, not left hanging in a
 * backlog nobody serves. The port closes when the last registration goes.
 */
#ifndef DDP_LISTEN_H
#define DDP_LISTEN_H

#include <stdint.h>
#include "ddp_hello.h"
#include "ddp_status.h"

typedef struct ddp_listen_reg ddp_listen_reg;

/* How long (ms) a held connection waits for its registration to be ready, or
 * for a tag nobody registered yet. The C unit tests build the core with a
 * shorter one (tests/c/Makefile), so that the waits they check take seconds. */
#ifndef DDP_LISTEN_READY_MS
#define DDP_LISTEN_READY_MS 10000
#endif

/* Serve one connection whose hello h (already read) names this
 * registration: the function owns fd. addr names the connecting end, for
 * messages. Called on an acceptor thread, possibly on several at once (for
 * different connections). */
typedef void (*ddp_listen_serve)(void *ctx, int fd, const ddp_hello *h, const char *addr);

/* Register (tag, rank) with the process's listener for bind_host ("" or NULL:
 * all interfaces) and port range lo..hi (0, 0: any port), opening it if
 * needed; *port is its port. Connections for the registration are held
 * (their acceptor waits, up to DDP_LISTEN_READY_MS) until ddp_listen_ready, and so are
 * connections naming a tag nobody registered (yet). DDP_ERR_INVALID
 * if (tag, rank) is registered already; the listen errors of ddp_sock_listen. */
ddp_status ddp_listen_attach(uint64_t tag, int rank, const char *bind_host, int lo, int hi,
                             ddp_listen_serve serve, void *ctx, int *port,
                             ddp_listen_reg **out);

/* Change r's tag (before ddp_listen_ready: the group's tag is known only
 * once its rendezvous agreed on a round). NULL is a no-op. */
void ddp_listen_retag(ddp_listen_reg *r, uint64_t tag);

/* From now on connections for r are handed to its serve function. */
void ddp_listen_ready(ddp_listen_reg *r);

/* Unregister r (NULL: no-op): later connections naming it are refused with
 * DDP_HELLO_GONE; returns once no serve call for it runs (the caller makes
 * those end soon, e.g. through an abort flag their waits check). Closes the
 * listener when it was its last registration. */
void ddp_listen_detach(ddp_listen_reg *r);

#endif
