"""Collectives on picklable Python objects: broadcast_object_list, all_gather_object,
gather_object and scatter_object_list (torch.distributed's semantics).

Objects are pickled into uint8 arrays; sizes travel first (int64), then the payloads,
so ranks may hold objects of any size. Like torch's, these unpickle data from peers:
use them only between ranks you trust.
"""
import pickle

import numpy as np

from . import _C
from .collectives import all_gather_into_tensor, broadcast, gather, scatter
from ._group import _resolve


def _dump(obj):
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)


def _load(buf):
    return pickle.loads(buf.tobytes())


def broadcast_object_list(object_list, src=0, group=None, device=None):
    """Replace object_list's entries on every rank with src's (same length everywhere)."""
    g = _resolve(group)
    if not isinstance(object_list, list):
        raise _C.DistTypeError("object_list must be a list")
    g.pg("broadcast_object_list")
    me = g.ranks[g.rank]
    n = len(object_list)
    sizes = np.zeros(n, dtype=np.int64)
    if me == src:
        blobs = [_dump(o) for o in object_list]
        sizes[:] = [len(b) for b in blobs]
    broadcast(sizes, src, group)
    payload = np.concatenate(blobs) if me == src and n else \
        np.empty(int(sizes.sum()), dtype=np.uint8)
    broadcast(payload, src, group)
    if me != src:
        off = 0
        for i in range(n):
            object_list[i] = _load(payload[off:off + sizes[i]])
            off += int(sizes[i])


def _gather_blobs(obj, group):
    """Every rank's pickled obj, padded to the longest: (matrix [ws, max], sizes)."""
    ws = _resolve(group).size
    blob = _dump(obj)
    sizes = np.zeros(ws, dtype=np.int64)
    all_gather_into_tensor(sizes, np.array([len(blob)], dtype=np.int64), group)
    mx = int(sizes.max())
    padded = np.zeros(mx, dtype=np.uint8)
    padded[:len(blob)] = blob
    return padded, sizes, mx


def all_gather_object(object_list, obj, group=None):
    """object_list[r] = rank r's obj, on every rank (object_list has world_size entries)."""
    g = _resolve(group)
    g.pg("all_gather_object")
    ws = g.size
    if not isinstance(object_list, list) or len(object_list) != ws:
        raise _C.DistValueError(f"object_list must be a list of world_size={ws} entries")
    padded, sizes, mx = _gather_blobs(obj, group)
    out = np.empty(ws * mx, dtype=np.uint8)
    all_gather_into_tensor(out, padded, group)
    for r in range(ws):
        object_list[r] = _load(out[r * mx:r * mx + sizes[r]])


def gather_object(obj, object_gather_list=None, dst=0, group=None):
    """At dst, object_gather_list[r] = rank r's obj; None elsewhere."""
    g = _resolve(group)
    g.pg("gather_object")
    ws = g.size
    me = g.ranks[g.rank]
    if me == dst and (not isinstance(object_gather_list, list) or len(object_gather_list) != ws):
        raise _C.DistValueError(f"object_gather_list must be a list of world_size={ws} "
                                f"entries on the destination rank")
    padded, sizes, mx = _gather_blobs(obj, group)
    rows = [np.empty(mx, dtype=np.uint8) for _ in range(ws)] if me == dst else None
    gather(padded, rows, dst, group)
    if me == dst:
        for r in range(ws):
            object_gather_list[r] = _load(rows[r][:sizes[r]])


def scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src=0,
                        group=None):
    """scatter_object_output_list[0] = src's scatter_object_input_list[rank]."""
    g = _resolve(group)
    g.pg("scatter_object_list")
    ws = g.size
    me = g.ranks[g.rank]
    if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
        raise _C.DistValueError("scatter_object_output_list must be a non-empty list")
    sizes = np.zeros(ws, dtype=np.int64)
    if me == src:
        if not isinstance(scatter_object_input_list, list) or \
                len(scatter_object_input_list) != ws:
            raise _C.DistValueError(f"scatter_object_input_list must have world_size={ws} "
                                    f"entries on the source rank")
        blobs = [_dump(o) for o in scatter_object_input_list]
        sizes[:] = [len(b) for b in blobs]
    broadcast(sizes, src, group)
    mx = int(sizes.max())
    rows = None
    if me == src:
        rows = []
        for b in blobs:
            row = np.zeros(mx, dtype=np.uint8)
            row[:len(b)] = b
            rows.append(row)
    out = np.empty(mx, dtype=np.uint8)
    scatter(out, rows, src, group)
    scatter_object_output_list[0] = _load(out[:sizes[g.rank]])
