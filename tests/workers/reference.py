"""Shared by the collective test workers: deterministic per-rank inputs and the NumPy
reference every rank computes locally for them.

Inputs are a function of (rank, case), so each rank can compute the expected result of a
collective from every rank's input without communicating. Values are small multiples of
1/8 so float16/bfloat16 sums are exact and comparisons can be exact; integer results wrap
as C integer arithmetic does.
"""
import numpy as np

FLOATS = ["float16", "float32", "float64"]
INTS = ["int8", "uint8", "int32", "int64"]


def data(rank, case, n, dtype, op=None):
    """Rank `rank`'s input for test case `case`: n elements of dtype."""
    rng = np.random.default_rng(1000 * rank + 7919 * case)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool)
    if op == "PRODUCT":
        v = rng.integers(1, 3, n)
    elif dtype == "uint8":
        v = rng.integers(0, 40, n)
    else:
        v = rng.integers(-16, 17, n)
    if dtype in FLOATS:
        return (v / 8.0).astype(dtype)
    return v.astype(dtype)


def reference(arrs, op, dtype):
    """The reduction `op` of arrays arrs (one per rank), as pyddp defines it."""
    if dtype == "bool":
        x = np.stack(arrs)
        return {"SUM": x.any(0), "MAX": x.any(0), "MIN": x.all(0), "PRODUCT": x.all(0)}[op]
    x = np.stack([a.astype(np.float64) for a in arrs])
    r = {"SUM": x.sum(0), "MIN": x.min(0), "MAX": x.max(0), "PRODUCT": x.prod(0),
         "AVG": x.sum(0) / len(arrs)}[op]
    if op == "AVG" and dtype in INTS:
        r = np.floor(r)  # the exact mean rounded toward minus infinity, like //
    if dtype in INTS and np.iinfo(dtype).bits < 64:
        info = np.iinfo(dtype)
        r = (r.astype(np.int64) - info.min) % (1 << info.bits) + info.min
    return r.astype(dtype)


class Checker:
    """Counts checks; raises AssertionError naming the rank, the case and the first wrong
    elements. exact=False allows float rounding differences (AVG's division)."""

    def __init__(self, rank):
        self.n, self.rank = 0, rank

    def eq(self, got, want, what, exact=True):
        self.n += 1
        got, want = np.asarray(got), np.asarray(want)
        ok = np.array_equal(got, want) if exact else np.allclose(
            got.astype(np.float64), want.astype(np.float64), rtol=2e-3, atol=1e-6)
        if not ok:
            bad = np.flatnonzero(got.ravel() != want.ravel())[:5]
            raise AssertionError(f"rank {self.rank}: {what}: wrong result at {bad}: got "
                                 f"{got.ravel()[bad]}, want {want.ravel()[bad]}")


def check_all_reduce(dist, ck, rank, ws, case, n, dtype, op):
    """One all_reduce of rank's input for `case` through pyddp (`dist`), checked against
    the reference; AVG of floats is compared with a tolerance (one rounding differs)."""
    x = data(rank, case, n, dtype, op)
    want = reference([data(r, case, n, dtype, op) for r in range(ws)], op, dtype)
    dist.all_reduce(x, op=dist.ReduceOp[op])
    ck.eq(x, want, f"all_reduce {dtype} {op} n={n}", exact=not (op == "AVG" and dtype in FLOATS))
