/* ddp_comm_shm.c - upgrade of same-host links to shared memory.
 *
 * After rendezvous every pair of ranks has a TCP link. For each pair whose
 * host identities (boot id + host name + network namespace, published at
 * rendezvous) are equal, the lower rank creates a segment and offers its
 * name over the TCP link; the higher rank maps it and acknowledges; the
 * lower rank then unlinks the name at once, so from here on a killed job
 * leaves nothing in /dev/shm. Both sides swap the pair's link for a
 * shared-memory link that keeps the TCP link for liveness only.
 *
 * Every same-host pair always exchanges an offer and an ack, even when one
 * side has PYDDP_SHM_DISABLE=1 or cannot create/map the segment (it then
 * offers or acks "no"), so both sides always agree on the pair's transport.
 * The exchange runs in three phases (all offers out, then answer the lower
 * ranks' offers, then collect acks); offers and acks are tiny, so sends
 * complete at once and no rank waits on a rank that waits on it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ddp_comm_internal.h"
#include "ddp_le.h"
#include "ddp_link_shm.h"
#include "ddp_settings.h"

#define OFFER_MAGIC 0x4f4d4853u /* "SHMO" */
#define ACK_MAGIC 0x414d4853u   /* "SHMA" */

/* The offer and the ack in host form. On the wire (little-endian, byte by
 * byte, see the codecs below): offer = u32 magic, u32 ok, u64 ring_bytes,
 * name[DDP_SHM_NAME_MAX] (NUL-padded), 80 bytes; ack = u32 magic, u32 ok,
 * 8 bytes. */
typedef struct shm_offer {
    uint32_t magic;
    uint32_t ok;                 /* 1: name is a segment to map; 0: stay on TCP */
    uint64_t ring_bytes;
    char name[DDP_SHM_NAME_MAX];
} shm_offer;

typedef struct shm_ack {
    uint32_t magic;
    uint32_t ok;                 /* 1: mapped, switching to shared memory */
} shm_ack;

#define OFFER_BYTES 80
#define ACK_BYTES 8
_Static_assert(16 + DDP_SHM_NAME_MAX == OFFER_BYTES, "the offer is a fixed 80-byte message");

static void offer_encode(const shm_offer *o, unsigned char out[OFFER_BYTES]) {
    ddp_le_put32(out, o->magic);
    ddp_le_put32(out + 4, o->ok);
    ddp_le_put64(out + 8, o->ring_bytes);
    memcpy(out + 16, o->name, DDP_SHM_NAME_MAX);
}

/* The name is NUL-terminated whatever the peer sent. */
static void offer_decode(const unsigned char in[OFFER_BYTES], shm_offer *o) {
    o->magic = ddp_le_get32(in);
    o->ok = ddp_le_get32(in + 4);
    o->ring_bytes = ddp_le_get64(in + 8);
    memcpy(o->name, in + 16, DDP_SHM_NAME_MAX);
    o->name[DDP_SHM_NAME_MAX - 1] = '\0';
}

static void ack_encode(const shm_ack *a, unsigned char out[ACK_BYTES]) {
    ddp_le_put32(out, a->magic);
    ddp_le_put32(out + 4, a->ok);
}

static void ack_decode(const unsigned char in[ACK_BYTES], shm_ack *a) {
    a->magic = ddp_le_get32(in);
    a->ok = ddp_le_get32(in + 4);
}

/* Per-peer state of segments this rank created (peers above it). */
typedef struct pending {
    ddp_shm_seg *seg;
    char name[DDP_SHM_NAME_MAX];
} pending;

static int shm_disabled(void) { return ddp_setting_int("PYDDP_SHM_DISABLE") != 0; }

static int same_host(ddp_comm *c, int r) {
    const char *mine = ddp_comm_host_id(c, c->rank), *theirs = ddp_comm_host_id(c, r);
    return r != c->rank && mine && theirs && mine[0] && strcmp(mine, theirs) == 0;
}

/* Phase 1: create a segment for each same-host higher peer and offer it. */
static ddp_status send_offers(ddp_comm *c, pending *pend, int disabled, ddp_wait w) {
    size_t ring = ddp_shm_ring_bytes();
    for (int p = c->rank + 1; p < c->size; p++) {
        if (!same_host(c, p)) continue;
        shm_offer o;
        memset(&o, 0, sizeof o);
        o.magic = OFFER_MAGIC;
        /* A failed creation (full /dev/shm, no /dev/shm) keeps this pair on
         * TCP rather than failing the job. */
        if (!disabled && ddp_shm_seg_create(ring, pend[p].name, &pend[p].seg) == DDP_OK) {
            o.ok = 1;
            o.ring_bytes = ring;
            memcpy(o.name, pend[p].name, sizeof o.name);
        }
        unsigned char msg[OFFER_BYTES];
        offer_encode(&o, msg);
        ddp_status st = ddp_link_send(c->links[p], msg, sizeof msg, w);
        if (st != DDP_OK)
            return ddp_error_prefix(st, "rank %d offering shared memory to %s: ", c->rank,
                                    c->desc[p]);
    }
    return DDP_OK;
}

/* Phase 2: answer each same-host lower peer's offer; switch on success. */
static ddp_status answer_offers(ddp_comm *c, int disabled, ddp_wait w) {
    for (int p = 0; p < c->rank; p++) {
        if (!same_host(c, p)) continue;
        shm_offer o;
        unsigned char msg[OFFER_BYTES];
        ddp_status st = ddp_link_recv(c->links[p], msg, sizeof msg, w);
        if (st != DDP_OK)
            return ddp_error_prefix(st, "rank %d waiting for %s's shared-memory offer: ",
                                    c->rank, c->desc[p]);
        offer_decode(msg, &o);
        if (o.magic != OFFER_MAGIC)
            return ddp_error(DDP_ERR_PROTOCOL, "rank %d: %s sent a malformed shared-memory "
                             "offer (magic %#x); do both ranks run the same pyddp?", c->rank,
                             c->desc[p], o.magic);
        ddp_shm_seg *seg = NULL;
        shm_ack a = {ACK_MAGIC, 0};
        if (o.ok && !disabled && ddp_shm_seg_open(o.name, &seg) == DDP_OK) a.ok = 1;
        unsigned char ack[ACK_BYTES];
        ack_encode(&a, ack);
        st = ddp_link_send(c->links[p], ack, sizeof ack, w);
        if (st != DDP_OK) {
            ddp_shm_seg_close(seg);
            return ddp_error_prefix(st, "rank %d acknowledging %s's shared-memory offer: ",
                                    c->rank, c->desc[p]);
        }
        if (!a.ok) continue;
        ddp_link *l = ddp_link_shm_new(seg, 1, c->links[p], p, c->desc[p]);
        c->links[p] = l;   /* the TCP link now belongs to l (freed with it on failure) */
        if (l == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory");
    }
    return DDP_OK;
}

/* Phase 3: collect acks; unlink every name at once; switch where mapped. */
static ddp_status collect_acks(ddp_comm *c, pending *pend, ddp_wait w) {
    for (int p = c->rank + 1; p < c->size; p++) {
        if (!same_host(c, p)) continue;
        shm_ack a;
        unsigned char ack[ACK_BYTES] = {0};
        ddp_status st = ddp_link_recv(c->links[p], ack, sizeof ack, w);
        ack_decode(ack, &a);
        ddp_shm_unlink(pend[p].name);
        pend[p].name[0] = '\0';
        if (st != DDP_OK)
            return ddp_error_prefix(st, "rank %d waiting for %s to map shared memory: ",
                                    c->rank, c->desc[p]);
        if (a.magic != ACK_MAGIC)
            return ddp_error(DDP_ERR_PROTOCOL, "rank %d: %s sent a malformed shared-memory "
                             "ack (magic %#x)", c->rank, c->desc[p], a.magic);
        if (!a.ok || pend[p].seg == NULL) {
            ddp_shm_seg_close(pend[p].seg);
            pend[p].seg = NULL;
            continue;
        }
        ddp_link *l = ddp_link_shm_new(pend[p].seg, 0, c->links[p], p, c->desc[p]);
        pend[p].seg = NULL;
        c->links[p] = l;
        if (l == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory");
    }
    return DDP_OK;
}

/* Collective over the TCP links (see the file comment). On failure every
 * name this rank created is unlinked and unadopted segments are unmapped;
 * links already switched stay in c->links for the caller to free. */
ddp_status ddp_comm_upgrade_links(ddp_comm *c, ddp_wait w) {
    int any = 0;
    for (int p = 0; p < c->size && !any; p++) any = same_host(c, p);
    if (!any) return DDP_OK;
    pending *pend = calloc((size_t)c->size, sizeof *pend);
    if (pend == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory");
    int disabled = shm_disabled();
    ddp_status st;
    DDP_CHECK(send_offers(c, pend, disabled, w), out);
    DDP_CHECK(answer_offers(c, disabled, w), out);
    DDP_CHECK(collect_acks(c, pend, w), out);
out:
    for (int p = 0; p < c->size; p++) {
        ddp_shm_unlink(pend[p].name);
        ddp_shm_seg_close(pend[p].seg);
    }
    free(pend);
    return st;
}
