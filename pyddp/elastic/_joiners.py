"""Processes that join a running in-place elastic job: asking to be admitted and
waiting for it (``admission``), which waiting nodes are complete and may be admitted
(``ready_joiners``), the ids that tell processes apart, and where torchrun's c10d
agents keep the store they share with their workers (``torch_worker_store``, for
PYDDP_ELASTIC_JOIN). The keys are ``_membership``'s (``E/join``, ``E/join/<i>``,
``E/join/<i>/epoch``).
"""
import json
import logging
import os
import socket
import uuid
from datetime import timedelta

from .. import _C, _env
from .._version import __version__
from ._live import LIVE_KEY, get_optional

log = logging.getLogger("pyddp")


class JobFinished(Exception):
    """A joiner's job ended before admitting it."""


def _node_key():
    """The same for the processes one launcher started on one node: its run id (a
    fresh one per torchrun --standalone) and the host."""
    return f"{socket.gethostname()}/{_env.elastic_attempt()[0]}/{os.getppid()}"


def ready_joiners(st, base, admitted):
    """[(index, record)] of the processes waiting to join whose node is complete (all
    its local ranks are waiting), in join order of the nodes and local rank within
    one: a node is admitted whole, so its ranks are adjacent."""
    n = st.add(f"{base}/join", 0)
    nodes = {}
    for i in range(n):
        if i not in admitted:
            raw = get_optional(st, f"{base}/join/{i}", 0.5)
            if raw is None:        # died between its ticket and its record, or slow
                continue
            r = json.loads(raw)
            nodes.setdefault(r["node"], []).append((i, r))
    ready = []
    for members in nodes.values():
        if len(members) >= members[0][1]["local_size"]:
            ready += sorted(members, key=lambda m: m[1]["local_rank"])
    return ready


def new_id():
    """A process id unique in the job: host, pid and a random part."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def admission(st, base, me, timeout_s):
    """A joiner's part (process id me) in the job whose key space is base: ask to join,
    then wait for a commit of the job to admit it; returns the membership epoch it was
    admitted into. Raises JobFinished when the job ended first, DistTimeoutError when
    no commit admitted it within timeout_s."""
    if json.loads(st.get(LIVE_KEY)).get("done"):
        raise JobFinished()
    i = st.add(f"{base}/join", 1) - 1
    st.set(f"{base}/join/{i}", json.dumps(
        {"id": me, "node": _node_key(), "local_rank": _env.local_rank(),
         "local_size": _env.local_world_size(), "version": __version__}))
    log.warning("pyddp: elastic: waiting to be admitted into the job at %s (at its "
                "next commit)", st.where)
    key = f"{base}/join/{i}/epoch"
    try:
        st.wait([key], timeout=timedelta(seconds=timeout_s))
    except _C.DistTimeoutError:
        raise _C.DistTimeoutError(
            f"the job at {st.where} did not admit this process within "
            f"{timeout_s:.0f} s: it admits joiners at state.commit(); check that it is "
            f"still running and commits") from None
    got = st.get(key)
    if got == b"done":
        raise JobFinished()
    return int(got)


def torch_worker_store(rdzv_store, rdzv_id, rounds=256):
    """(host, port) of the store that torchrun's agents share with their workers, read
    from the c10d rendezvous store at the endpoint (rdzv_store): the rank-0 agent
    publishes it as ``torch.rendezvous.<rdzv id>.<round>/MASTER_ADDR`` and
    ``.../MASTER_PORT`` when it makes it; the newest round that has it wins. None when no
    round has it (the endpoint is then taken to be the job's store itself)."""
    newest = None
    for r in range(rounds):
        if rdzv_store.check([f"torch.rendezvous.{rdzv_id}.{r}/MASTER_ADDR"]):
            newest = r
    if newest is None:
        return None
    pre = f"torch.rendezvous.{rdzv_id}.{newest}"
    return (rdzv_store.get(f"{pre}/MASTER_ADDR").decode(),
            int(rdzv_store.get(f"{pre}/MASTER_PORT")))
