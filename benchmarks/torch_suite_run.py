"""One run of torch's own distributed test suite for one backend and world size (the
child that ``benchmarks/torch_suite.py`` starts; not meant to be run by hand).

torch's ``test/distributed/test_distributed_spawn.py`` drives
``torch.testing._internal.distributed.distributed_test``: it reads ``BACKEND``,
``WORLD_SIZE`` and ``TEMP_DIR`` from the environment, defines
``TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase)`` whose
``setUp`` spawns one process per rank, and runs it with unittest. This module does the
same, with these changes:

* before the suite is imported (its decorators read the table at import), it adds
  ``BACKEND`` to every set of the suite's feature table (``DistTestCases.backend_feature``)
  that lists gloo, and to its "plugin" set: the table names gloo, nccl and ucc for DDP,
  subgroups and the like, so any other backend would skip those tests;
* with ``BACKEND=gloo TORCH_SUITE_STAND_IN=pyddp`` the suite runs as for gloo (its
  decorators and test bodies see gloo), but every group it asks gloo for is pyddp's:
  the driver's second look at the tests that the suite runs for gloo only (it names
  gloo in its own checks, outside the feature table);
* with ``TORCH_SUITE_START=fork`` the rank processes are forked from this one instead
  of spawned (torch's way, which imports torch and the suite again in every rank: about
  5 s of CPU per process, against a fraction of a second for most tests);
* the suite's poll loops (its file barrier, the wait for the rank processes) check
  every 10 ms instead of every 100 ms (``_QuickPoll``);
* it runs only the tests named on the command line, and writes one JSON line per test
  (``{"test", "outcome", "seconds", "detail"}``, outcome pass, fail or skip) to the
  file given by ``--out`` as each test ends, so that a run cut short by its time limit
  still leaves the results of the tests it finished.

Spawned rank processes import this module again (multiprocessing's spawn pickles the
test class by name), so the feature table is extended in them too; forked ones inherit
it. The suite's per-test limit (DISTRIBUTED_TESTS_DEFAULT_TIMEOUT, which the driver
sets) bounds every test, the few it gives more time included.

Usage: BACKEND=b WORLD_SIZE=n TEMP_DIR=d python torch_suite_run.py --out FILE NAME...
       BACKEND=gloo WORLD_SIZE=2 TEMP_DIR=d python torch_suite_run.py --list
       ... torch_suite_run.py --out FILE --list-to NAMES -    (the driver's form: the
       suite's names written to NAMES once imported, the tests' names read from stdin)
"""
import argparse
import functools
import inspect
import json
import os
import sys
import time
import unittest

import torch  # noqa: F401 - registers the installed backends (pyddp's entry point)
from torch.testing._internal import common_distributed as _cd

BACKEND = os.environ.get("BACKEND", "")


def extend_feature_table(backend):
    """Add backend to every feature set of the suite's table that lists gloo, and to its
    "plugin" set (the backends outside torch that the suite's availability check,
    ``require_backend_is_available``, accepts)."""
    table = _cd.DistTestCases.backend_feature
    for feature in table.values():
        if "gloo" in feature:
            feature.add(backend)
    table.setdefault("plugin", set()).add(backend)


def bound_test_timeouts():
    """The suite's per-test time limit (DISTRIBUTED_TESTS_DEFAULT_TIMEOUT, read at import)
    also for the few tests it gives more (TIMEOUT_OVERRIDE), so that the driver's
    limit bounds every test alike."""
    for name in _cd.TIMEOUT_OVERRIDE:
        _cd.TIMEOUT_OVERRIDE[name] = min(_cd.TIMEOUT_OVERRIDE[name], _cd.TIMEOUT_DEFAULT)


class _QuickPoll:
    """A stand-in for the ``time`` module in the suite's modules whose ``sleep(0.1)`` (the
    turn of the suite's two poll loops: its file barrier, ``Barrier.sync``, run twice in
    every test, and the driver's ``_join_processes``) sleeps 10 ms: a poll loop only
    checks again, so the tests are the same and each ends up to 0.1 s sooner after its
    condition holds, per loop. Every other ``sleep`` (the one in a test's body, a
    monitored-barrier test's ``WAIT_TIME + 0.1``) and everything else is ``time``'s."""

    POLL, QUICK = 0.1, 0.01

    def sleep(self, seconds):
        time.sleep(self.QUICK if seconds == self.POLL else seconds)

    def __getattr__(self, name):
        return getattr(time, name)


if BACKEND != "gloo":
    extend_feature_table(BACKEND)
bound_test_timeouts()
STAND_IN = os.environ.get("TORCH_SUITE_STAND_IN")

from torch.testing._internal.distributed import distributed_test as _dt  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest, TestDistBackend)

_cd.time = _dt.time = _QuickPoll()


def stand_in(backend):
    """In this rank process, init_process_group and new_group asked for gloo make
    backend's groups instead (the suite, imported for gloo, still sees gloo)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def swap(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            bound = sig.bind_partial(*args, **kwargs)
            if str(bound.arguments.get("backend", "")).lower() == "gloo":
                bound.arguments["backend"] = backend
            return fn(*bound.args, **bound.kwargs)
        return call
    for name in ("init_process_group", "new_group"):
        setattr(dist, name, swap(getattr(c10d, name)))
        setattr(c10d, name, getattr(dist, name))


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """torch's test_distributed_spawn.py class (with the choice of fork above)."""

    @classmethod
    def _run(cls, *args, **kwargs):
        if STAND_IN:
            stand_in(STAND_IN)
        super()._run(*args, **kwargs)

    def setUp(self):
        super().setUp()
        if os.environ.get("TORCH_SUITE_START") == "fork":
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


class _JsonResult(unittest.TextTestResult):
    """unittest's result that also appends one JSON line per finished test to out."""

    out = None

    def startTest(self, test):
        self._t0 = time.monotonic()
        super().startTest(test)

    def _record(self, test, outcome, detail=""):
        line = {"test": test.id().split(".")[-1], "outcome": outcome,
                "seconds": round(time.monotonic() - self._t0, 2), "detail": detail[-2000:]}
        with open(self.out, "a") as f:
            f.write(json.dumps(line) + "\n")

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test, "pass")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "fail", self.failures[-1][1])

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "fail", self.errors[-1][1])

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skip", str(reason))

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._record(test, "pass", "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._record(test, "fail", "unexpected success")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON lines file to append results to")
    ap.add_argument("--list", action="store_true", help="print the suite's test names")
    ap.add_argument("--list-to", help="write the suite's test names to this file first "
                                      "(written whole: a temporary file, then renamed)")
    ap.add_argument("names", nargs="*", help="test method names (test_...), or - to read "
                                             "them from standard input, until it closes")
    args = ap.parse_args()
    listed = unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn)
    if args.list:
        print("\n".join(listed))
        return 0
    if args.list_to:
        with open(args.list_to + ".tmp", "w") as f:
            f.write("\n".join(listed) + "\n")
        os.rename(args.list_to + ".tmp", args.list_to)
    names = sys.stdin.read().split() if args.names == ["-"] else args.names
    if not args.out or not args.names:
        ap.error("--out and test names are needed")
    _JsonResult.out = args.out
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names)
    runner = unittest.TextTestRunner(verbosity=2, resultclass=_JsonResult, stream=sys.stderr)
    runner.run(suite)
    return 0


if __name__ == "__main__":
    sys.exit(main())
