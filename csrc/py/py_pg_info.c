/* py_pg_info.c - what a pyddp._C.ProcessGroup can tell about itself without
 * communicating: its peers and the transport to each, the flight record and
 * progress counters of its communicator (csrc/core/ddp_flight.h), the work
 * still pending on it (pyddp/_exit.py), and where a timeout is announced
 * (the stall store, used by pyddp/_forensics.py).
 * All of it is the CPU transport's info table (ddp_pg_info, ddp_pg.h).
 */
#include "py_common.h"

#include <string.h>
#include "ddp_store.h"
#include "py_array.h"
#include "py_pg.h"
#include "ddp_flight.h"

/* The CPU transport's info table, or NULL with an exception (destroyed). */
static const ddp_pg_info *info(PGObject *self) {
    const ddp_pg_info *in = ddp_pg_info_of(self->cpu);
    if (in == NULL) ddp_py_raise(DDP_ERR_INVALID, "the process group was destroyed");
    return in;
}

/* Parse a group rank argument; 0, or -1 with an exception. */
static int rank_arg(PGObject *self, PyObject *args, int *r) {
    if (!PyArg_ParseTuple(args, "i", r)) return -1;
    if (self->cpu.ops == NULL || *r < 0 || *r >= self->cpu.ops->size(self->cpu.impl)) {
        ddp_py_raise(DDP_ERR_INVALID, "no such rank");
        return -1;
    }
    return 0;
}

PyObject *ddp_py_pg_peer(PGObject *self, PyObject *args) {
    int r;
    const ddp_pg_info *in;
    if (rank_arg(self, args, &r) < 0 || (in = info(self)) == NULL) return NULL;
    return Py_BuildValue("(ss)", in->peer_desc(self->cpu.impl, r), in->host_id(self->cpu.impl, r));
}

/* A flight-record entry as a dict; times as seconds before now (None: not yet). */
static PyObject *entry_dict(const ddp_flight_entry *e, int64_t now_us) {
    PyObject *st = e->ended_us ? PyUnicode_FromString(e->status == DDP_OK ? "ok" :
                                                      ddp_status_name((ddp_status)e->status))
                               : Py_NewRef(Py_None);
    if (st == NULL) return NULL;
    const char *state = e->ended_us ? "done" : e->started_us ? "running" : "queued";
    PyObject *d = Py_BuildValue(
        "{s:K,s:K,s:K,s:s,s:s,s:i,s:i,s:i,s:i,s:K,s:d,s:N,s:N,s:s,s:N}",
        "id", (unsigned long long)e->id, "tag", (unsigned long long)e->tag,
        "seq", (unsigned long long)e->seq, "op", ddp_coll_name((ddp_coll_kind)e->kind),
        "dtype", ddp_dtype_name((ddp_dtype)e->dtype), "redop", e->op, "root", e->root,
        "group_rank", e->group_rank, "group_size", e->group_size,
        "bytes", (unsigned long long)e->bytes,
        "queued_ago", (now_us - e->queued_us) / 1e6,
        "started_ago", e->started_us ? PyFloat_FromDouble((now_us - e->started_us) / 1e6)
                                     : Py_NewRef(Py_None),
        "ended_ago", e->ended_us ? PyFloat_FromDouble((now_us - e->ended_us) / 1e6)
                                 : Py_NewRef(Py_None),
        "state", state, "status", st);
    return d;
}

PyObject *ddp_py_pg_flight_record(PGObject *self, PyObject *unused) {
    const ddp_pg_info *in = ddp_pg_info_of(self->cpu);
    if (in == NULL) return PyList_New(0);
    ddp_flight_entry fr[DDP_FLIGHT_LEN];
    size_t n = in->flight(self->cpu.impl, fr, DDP_FLIGHT_LEN);
    int64_t now = ddp_now_us();
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out && i < n; i++) {
        PyObject *d = entry_dict(&fr[i], now);
        if (d == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, d);
    }
    return out;
}

PyObject *ddp_py_pg_pending(PGObject *self, PyObject *unused) {
    const ddp_pg_info *in = ddp_pg_info_of(self->cpu);   /* destroyed: nothing pending */
    return PyLong_FromLong(in && in->pending ? in->pending(self->cpu.impl) : 0);
}

PyObject *ddp_py_pg_progress(PGObject *self, PyObject *unused) {
    const ddp_pg_info *in = info(self);
    if (in == NULL) return NULL;
    uint64_t sub, done;
    ddp_flight_entry last;
    in->progress(self->cpu.impl, &sub, &done, &last);
    PyObject *ld = last.id ? entry_dict(&last, ddp_now_us()) : Py_NewRef(Py_None);
    if (ld == NULL) return NULL;
    return Py_BuildValue("{s:K,s:K,s:N,s:K}", "submitted", (unsigned long long)sub,
                         "completed", (unsigned long long)done, "last_done", ld,
                         "tag", (unsigned long long)in->tag(self->cpu.impl));
}

PyObject *ddp_py_pg_wait_used(PGObject *self, PyObject *args) {
    long long timeout_ms;
    if (!PyArg_ParseTuple(args, "L", &timeout_ms)) return NULL;
    const ddp_pg_info *in = ddp_pg_info_of(self->cpu);
    if (in == NULL || in->wait_used == NULL) Py_RETURN_TRUE;   /* destroyed: nothing to wait for */
    ddp_pg pg = self->cpu;
    pg.ops->retain(pg.impl);   /* a destroy on another thread meanwhile keeps the memory */
    int done;
    Py_BEGIN_ALLOW_THREADS
    done = in->wait_used(pg.impl, ddp_wait_for(timeout_ms, NULL));
    Py_END_ALLOW_THREADS
    pg.ops->release(pg.impl);
    return PyBool_FromLong(done);
}

PyObject *ddp_py_pg_set_stall_store(PGObject *self, PyObject *args) {
    PyObject *store_obj;
    const char *prefix;
    if (!PyArg_ParseTuple(args, "Os", &store_obj, &prefix)) return NULL;
    const ddp_pg_info *in = info(self);
    if (in == NULL) return NULL;
    ddp_store *s = ddp_py_store_client_ref(store_obj);
    if (s == NULL) return NULL;
    in->set_stall_store(self->cpu.impl, s, prefix);
    ddp_store_release(s);
    Py_RETURN_NONE;
}

PyObject *ddp_py_pg_transport(PGObject *self, PyObject *args) {
    int r;
    const ddp_pg_info *in;
    if (rank_arg(self, args, &r) < 0 || (in = info(self)) == NULL) return NULL;
    return PyUnicode_FromString(in->transport(self->cpu.impl, r));
}
