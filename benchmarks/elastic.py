"""Elastic recovery time: torchrun restarting the workers against pyddp.elastic in place.

    python benchmarks/elastic.py [--steps-per-epoch 20] [--hidden 512] [--settle 1]

Two "nodes" on this machine (loopback), each a stock torchrun agent
(``--nnodes=1:2 --nproc_per_node=2``) running this file as the training script: an MLP
under pyddp's DDP, DistributedSampler data, a commit (in place) or a checkpoint on each
node's own disk (restart) every epoch. Node 0 is the endpoint. Three changes, each
measured from the moment it happens:

1. node 1 is killed mid-epoch (loss -> first step at world 2), then started again with
   the same line (return -> first step at world 4; how long the survivors were held up:
   the longest gap between two steps of rank 0 around it; the new processes' own
   start-up, imports included, is in the return time);
2. one worker of node 0 (the store's node) is killed: its agent starts that node's
   workers again (crash -> first step at any size; -> first step at world 4 again);
3. node 1's torchrun is sent SIGTERM, a spot VM's notice (leave -> first step at world
   2; steps lost: steps done before the change that were done again after it).

Restart runs with c10d, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the only way it can grow
back, see docs/elastic.md) and --max-restarts=6; in place with docs/elastic.md's line
(``--rdzv-backend=pyddp --max-restarts=100``).
"""
import argparse
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
N = 4096


# -- the training script (run by torchrun) ----------------------------------------------

def _worker(mode, steps_per_epoch, hidden, stop_file):
    import torch
    import pyddp as dist
    from pyddp import DistributedDataParallel as DDP, DistributedSampler
    dist.init_process_group("cpu")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                                    torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                    torch.nn.Linear(hidden, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 64, generator=g), torch.randint(0, 10, (N,), generator=g)
    box = {}

    def remake():
        ws = dist.get_world_size()
        box["sampler"] = DistributedSampler(range(N), shuffle=True, seed=1)
        box["batch"] = max(N // (ws * steps_per_epoch), 1)

    def epoch_steps(epoch):
        sampler = box["sampler"]
        sampler.set_epoch(epoch)
        idx, b = list(sampler), box["batch"]
        for i in range(0, len(idx) - b + 1, b):
            batch = idx[i:i + b]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()
            if dist.get_rank() == 0:
                print(f"STEP {time.time():.4f} {dist.get_world_size()} "
                      f"{epoch * steps_per_epoch + i // b}", flush=True)

    def stop():
        flag = [os.path.exists(stop_file)]
        dist.broadcast_object_list(flag, src=0)
        return flag[0]

    remake()
    if mode == "inplace":
        from pyddp import elastic
        state = elastic.TorchState(model=model, optimizer=opt, epoch=0)
        state.register_reset_callbacks([remake])

        @elastic.run
        def train(state):
            while True:
                epoch_steps(state.epoch)
                state.epoch += 1
                state.commit()
                if stop():
                    return
        train(state)
    else:
        ckpt = os.path.join(os.environ["CKPT_DIR"], "latest.pt")
        mine = -1
        if int(os.environ["LOCAL_RANK"]) == 0 and os.path.exists(ckpt):
            saved = torch.load(ckpt)
            mine = saved["epoch"]
        epochs = [None] * dist.get_world_size()
        dist.all_gather_object(epochs, mine)
        epoch = max(epochs) + 1
        if epoch > 0:
            box2 = [saved if mine == epoch - 1 else None]
            dist.broadcast_object_list(box2, src=epochs.index(epoch - 1))
            model.module.load_state_dict(box2[0]["model"])
            opt.load_state_dict(box2[0]["optimizer"])
        while True:
            epoch_steps(epoch)
            if int(os.environ["LOCAL_RANK"]) == 0:
                os.makedirs(os.environ["CKPT_DIR"], exist_ok=True)
                torch.save({"model": model.module.state_dict(),
                            "optimizer": opt.state_dict(), "epoch": epoch}, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
            epoch += 1
            if stop():
                break
    dist.destroy_process_group()


# -- the driver ---------------------------------------------------------------------------

def _descendants(pid):
    """pid and every process below it (torchrun starts its workers in sessions of their
    own, so a process group kill would leave them running)."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _kill_node(pid):
    """A node dies: its launcher and all its workers at once."""
    for p in _descendants(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Job:
    def __init__(self, mode, args, tmp):
        self.mode, self.args, self.tmp = mode, args, tmp
        self.port = _free_port()
        self.stop_file = os.path.join(tmp, "stop")
        self.q = queue.Queue()
        self.procs = []
        self.tail = []           # the last output lines, shown when a wait fails

    def start(self, node):
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                   CKPT_DIR=os.path.join(self.tmp, f"ckpt{node}"),
                   PYDDP_ELASTIC_SETTLE_S=str(self.args.settle))
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "PYDDP_ELASTIC_JOIN"):
            env.pop(k, None)
        if self.mode == "restart":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        if self.mode == "inplace":
            launch = ["--nnodes=1:2", "--nproc_per_node=2", "--rdzv-backend=pyddp",
                      f"--rdzv-endpoint=127.0.0.1:{self.port}", "--rdzv-id=bench",
                      "--max-restarts=100", "--monitor-interval=0.5",
                      f"--rdzv-conf=last_call_timeout=2,is_host={int(node == 0)}"]
        else:
            launch = ["--nnodes=1:2", "--nproc_per_node=2", "--rdzv-backend=c10d",
                      f"--rdzv-endpoint=127.0.0.1:{self.port}", "--rdzv-id=bench",
                      f"--max-restarts={0 if self.mode == 'inplace' else 6}",
                      "--monitor-interval=0.5",
                      "--rdzv-conf=last_call_timeout=2,keep_alive_interval=1,"
                      f"keep_alive_max_attempt=3,is_host={int(node == 0)}"]
        cmd = [sys.executable, "-m", "torch.distributed.run", *launch, HERE, "--worker",
               self.mode, str(self.args.steps_per_epoch), str(self.args.hidden),
               self.stop_file]
        p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.procs.append(p)
        threading.Thread(target=self._pump, args=(p,), daemon=True).start()
        return p

    def _pump(self, p):
        for line in p.stdout:
            self.tail.append(f"{time.time():.2f} {line.rstrip()}")
            del self.tail[:-40]
            if line.startswith("STEP "):
                _, t, w, g = line.split()
                self.q.put((float(t), int(w), int(g)))

    def drain(self):
        """Forget the steps so far; the global step number of the last one."""
        g = None
        while not self.q.empty():
            g = self.q.get()[2]
        return g

    def first_step(self, world, timeout, after=0.0):
        """Steps until one at this world size done after time `after` (world None: the
        first one after the change took effect: at another size than 4, or after a
        pause of a second): (its time, the longest gap seen, its global step number)."""
        deadline, last, gap = time.monotonic() + timeout, None, 0.0
        while time.monotonic() < deadline:
            try:
                t, w, g = self.q.get(timeout=0.5)
            except queue.Empty:
                continue
            pause = t - last if last is not None else 0.0
            gap = max(gap, pause)
            last = t
            if world is None:
                if t > after and (w != 4 or pause >= 1.0):
                    return t, gap, g
            elif w == world and t > after:
                return t, gap, g
        raise RuntimeError(f"{self.mode}: no step at world {world} within {timeout} s\n"
                           + "\n".join(self.tail))

    def close(self):
        for p in self.procs:
            _kill_node(p.pid)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _worker_of(pid):
    """One worker process under the launcher pid (a python running this file)."""
    for p in _descendants(pid)[1:]:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if b"--worker" in f.read():
                    return p
        except OSError:
            continue
    raise RuntimeError("no worker found")


def _measure(mode, args):
    tmp = tempfile.mkdtemp(prefix=f"pyddp-elastic-{mode}-")
    job = _Job(mode, args, tmp)
    out = {}
    try:
        job.start(0)
        node1 = job.start(1)
        job.first_step(4, 180)
        time.sleep(args.warm)
        job.drain()
        t = time.time()
        _kill_node(node1.pid)
        out["loss_to_step_s"] = job.first_step(2, 180, t)[0] - t
        time.sleep(args.warm)
        job.drain()
        t = time.time()
        node1 = job.start(1)
        t_big, gap, _ = job.first_step(4, 180, t)
        out["return_to_step_s"], out["survivors_held_s"] = t_big - t, gap
        time.sleep(args.warm)
        job.drain()
        t = time.time()
        os.kill(_worker_of(job.procs[0].pid), signal.SIGKILL)
        out["crash_to_step_s"] = job.first_step(None, 180, t)[0] - t
        out["crash_to_full_s"] = job.first_step(4, 180, t)[0] - t
        time.sleep(args.warm)
        before = job.drain()
        t = time.time()
        node1.send_signal(signal.SIGTERM)
        t_small, _, g = job.first_step(2, 180, t)
        out["leave_to_step_s"], out["leave_steps_lost"] = t_small - t, max(0, before - g + 1)
        open(job.stop_file, "w").close()
        return out
    finally:
        job.close()
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", nargs=4, metavar=("MODE", "STEPS", "HIDDEN", "STOP"))
    ap.add_argument("--steps-per-epoch", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--settle", type=float, default=1.0, help="PYDDP_ELASTIC_SETTLE_S")
    ap.add_argument("--warm", type=float, default=3.0, help="seconds of steps before a change")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.worker:
        mode, steps, hidden, stop = a.worker
        _worker(mode, int(steps), int(hidden), stop)
        return
    rows = {m: _measure(m, a) for m in ("restart", "inplace")}
    if a.json:
        print(json.dumps(rows))
        return
    print(f"2 nodes x 2 ranks on loopback, MLP hidden={a.hidden}, "
          f"{a.steps_per_epoch} steps/epoch, PYDDP_ELASTIC_SETTLE_S={a.settle:g}")
    print(f"{'':44} {'torchrun restart':>17} {'pyddp in place':>15}")
    for key, name in (("loss_to_step_s", "node lost -> first step at world 2"),
                      ("return_to_step_s", "same line again -> first step at world 4"),
                      ("survivors_held_s", "survivors held up by the return"),
                      ("crash_to_step_s", "worker crash on node 0 -> next step"),
                      ("crash_to_full_s", "worker crash on node 0 -> world 4 again"),
                      ("leave_to_step_s", "SIGTERM to node 1 -> first step at world 2"),
                      ("leave_steps_lost", "SIGTERM to node 1: steps lost")):
        unit = "" if key.endswith("lost") else " s"
        print(f"{name:44} {rows['restart'][key]:>15.2f}{unit:2} "
              f"{rows['inplace'][key]:>13.2f}{unit:2}")


if __name__ == "__main__":
    main()
