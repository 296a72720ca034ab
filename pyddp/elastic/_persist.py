"""Committed state of an in-place elastic job on each node's disk, so that losing the
node the job depends on (its store's) costs at most k commits: ``pyddp.elastic.run``
writes every k-th commit to ``<dir>/pyddp-elastic-state.pkl`` (local rank 0 of each
node, to a temporary file that is then renamed over the old copy, so a crash while
writing leaves the previous copy whole), and a job started again reads its node's copy
before the first sync; the sync then hands every rank the newest commit on any node.

The directory is PYDDP_ELASTIC_CHECKPOINT_DIR (or run's ``checkpoint_dir``), every k
is PYDDP_ELASTIC_CHECKPOINT_EVERY (or ``checkpoint_every``). A shared directory works
too: the nodes then write the same commit to the same name, each through its own
temporary file.
"""
import logging
import os
import pickle
import socket

from .. import _C, _env

log = logging.getLogger("pyddp")

FILE = "pyddp-elastic-state.pkl"
_FORMAT = 1


class Disk:
    """Where and how often this process keeps commits on disk."""

    def __init__(self, directory, every):
        if every < 1:
            raise _C.DistValueError(f"checkpoint_every must be at least 1, got {every}")
        self.path = os.path.join(directory, FILE)
        self.every = every
        self.writer = _env.local_rank() == 0
        if self.writer:
            os.makedirs(directory, exist_ok=True)

    def commit(self, number, saved):
        """Write commit number (State._saved) when it is a k-th one, on local rank 0."""
        if not self.writer or number % self.every:
            return
        tmp = f"{self.path}.{socket.gethostname()}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump({"format": _FORMAT, "commit": number, "saved": saved}, f,
                        protocol=pickle.HIGHEST_PROTOCOL)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        try:
            fd = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass

    def read(self):
        """The saved commit (State._saved) in this node's copy, or None without one."""
        try:
            with open(self.path, "rb") as f:
                rec = pickle.load(f)
        except FileNotFoundError:
            return None
        if not isinstance(rec, dict) or rec.get("format") != _FORMAT:
            raise _C.DistValueError(f"{self.path} is not a pyddp elastic state file of "
                                    f"format {_FORMAT}; move it away to start afresh")
        log.warning("pyddp: elastic: read commit %d from %s", rec["commit"], self.path)
        return rec["saved"]


def configured(directory=None, every=None):
    """The Disk of run()'s arguments or the PYDDP_ELASTIC_CHECKPOINT_* settings, or
    None when no directory is given."""
    directory = directory or _C.setting_text("PYDDP_ELASTIC_CHECKPOINT_DIR")
    if not directory:
        return None
    if every is None:
        every = int(_C.setting("PYDDP_ELASTIC_CHECKPOINT_EVERY"))
    return Disk(os.fspath(directory), int(every))
