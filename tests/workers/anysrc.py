"""Worker for tests/test_recv_any.py: receives from any source and the coalesced
all_gather, through pyddp's own API (NumPy arrays) and through torch's on the "pyddp"
backend (torch tensors), against references every rank computes itself.

Run as plain processes (RANK/WORLD_SIZE/MASTER_*). ``--api pyddp`` or ``--api torch``.
Checks:

* turns: every rank in turn receives 2*(ws-1) messages from any source (recv and
  irecv alternating, small and bandwidth-path sizes) while every other rank sends it two;
  each message must hold its sender's data, the reported source (a global rank) must be
  the sender, and every sender must be seen twice;
* a subgroup of the ranks but rank 0 (group ranks differ from global ones): recv from
  any source returns the global rank;
* passed over (ws >= 3): rank 0 receives from any source while rank 1's next call is an
  all_reduce and rank 2 sends late: the message comes from rank 2, then the all_reduce
  runs on every rank;
* all_gather_coalesced: inputs of different sizes (one empty), dtypes float32, int64;
* torch only: a sparse all_reduce (SUM) against the dense sum.
Prints "rank R: PASS N checks".
"""
import argparse
import os
import time

import numpy as np


class Checker:
    def __init__(self, rank):
        self.rank, self.n = rank, 0

    def true(self, cond, what):
        if not cond:
            raise AssertionError(f"rank {self.rank}: {what}")
        self.n += 1


def payload(sender, k, n):
    return (np.arange(n, dtype=np.int64) * 7 + sender * 100003 + k * 31).astype(np.int64)


class PyddpApi:
    """pyddp's own functions on NumPy arrays."""

    def __init__(self):
        import pyddp
        self.d = pyddp
        pyddp.init_process_group("cpu")

    def array(self, a):
        return a.copy()

    def recv(self, buf, group=None):
        return self.d.recv(buf, group=group)

    def irecv_source(self, buf, group=None):
        return self.d.irecv(buf, group=group).source_rank()

    def numpy(self, x):
        return np.asarray(x)


class TorchApi:
    """torch.distributed on the "pyddp" backend, torch tensors."""

    def __init__(self):
        import torch
        import torch.distributed as dist
        self.torch, self.d = torch, dist
        dist.init_process_group("pyddp")
        assert dist.get_backend() == "pyddp"

    def array(self, a):
        return self.torch.from_numpy(a.copy())

    def recv(self, buf, group=None):
        return self.d.recv(buf, group=group)

    def irecv_source(self, buf, group=None):
        w = self.d.irecv(buf, group=group)
        w.wait()
        src = w._source_rank()          # a group rank, as torch's own recv reads it
        return self.d.get_global_rank(group, src) if group is not None else src

    def numpy(self, x):
        return x.numpy()


def check_turns(api, ck, rank, ws, group=None, members=None):
    members = members or list(range(ws))
    if rank not in members:
        return
    for n in (3, 20000):        # 20000 int64 = 160 KB: the bandwidth path
        for dst in members:
            if dst == rank:
                seen = {}
                for k in range(2 * (len(members) - 1)):
                    buf = api.array(np.zeros(n, dtype=np.int64))
                    src = api.recv(buf, group) if k % 2 == 0 else api.irecv_source(buf, group)
                    ck.true(src in members and src != rank, f"source {src} of {members}")
                    got = api.numpy(buf)
                    ck.true(np.array_equal(got, payload(src, seen.get(src, 0), n)),
                            f"data from {src} (message {seen.get(src, 0)}, n={n})")
                    seen[src] = seen.get(src, 0) + 1
                ck.true(all(seen.get(p) == 2 for p in members if p != rank), f"senders {seen}")
            else:
                for k in range(2):
                    api.d.send(api.array(payload(rank, k, n)), dst, group=group)


def check_passed_over(api, ck, rank, ws):
    if ws < 3:
        return
    one = api.array(np.ones(1, dtype=np.int64))
    if rank == 0:
        buf = api.array(np.zeros(5, dtype=np.int64))
        src = api.recv(buf)
        ck.true(src == 2, f"passed over rank 1: source {src}")
        ck.true(np.array_equal(api.numpy(buf), payload(2, 9, 5)), "data from rank 2")
    elif rank == 2:
        time.sleep(0.3)         # rank 1's all_reduce header is there first
        api.d.send(api.array(payload(2, 9, 5)), 0)
    api.d.all_reduce(one)
    ck.true(int(api.numpy(one)[0]) == ws, "all_reduce after the passed-over header")


def check_all_gather_coalesced(api, ck, rank, ws):
    for dt in (np.float32, np.int64):
        sizes = [3, 0, 1000, 5]
        ins = [api.array((np.arange(s) + 1000 * rank + 10 * i).astype(dt))
               for i, s in enumerate(sizes)]
        outs = [[api.array(np.full(s, -1, dtype=dt)) for s in sizes] for _ in range(ws)]
        api.d.all_gather_coalesced(outs, ins)
        for r in range(ws):
            for i, s in enumerate(sizes):
                want = (np.arange(s) + 1000 * r + 10 * i).astype(dt)
                ck.true(np.array_equal(api.numpy(outs[r][i]), want),
                        f"all_gather_coalesced {dt.__name__} [{r}][{i}]")


def check_sparse(api, ck, rank, ws):
    torch = api.torch
    for dense_dims in (0, 2):
        idx = torch.tensor([[r for r in range(rank + 1)]])
        val = torch.ones([rank + 1] + [2] * dense_dims) * (rank + 1)
        shape = [ws] + [2] * dense_dims
        t = torch.sparse_coo_tensor(idx, val, shape)
        want = sum(torch.sparse_coo_tensor(torch.tensor([list(range(r + 1))]),
                                           torch.ones([r + 1] + [2] * dense_dims) * (r + 1),
                                           shape).to_dense() for r in range(ws))
        api.d.all_reduce(t)
        ck.true(t.is_sparse and torch.equal(t.to_dense(), want), f"sparse all_reduce {dense_dims}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--api", choices=("pyddp", "torch"), default="pyddp")
    args = ap.parse_args()
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    api = PyddpApi() if args.api == "pyddp" else TorchApi()
    ck = Checker(rank)
    check_turns(api, ck, rank, ws)
    if ws >= 3:
        sub = api.d.new_group(list(range(1, ws)))
        check_turns(api, ck, rank, ws, sub, list(range(1, ws)))
    check_passed_over(api, ck, rank, ws)
    check_all_gather_coalesced(api, ck, rank, ws)
    if args.api == "torch":
        check_sparse(api, ck, rank, ws)
    api.d.barrier()
    api.d.destroy_process_group()
    print(f"rank {rank}: PASS {ck.n} checks", flush=True)


if __name__ == "__main__":
    main()
