"""Worker: subgroups, the collectives added with them, and exact integer AVG, checked
against NumPy on every rank. Launched by tests/test_subgroups.py under torchrun at
several world sizes; prints "rank R: PASS N checks" at the end, or raises.

Every rank computes the expected result of each call from every rank's input (a
function of rank and case), so nothing is compared through the library under test.
"""
import sys
from datetime import timedelta

import numpy as np

import pyddp as dist

CHECKS = [0]


def ok(cond, what):
    if not cond:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")
    CHECKS[0] += 1


def val(rank, case, n, dtype="float64"):
    rng = np.random.default_rng(977 * rank + 131 * case)
    return rng.integers(-20, 21, n).astype(dtype)


def groups_of(ws):
    """Subgroups every rank makes, in the same order: evens, odds, a prefix, all ranks,
    and (at 4 ranks) a non-contiguous pair."""
    out = [[r for r in range(ws) if r % 2 == 0], [r for r in range(ws) if r % 2 == 1],
           list(range(ws - 1)), list(range(ws))]
    if ws >= 4:
        out.append([1, 3])
    return [g for g in out if g]


def check_group(g, ranks, me, case):
    """Every collective on group g (ranks: its members; me: this global rank)."""
    n = len(ranks)
    gr = ranks.index(me)
    ok(dist.get_rank(g) == gr and dist.get_world_size(g) == n, "group rank/size")
    ok(dist.get_process_group_ranks(g) == ranks, "get_process_group_ranks")
    # all_reduce, every op
    for op, f in (("SUM", np.sum), ("MAX", np.max), ("MIN", np.min)):
        x = val(me, case, 37)
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op), group=g)
        ok(np.array_equal(x, f(np.stack([val(r, case, 37) for r in ranks]), 0)),
           f"all_reduce {op} on {ranks}")
    # large enough for the ring path
    x = val(me, case + 1, 70000, "float32")
    dist.all_reduce(x, group=g)
    ok(np.array_equal(x, sum(val(r, case + 1, 70000, "float32") for r in ranks)),
       f"ring all_reduce on {ranks}")
    # broadcast / reduce with global src/dst
    src = ranks[-1]
    x = val(me, case + 2, 9)
    dist.broadcast(x, src=src, group=g)
    ok(np.array_equal(x, val(src, case + 2, 9)), f"broadcast from {src} on {ranks}")
    x = val(me, case + 3, 9)
    dist.reduce(x, dst=src, group=g)
    want = sum(val(r, case + 3, 9) for r in ranks) if me == src else val(me, case + 3, 9)
    ok(np.array_equal(x, want), f"reduce to {src} on {ranks}")
    # gathers and scatters
    out = np.zeros(5 * n)
    dist.all_gather_into_tensor(out, val(me, case + 4, 5), group=g)
    ok(np.array_equal(out, np.concatenate([val(r, case + 4, 5) for r in ranks])),
       "all_gather_into_tensor")
    lst = [np.zeros(3) for _ in ranks]
    dist.all_gather(lst, val(me, case + 5, 3), group=g)
    ok(all(np.array_equal(lst[i], val(r, case + 5, 3)) for i, r in enumerate(ranks)),
       "all_gather")
    o = np.zeros(4)
    dist.reduce_scatter_tensor(o, val(me, case + 6, 4 * n), group=g)
    ok(np.array_equal(o, sum(val(r, case + 6, 4 * n) for r in ranks)[4 * gr:4 * gr + 4]),
       "reduce_scatter_tensor")
    dst = ranks[0]
    gl = [np.zeros(2) for _ in ranks] if me == dst else None
    dist.gather(val(me, case + 7, 2), gl, dst=dst, group=g)
    if me == dst:
        ok(all(np.array_equal(gl[i], val(r, case + 7, 2)) for i, r in enumerate(ranks)),
           "gather")
    o = np.zeros(2)
    sl = [val(dst, case + 8 + i, 2) for i in range(n)] if me == dst else None
    dist.scatter(o, sl, src=dst, group=g)
    ok(np.array_equal(o, val(dst, case + 8 + gr, 2)), "scatter")
    dist.barrier(group=g)
    # object collectives
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": me}, group=g)
    ok(objs == [{"rank": r} for r in ranks], "all_gather_object")
    bl = [me, "x"]
    dist.broadcast_object_list(bl, src=src, group=g)
    ok(bl == [src, "x"], "broadcast_object_list")
    # all_to_all_single, even and uneven splits
    x = np.arange(2 * n, dtype=np.int64) + 100 * me
    o = np.zeros(2 * n, dtype=np.int64)
    dist.all_to_all_single(o, x, group=g)
    want = np.concatenate([np.arange(2 * n, dtype=np.int64)[2 * gr:2 * gr + 2] + 100 * r
                           for r in ranks])
    ok(np.array_equal(o, want), "all_to_all_single even")
    # rank p sends (p + q) % 3 rows of width 2 to group rank q
    rows_to = [(gr + q) % 3 for q in range(n)]
    rows_from = [(p + gr) % 3 for p in range(n)]
    x = np.concatenate([np.full((k, 2), 10 * me + q, dtype=np.float32)
                        for q, k in enumerate(rows_to)]) if sum(rows_to) else \
        np.zeros((0, 2), np.float32)
    o = np.zeros((sum(rows_from), 2), dtype=np.float32)
    dist.all_to_all_single(o, x, output_split_sizes=rows_from, input_split_sizes=rows_to,
                           group=g)
    want = np.concatenate([np.full((k, 2), 10 * r + gr, dtype=np.float32)
                           for r, k in zip(ranks, rows_from)]) if sum(rows_from) else o
    ok(np.array_equal(o, want), "all_to_all_single uneven")
    ins = [np.full(q + 1, me * 10 + q, dtype=np.int32) for q in range(n)]
    outs = [np.zeros(gr + 1, dtype=np.int32) for _ in range(n)]
    dist.all_to_all(outs, ins, group=g)
    ok(all(np.array_equal(outs[p], np.full(gr + 1, r * 10 + gr, np.int32))
           for p, r in enumerate(ranks)), "all_to_all lists")
    # ring exchange in one batch, payloads bigger than socket buffers
    if n > 1:
        nxt, prv = ranks[(gr + 1) % n], ranks[(gr - 1) % n]
        send = val(me, case + 20, 600000, "float32")
        recv = np.zeros(600000, dtype=np.float32)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group=g),
                                        dist.P2POp(dist.irecv, recv, prv, group=g)])
        for w in works:
            w.wait()
        ok(np.array_equal(recv, val(prv, case + 20, 600000, "float32")), "batch ring")
    # coalesced all_reduce over two dtypes
    a, b = val(me, case + 30, 5), val(me, case + 31, 7, "int32")
    dist.all_reduce_coalesced([a, b], group=g)
    ok(np.array_equal(a, sum(val(r, case + 30, 5) for r in ranks)) and
       np.array_equal(b, sum(val(r, case + 31, 7, "int32") for r in ranks)),
       "all_reduce_coalesced")
    dist.monitored_barrier(group=g, timeout=timedelta(seconds=30))
    # async with a completion callback
    x = val(me, case + 40, 11)
    seen = []
    w = dist.all_reduce(x, group=g, async_op=True)
    w.add_done_callback(lambda work: seen.append((work.exception(), x.copy())))
    w.wait()
    for _ in range(200):
        if seen:
            break
        import time
        time.sleep(0.01)
    ok(seen and seen[0][0] is None and
       np.array_equal(seen[0][1], sum(val(r, case + 40, 11) for r in ranks)),
       "add_done_callback")


def check_int_avg(ws, me):
    """Integer AVG is the exact floor of the mean, with sums that overflow the type,
    on the latency path and the ring path."""
    info = {"int8": (-128, 127), "uint8": (0, 255), "int32": (-2**31, 2**31 - 1),
            "int64": (-2**63, 2**63 - 1)}
    for dt, (lo, hi) in info.items():
        for n in (13, 40000):
            rng = np.random.default_rng(5 + me)
            # values near the top (and the bottom) of the range: the sum overflows
            x = np.where(rng.integers(0, 2, n) == 1, hi - rng.integers(0, 3, n),
                         lo + rng.integers(0, 3, n)).astype(dt)
            arrs = []
            for r in range(ws):
                rr = np.random.default_rng(5 + r)
                arrs.append([int(v) for v in np.where(rr.integers(0, 2, n) == 1,
                                                      hi - rr.integers(0, 3, n),
                                                      lo + rr.integers(0, 3, n)).astype(dt)])
            want = np.array([sum(col) // ws for col in zip(*arrs)], dtype=dt)
            dist.all_reduce(x, op=dist.ReduceOp.AVG)
            ok(np.array_equal(x, want), f"integer AVG {dt} n={n}")


def check_non_member(ws, me):
    g = dist.new_group([0])   # every rank calls new_group, as in torch
    if me != 0:
        ok(dist.get_rank(g) == -1, "get_rank off the group is -1")
        try:
            dist.all_reduce(np.zeros(1), group=g)
        except dist.DistValueError as e:
            ok("not a member" in str(e), "non-member message")
        else:
            raise AssertionError("a collective on a group this rank is not in did not fail")
    else:
        x = np.ones(3)
        dist.all_reduce(x, group=g)
        ok(np.array_equal(x, np.ones(3)), "size-1 group")


def check_monitored_barrier_names_missing(ws, me):
    """The last rank skips a monitored_barrier: rank 0 raises DistTimeoutError naming it
    (wait_all_ranks=True lists every missing rank), and so do the ranks that came."""
    if ws < 2 or me == ws - 1:
        return
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=2), wait_all_ranks=True)
    except dist.DistTimeoutError as e:
        ok(f"ranks [{ws - 1}]" in str(e) and "did not reach the barrier" in str(e),
           f"monitored_barrier message: {e}")
    else:
        raise AssertionError("monitored_barrier passed although a rank never came")


def check_wrong_group(ws, me):
    """Rank 0 calls all_reduce on a subgroup while rank 1 calls it on the world: a
    mismatch that names the groups, on both ranks. Breaks the group; run last."""
    pair = dist.new_group([0, 1])
    x = np.ones(4)
    try:
        if me == 0:
            dist.all_reduce(x, group=pair)
        elif me == 1:
            dist.all_reduce(x)
        else:
            return
    except dist.DistError as e:
        print(f"rank {me}: wrong-group error: {e}", flush=True)
        ok("different process groups" in str(e) or "group tag" in str(e),
           f"wrong-group message: {e}")
        return
    raise AssertionError("a collective on different groups did not fail")


def main():
    dist.init_process_group("cpu", timeout=timedelta(seconds=60))
    ws, me = dist.get_world_size(), dist.get_rank()
    check_int_avg(ws, me)
    # every rank makes every group, in the same order; members run its checks
    made = [(ranks, dist.new_group(ranks)) for ranks in groups_of(ws)]
    for case, (ranks, g) in enumerate(made):
        if me in ranks:
            check_group(g, ranks, me, 100 * case)
        # interleave with the world group between subgroups
        x = val(me, 7, 3)
        dist.all_reduce(x)
        ok(np.array_equal(x, sum(val(r, 7, 3) for r in range(ws))), "world between groups")
    check_group(None, list(range(ws)), me, 999)
    check_non_member(ws, me)
    if "--wrong-group" in sys.argv and ws >= 2:
        check_wrong_group(ws, me)
        print(f"rank {me}: PASS {CHECKS[0]} checks", flush=True)
        return
    check_monitored_barrier_names_missing(ws, me)
    dist.destroy_process_group()
    print(f"rank {me}: PASS {CHECKS[0]} checks", flush=True)


if __name__ == "__main__":
    main()
