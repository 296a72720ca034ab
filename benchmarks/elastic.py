"""Elastic recovery time: torchrun restarting the workers against pyddp.elastic in place.

    python benchmarks/elastic.py [--steps-per-epoch 20] [--hidden 512] [--settle 1]

Two "nodes" on this machine (loopback), each a stock torchrun c10d agent
(``--nnodes=1:2 --nproc_per_node=2``) running this file as the training script: an MLP
under pyddp's DDP, DistributedSampler data, a commit (in place) or a checkpoint on each
node's own disk (restart) every epoch. Node 1 is killed mid-epoch and, once the job goes
on without it, started again (in place: the joining line, ``PYDDP_ELASTIC_JOIN=...
torchrun --standalone``; restart: the same line). Printed for each mode:

* loss -> first step at the new size: from the kill to the first step the survivors
  complete at world 2 (the kill of a process is noticed at once);
* join -> first step at the larger size: from starting the node's launcher to the first
  step at world 4 (the new processes' own start-up, imports included, is in it);
* survivors held up by the join: the longest gap between two steps of rank 0 around it.

Restart runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the only way it can grow back,
see docs/elastic.md) and --max-restarts=6; in place with torchrun's default store and
--max-restarts=0, the launch lines docs/elastic.md gives for each mode.
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
                print(f"STEP {time.time():.4f} {dist.get_world_size()}", flush=True)

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

    def start(self, node, join=False):
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                   CKPT_DIR=os.path.join(self.tmp, f"ckpt{node}"),
                   PYDDP_ELASTIC_SETTLE_S=str(self.args.settle))
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "PYDDP_ELASTIC_JOIN"):
            env.pop(k, None)
        if self.mode == "restart":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        if join:
            env["PYDDP_ELASTIC_JOIN"] = f"127.0.0.1:{self.port}/bench"
            launch = ["--standalone", "--nproc_per_node=2"]
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
                _, t, w = line.split()
                self.q.put((float(t), int(w)))

    def first_step(self, world, timeout):
        """Steps until one at this world size: (its time, the longest gap seen)."""
        deadline, last, gap = time.monotonic() + timeout, None, 0.0
        while time.monotonic() < deadline:
            try:
                t, w = self.q.get(timeout=0.5)
            except queue.Empty:
                continue
            if last is not None:
                gap = max(gap, t - last)
            last = t
            if w == world:
                return t, gap
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


def _measure(mode, args):
    tmp = tempfile.mkdtemp(prefix=f"pyddp-elastic-{mode}-")
    job = _Job(mode, args, tmp)
    try:
        job.start(0)
        node1 = job.start(1)
        job.first_step(4, 180)
        time.sleep(args.warm)
        while not job.q.empty():
            job.q.get()
        t_kill = time.time()
        _kill_node(node1.pid)
        t_small, _ = job.first_step(2, 180)
        time.sleep(args.warm)
        while not job.q.empty():
            job.q.get()
        t_join = time.time()
        job.start(1, join=(mode == "inplace"))
        t_big, gap = job.first_step(4, 180)
        open(job.stop_file, "w").close()
        return {"loss_to_step_s": t_small - t_kill, "join_to_step_s": t_big - t_join,
                "survivors_held_s": gap}
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
    print(f"{'':34} {'torchrun restart':>17} {'pyddp in place':>15}")
    for key, name in (("loss_to_step_s", "loss -> first step at world 2"),
                      ("join_to_step_s", "join -> first step at world 4"),
                      ("survivors_held_s", "survivors held up by the join")):
        print(f"{name:34} {rows['restart'][key]:>15.2f} s {rows['inplace'][key]:>13.2f} s")


if __name__ == "__main__":
    main()
