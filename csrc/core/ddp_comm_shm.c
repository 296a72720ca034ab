/* ddp_comm_shm.c - upgrade of a new same-host link to shared memory.
 *
 * A pair's link starts as one TCP connection, made when the pair first
 * needs it (ddp_comm_link.c). When the two ranks' host identities (boot id +
 * host name + network namespace, published at rendezvous) are equal, the
 * accepting rank creates a segment and offers its name over that
 * connection; the dialing rank maps it and acknowledges; the accepting rank
 * then unlinks the name at once, so from here on a killed job leaves nothing
 * in /dev/shm. Both sides swap the pair's link for a shared-memory link that
 * keeps the TCP connection for liveness only.
 *
 * Every same-host pair always exchanges an offer and an ack, even when one
 * side has PYDDP_SHM_DISABLE=1 or cannot create/map the segment (it then
 * offers or acks "no"), so both sides always agree on the pair's transport.
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

static int shm_disabled(void) { return ddp_setting_int("PYDDP_SHM_DISABLE") != 0; }

int ddp_comm_same_host(const ddp_comm *c, int r) {
    const char *mine = c->host_ids[c->rank], *theirs = c->host_ids[r];
    return r != c->rank && mine && theirs && mine[0] && strcmp(mine, theirs) == 0;
}

/* Accepting side: create a segment, offer it, wait for the ack, unlink the
 * name at once, and switch where the peer mapped it. */
static ddp_status offer(ddp_comm *c, int p, ddp_link **l, ddp_wait w) {
    shm_offer o;
    ddp_shm_seg *seg = NULL;
    memset(&o, 0, sizeof o);
    o.magic = OFFER_MAGIC;
    /* A failed creation (full /dev/shm, no /dev/shm) keeps this pair on TCP
     * rather than failing the job. */
    if (!shm_disabled() && ddp_shm_seg_create(ddp_shm_ring_bytes(), o.name, &seg) == DDP_OK) {
        o.ok = 1;
        o.ring_bytes = ddp_shm_ring_bytes();
    }
    unsigned char msg[OFFER_BYTES], ack[ACK_BYTES] = {0};
    offer_encode(&o, msg);
    ddp_status st = ddp_link_send(*l, msg, sizeof msg, w);
    if (st == DDP_OK) st = ddp_link_recv(*l, ack, sizeof ack, w);
    if (o.ok) ddp_shm_unlink(o.name);
    shm_ack a;
    ack_decode(ack, &a);
    if (st == DDP_OK && a.magic != ACK_MAGIC)
        st = ddp_error(DDP_ERR_PROTOCOL, "rank %d: %s sent a malformed shared-memory ack "
                       "(magic %#x)", c->rank, c->desc[p], a.magic);
    else if (st != DDP_OK)
        ddp_error_prefix(st, "rank %d offering shared memory to %s: ", c->rank, c->desc[p]);
    if (st != DDP_OK || !a.ok || seg == NULL) {
        ddp_shm_seg_close(seg);
        return st;
    }
    *l = ddp_link_shm_new(seg, 0, *l, p, c->desc[p]);   /* owns the TCP link now */
    return *l ? DDP_OK : ddp_error(DDP_ERR_NOMEM, "out of memory");
}

/* Dialing side: read the offer, map it if allowed, acknowledge, switch. */
static ddp_status answer(ddp_comm *c, int p, ddp_link **l, ddp_wait w) {
    unsigned char msg[OFFER_BYTES];
    ddp_status st = ddp_link_recv(*l, msg, sizeof msg, w);
    if (st != DDP_OK)
        return ddp_error_prefix(st, "rank %d waiting for %s's shared-memory offer: ", c->rank,
                                c->desc[p]);
    shm_offer o;
    offer_decode(msg, &o);
    if (o.magic != OFFER_MAGIC)
        return ddp_error(DDP_ERR_PROTOCOL, "rank %d: %s sent a malformed shared-memory offer "
                         "(magic %#x); do both ranks run the same pyddp?", c->rank, c->desc[p],
                         o.magic);
    ddp_shm_seg *seg = NULL;
    shm_ack a = {ACK_MAGIC, 0};
    if (o.ok && !shm_disabled() && ddp_shm_seg_open(o.name, &seg) == DDP_OK) a.ok = 1;
    unsigned char ack[ACK_BYTES];
    ack_encode(&a, ack);
    st = ddp_link_send(*l, ack, sizeof ack, w);
    if (st != DDP_OK) {
        ddp_shm_seg_close(seg);
        return ddp_error_prefix(st, "rank %d acknowledging %s's shared-memory offer: ",
                                c->rank, c->desc[p]);
    }
    if (!a.ok) return DDP_OK;
    *l = ddp_link_shm_new(seg, 1, *l, p, c->desc[p]);
    return *l ? DDP_OK : ddp_error(DDP_ERR_NOMEM, "out of memory");
}

ddp_status ddp_comm_pair_shm(ddp_comm *c, int p, int accepting, ddp_link **l, ddp_wait w) {
    if (!ddp_comm_same_host(c, p)) return DDP_OK;
    return accepting ? offer(c, p, l, w) : answer(c, p, l, w);
}
