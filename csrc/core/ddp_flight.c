/* ddp_flight.c - the flight record's ring (contract in ddp_flight.h). The
 * caller serialises every call (the communicator's queue mutex). */
#include "ddp_flight.h"

#include "ddp_clock.h"

static ddp_flight_entry *slot(ddp_flight *f, uint64_t id) {
    if (id == 0 || id >= f->next_id || f->next_id - id > DDP_FLIGHT_LEN) return NULL;
    return &f->ring[(id - 1) % DDP_FLIGHT_LEN];
}

uint64_t ddp_flight_queued(ddp_flight *f, ddp_flight_entry *e) {
    if (f->next_id == 0) f->next_id = 1;
    e->id = f->next_id++;
    e->queued_us = ddp_now_us();
    e->started_us = e->ended_us = 0;
    e->status = 0;
    f->ring[(e->id - 1) % DDP_FLIGHT_LEN] = *e;
    return e->id;
}

void ddp_flight_started(ddp_flight *f, uint64_t id) {
    ddp_flight_entry *e = slot(f, id);
    if (e) e->started_us = ddp_now_us();
}

void ddp_flight_ended(ddp_flight *f, uint64_t id, int status) {
    ddp_flight_entry *e = slot(f, id);
    if (e) {
        e->ended_us = ddp_now_us();
        e->status = status;
    }
}

int ddp_flight_get(const ddp_flight *f, uint64_t id, ddp_flight_entry *out) {
    const ddp_flight_entry *e = slot((ddp_flight *)f, id);
    if (e == NULL) return 0;
    *out = *e;
    return 1;
}

size_t ddp_flight_copy(const ddp_flight *f, ddp_flight_entry *out, size_t max) {
    if (f->next_id <= 1) return 0;
    uint64_t last = f->next_id - 1;
    uint64_t first = last >= DDP_FLIGHT_LEN ? last - DDP_FLIGHT_LEN + 1 : 1;
    size_t n = 0;
    for (uint64_t id = first; id <= last && n < max; id++)
        out[n++] = f->ring[(id - 1) % DDP_FLIGHT_LEN];
    return n;
}
