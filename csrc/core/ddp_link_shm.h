/* ddp_link_shm.h - a link between two processes on one host over a POSIX
 * shared-memory segment.
 *
 * A segment holds two single-producer/single-consumer byte rings, one per
 * direction, each with its head (written by the producer) and tail (written
 * by the consumer) on separate cache lines. Side 0 (the creator) sends on
 * ring 0 and receives on ring 1; side 1 the reverse. Small sends are copied
 * into the ring and out again; large ones (PYDDP_SHM_CMA_MIN) are copied by
 * the receiver straight out of the sender's memory with process_vm_readv
 * where the two processes may do that (probed when the link is made). A
 * waiting side parks on a futex in the segment (ddp_link_ops.park) and the
 * other side wakes it when it publishes progress.
 *
 * The link keeps the pair's original TCP link for liveness only: nothing is
 * sent on it after the upgrade, so EOF or an error on it means the peer died
 * or shut down, and a rank spinning on an empty ring notices within about a
 * millisecond. Each side also raises a "closed" flag in the segment when it
 * shuts down, which the other side sees at once.
 *
 * Lifetime of a segment name: the creator makes it with a unique name,
 * hands the name to its peer, and unlinks it as soon as the peer has mapped
 * it (ddp_shm_unlink), so a killed job leaves nothing in /dev/shm. The
 * mappings live until ddp_link_free (or ddp_shm_seg_close).
 */
#ifndef DDP_LINK_SHM_H
#define DDP_LINK_SHM_H

#include <stddef.h>
#include "ddp_link.h"
#include "ddp_status.h"

#define DDP_SHM_NAME_MAX 64
#define DDP_SHM_RING_DEFAULT (1u << 20)  /* bytes per direction */

typedef struct ddp_shm_seg ddp_shm_seg;

/* Ring size from PYDDP_SHM_RING_BYTES (rounded up to a power of two, at
 * least 64 KiB, at most 256 MiB), else DDP_SHM_RING_DEFAULT. */
size_t ddp_shm_ring_bytes(void);

/* Create and map a new segment with two rings of ring_bytes (a power of
 * two) under a fresh unique name, written to name_out. Memory is reserved
 * up front (posix_fallocate), so a full /dev/shm fails here with
 * DDP_ERR_NOMEM instead of SIGBUS later. On failure nothing is left behind
 * (the name is unlinked). The caller must ddp_shm_unlink(name_out) once the
 * peer has mapped it, or on any later failure. */
ddp_status ddp_shm_seg_create(size_t ring_bytes, char name_out[DDP_SHM_NAME_MAX],
                              ddp_shm_seg **out);

/* Map an existing segment by name and check its header (magic, version,
 * size). DDP_ERR_SYS / DDP_ERR_PROTOCOL with a message on failure. */
ddp_status ddp_shm_seg_open(const char *name, ddp_shm_seg **out);

/* Remove a segment's name (ignores "does not exist"). Mappings stay valid. */
void ddp_shm_unlink(const char *name);

/* Unmap a segment not handed to a link. NULL is a no-op. */
void ddp_shm_seg_close(ddp_shm_seg *s);

/* A link over seg as side 0 (creator) or 1. Takes ownership of seg and of
 * liveness (the pair's TCP link, may be NULL), also on failure (NULL is
 * returned only when out of memory, after releasing both). */
ddp_link *ddp_link_shm_new(ddp_shm_seg *seg, int side, ddp_link *liveness,
                           int peer, const char *desc);

#endif
