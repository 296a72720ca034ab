/* ddp_nccl_comm.h - an NCCL communicator for one process group, on one
 * device, with its own communication stream.
 *
 * Creation is collective: rank 0 makes the NCCL unique id and publishes it,
 * with its pyddp and NCCL versions, under "<prefix>/nccl_uid" in the store;
 * every rank checks the versions and joins a non-blocking NCCL communicator
 * on the chosen device, polling until it is ready, the deadline passes or
 * the abort flag is set (no call can hang inside NCCL's set-up).
 *
 * Collectives on device buffers are enqueued on the communicator's stream,
 * after an event recorded on the producer's (caller's) stream, and followed
 * by a completion event. The returned work is polled: it finishes when that
 * event completes; NCCL's asynchronous error state, CUDA errors and the
 * work's deadline are checked on every poll, and any of them aborts the NCCL
 * communicator (ncclCommAbort) and breaks this one with a message naming the
 * rank, the device and the operation. Later submissions then fail at once.
 *
 * Collectives on host buffers run synchronously through pinned and device
 * staging buffers (for small things such as pickled objects).
 *
 * NCCL has no message headers, so ranks that call different collectives are
 * not detected as such: they show up as a timeout (whose message says to
 * check that every rank calls the same collectives with the same sizes).
 *
 * Threads: any thread may submit, poll, wait or abort; a mutex serialises
 * the calls into NCCL. Calls make the communicator's device current on the
 * calling thread (like torch.cuda.set_device), and never switch it back, so
 * that no CUDA context is created on another device.
 */
#ifndef DDP_NCCL_COMM_H
#define DDP_NCCL_COMM_H

#include <stdatomic.h>
#include <stdint.h>
#include "ddp_coll.h"
#include "ddp_cuda_lib.h"
#include "ddp_pg.h"
#include "ddp_store.h"

typedef struct ddp_nccl_comm ddp_nccl_comm;
typedef struct ddp_nccl_work ddp_nccl_work;

typedef struct ddp_nccl_config {
    int rank, size;
    int device;                  /* CUDA device ordinal */
    const char *prefix;          /* store key prefix, unique per group and attempt */
    int64_t timeout_ms;          /* default deadline of every operation */
    const char *version;         /* pyddp version, compared with rank 0's */
    const atomic_int *abort;     /* may be NULL: aborts the creation when set */
} ddp_nccl_config;

/* Collective: exchange the unique id through store (borrowed for the call)
 * and create the communicator. Needs a successful ddp_cuda_load. On failure
 * nothing is left behind (the NCCL communicator, if started, is aborted). */
ddp_status ddp_nccl_comm_create(const ddp_nccl_config *cfg, ddp_store *store,
                                ddp_nccl_comm **out);

int ddp_nccl_comm_rank(const ddp_nccl_comm *c);
int ddp_nccl_comm_size(const ddp_nccl_comm *c);
int ddp_nccl_comm_device(const ddp_nccl_comm *c);

/* The NCCL data type and reduction for (dtype, op): bool travels as uint8,
 * with SUM as MAX and PRODUCT as MIN (logical or / and, no overflow).
 * DDP_ERR_TYPE for what NCCL cannot do (AVG on bool). nc_op may be NULL. */
ddp_status ddp_nccl_map(ddp_dtype t, ddp_redop op, int *nc_type, int *nc_op);

/* Check a collective before anything is enqueued: root/peer range, sending
 * to oneself, dtype and op; for all_to_all also the count arrays, extents,
 * NULL and overlapping buffers and the own block (its input and output
 * split must agree), for a batch every op (peer, self, dtype, buffer).
 * DDP_ERR_INVALID / DDP_ERR_TYPE / DDP_ERR_MISMATCH with a message. NCCL
 * cannot check that the peers agree on sizes: see ddp_nccl_coll.c. */
ddp_status ddp_nccl_validate(const ddp_nccl_comm *c, const ddp_coll_args *a);

/* The device that owns ptr (device or managed memory), or DDP_ERR_INVALID
 * naming argname when ptr is not GPU memory. */
ddp_status ddp_nccl_pointer_device(const ddp_nccl_comm *c, const void *ptr,
                                   const char *argname, int *device);

/* Asked about every DDP_WAIT_SLICE_MS while NCCL is still launching a
 * collective (ncclInProgress: connection set-up can wait for a missing
 * peer); returning nonzero aborts the communicator. */
typedef ddp_pg_interrupt ddp_nccl_interrupt;

/* Enqueue a validated collective on device buffers. has_producer: order it
 * after the work already queued on `producer` (a cudaStream_t value; 0 is
 * the legacy default stream). timeout_ms < 0 uses the communicator's.
 * intr may be NULL. On success *out is a work the caller must release; the
 * buffers must stay allocated until the work is finished. */
ddp_status ddp_nccl_submit(ddp_nccl_comm *c, const ddp_coll_args *a, int has_producer,
                           uintptr_t producer, int64_t timeout_ms,
                           const ddp_nccl_interrupt *intr, ddp_nccl_work **out);

/* Run a validated collective on host buffers to completion, staging it
 * through device memory; bounded by the timeout and the abort flag.
 * all_to_all and batches are refused (DDP_ERR_INVALID): host arrays take
 * the CPU transport. */
ddp_status ddp_nccl_run_host(ddp_nccl_comm *c, const ddp_coll_args *a, int64_t timeout_ms,
                             const atomic_int *abort);

/* Poll once, never blocking: nonzero once the work finished (successfully
 * or not). May abort the communicator when the work failed. */
int ddp_nccl_work_done(ddp_nccl_work *w);
/* Poll until the work finishes or `wait` ends (the first 100 us without
 * sleeping, then with naps growing to 1 ms). Returns the work's status
 * when finished, else DDP_ERR_TIMEOUT / DDP_ERR_ABORTED for the wait itself
 * (check ddp_nccl_work_done to tell the two apart). */
ddp_status ddp_nccl_work_wait(ddp_nccl_work *w, ddp_wait wait);
/* The failed work's message ("" before it finished or when it succeeded). */
const char *ddp_nccl_work_error(const ddp_nccl_work *w);
/* Make `stream` wait for the work's results on the device, so that work the
 * caller queues there later sees them; the host does not wait, and the work
 * need not have finished (torch's wait() on a CUDA work). */
ddp_status ddp_nccl_work_sync_stream(ddp_nccl_work *w, uintptr_t stream);
/* After a failure: poll the completion event for up to ms milliseconds;
 * 1 once the GPU is done with the work's buffers (an aborted NCCL kernel
 * exits, so this normally comes quickly), 0 if it still was not. */
int ddp_nccl_work_drained(ddp_nccl_work *w, int64_t ms);
/* Drop the work (it need not be finished: the event is released by CUDA
 * once it completes). NULL is a no-op. */
void ddp_nccl_work_release(ddp_nccl_work *w);

/* Break the communicator now: ncclCommAbort, and every pending or later
 * operation fails with reason. Thread-safe; later calls do nothing. */
void ddp_nccl_comm_abort(ddp_nccl_comm *c, const char *reason);
/* Take / drop a reference that keeps c's memory valid (not the NCCL
 * communicator: a concurrent destroy still ends that). Thread-safe. */
void ddp_nccl_comm_retain(ddp_nccl_comm *c);
void ddp_nccl_comm_release(ddp_nccl_comm *c);
/* Finalize and destroy the NCCL communicator (waiting at most until w's
 * deadline, aborting it if that passes or the communicator is broken),
 * then drop the owner's reference; works still held keep the memory alive.
 * NULL is a no-op. */
void ddp_nccl_comm_destroy(ddp_nccl_comm *c, ddp_wait w);

#endif
