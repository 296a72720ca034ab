"""Checks for tests/test_torch_backend.py: every torch.distributed collective on the
"pyddp" backend against arithmetic each rank computes locally with torch (in float64 or
int64, then cast as the collective's dtype does).

Inputs are a function of (rank, case) (reference.data: small multiples of 1/8, so
float16/bfloat16 sums are exact), so the expected result needs no communication. Each
check_* function takes a Checker and runs one family; torch_backend.py (the worker)
calls them in one process group. Float AVG is compared with a tolerance (its one
division may round differently in float32 and float64); everything else exactly.
"""
import datetime

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from reference import data

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
SIZES = [7, 40_003]            # 40_003 elements > 64 KiB: pyddp's bandwidth path
R = dist.ReduceOp


def inp(rank, case, n, dtype, op=None):
    """Rank rank's input for case: n elements of dtype."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(data(rank, case, n, "float32", op)).to(torch.bfloat16)
    name = str(dtype).replace("torch.", "")
    return torch.from_numpy(data(rank, case, n, name, op).copy())


def expect(xs, op, dtype):
    """The reduction op of tensors xs (one per rank), exact, cast to dtype."""
    if dtype == torch.bool:
        st = torch.stack(xs)
        return st.any(0) if op in (R.SUM, R.MAX) else st.all(0)
    fl = dtype.is_floating_point
    st = torch.stack([x.to(torch.float64 if fl else torch.int64) for x in xs])
    if op == R.SUM:
        r = st.sum(0)
    elif op == R.MIN:
        r = st.min(0).values
    elif op == R.MAX:
        r = st.max(0).values
    elif op == R.PRODUCT:
        r = st.prod(0)
    elif op == R.AVG:
        r = st.sum(0) / len(xs) if fl else torch.div(st.sum(0), len(xs), rounding_mode="floor")
    else:
        raise ValueError(op)
    return r.to(dtype)          # integer casts wrap as the C arithmetic does


class Checker:
    """Counts checks; raises naming the rank, the check and the first wrong elements."""

    def __init__(self, rank):
        self.n, self.rank = 0, rank

    def eq(self, got, want, what, exact=True):
        self.n += 1
        got, want = got.detach(), want.detach()
        if got.shape != want.shape:
            raise AssertionError(f"rank {self.rank}: {what}: shape {tuple(got.shape)}, want "
                                 f"{tuple(want.shape)}")
        if exact:
            ok = torch.equal(got, want)
        else:
            ok = torch.allclose(got.double(), want.double(), rtol=2e-3, atol=1e-6)
        if not ok:
            bad = (got.double() != want.double()).flatten().nonzero().flatten()[:5]
            raise AssertionError(f"rank {self.rank}: {what}: wrong at {bad.tolist()}: got "
                                 f"{got.flatten()[bad].tolist()}, want "
                                 f"{want.flatten()[bad].tolist()}")

    def true(self, cond, what):
        self.n += 1
        if not cond:
            raise AssertionError(f"rank {self.rank}: {what}")


def _ops(dtype):
    if dtype == torch.bool:
        return [R.SUM, R.MIN, R.MAX, R.PRODUCT]
    return [R.SUM, R.AVG, R.MIN, R.MAX, R.PRODUCT]


def check_all_reduce(ck, rank, ws):
    """all_reduce of every dtype and op at both sizes; async handles and their future
    values; AVG on integers (exact floor, as Lightning sends it); PREMUL_SUM."""
    case = 0
    for dtype in FLOATS + INTS + [torch.bool]:
        for op in _ops(dtype):
            for n in SIZES:
                case += 1
                kind = "PRODUCT" if op == R.PRODUCT else None   # factors 1 and 2 only
                x = inp(rank, case, n, dtype, kind)
                want = expect([inp(r, case, n, dtype, kind) for r in range(ws)], op, dtype)
                work = dist.all_reduce(x, op=op, async_op=True)
                work.wait()
                ck.true(work.get_future().value()[0] is x or
                        torch.equal(work.get_future().value()[0], x),
                        "future value is the output tensor")
                ck.eq(x, want, f"all_reduce {dtype} {op} n={n}",
                      exact=not (op == R.AVG and dtype.is_floating_point))
    # integers whose sum overflows the type: the mean is still exact
    big = torch.tensor([2 ** 62 + rank, -(2 ** 62) - 3 * rank, 7 * rank - 5], dtype=torch.int64)
    want = torch.stack([torch.tensor([2 ** 62 + r, -(2 ** 62) - 3 * r, 7 * r - 5]) for r in
                        range(ws)])
    want = torch.tensor([_floor_mean([int(v) for v in want[:, i]]) for i in range(3)])
    dist.all_reduce(big, op=R.AVG)
    ck.eq(big, want, "all_reduce int64 AVG near 2**62")
    u8 = torch.tensor([200, 255, rank], dtype=torch.uint8)
    dist.all_reduce(u8, op=R.AVG)
    ck.eq(u8, torch.tensor([200, 255, _floor_mean(list(range(ws)))], dtype=torch.uint8),
          "all_reduce uint8 AVG")
    # PREMUL_SUM: the sum of every input times the factor (float and tensor factors)
    for factor in (0.5, torch.tensor(0.25)):
        case += 1
        x = inp(rank, case, 40, torch.float32)
        want = expect([inp(r, case, 40, torch.float32) * factor for r in range(ws)], R.SUM,
                      torch.float32)
        dist.all_reduce(x, op=dist._make_nccl_premul_sum(factor))
        ck.eq(x, want, f"all_reduce PREMUL_SUM factor={factor}", exact=False)


def _floor_mean(vals):
    return sum(vals) // len(vals)


def check_tensor_kinds(ck, rank, ws):
    """Tensors that require grad, non-contiguous tensors (the untouched elements stay
    as they were), 2-D tensors, and a refused op that leaves the group usable."""
    p = torch.full((5,), float(rank + 1), requires_grad=True)
    dist.all_reduce(p)
    ck.eq(p, torch.full((5,), float(sum(range(1, ws + 1)))), "all_reduce requires_grad")
    ck.true(p.requires_grad and p.grad_fn is None, "still a leaf that requires grad")
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) + 100 * rank
    view = base[:, ::2]
    ck.true(not view.is_contiguous(), "the view is strided")
    dist.all_reduce(view)
    want = sum(torch.arange(24, dtype=torch.float32).reshape(4, 6) + 100 * r
               for r in range(ws))
    ck.eq(base[:, ::2], want[:, ::2], "all_reduce non-contiguous")
    ck.eq(base[:, 1::2], (torch.arange(24, dtype=torch.float32).reshape(4, 6) +
                          100 * rank)[:, 1::2], "non-contiguous: other elements untouched")
    for op in (R.BAND, R.BOR, R.BXOR):
        try:
            dist.all_reduce(torch.ones(3, dtype=torch.int32), op=op)
            ck.true(False, f"{op} was accepted")
        except ValueError as e:
            ck.true("PREMUL_SUM" in str(e) and "does not support" in str(e), str(e))
    x = torch.ones(3)
    dist.all_reduce(x)
    ck.eq(x, torch.full((3,), float(ws)), "group usable after a refused op")


def check_rooted(ck, rank, ws):
    """broadcast, reduce, gather and scatter with every root; broadcast and reduce
    blocking and asynchronous in turns (the thin path's two C branches)."""
    case = 100
    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.bool):
        for n in SIZES:
            for root in range(ws):
                case += 1
                x = inp(rank, case, n, dtype)
                _wait(dist.broadcast(x, src=root, async_op=bool(case % 2)))
                ck.eq(x, inp(root, case, n, dtype), f"broadcast {dtype} n={n} src={root}")
                if dtype == torch.bool:
                    continue
                for op in (R.SUM, R.MAX, R.AVG):
                    case += 1
                    x = inp(rank, case, n, dtype)
                    mine = x.clone()
                    _wait(dist.reduce(x, dst=root, op=op, async_op=bool(case % 2)))
                    want = expect([inp(r, case, n, dtype) for r in range(ws)], op, dtype) \
                        if rank == root else mine
                    ck.eq(x, want, f"reduce {dtype} {op} n={n} dst={root}",
                          exact=not (op == R.AVG and dtype.is_floating_point))
                case += 1
                x = inp(rank, case, n, dtype)
                lst = [torch.empty(n, dtype=dtype) for _ in range(ws)] if rank == root else None
                dist.gather(x, lst, dst=root)
                if rank == root:
                    for r in range(ws):
                        ck.eq(lst[r], inp(r, case, n, dtype), f"gather {dtype} dst={root} [{r}]")
                case += 1
                out = torch.empty(n, dtype=dtype)
                src_list = [inp(r, case, n, dtype) for r in range(ws)] if rank == root else None
                dist.scatter(out, src_list, src=root)
                ck.eq(out, inp(rank, case, n, dtype), f"scatter {dtype} src={root}")


def _wait(work):
    """Wait for an asynchronous call's work (None for a blocking call)."""
    if work is not None:
        work.wait()


def check_gathers(ck, rank, ws):
    """all_gather (list), all_gather_into_tensor (flat and stacked), reduce_scatter
    (list) and reduce_scatter_tensor with SUM, AVG and PREMUL_SUM, the coalesced forms."""
    case = 300
    for dtype in (torch.float32, torch.float16, torch.int32, torch.bool):
        for n in SIZES:
            case += 1
            x = inp(rank, case, n, dtype)
            every = [inp(r, case, n, dtype) for r in range(ws)]
            lst = [torch.empty(n, dtype=dtype) for _ in range(ws)]
            dist.all_gather(lst, x)
            for r in range(ws):
                ck.eq(lst[r], every[r], f"all_gather {dtype} n={n} [{r}]")
            flat = torch.empty(ws * n, dtype=dtype)
            dist.all_gather_into_tensor(flat, x)
            ck.eq(flat, torch.cat(every), f"all_gather_into_tensor {dtype} n={n}")
            stacked = torch.empty(ws, n, dtype=dtype)
            dist.all_gather_into_tensor(stacked, x)
            ck.eq(stacked, torch.stack(every), f"all_gather_into_tensor stacked {dtype}")
            if dtype == torch.bool:
                continue
            # (op passed, op of the reference, factor applied to the inputs)
            ops = [(R.SUM, R.SUM, 1), (R.AVG, R.AVG, 1), (R.MIN, R.MIN, 1)]
            if dtype.is_floating_point:
                ops.append((dist._make_nccl_premul_sum(0.5), R.SUM, 0.5))
            for op, kind, factor in ops:
                case += 1
                full = [inp(r, case, ws * n, dtype) for r in range(ws)]
                red = expect([f * factor for f in full], kind, dtype)
                out = torch.empty(n, dtype=dtype)
                mine = full[rank].clone()
                dist.reduce_scatter_tensor(out, mine, op=op)
                approx = (kind == R.AVG and dtype.is_floating_point) or factor != 1
                ck.eq(out, red[rank * n:(rank + 1) * n], f"reduce_scatter_tensor {dtype} {op}",
                      exact=not approx)
                ck.eq(mine, full[rank], "reduce_scatter_tensor leaves its input")
                out2 = torch.empty(n, dtype=dtype)
                dist.reduce_scatter(out2, list(full[rank].chunk(ws)), op=op)
                ck.eq(out2, red[rank * n:(rank + 1) * n], f"reduce_scatter {dtype} {op}",
                      exact=not approx)
    ts = [torch.full((k + 1,), float(rank + k)) for k in range(4)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    for k, t in enumerate(ts):
        ck.eq(t, torch.full((k + 1,), float(sum(r + k for r in range(ws)))), f"coalesced {k}")
    outs = [torch.empty(ws * 3) for _ in range(2)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for k in range(2):
            dist.all_gather_into_tensor(outs[k], torch.full((3,), float(10 * k + rank)))
    cm.wait()
    for k in range(2):
        ck.eq(outs[k], torch.cat([torch.full((3,), float(10 * k + r)) for r in range(ws)]),
              f"coalesced all_gather_into_tensor {k}")


def check_all_to_all(ck, rank, ws):
    """all_to_all (lists of uneven sizes), all_to_all_single (even and uneven splits)."""
    def block(src, dst, n):
        return torch.arange(n, dtype=torch.float32) + 1000 * src + 10 * dst

    sizes = lambda src, dst: (src + 2 * dst) % 4 + 1  # noqa: E731
    ins = [block(rank, d, sizes(rank, d)) for d in range(ws)]
    outs = [torch.empty(sizes(s, rank)) for s in range(ws)]
    dist.all_to_all(outs, ins)
    for s in range(ws):
        ck.eq(outs[s], block(s, rank, sizes(s, rank)), f"all_to_all from {s}")
    x = torch.cat([block(rank, d, 5) for d in range(ws)])
    y = torch.empty(5 * ws)
    dist.all_to_all_single(y, x)
    ck.eq(y, torch.cat([block(s, rank, 5) for s in range(ws)]), "all_to_all_single even")
    isz = [sizes(rank, d) for d in range(ws)]
    osz = [sizes(s, rank) for s in range(ws)]
    x = torch.cat(ins)
    y = torch.empty(sum(osz))
    dist.all_to_all_single(y, x, output_split_sizes=osz, input_split_sizes=isz)
    ck.eq(y, torch.cat([block(s, rank, sizes(s, rank)) for s in range(ws)]),
          "all_to_all_single uneven")


def check_p2p(ck, rank, ws):
    """send/recv between every ordered pair, isend/irecv, and batch_isend_irecv ring
    exchanges whose payload is larger than socket buffers (both ways at once)."""
    for a in range(ws):
        for b in range(ws):
            if a == b:
                continue
            t = torch.arange(6, dtype=torch.float64) + 10 * a + b
            if rank == a:
                dist.send(t, dst=b)
            elif rank == b:
                got = torch.empty(6, dtype=torch.float64)
                dist.recv(got, src=a)
                ck.eq(got, t, f"send {a}->{b}")
    if ws >= 2 and rank < 2:
        peer = 1 - rank
        t = torch.full((4,), float(rank))
        if rank == 0:
            dist.isend(t, peer).wait()
            got = torch.empty(4)
            dist.irecv(got, peer).wait()
        else:
            got = torch.empty(4)
            dist.irecv(got, peer).wait()
            dist.isend(t, peer).wait()
        ck.eq(got, torch.full((4,), float(peer)), "isend/irecv")
    n = 3 << 20      # 12 MiB each way
    send = torch.full((n,), float(rank))
    recv = torch.empty(n)
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % ws),
           dist.P2POp(dist.irecv, recv, (rank - 1) % ws)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    ck.eq(recv, torch.full((n,), float((rank - 1) % ws)), "batch_isend_irecv ring")


def check_objects_and_barriers(ck, rank, ws):
    """Object collectives, barrier, monitored_barrier, functional collectives (C++
    callers through the trampoline) and torch's DistributedSampler."""
    objs = [None] * ws
    dist.all_gather_object(objs, {"rank": rank, "pad": "x" * (rank * 1000)})
    ck.true(objs == [{"rank": r, "pad": "x" * (r * 1000)} for r in range(ws)], "all_gather_object")
    lst = [f"from {rank}", rank] if rank == ws - 1 else [None, None]
    dist.broadcast_object_list(lst, src=ws - 1)
    ck.true(lst == [f"from {ws - 1}", ws - 1], "broadcast_object_list")
    got = [None] * ws if rank == 0 else None
    dist.gather_object(("g", rank), got, dst=0)
    ck.true(rank != 0 or got == [("g", r) for r in range(ws)], "gather_object")
    out = [None]
    dist.scatter_object_list(out, [("s", r) for r in range(ws)] if rank == 0 else None, src=0)
    ck.true(out == [("s", rank)], "scatter_object_list")
    dist.barrier()
    dist.barrier(async_op=True).wait()
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    dist.monitored_barrier(wait_all_ranks=True)
    ck.true(True, "monitored_barrier")
    x = torch.full((4,), float(rank))
    y = funcol.all_reduce(x, "sum", dist.group.WORLD)
    ck.eq(funcol.wait_tensor(y), torch.full((4,), float(sum(range(ws)))), "funcol all_reduce")
    g = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
    ck.eq(funcol.wait_tensor(g), torch.cat([torch.full((4,), float(r)) for r in range(ws)]),
          "funcol all_gather_tensor")
    rs = funcol.reduce_scatter_tensor(torch.arange(4.0 * ws), "sum", 0, dist.group.WORLD)
    ck.eq(funcol.wait_tensor(rs), torch.arange(4.0 * ws)[4 * rank:4 * rank + 4] * ws,
          "funcol reduce_scatter_tensor")
    ds = list(range(103))
    sampler = torch.utils.data.distributed.DistributedSampler(ds, shuffle=True, seed=3)
    sampler.set_epoch(2)
    mine = list(sampler)
    every = [None] * ws
    dist.all_gather_object(every, mine)
    ck.true(sampler.num_replicas == ws and sampler.rank == rank, "sampler sees the group")
    ck.true(sorted(set(i for e in every for i in e)) == ds and
            all(len(e) == len(mine) for e in every), "sampler covers the dataset")


def check_subgroups(ck, rank, ws):
    """new_group subsets: collectives with group ranks translated to global ones,
    non-members untouched; a second new_group over all ranks."""
    members = [r for r in range(ws) if r != 1] if ws > 2 else [0, 1]
    g = dist.new_group(members)
    everyone = dist.new_group(list(range(ws)))
    if rank in members:
        me = members.index(rank)
        ck.true(dist.get_rank(g) == me and dist.get_world_size(g) == len(members),
                "group rank and size")
        x = torch.full((3,), float(rank + 1))
        dist.all_reduce(x, group=g)
        ck.eq(x, torch.full((3,), float(sum(r + 1 for r in members))), "subgroup all_reduce")
        last = members[-1]
        b = torch.full((2,), float(rank))
        dist.broadcast(b, src=last, group=g)
        ck.eq(b, torch.full((2,), float(last)), "subgroup broadcast from a global rank")
        lst = [torch.empty(1) for _ in members]
        dist.all_gather(lst, torch.tensor([float(rank)]), group=g)
        ck.eq(torch.cat(lst), torch.tensor([float(r) for r in members]), "subgroup all_gather")
    y = torch.ones(2)
    dist.all_reduce(y, group=everyone)
    ck.eq(y, torch.full((2,), float(ws)), "second full group")
    if rank in members:
        dist.destroy_process_group(g)
    dist.barrier()


SECTIONS = [check_all_reduce, check_tensor_kinds, check_rooted, check_gathers,
            check_all_to_all, check_p2p, check_objects_and_barriers, check_subgroups]

