/* ddp_link_shm_int.h - layout of a shared-memory segment, shared by the two
 * files of the shared-memory transport (ddp_shm_seg.c: creating and mapping
 * segments; ddp_link_shm.c: the link's progress functions). Nothing else
 * includes it.
 *
 * A segment is this header followed (at DATA_OFFSET) by two byte rings of
 * ring_bytes each. Ring d carries side d -> side 1-d; side 0 created the
 * segment. Fields written by one process and read by the other are atomics
 * on their own cache lines, grouped by writer.
 */
#ifndef DDP_LINK_SHM_INT_H
#define DDP_LINK_SHM_INT_H

#include <stdatomic.h>
#include <stdint.h>
#include "ddp_link_shm.h"

#define SHM_MAGIC 0x4d484444u      /* "DDHM" */
#define SHM_VERSION 3u
#define SHM_PROBE 0x70794464704d4143ull  /* read across processes to test CMA */
#define RING_MIN (64u << 10)
#define RING_MAX (256u << 20)

typedef struct shm_ring_ctl {
    _Alignas(64) _Atomic uint64_t head;   /* bytes ever written (producer) */
    _Alignas(64) _Atomic uint64_t tail;   /* bytes ever consumed (consumer) */
} shm_ring_ctl;

/* A large send that the receiver copies straight out of the sender's memory
 * (process_vm_readv, "cross-memory attach"): one copy instead of two. */
typedef struct shm_desc {
    _Alignas(64) _Atomic uint64_t posted;  /* descriptors posted (sender) */
    uint64_t addr, len;                    /* the current one, sender's address space */
    _Alignas(64) _Atomic uint64_t copied;  /* bytes of it copied so far (receiver) */
    _Atomic uint64_t finished;             /* descriptors fully copied (receiver) */
} shm_desc;

typedef struct shm_hdr {
    uint32_t magic;
    uint32_t version;
    uint64_t ring_bytes;
    uint64_t total_bytes;
    int64_t pid[2];                            /* process of side s */
    uint64_t probe[2];                         /* address of SHM_PROBE in side s */
    _Alignas(64) _Atomic uint32_t closed[2];   /* side s has shut down */
    _Atomic uint32_t cma_ok[2];                /* receiver of ring d can read side d */
    _Alignas(64) _Atomic uint32_t bell[2];     /* futex word side s parks on */
    _Atomic uint32_t sleeping[2];              /* side s is parked (or about to be) */
    shm_ring_ctl ring[2];                      /* ring d: side d -> side 1-d */
    shm_desc desc[2];                          /* large sends of side d */
} shm_hdr;

_Static_assert(sizeof(_Atomic uint64_t) == 8, "64-bit atomics must be plain words");

#define DATA_OFFSET ((sizeof(shm_hdr) + 4095) & ~(size_t)4095)

struct ddp_shm_seg {
    shm_hdr *hdr;
    size_t map_len;
};

#endif
