"""torchrun's agents and an in-place elastic job: the exit barrier of agents that were
lost.

When its workers succeed, each torchrun agent waits in an exit barrier (torch's
``torchelastic/agent/terminal_state``, in the agents' rendezvous store) for every agent
of its rendezvous round, up to 300 s. After an in-place change the lost nodes' agents
never arrive, so the survivors' torchrun would sit there for 5 minutes after training
ended. At the end of an in-place job rank 0 checks in for each lost agent, so that the
survivors' agents exit as soon as their workers do. Where the agents' store is:

* static rendezvous (``--master_addr/--master_port``): the store the workers use, keys
  under ``<run id>/``;
* c10d rendezvous (``--rdzv-endpoint``): the endpoint's store, keys under
  ``torch.rendezvous.<rdzv id>.<round>/`` (the newest round this node's agent joined);
  the endpoint and id are read from the agent's command line (the worker's parent).

Best effort: anything that does not look like torchrun's layout leaves the agents as
they are (they then wait out their own timeout and exit normally).
"""
import logging
import os
from datetime import timedelta

from .. import _C, _env

log = logging.getLogger("pyddp")

_ROLE0 = "torchelastic/role_info/0"
_BARRIER = "torchelastic/agent/terminal_state"


def node_facts():
    """(group rank, group world size) of this worker's torchrun agent, or None."""
    try:
        return int(os.environ["GROUP_RANK"]), int(os.environ["GROUP_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None


def _launcher_rdzv():
    """(endpoint host, port, rdzv id) from the parent torchrun's command line, or None."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0")]
    except OSError:
        return None
    opts = {}
    for i, a in enumerate(argv):
        for name in ("rdzv-endpoint", "rdzv_endpoint", "rdzv-id", "rdzv_id",
                     "rdzv-backend", "rdzv_backend"):
            key = name.replace("_", "-")
            if a == f"--{name}" and i + 1 < len(argv):
                opts[key] = argv[i + 1]
            elif a.startswith(f"--{name}="):
                opts[key] = a.split("=", 1)[1]
    if opts.get("rdzv-backend") != "c10d" or "rdzv-endpoint" not in opts:
        return None
    host, _, port = opts["rdzv-endpoint"].rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port), opts.get("rdzv-id", "none")


def _agents_store(job_store):
    """(store, key prefix, own) of this job's agents' rendezvous, or None."""
    run_id = _env.elastic_attempt()[0]
    if job_store.check([f"{run_id}/{_ROLE0}"]):
        return job_store, run_id, False
    found = _launcher_rdzv()
    if found is None:
        return None
    host, port, rdzv_id = found
    from ..store import TCPStore
    st = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
    newest = None
    for r in range(256):
        if st.check([f"torch.rendezvous.{rdzv_id}.{r}/{_ROLE0}"]):
            newest = r
    if newest is None:
        st.close()
        return None
    return st, f"torch.rendezvous.{rdzv_id}.{newest}", True


def check_in_for_lost(job_store, alive_group_ranks, group_world_size):
    """Rank 0 at the end of an in-place job: check in at the agents' exit barrier for
    each agent of the founders' round that is gone (group ranks not in
    alive_group_ranks), so that the live agents do not wait 300 s for them."""
    lost = group_world_size - len(alive_group_ranks)
    if lost <= 0:
        return
    try:
        found = _agents_store(job_store)
        if found is None:
            return
        st, prefix, own = found
        try:
            n = st.add(f"{prefix}/{_BARRIER}/num_members", lost)
            if n >= group_world_size:
                st.set(f"{prefix}/{_BARRIER}/last_member", "<val_ignored>")
        finally:
            if own:
                st.close()
        log.info("pyddp: elastic: checked in at torchrun's exit barrier for %d lost "
                 "agent(s)", lost)
    except _C.DistError as e:
        log.warning("pyddp: elastic: could not check in for the lost torchrun agents (%s); "
                    "the survivors' torchrun may wait up to 300 s before it exits", e)
