"""torch's own distributed test suite as the judge of the "pyddp" backend: run the
suite that torch runs against its backends (``distributed_test``'s ``TestDistBackend``,
as ``test/distributed/test_distributed_spawn.py`` drives it) against gloo and against
pyddp, side by side, and print the tests that pass for gloo and not for pyddp.

    python benchmarks/torch_suite.py                        # every test, world sizes 2 and 3
    python benchmarks/torch_suite.py --select collectives --world-sizes 2
    python benchmarks/torch_suite.py -k any_source -k coalesced --start spawn

For each world size and backend one child (``torch_suite_run.py``; ``--shards N``: N
children, each with every N-th test) runs the chosen tests with ``BACKEND``,
``WORLD_SIZE`` and ``TEMP_DIR`` set, the suite's feature table extended with the
backend's name wherever it lists gloo, and writes one result per test. gloo's and
pyddp's children run side by side (a test's time is mostly waiting for its rank
processes, not CPU), and every child of a world size, the stand-in's below included,
starts at once and imports torch and the suite while the work before its tests is
done; the first one lists the suite's tests. Every child runs in its own session,
bounded by what is left of ``--timeout``, and the whole session is killed when it ends
(the rank processes the suite starts included); each test is bounded by
``--test-timeout`` (the suite's own per-test limit).

Some tests the suite runs for gloo only: it names gloo in its own checks, outside the
feature table (``require_backend_is_available({"gloo"})``, ``BACKEND != "gloo"``), or
picks the test's code by the backend's name. Those that pass on gloo and are skipped
for pyddp run a second time with pyddp standing in for gloo: the suite runs as for
gloo, but every group it asks gloo for is pyddp's (``TORCH_SUITE_STAND_IN``).

Output: the counts per backend, with ``--table`` the outcome of every test for each
backend, the tests passed standing in for gloo, and the list "passes on gloo, not on
pyddp", where the differences documented as deliberate in docs/torch-backend.md
(``DELIBERATE``) are marked as such. Exit status 0 when no other test passes on gloo
and not on pyddp, 1 otherwise, 2 when a run did not finish in time. ``--json FILE``
writes every result.
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Named selections (regular expressions on the test names).
SELECTIONS = {
    "all": r".",
    "p2p": r"^test_(send_recv|isend|irecv|batch_isend_irecv)",
    "collectives": r"^test_(all_reduce|all_gather|all_to_all|broadcast|reduce|scatter|gather|"
                   r"barrier|send_recv|isend|irecv|batch_isend_irecv|sparse_all_reduce|"
                   r"coalescing_manager|get_future|monitored_barrier|nccl_backend)",
}

# Tests that pass on gloo and deliberately not on pyddp, with the reason (each one is
# written down in docs/torch-backend.md, "What differs from gloo").
DELIBERATE = {}


class Child:
    """One run of torch_suite_run.py for one backend at one world size, in a session of
    its own, started before its tests are chosen: it imports torch and the suite, writes
    the suite's test names to a file, then reads the names of the tests to run from its
    standard input, so that its start overlaps the work before it. stand_in: that
    backend's groups wherever the suite (run for backend) asks for gloo."""

    def __init__(self, python, backend, world, args, log, stand_in=None):
        self.tmp = tempfile.mkdtemp(prefix="torch_suite_")
        self.out = os.path.join(self.tmp, "results.jsonl")
        self.listed = os.path.join(self.tmp, "names")
        open(os.path.join(self.tmp, "barrier"), "w").close()
        env = dict(os.environ, BACKEND=backend, WORLD_SIZE=str(world), TEMP_DIR=self.tmp,
                   DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(args.test_timeout),
                   TORCH_SUITE_START=args.start, PYTHONUNBUFFERED="1")
        env.pop("TORCH_SUITE_STAND_IN", None)
        if stand_in:
            env["TORCH_SUITE_STAND_IN"] = stand_in
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
        cmd = [python, os.path.join(HERE, "torch_suite_run.py"), "--out", self.out,
               "--list-to", self.listed, "-"]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=log,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.t0 = time.monotonic()

    def suite_names(self, deadline):
        """Every test name of the suite, as the child sees it (once it has imported the
        suite); None if the child ended or the deadline came first."""
        while not os.path.exists(self.listed):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        with open(self.listed) as f:
            return f.read().split()

    def feed(self, names):
        """Hand the child its tests (none: it ends at once)."""
        self.t0 = time.monotonic()
        try:
            self.proc.stdin.write("".join(n + "\n" for n in names))
            self.proc.stdin.close()
        except BrokenPipeError:         # it ended already: finish() reports what it ran
            pass

    def finish(self, deadline):
        """Wait for the child until the deadline, then kill its session and remove its
        files. Returns ({test: result}, finished, seconds since its tests were fed)."""
        finished = True
        try:
            self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            finished = False
        self._stop()
        results = {}
        if os.path.exists(self.out):
            with open(self.out) as f:
                for line in f:
                    r = json.loads(line)
                    results[r["test"]] = r
        self.kill()
        return results, finished, time.monotonic() - self.t0

    def _stop(self):
        """Kill the child's session: the child and every rank process it started."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def kill(self):
        """_stop(), and remove the child's files."""
        self._stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


def finish_all(children, deadline):
    """finish() every child, side by side (each one's seconds end when it does): a list
    of ({test: result}, finished, seconds), in the order of children."""
    with ThreadPoolExecutor(len(children)) as pool:
        return list(pool.map(lambda c: c.finish(deadline), children))


def merge(done):
    """One run's result from its shards' (finish_all's items): ({test: result}, all
    finished, seconds of the slowest shard)."""
    results = {}
    for r, _, _ in done:
        results.update(r)
    return results, all(f for _, f, _ in done), max(s for _, _, s in done)


def summary_line(reason):
    """The last informative line of a failure's traceback (not unittest's advice on
    how to run it again), or a skip's reason."""
    lines = [ln.strip() for ln in reason.strip().splitlines() if ln.strip() and
             not re.search(r"PYTORCH_PRINT_REPRO|To execute this test|torch_suite_run\.py ",
                           ln)]
    return (lines[-1] if lines else "")[:200]


def outcome(res, backend, name):
    return res[backend].get(name, {}).get("outcome", "not run")


def compare(world, res, names):
    """Print the counts and the tests that pass on gloo and not on pyddp; return the
    ones that are neither documented (DELIBERATE) nor passed by pyddp standing in for
    gloo (res["stand-in"]: the tests the suite runs for gloo only)."""
    for b in ("gloo", "pyddp"):
        counts = {}
        for n in names:
            o = outcome(res, b, n)
            counts[o] = counts.get(o, 0) + 1
        print(f"world {world} {b:6s}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    diff = [n for n in names if outcome(res, "gloo", n) == "pass" and
            outcome(res, "pyddp", n) != "pass"]
    gloo_only = [n for n in diff if outcome(res, "pyddp", n) == "skip" and
                 outcome(res, "stand-in", n) == "pass"]
    if gloo_only:
        print(f"world {world}: skipped for pyddp by the suite's own gloo-only checks, passed "
              f"with pyddp standing in for gloo: {len(gloo_only)}")
        for n in gloo_only:
            print(f"  {n} (skip: {summary_line(res['pyddp'][n]['detail'])})")
    diff = [n for n in diff if n not in gloo_only]
    print(f"world {world}: passes on gloo, not on pyddp: {len(diff)}")
    bad = []
    for n in diff:
        r = res["pyddp"].get(n, {"outcome": "not run", "detail": "the run ended before it"})
        if r["outcome"] == "skip" and n in res["stand-in"]:
            r = dict(res["stand-in"][n], outcome="skip, standing in for gloo: " +
                     res["stand-in"][n]["outcome"])
        if n in DELIBERATE:
            print(f"  {n}: {r['outcome']} (deliberate: {DELIBERATE[n]})")
        else:
            print(f"  {n}: {r['outcome']}: {summary_line(r['detail'])}")
            bad.append(n)
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--select", default="all", choices=sorted(SELECTIONS),
                    help="named selection of tests (default all)")
    ap.add_argument("-k", dest="patterns", action="append", default=[],
                    help="only tests whose name matches this regular expression (repeatable; "
                         "instead of --select)")
    ap.add_argument("--world-sizes", default="2,3")
    ap.add_argument("--start", choices=("fork", "spawn"), default="fork",
                    help="how the suite starts its rank processes: fork (fast; default) or "
                         "spawn (as torch's test_distributed_spawn.py, about 5 s more per test)")
    ap.add_argument("--shards", type=int, default=1,
                    help="children per backend, each with its share of the tests (gloo's and "
                         "pyddp's run side by side; default 1)")
    ap.add_argument("--test-timeout", type=int, default=120, help="seconds per test")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for the whole run")
    ap.add_argument("--table", action="store_true", help="print every test's outcomes")
    ap.add_argument("--json", help="write every result to this file")
    ap.add_argument("--log", help="the children's output (default: discarded)")
    args = ap.parse_args()
    deadline = time.monotonic() + args.timeout
    python = sys.executable
    patterns = args.patterns or [SELECTIONS[args.select]]
    log = open(args.log, "a") if args.log else subprocess.DEVNULL
    shards = max(1, args.shards)
    all_results, bad, complete, children = {}, [], True, []
    try:
        for world in [int(w) for w in args.world_sizes.split(",")]:
            # every child of this world size starts now; each imports while it waits
            runs = {b: [Child(python, b, world, args, log) for _ in range(shards)]
                    for b in ("gloo", "pyddp")}
            stand_in = Child(python, "gloo", world, args, log, stand_in="pyddp")
            children = runs["gloo"] + runs["pyddp"] + [stand_in]
            listed = runs["gloo"][0].suite_names(deadline)
            if listed is None:
                print("the suite's tests could not be listed (see --log)", file=sys.stderr)
                return 2
            names = [n for n in listed if any(re.search(p, n) for p in patterns)]
            if not names:
                print("no test matches", file=sys.stderr)
                return 1
            for b in runs:                      # dealt round-robin into the shards
                for i, c in enumerate(runs[b]):
                    c.feed(names[i::shards])
            res = {}
            done = finish_all(runs["gloo"] + runs["pyddp"], deadline)
            for i, backend in enumerate(("gloo", "pyddp")):
                res[backend], finished, secs = merge(done[i * shards:(i + 1) * shards])
                complete &= finished
                print(f"world {world} {backend}: {len(res[backend])} of {len(names)} tests "
                      f"in {secs:.0f} s{'' if finished else ' (time is up)'}", flush=True)
            # the tests the suite runs for gloo only: again, pyddp standing in for gloo
            again = [n for n in names if outcome(res, "gloo", n) == "pass" and
                     outcome(res, "pyddp", n) == "skip"]
            stand_in.feed(again)
            res["stand-in"], finished, secs = merge(finish_all([stand_in], deadline))
            if again:
                complete &= finished
                print(f"world {world} pyddp standing in for gloo: {len(res['stand-in'])} of "
                      f"{len(again)} tests in {secs:.0f} s"
                      f"{'' if finished else ' (time is up)'}", flush=True)
            if args.table:
                print(f"  {'test':70s} gloo  pyddp stand-in")
                for n in names:
                    print(f"  {n:70s} " + " ".join(f"{res[b].get(n, {}).get('outcome', '-'):5s}"
                                                   for b in ("gloo", "pyddp", "stand-in")))
            bad += [(world, n) for n in compare(world, res, names)]
            all_results[world] = res
    finally:
        for c in children:                      # on any error: none outlives the run
            c.kill()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_results, f, indent=1)
    if bad:
        print(f"{len(bad)} test(s) pass on gloo and not on pyddp without a documented reason")
        return 1
    return 0 if complete else 2


if __name__ == "__main__":
    sys.exit(main())
