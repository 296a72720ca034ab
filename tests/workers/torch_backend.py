"""Worker for tests/test_torch_backend.py: a plain torch script on the "pyddp" backend.

It never imports pyddp: the backend comes from the installed entry point (unless
--import-backend, which imports pyddp.torch_backend as TORCH_DEVICE_BACKEND_AUTOLOAD=0
users do). Modes:

* ``all`` (default, under torchrun): every collective against arithmetic
  (torch_colls.py), then DDP over pyddp against DDP over gloo, FSDP2 and DTensor
  (torch_train.py), in one process group. Prints "PASS <section> rank=<r>" per section.
* ``errors`` (torchrun, 2 ranks): a mismatch (also 12 times in a row, with nothing
  left alive afterwards), a timeout from the group's options and a
  dead peer arrive as torch's DistError family; each breaks the group, which is
  destroyed and initialised again (a second init in the same process starts clean).
* ``restart`` (torchrun --max-restarts=1): attempt 0 fails after a collective; attempt 1
  must rendezvous cleanly on the same agent store.
* ``plain`` (plain processes): init_method file:// (torch's FileStore, not a TCPStore),
  then env:// twice, rank 0 hosting torch's TCPStore anew on the same port.
"""
import argparse
import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

import torch_colls
import torch_train


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("mode", nargs="?", default="all")
    p.add_argument("--import-backend", action="store_true")
    p.add_argument("--file", default=None)
    return p.parse_args()


def run_all(rank, ws):
    gloo = dist.new_group(backend="gloo")
    ck = torch_colls.Checker(rank)
    failed = 0
    for fn in torch_colls.SECTIONS:
        try:
            n0 = ck.n
            fn(ck, rank, ws)
            print(f"PASS {fn.__name__[6:]} rank={rank} checks={ck.n - n0}", flush=True)
        except Exception:  # noqa: BLE001 - report every section, then fail
            failed += 1
            print(f"FAIL {fn.__name__[6:]} rank={rank}\n{traceback.format_exc()}", flush=True)
    for fn, args in ((torch_train.check_ddp, (gloo,)), (torch_train.check_fsdp2, (gloo,)),
                     (torch_train.check_dtensor, ())):
        try:
            fn(ck, rank, ws, *args)
        except Exception:  # noqa: BLE001
            failed += 1
            print(f"FAIL {fn.__name__[6:]} rank={rank}\n{traceback.format_exc()}", flush=True)
    return failed


def say(line):
    """Print one whole line with a single write: torchrun's ranks share one stdout, and
    print() writes the text and its newline separately when unbuffered, so another
    rank's line could land between them."""
    os.write(1, (line + "\n").encode())


def run_errors(rank, ws):
    """Three failures, one group each; the group is re-made after every one."""
    # 1. mismatch: different element counts
    dist.init_process_group("pyddp")
    try:
        dist.all_reduce(torch.ones(4 + rank))
        print(f"rank {rank}: mismatch not detected", flush=True)
    except dist.DistBackendError as e:
        import pyddp
        say(f"ERRCASE mismatch rank={rank} type={type(e).__name__} "
            f"pyddp_class={isinstance(e, pyddp.CollectiveMismatchError)} "
            f"names_both={'rank 0 called' in str(e) and 'rank 1 called' in str(e)}")
    dist.destroy_process_group()
    # 2. the group's timeout (from init_process_group's options): rank 1 stays away
    dist.init_process_group("pyddp", timeout=datetime.timedelta(seconds=2))
    dist.barrier()
    if rank == 0:
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(3))
            print("rank 0: no timeout", flush=True)
        except dist.DistError as e:
            say(f"ERRCASE timeout rank=0 type={type(e).__name__} "
                f"timeouterror={isinstance(e, TimeoutError)} after={time.monotonic() - t0:.1f}")
    else:
        time.sleep(4)
    dist.destroy_process_group()
    # 2b. case 1's mismatch, again and again: every rank reports it every time (a work
    # finished on two threads at once once read as success on one of them), and the
    # failed calls leave nothing alive (their Works, groups and connections)
    import gc
    import pyddp
    missed = 0
    for _ in range(12):
        dist.init_process_group("pyddp")
        try:
            dist.all_reduce(torch.ones(4 + rank))
            missed += 1
        except pyddp.CollectiveMismatchError:
            pass
        dist.destroy_process_group()
    gc.collect()
    alive = sorted({type(o).__name__ for o in gc.get_objects()
                    if type(o).__module__.startswith("pyddp")
                    and type(o).__name__ in ("Work", "PyddpWork", "_Completion", "_One",
                                             "Group")})
    say(f"ERRCASE repeated rank={rank} type=CollectiveMismatchError missed={missed} "
        f"alive={','.join(alive) or 'none'}")
    # 3. a peer dies: the survivor fails fast, with a DistError
    dist.init_process_group("pyddp")
    x = torch.ones(3)
    dist.all_reduce(x)
    if rank == 1:
        os._exit(0)
    t0 = time.monotonic()
    try:
        for _ in range(100):
            dist.all_reduce(x)
            time.sleep(0.05)
        print("rank 0: dead peer not noticed", flush=True)
    except dist.DistError as e:
        say(f"ERRCASE dead rank=0 type={type(e).__name__} after={time.monotonic() - t0:.1f}")
    os._exit(0)


def run_restart(rank, ws):
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("pyddp")
    x = torch.full((3,), float(rank + 10 * attempt))
    dist.all_reduce(x)
    assert torch.equal(x, torch.full((3,), float(sum(r + 10 * attempt for r in range(ws)))))
    if attempt == 0:
        if rank == 1:
            sys.exit(17)
        dist.barrier()          # rank 1 never arrives: fails, or the agent stops us
        sys.exit(1)
    g = dist.new_group(backend="gloo")
    dist.barrier(group=g)
    print(f"PASS restart rank={rank} attempt={attempt}", flush=True)
    dist.destroy_process_group()


def run_plain(rank, ws, path):
    """init_method file:// (torch's FileStore), then twice env:// with rank 0 hosting
    torch's TCPStore on MASTER_PORT (a new server each time, on the same port)."""
    for i, method in enumerate([f"file://{path}", "env://", "env://"]):
        dist.init_process_group("pyddp", init_method=method, rank=rank, world_size=ws)
        base = dist.distributed_c10d._get_default_store()
        while isinstance(base, dist.PrefixStore):
            base = base.underlying_store
        x = torch.full((5,), float(rank + 1 + i))
        dist.all_reduce(x)
        assert torch.equal(x, torch.full((5,), float(sum(range(1 + i, ws + 1 + i))))), x
        print(f"PASS plain{i} rank={rank} store={type(base).__name__}", flush=True)
        dist.destroy_process_group()


def main():
    args = parse()
    if args.import_backend:
        import pyddp.torch_backend  # noqa: F401 - registers the backend
    if args.mode == "errors":
        return run_errors(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    if args.mode == "restart":
        return run_restart(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    if args.mode == "plain":
        return run_plain(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.file)
    before = "pyddp" in sys.modules
    dist.init_process_group("pyddp")
    rank, ws = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank}: backend={dist.get_backend()} pyddp_imported_before_init={before}",
          flush=True)
    failed = run_all(rank, ws)
    dist.destroy_process_group()
    print(f"rank {rank}: {'FAILED' if failed else 'DONE'}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
