/* ddp_coll_internal.h - what the collective files share among themselves:
 * the wire header, the full-mesh message exchange every collective starts
 * with, scratch memory, block partitioning, and the entry points of each
 * algorithm. Not part of the core's public interface (see ddp_coll.h).
 *
 * Files: ddp_coll.c (validation, dispatch, scratch), ddp_coll_xchg.c
 * (header codec, mismatch check, exchange), ddp_coll_small.c (latency path),
 * ddp_coll_ring.c (ring reduce-scatter / all-gather), ddp_coll_root.c
 * (broadcast, reduce, gather, scatter, send/recv on the bandwidth path),
 * ddp_coll_a2a.c (all_to_all), ddp_coll_batch.c (batched send/recv),
 * ddp_coll_anysrc.c (receive from any source),
 * ddp_coll_hier.c (hierarchical all-reduce, reduce-scatter, all-gather
 * across hosts) with ddp_coll_hier_pipe.c (its pipelined all-reduce),
 * ddp_coll_layout.c (which ranks share a host).
 */
#ifndef DDP_COLL_INTERNAL_H
#define DDP_COLL_INTERNAL_H

#include "ddp_coll.h"
#include "ddp_le.h"

#define DDP_COLL_MAGIC 0x4c4f4344u /* "DCOL" little-endian */
#define DDP_COLL_HDR_BYTES 40
#define DDP_COLL_DEFAULT_CHUNK (1u << 20)
#define DDP_COLL_SCRATCH_KEEP ((size_t)64 << 20) /* scratch kept between calls */

/* Which algorithm family a rank chose (from its small_bytes): ranks that
 * disagree would misread each other's streams, so it is in the header. */
#define DDP_COLL_PATH_SMALL 1
#define DDP_COLL_PATH_LARGE 2
#define DDP_COLL_PATH_HIER 3 /* bandwidth path, hierarchical (ddp_coll_hier.c) */

/* The header every collective exchanges, in host form. On the wire it is
 * these fields in this order, little-endian, 40 bytes (the codec in
 * ddp_coll_xchg.c lists the offsets and asserts the size). Fields that do not
 * apply to a kind are zero (op outside reductions, root outside rooted
 * kinds, everything but kind, path and seq for barrier), so headers
 * compare field by field. */
typedef struct ddp_coll_hdr {
    uint32_t magic;
    uint8_t kind, dtype, op, path;
    int32_t root;    /* root, or the peer for send/recv */
    uint32_t rank;   /* sender */
    uint64_t count;
    uint64_t seq;    /* g->seq of the sender (not advanced by send/recv) */
    uint64_t tag;    /* g->tag: which process group the call is on */
} ddp_coll_hdr;

/* What one exchange carries: every rank sends one message to each peer and
 * receives one from each peer (or only to/from `peer` for send/recv). A
 * message is the 40-byte header followed by an optional payload. */
typedef struct ddp_coll_xchg {
    int peer;            /* -1: every other rank (in a group of more than
                          * DDP_COLL_MESH_MAX ranks: the ring neighbours only,
                          * unless mesh); else only this rank */
    int mesh;            /* with peer -1: every other rank whatever the size */
    const void *sbase;   /* payload to send (NULL when sbytes == 0) */
    size_t sbytes;       /* payload bytes per destination */
    size_t sstride;      /* 0: the same payload to all; else rank p gets sbase + p*sstride */
    int sto;             /* -1: payload to every destination; else only to this rank */
    size_t rbytes;       /* payload bytes expected per source */
    int rfrom;           /* -1: from every source; else only from this rank */
    size_t extra;        /* scratch bytes the caller needs afterwards */
} ddp_coll_xchg;

/* Where an exchange left things (all inside g->scratch, valid until the
 * next scratch request). */
typedef struct ddp_coll_xres {
    unsigned char *slots; /* rank p's message at slots + p*slot_len */
    size_t slot_len;
    const void *own;      /* copy of the payload sent (sstride == 0), or NULL */
    void *extra;          /* x->extra bytes, 64-byte aligned */
} ddp_coll_xres;

/* Payload of rank p's message in an exchange result. */
static inline const void *ddp_coll_payload(const ddp_coll_xres *r, int p) {
    return r->slots + (size_t)p * r->slot_len + DDP_COLL_HDR_BYTES;
}

static inline int ddp_coll_is_half(ddp_dtype t) {
    return t == DDP_FLOAT16 || t == DDP_BFLOAT16;
}

/* What partial sums travel in on the ring (the bandwidth path's reduce-
 * scatter): the accumulator type where it is needed for exactness (integer
 * AVG), but float16/bfloat16 in their own type: each rank combines a
 * received block with its own in float32 and rounds once (as NCCL does), so
 * a half-precision all-reduce moves half the bytes of a float32 one. */
static inline int ddp_coll_wire_wide(ddp_dtype t, ddp_redop op) {
    return !ddp_acc_is_native(t, op) && !ddp_coll_is_half(t);
}
static inline size_t ddp_coll_wire_size(ddp_dtype t, ddp_redop op) {
    return ddp_coll_wire_wide(t, op) ? ddp_acc_size(t, op) : ddp_dtype_size(t);
}
/* dst = a op b in the wire type (dst may alias a). */
static inline void ddp_coll_wire_combine(ddp_dtype t, ddp_redop op, void *dst, const void *a,
                                         const void *b, size_t n) {
    if (ddp_coll_wire_wide(t, op)) ddp_acc_combine(t, op, dst, a, b, n);
    else ddp_reduce3(t, op, dst, a, b, n);
}
/* dst (element type) = the final value of wire-type `acc` after AVG's
 * division by nranks; dst is acc or does not overlap it. */
void ddp_coll_wire_store(ddp_dtype t, ddp_redop op, void *dst, void *acc, size_t n, int nranks);

/* The header this rank sends for a (validated) call taking `path`. */
ddp_coll_hdr ddp_coll_hdr_make(const ddp_group *g, const ddp_coll_args *a, int path);
/* Wire form of a header (DDP_COLL_HDR_BYTES), and back: parse fails with
 * DDP_ERR_MISMATCH ("different process groups", both calls named) if `in`
 * carries another group tag than `mine` (this rank's own header), else with
 * DDP_ERR_PROTOCOL unless `in` is a header sent by rank p. */
void ddp_coll_hdr_encode(const ddp_coll_hdr *h, unsigned char *out);
void ddp_coll_hdr_decode(const unsigned char *in, ddp_coll_hdr *h);
ddp_status ddp_coll_hdr_parse(const unsigned char *in, int p, const ddp_coll_hdr *mine,
                              ddp_coll_hdr *h);
/* "all_reduce(count=10, float32, sum)" for a header, into buf. */
void ddp_coll_describe(const ddp_coll_hdr *h, char *buf, size_t len);

/* Send this rank's header (+payload) to every peer and receive theirs, as
 * laid out by x; check every header as soon as all have arrived (so every
 * rank reports a mismatch, whatever the payload sizes), then finish moving
 * the payloads. DDP_ERR_MISMATCH names both ranks and both calls;
 * DDP_ERR_PROTOCOL for garbage. Uses g->scratch. */
ddp_status ddp_coll_exchange(ddp_group *g, const ddp_coll_hdr *h, const ddp_coll_xchg *x,
                             ddp_wait w, ddp_coll_xres *res);

/* Bytes of the largest buffer a call touches (size*count elements for the
 * blocked kinds: all_gather, reduce_scatter, gather, scatter): what decides
 * its path. */
size_t ddp_coll_call_bytes(const ddp_group *g, const ddp_coll_args *a);

/* Make g->scratch at least n bytes (contents not kept); *out = g->scratch. */
ddp_status ddp_coll_scratch(ddp_group *g, size_t n, void **out);

/* Block b of `count` elements split into n nearly equal blocks (the first
 * count % n blocks one element longer). */
void ddp_coll_block(size_t count, int n, int b, size_t *off, size_t *len);

/* Elements per pipeline chunk for elements of esize bytes (at least 1). */
size_t ddp_coll_chunk_elems(const ddp_group *g, size_t esize);

/* Round n up to a multiple of 64 (scratch regions start cache-aligned). */
static inline size_t ddp_coll_align(size_t n) { return (n + 63) & ~(size_t)63; }

/* For a RECV from DDP_ANY_SOURCE (ddp_coll_anysrc.c): wait for the first
 * peer whose next message on its link is a send to this rank on this group,
 * and set *src to it. Nothing is consumed: every byte read from a link is
 * handed back to it (ddp_link_unread), so the ordinary receive from *src
 * (and later calls with the other peers) read the stream as if the search
 * had not happened. DDP_ERR_MISMATCH when no peer can send to this rank any
 * more (each one's next message is another call), naming their calls;
 * TIMEOUT, ABORTED or a link's failure otherwise. Errors carry no prefix. */
ddp_status ddp_coll_recv_find(ddp_group *g, const ddp_coll_args *a, ddp_wait w, int *src);

/* The header raw, received from rank p, must be p's for the same call as
 * mine (same_call, path and sequence number): DDP_ERR_MISMATCH naming both
 * calls otherwise (ddp_coll_xchg.c). */
ddp_status ddp_coll_hdr_agree(const ddp_coll_hdr *mine, int p, const unsigned char *raw);

/* Latency path of groups larger than DDP_COLL_MESH_MAX (ddp_coll_tree.c):
 * ALLREDUCE, BROADCAST, REDUCE and BARRIER in O(log size) steps. */
ddp_status ddp_coll_tree(ddp_group *g, const ddp_coll_args *a, const ddp_coll_hdr *h,
                         ddp_wait w);

/* Latency path: the whole collective in one exchange. */
ddp_status ddp_coll_small(ddp_group *g, const ddp_coll_args *a, const ddp_coll_hdr *h,
                          ddp_wait w);

/* Make the links to g's ring neighbours (rank +- 1) if missing. */
ddp_status ddp_coll_ring_need(ddp_group *g, ddp_wait w);

/* Ring pieces over any group or view (the hierarchical algorithms run them
 * on a host's ranks and on a rail): an in-place reduce-scatter of `count`
 * elements of t, which must not need a wide wire type
 * (ddp_coll_wire_wide), after which block g->rank (ddp_coll_block) holds
 * the group's combination, unfinished (AVG not yet divided); and an
 * in-place all-gather of the blocks of `count` elements of es bytes. */
ddp_status ddp_coll_ring_rs_inplace(ddp_group *g, ddp_dtype t, ddp_redop op, void *data,
                                    size_t count, ddp_wait w);
ddp_status ddp_coll_ring_ag_inplace(ddp_group *g, void *data, size_t count, size_t es,
                                    ddp_wait w);

/* A group's hosts seen by the hierarchical algorithms (ddp_coll_layout.c):
 * hosts are numbered 0..nhosts-1 in order of their first rank, a rank's
 * local index is its position among its host's ranks in rank order. */
typedef struct ddp_hier {
    int uniform;      /* every host has per_host ranks */
    int per_host;     /* ranks on this rank's host */
    int lrank;        /* this rank's local index */
    int myhost;       /* this rank's host */
    int *local_ranks; /* [per_host] group rank of each local index on this host */
    int *rail_ranks;  /* [nhosts] the rail's rank on host k: local index lrank
                       * (uniform) or 0 (otherwise: the hosts' leaders) */
    int *rank_at;     /* uniform: [nhosts*per_host] group rank of (host k, index j) at
                       * k*per_host + j; NULL otherwise */
    ddp_group local;  /* view over this host's ranks (rank lrank) */
    ddp_group rail;   /* view over the rail (rank myhost); used only by rail members */
    ddp_group chain;  /* view over every rank in host order, for broadcast (per call) */
    int *order;       /* [size] the chain's ranks (built per call, from the root) */
    ddp_link **links; /* the views' link arrays */
} ddp_hier;

/* Point the views' links at g's current links (before each use). */
void ddp_hier_refresh(ddp_group *g);

/* Hierarchical algorithms (ddp_coll_hier.c). ddp_coll_hier_applies says
 * whether a call on g takes them (from the layout, the kind, the dtype and
 * PYDDP_ALGO, and for broadcast the root: the same answer on every rank given
 * the same settings and call);
 * ddp_coll_hier_run runs one after the header exchange. */
int ddp_coll_hier_applies(ddp_group *g, const ddp_coll_args *a);
ddp_status ddp_coll_hier_run(ddp_group *g, const ddp_coll_args *a, ddp_wait w);
/* The all-reduce of equal hosts (ddp_coll_hier_pipe.c): host reduce-
 * scatter, rail all-reduce, host all-gather, over pieces of the buffer with
 * the rail stage on a second thread, so the stages overlap. */
ddp_status ddp_coll_hier_pipeline(ddp_group *g, const ddp_coll_args *a, ddp_wait w);

/* The all-reduce of a group on one host (ddp_coll_slice.c): the ring, slice
 * by slice, combining in place over shared memory. _applies: whether a
 * (bandwidth-path) all-reduce on g takes it, the same answer on every rank. */
int ddp_coll_slice_applies(const ddp_group *g, const ddp_coll_args *a);
ddp_status ddp_coll_slice_allreduce(ddp_group *g, const ddp_coll_args *a, ddp_wait w);

/* Bandwidth path, run after a header-only exchange. */
ddp_status ddp_coll_ring_allreduce(ddp_group *g, const ddp_coll_args *a, ddp_wait w);
ddp_status ddp_coll_ring_allgather(ddp_group *g, const ddp_coll_args *a, ddp_wait w);
ddp_status ddp_coll_ring_reduce_scatter(ddp_group *g, const ddp_coll_args *a, ddp_wait w);
ddp_status ddp_coll_chain_broadcast(ddp_group *g, const ddp_coll_args *a, ddp_wait w);
ddp_status ddp_coll_chain_reduce(ddp_group *g, const ddp_coll_args *a, ddp_wait w);
ddp_status ddp_coll_direct_gather(ddp_group *g, const ddp_coll_args *a, ddp_wait w);
ddp_status ddp_coll_direct_scatter(ddp_group *g, const ddp_coll_args *a, ddp_wait w);
ddp_status ddp_coll_p2p(ddp_group *g, const ddp_coll_args *a, ddp_wait w);

/* all_to_all (ddp_coll_a2a.c) and batched send/recv (ddp_coll_batch.c):
 * their own validation, and the whole call, header exchange included. */
ddp_status ddp_coll_a2a_validate(const ddp_group *g, const ddp_coll_args *a);
ddp_status ddp_coll_a2a_run(ddp_group *g, const ddp_coll_args *a, ddp_wait w);
ddp_status ddp_coll_batch_validate(const ddp_group *g, const ddp_coll_args *a);
ddp_status ddp_coll_batch_run(ddp_group *g, const ddp_coll_args *a, ddp_wait w);

/* Little-endian 64-bit fields of the tables those two exchange (ddp_le.h). */
static inline void ddp_coll_put_le64(unsigned char *p, uint64_t v) { ddp_le_put64(p, v); }
static inline uint64_t ddp_coll_get_le64(const unsigned char *p) { return ddp_le_get64(p); }

#endif
