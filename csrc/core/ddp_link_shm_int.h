/* ddp_link_shm_int.h - layout of a shared-memory segment, shared by the two
 * files of the shared-memory transport (ddp_shm_seg.c: creating and mapping
 * segments; ddp_link_shm.c: the link's progress functions). Nothing else
 * includes it.
 *
 * A segment is this header followed (at DATA_OFFSET) by two byte rings of
 * ring_bytes each. Ring d carries side d -> side 1-d; side 0 created the
 * segment. Fields written by one process and read by the other are atomics
 * on their own cache lines, grouped by writer.
 *
 * Byte order: the plain fields (identity, descriptors) are little-endian
 * byte arrays, read and written with ddp_le.h like every other structure
 * that crosses a process boundary. The atomic counters and flags cannot be:
 * they are the CPU's own words, which is sound because both processes run on
 * one host (equal host identity, boot id included) and so one byte order.
 * The layout is pinned by the _Static_asserts below; changing it means a new
 * SHM_VERSION.
 */
#ifndef DDP_LINK_SHM_INT_H
#define DDP_LINK_SHM_INT_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include "ddp_le.h"
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
    unsigned char addr[8], len[8];         /* the current one (LE u64), sender's address space */
    _Alignas(64) _Atomic uint64_t copied;  /* bytes of it copied so far (receiver) */
    _Atomic uint64_t finished;             /* descriptors fully copied (receiver) */
} shm_desc;

typedef struct shm_hdr {
    unsigned char magic[4];                    /* LE u32, written last by the creator */
    unsigned char version[4];                  /* LE u32 */
    unsigned char ring_bytes[8];               /* LE u64; checked once at open, then unused */
    unsigned char total_bytes[8];              /* LE u64 */
    unsigned char pid[2][8];                   /* LE i64: process of side s */
    unsigned char probe[2][8];                 /* LE u64: address of SHM_PROBE in side s */
    _Alignas(64) _Atomic uint32_t closed[2];   /* side s has shut down */
    _Atomic uint32_t cma_ok[2];                /* receiver of ring d can read side d */
    _Alignas(64) _Atomic uint32_t bell[2];     /* futex word side s parks on */
    _Atomic uint32_t sleeping[2];              /* side s is parked (or about to be) */
    shm_ring_ctl ring[2];                      /* ring d: side d -> side 1-d */
    shm_desc desc[2];                          /* large sends of side d */
} shm_hdr;

_Static_assert(sizeof(_Atomic uint64_t) == 8, "64-bit atomics must be plain words");
_Static_assert(offsetof(shm_hdr, version) == 4 && offsetof(shm_hdr, ring_bytes) == 8 &&
               offsetof(shm_hdr, total_bytes) == 16 && offsetof(shm_hdr, pid) == 24 &&
               offsetof(shm_hdr, probe) == 40 && offsetof(shm_hdr, closed) == 64 &&
               offsetof(shm_hdr, cma_ok) == 72 && offsetof(shm_hdr, bell) == 128 &&
               offsetof(shm_hdr, sleeping) == 136 && offsetof(shm_hdr, ring) == 192 &&
               offsetof(shm_hdr, desc) == 448 && sizeof(shm_hdr) == 704,
               "shared-memory header layout (SHM_VERSION 3)");
_Static_assert(offsetof(shm_desc, addr) == 8 && offsetof(shm_desc, len) == 16 &&
               offsetof(shm_desc, copied) == 64 && sizeof(shm_desc) == 128,
               "shared-memory descriptor layout (SHM_VERSION 3)");

#define DATA_OFFSET ((sizeof(shm_hdr) + 4095) & ~(size_t)4095)

/* This process's view of a segment. ring_bytes is derived from map_len (what
 * this process mapped), never re-read from the header afterwards: the peer
 * can write the header at any time, and a ring capacity taken from it would
 * let a confused or hostile peer make this process index past its mapping. */
struct ddp_shm_seg {
    shm_hdr *hdr;
    size_t map_len;
    size_t ring_bytes;  /* (map_len - DATA_OFFSET) / 2, a power of two */
};

#endif
