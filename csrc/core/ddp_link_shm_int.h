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

/* This process's state of one shared-memory link (ddp_link_shm.c). */
typedef struct shm_impl {
    ddp_shm_seg *seg;
    shm_hdr *h;
    int side;
    size_t cap, mask;
    uint8_t *tx, *rx;               /* data areas of the send and receive rings */
    shm_ring_ctl *txc, *rxc;
    uint64_t tx_head, tx_tail_seen; /* producer's own head, last tail seen */
    uint64_t rx_tail, rx_head_seen; /* consumer's own tail, last head seen */
    /* descriptor path, sending */
    size_t cma_min;
    uint64_t desc_seq;              /* descriptors posted by this side */
    int desc_active;
    uint64_t desc_len, desc_reported;
    /* descriptor path, receiving */
    uint64_t rx_desc_seen, rx_desc_done;
    uint64_t rx_addr, rx_len, rx_copied;
    int64_t peer_pid;               /* read once at creation (the peer may rewrite it) */
    ddp_link *liveness;             /* the pair's TCP link, idle after the upgrade */
    int64_t last_check_us;
    int parked, idle_spins;         /* idle checks since the last clock read */
    uint64_t park_sig;              /* the peer's counters when we last parked */
    atomic_int shut;
    /* direct access (ddp_link_shm_direct.c): received bytes a peek could not
     * show where they lie (a descriptor's, or an element split by the ring's
     * wrap) are copied to rxb and shown from there first, also to recv_some;
     * room split by the wrap is lent from txb and copied in on commit */
    uint8_t *rxb;                   /* SHM_BOUNCE bytes, allocated on first need */
    size_t rxb_pos, rxb_len;
    int rx_peeked_rxb, tx_lent_txb; /* what the last peek / reserve showed */
    uint8_t txb[DDP_LINK_DIRECT_MIN];
} shm_impl;

#define SHM_BOUNCE (64u << 10)

/* Shared by ddp_link_shm.c and ddp_link_shm_direct.c. */
/* Wake the peer if it is parked, after publishing progress. */
void ddp_shm_wake_peer(shm_impl *s);
/* "This link was shut down on this rank." */
ddp_status ddp_shm_local_shutdown(void);
/* Called when no progress was possible: DDP_OK to keep waiting, or
 * DDP_ERR_CLOSED if this side shut down or the peer is gone (unless
 * recheck(s) sees progress meanwhile). */
ddp_status ddp_shm_idle_check(shm_impl *s, int (*recheck)(shm_impl *));
int ddp_shm_tx_has_space(shm_impl *s);
int ddp_shm_rx_has_data(shm_impl *s);
/* A counter of the peer's is where a correct peer never puts it. */
ddp_status ddp_shm_corrupt(const shm_impl *s, const char *which, uint64_t mine,
                           uint64_t theirs);
/* Copy the next bytes (at most want) of the peer's descriptor `posted` into dst. */
ddp_status ddp_shm_desc_recv(shm_impl *s, uint64_t posted, uint8_t *dst, size_t want,
                             size_t *done);
/* The direct-access ops of ddp_link_ops (contract in ddp_link.h). */
ddp_status ddp_shm_rx_peek(ddp_link *l, size_t min, const void **p, size_t *n);
void ddp_shm_rx_consume(ddp_link *l, size_t k);
ddp_status ddp_shm_tx_reserve(ddp_link *l, size_t min, void **p, size_t *n);
void ddp_shm_tx_commit(ddp_link *l, size_t k);
uint64_t ddp_shm_direct_pos(ddp_link *l, int send);

#endif
