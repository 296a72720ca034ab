/* ddp_hello.h - the first bytes on a data link: the hello a connecting rank
 * sends, the acceptor's reply, and the PYDDP_AUTH_TOKEN handshake that
 * follows it (ddp_auth.h); plus how ranks tell each other, through the
 * store, that authentication failed, so that every rank fails within
 * seconds instead of waiting for its timeout.
 *
 * On the wire (little-endian): hello = u32 magic, u32 wire version, u64
 * group tag, i32 rank, i32 size, u32 flags (bit 0: the sender has a token),
 * u32 stream, i32 to, u32 spare (0): 40 bytes. stream is the connection's index
 * among the sockets of one striped link (PYDDP_NSOCKS_PERPEER): 0 for the
 * first, the one every pair has, 1.. for the extra ones made after the
 * shared-memory upgrade. to is the rank the sender dials: the process's one
 * data port serves every group and rank of the process (ddp_listen.h), so
 * (tag, to) names the communicator. The first 24 bytes are laid out alike in
 * every wire version. Reply = u32 magic, u32 verdict: 8 bytes. With
 * verdict DDP_HELLO_AUTH the challenge-response of ddp_auth.h follows, the
 * connecting rank being the initiator.
 */
#ifndef DDP_HELLO_H
#define DDP_HELLO_H

#include <stddef.h>
#include <stdint.h>

#include "ddp_auth.h"
#include "ddp_store.h"

#define DDP_HELLO_MAGIC 0x44445048u       /* "HPDD" */
#define DDP_HELLO_REPLY_MAGIC 0x52445048u /* "HPDR" */
#define DDP_HELLO_BYTES 40
#define DDP_HELLO_REPLY_BYTES 8
#define DDP_HELLO_HAS_TOKEN 1u
/* How long a failed authentication may go unanswered by a good connection
 * from the rank it claimed to be before the job fails. */
#define DDP_AUTH_GRACE_MS 5000

enum {
    DDP_HELLO_OK = 0,        /* neither side has a token: the link is up */
    DDP_HELLO_AUTH = 1,      /* both have one: the handshake follows */
    DDP_HELLO_NEED_TOKEN = 2,/* the acceptor has a token, the sender none: closed */
    DDP_HELLO_NO_TOKEN = 3,  /* the sender has a token, the acceptor none: closed */
    DDP_HELLO_DUPLICATE = 4, /* the acceptor keeps its own connection to the sender
                              * (both dialed; the higher rank's wins): closed */
    DDP_HELLO_BROKEN = 5,    /* the acceptor's process group has failed: closed */
    DDP_HELLO_GONE = 6       /* no such group or rank in the acceptor's process (it
                              * left the group; the port serves its other groups) */
};

typedef struct ddp_hello {
    uint32_t magic;
    uint32_t wire;
    uint64_t tag;    /* hash of the group prefix */
    int32_t rank;
    int32_t size;
    uint32_t flags;
    uint32_t stream; /* 0: the link's first socket; k > 0: its extra socket k */
    int32_t to;      /* the rank dialed */
    uint32_t spare;  /* sent as 0, kept as read (so a hello decodes and encodes alike) */
} ddp_hello;

void ddp_hello_encode(const ddp_hello *h, unsigned char out[DDP_HELLO_BYTES]);
void ddp_hello_decode(const unsigned char in[DDP_HELLO_BYTES], ddp_hello *h);

/* The purpose string both ends of socket `stream` of the link from rank
 * `from` to rank `to` authenticate (group tag, both ranks and, for extra
 * sockets, the stream, so a proof fits one connection only). */
void ddp_hello_purpose(uint64_t tag, int from, int to, int size, int stream, char *out,
                       size_t len);

/* Connecting side, after sending its hello: read the reply and, if asked,
 * authenticate as initiator. DDP_OK: the link is up. DDP_ERR_AUTH with a
 * message naming peer when tokens differ or the proof fails; other
 * statuses for timeouts, aborts and broken connections. */
ddp_status ddp_hello_connect(int fd, const ddp_auth *a, const char *purpose, ddp_wait w,
                             const char *peer);

/* ddp_hello_connect that also reports the acceptor's verdict (0 if no
 * reply came). DDP_HELLO_DUPLICATE, DDP_HELLO_BROKEN and DDP_HELLO_GONE fail
 * with DDP_ERR_CLOSED, the latter two saying that the peer's process group
 * has already failed, or that the peer left it. */
ddp_status ddp_hello_connect_v(int fd, const ddp_auth *a, const char *purpose, ddp_wait w,
                               const char *peer, uint32_t *verdict);

/* Accepting side, turning a connection away with verdict (DDP_HELLO_DUPLICATE,
 * DDP_HELLO_BROKEN or DDP_HELLO_GONE) before any handshake; best effort,
 * bounded by w. */
void ddp_hello_refuse(int fd, uint32_t verdict, ddp_wait w);

/* Accepting side, for a hello h already checked to be this group's: reply
 * and, when both sides have a token, authenticate as responder. DDP_OK: the
 * link is up. DDP_ERR_AUTH: the connection must be dropped; the message
 * names addr and why, and the rejection is logged (once per host). */
ddp_status ddp_hello_accept(int fd, const ddp_hello *h, const ddp_auth *a,
                            const char *purpose, ddp_wait w, const char *addr);

/* Best effort, bounded to a couple of seconds: record msg under
 * "<prefix>/auth_failed" so the other ranks fail with it. */
void ddp_auth_announce(ddp_store *store, const char *prefix, const char *msg);

/* DDP_OK if nobody announced an authentication failure under prefix;
 * DDP_ERR_AUTH with the announced message otherwise. Store errors are not
 * reported here (the caller's own wait reports them). */
ddp_status ddp_auth_check_announced(ddp_store *store, const char *prefix, ddp_wait w);

/* Process-wide record of the latest authentication rejection (by this
 * process's store server or data-port acceptor): note one, or read the
 * latest (1 and its time and message, 0 if none since `since_ms`). */
void ddp_auth_note_reject(const char *msg);
int ddp_auth_last_reject(int64_t since_ms, int64_t *when_ms, char *msg, size_t len);

#endif
