/* ddp_flight.h - the flight record: the last DDP_FLIGHT_LEN collectives a
 * communicator queued (on any of its groups), in a fixed ring, so that a
 * stuck or failed job can say what each process was doing (dumped on a
 * timeout, on request, or on a signal).
 *
 * Recording costs no lock of its own: the communicator writes entries while
 * it already holds its queue mutex (at submit, when the worker starts a work,
 * when it finishes it), and ddp_flight_copy must be called under that same
 * mutex. Times are ddp_now_us() (monotonic).
 */
#ifndef DDP_FLIGHT_H
#define DDP_FLIGHT_H

#include <stddef.h>
#include <stdint.h>

#define DDP_FLIGHT_LEN 64

typedef struct ddp_flight_entry {
    uint64_t id;          /* 1, 2, ...: collectives queued on this communicator */
    uint64_t tag;         /* the group's tag */
    uint64_t seq;         /* the group's collective number (1-based); 0 for point-to-point */
    int kind, dtype, op, root;   /* ddp_coll_kind, ddp_dtype, ddp_redop, root or peer */
    int group_rank, group_size;
    uint64_t bytes;       /* payload bytes of this rank's largest buffer */
    int64_t queued_us, started_us, ended_us;   /* 0: not yet */
    int status;           /* ddp_status once ended */
} ddp_flight_entry;

typedef struct ddp_flight {
    ddp_flight_entry ring[DDP_FLIGHT_LEN];
    uint64_t next_id;     /* id of the next entry; ring slot = (id - 1) % LEN */
} ddp_flight;

/* Record a queued collective (e->id is assigned and returned). */
uint64_t ddp_flight_queued(ddp_flight *f, ddp_flight_entry *e);
/* The worker started / ended entry id (no-op if it left the ring). */
void ddp_flight_started(ddp_flight *f, uint64_t id);
void ddp_flight_ended(ddp_flight *f, uint64_t id, int status);
/* Entry id into *out: 1, or 0 when it left the ring (or never existed). */
int ddp_flight_get(const ddp_flight *f, uint64_t id, ddp_flight_entry *out);
/* Copy up to max entries, oldest first; returns how many. */
size_t ddp_flight_copy(const ddp_flight *f, ddp_flight_entry *out, size_t max);

#endif
