/* ddp_comm.h - the communicator: rendezvous of ranks through the store, one
 * link per peer, and a worker thread that runs collectives in call order.
 *
 * Creation (ddp_comm_create) is collective: every rank of the group calls it
 * with the same prefix and size. Each rank listens on a data port, publishes
 * {version, advertised host:port, host identity} under the prefix; rank 0
 * checks that every rank runs the same pyddp and wire version
 * (DDP_ERR_VERSION naming the ranks, hosts and versions otherwise, on every
 * rank) and publishes one table of the members that every rank reads: O(N)
 * store requests in all. No connection is made then: the link to a peer is
 * made the first time a collective needs it (ddp_comm_link.c), so a rank
 * connects only to the peers its algorithms talk to, and an unreachable peer
 * is an error naming it at that first use, within the call's deadline.
 *
 * Threads: the caller's thread submits work; one worker thread per
 * communicator runs it in submission order, so all ranks see the same
 * sequence (a small blocking call may run on the caller's thread instead,
 * ddp_comm_run_inline, when nothing is queued ahead of it). Submitting never blocks on the network. Argument validation
 * happens in ddp_comm_submit, on the caller's thread, before anything is
 * queued. After any communication failure the communicator is "broken":
 * every link is shut down (so peers blocked on this rank fail within
 * moments), queued work fails, and later submissions fail at once with the
 * original error. ddp_comm_abort does the same on demand.
 *
 * Subgroups (ddp_comm_subgroup) are views of a communicator over a subset
 * of its ranks: they run on the parent's links and worker thread (no second
 * rendezvous, no new connections), with their own rank numbering, sequence
 * numbers and group tag (carried in every collective header, so a rank that
 * calls a collective on the wrong group is a mismatch, not a hang). All of a
 * process's groups share one queue: collectives run in the order this
 * process submitted them, across groups. A failure on any group breaks the
 * whole communicator and every group over it.
 *
 * Lifetimes: communicators are reference-counted. ddp_comm_destroy ends
 * communication and drops the owner's reference; works, subgroups and other
 * borrowers (ddp_comm_retain) keep the memory valid until they release it,
 * and calls on a destroyed communicator fail with DDP_ERR_INVALID.
 *
 * Buffers named in submitted work must stay valid until the work is done.
 */
#ifndef DDP_COMM_H
#define DDP_COMM_H

#include <stdatomic.h>
#include <stdint.h>
#include "ddp_coll.h"
#include "ddp_flight.h"
#include "ddp_pg.h"
#include "ddp_store.h"

#define DDP_WIRE_VERSION 5

typedef struct ddp_comm ddp_comm;
typedef struct ddp_work ddp_work;

typedef struct ddp_comm_config {
    int rank;
    int size;
    const char *prefix;          /* store key prefix, unique per group and attempt; with
                                  * agree_round the start's base (below) */
    int agree_round;             /* 1: the store outlives the workers (earlier rounds'
                                  * keys may be in it): the ranks agree on a round in the
                                  * rendezvous (ddp_comm_round.c) and the group's prefix is
                                  * "<prefix>/<round>" (ddp_comm_prefix) */
    const char *advertise_host;  /* address peers connect to (numeric preferred) */
    const char *bind_host;       /* NULL/"" = all interfaces */
    int port_lo, port_hi;        /* data port range; 0,0 = ephemeral */
    int64_t timeout_ms;          /* default deadline of every operation */
    const char *version;         /* pyddp version string, compared across ranks */
    const char *host_id;         /* identity of this host (boot id + host name) */
    const atomic_int *abort;     /* may be NULL: aborts the rendezvous when set */
} ddp_comm_config;

/* Collective: rendezvous and connect. store is borrowed for the call. */
ddp_status ddp_comm_create(const ddp_comm_config *cfg, ddp_store *store,
                           ddp_comm **out);

/* Member-only, no communication: a view of parent over the parent ranks
 * ranks[0..n-1] (strictly increasing, this rank among them), whose
 * collectives carry `tag` (the same on every member, different from every
 * other group's). Holds a reference on parent. DDP_ERR_INVALID for bad
 * ranks, a destroyed parent, or a rank not in the list. */
ddp_status ddp_comm_subgroup(ddp_comm *parent, int n, const int *ranks, uint64_t tag,
                             ddp_comm **out);

/* Override PYDDP_ALGO for c's bandwidth-path collectives (DDP_ALGO_* of
 * ddp_coll.h). Only before c's first collective; every member must pass
 * the same value (ranks that differ get DDP_ERR_MISMATCH, never a wrong
 * result). */
void ddp_comm_set_algo(ddp_comm *c, int algo);

/* Take / drop a reference that keeps c's memory valid (thread-safe). */
void ddp_comm_retain(ddp_comm *c);
void ddp_comm_release(ddp_comm *c);

/* c behind the one process-group interface (ddp_pg.h): every op, run_inline
 * (ddp_comm_run_inline) and the info table included. */
ddp_pg ddp_comm_pg(ddp_comm *c);

int ddp_comm_rank(const ddp_comm *c);
/* The store key prefix of c's communicator (the agreed round's with agree_round). */
const char *ddp_comm_prefix(const ddp_comm *c);
/* The group's tag (in every collective header; a hash of the group's key prefix). */
uint64_t ddp_comm_tag(const ddp_comm *c);
int ddp_comm_size(const ddp_comm *c);
/* Human description of peer r, e.g. "rank 1 (10.0.0.2:40411)". */
const char *ddp_comm_peer_desc(const ddp_comm *c, int r);
/* The transport of the link to group rank r ("tcp", "shm"), "self" for this
 * rank, "none" while no link to r was made (links are made on first use),
 * "closed" once the communicator was destroyed. */
const char *ddp_comm_transport(ddp_comm *c, int r);
/* How many links c's communicator has made so far (to any peer, for any of
 * its groups): links are made on first use, so this is the number of peers
 * its collectives have talked to. */
int ddp_comm_links_made(ddp_comm *c);
/* How many connections c's communicator has dialed (the first of each link
 * it dialed, whatever became of it); *refused: how many of those the peer
 * refused because it dialed this rank at the same time and its connection
 * was kept, work spent for nothing that ddp_group_need_mutual keeps rare. */
int ddp_comm_dials(ddp_comm *c, int *refused);
/* Host identity string of rank r, as published at rendezvous. */
const char *ddp_comm_host_id(const ddp_comm *c, int r);

/* The rank of c's group rank r in the communicator c was made from by
 * ddp_comm_create (its "world"); r itself for such a communicator. */
int ddp_comm_world_rank(const ddp_comm *c, int r);

/* Validate and queue one collective. timeout_ms < 0 uses the default.
 * On success *out is a handle the caller must release. */
ddp_status ddp_comm_submit(ddp_comm *c, const ddp_coll_args *a,
                           int64_t timeout_ms, ddp_work **out);
/* The same with options (timeout, completion notification; ddp_pg.h). */
ddp_status ddp_comm_submit_opts(ddp_comm *c, const ddp_coll_args *a, const ddp_pg_opts *o,
                                ddp_work **out);

/* The inline fast path of a blocking small collective (ALLREDUCE, BROADCAST,
 * REDUCE, BARRIER of at most PYDDP_SMALL_BYTES): if the engine is idle (no
 * work queued or running) and the group usable, run it on the calling thread
 * now, exactly as the worker would (header exchange, sequence number, flight
 * record, progress counters, timeout, breaking on failure) and return its
 * status with *taken = 1; on an idle engine validation and
 * "broken"/"destroyed" errors also come with *taken = 1. Otherwise (another
 * kind, too big, the engine busy) *taken = 0 and nothing happened, not even
 * validation: submit it instead (which validates it). The wait spins, then
 * parks as the worker's does; check(check_ctx), if given, is asked while it
 * parks, at most every DDP_WAIT_SLICE_MS (nonzero aborts the run: the caller
 * should have broken the group first, e.g. ddp_comm_abort, so that peers fail
 * too). Work submitted meanwhile by other threads runs after it. The caller
 * holds a reference on g; a ddp_comm_destroy of g's communicator from check
 * (on this thread) is finished when the run returns. */
ddp_status ddp_comm_run_inline(ddp_comm *g, const ddp_coll_args *a, int64_t timeout_ms,
                               int (*check)(void *ctx), void *check_ctx, int *taken);

/* Nonzero once the work finished (successfully or not). Never blocks. */
int ddp_work_done(ddp_work *w);
/* Block until the work finishes or w's deadline/abort hits. Returns the
 * work's status (its message via ddp_work_error) or DDP_ERR_TIMEOUT /
 * DDP_ERR_ABORTED for the wait itself (the work keeps running). */
ddp_status ddp_work_wait(ddp_work *work, ddp_wait w);
const char *ddp_work_error(const ddp_work *work);
/* Take one more reference (e.g. for a thread that waits on the work while
 * another may release it); each retain needs a ddp_work_release. */
void ddp_work_retain(ddp_work *work);
/* Drop the caller's reference (the worker holds its own until done). */
void ddp_work_release(ddp_work *work);

/* The flight record of c's communicator (every group over it): up to max
 * entries, oldest first; returns how many (ddp_flight.h). Thread-safe. */
size_t ddp_comm_flight(ddp_comm *c, ddp_flight_entry *out, size_t max);
/* Progress of group c: collectives queued and finished on it (point-to-point
 * excluded: the k-th is the group's collective #k), and the last finished
 * (zeroed if none). Thread-safe. */
void ddp_comm_progress(ddp_comm *c, uint64_t *submitted, uint64_t *completed,
                       ddp_flight_entry *last_done);
/* How many collectives or point-to-point works are queued or running on c's
 * communicator (every group over it) right now; 0 once it was destroyed.
 * Thread-safe. */
int ddp_comm_pending(ddp_comm *c);
/* When a collective of any group of c times out, before the communicator
 * breaks, its worker announces it in the store s (retained) under prefix:
 * ADD "<prefix>/stuck_n" 1 -> i, then SET "<prefix>/stuck/<i>" to a STUCK
 * record, "rank=R;tag=T;seq=K;what=DESCRIPTION" (R: world rank, T: the
 * group's tag in hex, K: the collective's number on that group), each bounded
 * by 2 s; the keys are user keys as TCPStore clients spell them (a leading
 * '/'). So the other ranks can tell a peer's timeout from a crash and gather
 * reports about who did not arrive. Any other failure of the communicator is
 * kept there too, before its links close: "<prefix>/broken/<R>" is a BROKEN
 * record, "rank=R;what=MESSAGE", and whoever ADDs "<prefix>/broken_n" to 1
 * sets "<prefix>/broken" to the same. Keys and records are declared in
 * ddp_forensics.h. Call once, before work is queued. */
void ddp_comm_set_stall_store(ddp_comm *c, ddp_store *s, const char *prefix);

/* Break the communicator now (thread-safe). */
void ddp_comm_abort(ddp_comm *c, const char *reason);
/* For a communicator from ddp_comm_create: abort pending work, join the
 * worker and close the links; for a subgroup: refuse further work. Then
 * drop the owner's reference (borrowers keep the memory). NULL: no-op. */
void ddp_comm_destroy(ddp_comm *c);

#endif
