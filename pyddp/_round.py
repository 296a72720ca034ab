"""The rendezvous round: one key prefix that every rank of one start of a world agrees
on, whatever each node's restart count and whatever earlier rounds left in the store.

Under torchrun's elastic agents a round is no number any worker can read: each node
counts its own restarts (a node restarted because another joined counts none), and the
agent's store keeps every earlier round's keys. So the ranks agree on a round through
the store itself, under ``<base>`` (``/pyddp/<run id>/<generation>``):

1. every rank draws a fresh nonce and writes it to ``<base>/hello/<rank>``;
2. rank 0 reads the nonces of ranks 1..n-1 (waiting for each key to exist), names the
   round ``R`` after its own nonce and an attempt number, and writes ``R`` to
   ``<base>/round/<nonce of rank r>`` for every rank;
3. rank r reads ``<base>/round/<its nonce>``, writes ``<base>/ack/<R>/<r>``, adds one
   to ``<base>/acks/<R>`` (the rank whose add makes it n - 1 also sets
   ``<base>/acked/<R>``) and waits for ``<base>/go/<R>``;
4. rank 0 sets ``go/<R>`` to ``go`` once every rank acknowledged (``acked/<R>``
   exists). A nonce read in step 2
   may be a dead process's from an earlier round (its successor has not started yet):
   that rank never acknowledges, and when its ``hello`` key changes rank 0 names a new
   round ``R'`` for the nonces it now sees, then sets ``go/<R>`` to ``void`` so that
   the ranks that acknowledged ``R`` read their round key again.

Only live processes of this start acknowledge, so the ranks that receive ``go`` all
hold one round, and keys under ``<base>/<R>`` are never an earlier round's. When every
rank is live it costs rank 0 four store round trips and every other rank five (two
GETs, each a WAIT and then a read, and an ADD), whatever the world size.
"""
import time
import uuid
from datetime import timedelta

from . import _C

_LOOK_S = 1.0    # rank 0 looks for restarted ranks this often (one request per rank)


def agree(store, base, rank, world_size, timeout_s):
    """The round name every rank of this start agrees on (see the module's docstring).
    Collective over world_size ranks through store; raises DistTimeoutError naming the
    ranks that did not take part within timeout_s, and the store's own errors
    (DistNetworkError when it goes away) unchanged."""
    nonce = uuid.uuid4().hex
    deadline = time.monotonic() + timeout_s
    store.set(f"{base}/hello/{rank}", nonce)
    if world_size == 1:
        return nonce[:16]
    if rank == 0:
        return _lead(store, base, nonce, world_size, deadline, timeout_s)
    key = f"{base}/round/{nonce}"
    while True:
        name = _get(store, key, deadline, timeout_s, f"rank 0's round for rank {rank}").decode()
        store.set(f"{base}/ack/{name}/{rank}", "1")
        if store.add(f"{base}/acks/{name}", 1) == world_size - 1:
            store.set(f"{base}/acked/{name}", "1")    # the last to acknowledge wakes rank 0
        if _get(store, f"{base}/go/{name}", deadline, timeout_s, "rank 0's go") == b"go":
            return name
        # void: rank 0 wrote this rank's new round before voiding the old one


def _lead(store, base, nonce, world_size, deadline, timeout_s):
    """Rank 0's part: name rounds until every rank acknowledges one (see above). Its
    store requests do not grow with the world: the hellos are waited for in one request
    and read in one, every rank's round is written in one, and the acknowledgements are
    counted in one key whose last adder sets ``acked/<R>``, which rank 0 waits for; the
    per-rank keys are read only to name the missing at a timeout, and to look for
    restarted ranks about once a second while it waits."""
    hello = [f"{base}/hello/{r}" for r in range(world_size)]
    try:
        store.wait(hello[1:], timeout=timedelta(seconds=max(deadline - time.monotonic(),
                                                            0.001)))
    except _C.DistTimeoutError:
        late = [r for r in range(1, world_size) if not store.check([hello[r]])]
        raise _C.DistTimeoutError(
            f"waited {timeout_s:.0f} s for ranks {late} to start in the rendezvous round; "
            f"check that every node was started for this job") from None
    nonces = [nonce] + [v.decode() for v in _read_all(store, hello[1:])]
    attempt, old = 0, None
    while True:
        name = f"{nonce[:16]}.{attempt}"
        _write_all(store, [f"{base}/round/{nonces[r]}" for r in range(1, world_size)], name)
        if old is not None:
            store.set(f"{base}/go/{old}", "void")
        acked, changed = f"{base}/acked/{name}", []
        while True:
            try:
                store.wait([acked], timeout=timedelta(seconds=max(
                    min(_LOOK_S, deadline - time.monotonic()), 0.001)))
                break
            except _C.DistTimeoutError:
                pass
            missing = [r for r in range(1, world_size)
                       if not store.check([f"{base}/ack/{name}/{r}"])]
            now_n = dict(zip(missing, _read_all(store, [hello[r] for r in missing])))
            changed = [r for r in missing if now_n[r].decode() != nonces[r]]
            if changed:
                break
            if missing and time.monotonic() >= deadline:
                raise _C.DistTimeoutError(
                    f"rank 0: ranks {missing} did not join this start's rendezvous "
                    f"round within {timeout_s:.0f} s (their last announced process "
                    f"never answered). Check that every node was started for this job.")
        if not changed:
            store.set(f"{base}/go/{name}", "go")
            return name
        for r in changed:
            nonces[r] = store.get(hello[r]).decode()
        attempt, old = attempt + 1, name


def _read_all(store, keys):
    """The values of keys that exist: one request on pyddp's store; one per key on a
    store without multi_get (torch's under the torch backend)."""
    if not keys:
        return []
    multi = getattr(store, "multi_get", None)
    return multi(keys) if multi is not None else [store.get(k) for k in keys]


def _write_all(store, keys, value):
    """Set every key to value: one request on a store with multi_set (pyddp's, and
    torch's own), one per key otherwise."""
    multi = getattr(store, "multi_set", None)
    if multi is not None:
        multi(keys, [value] * len(keys))
    else:
        for k in keys:
            store.set(k, value)


def _get(store, key, deadline, timeout_s, what):
    """key's value, waiting for it until deadline (a clear DistTimeoutError after it):
    one GET with the store's timeout set to what is left, then restored."""
    old = store.timeout
    store.set_timeout(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    try:
        return store.get(key)
    except _C.DistTimeoutError:
        raise _C.DistTimeoutError(
            f"waited {timeout_s:.0f} s for {what} in the rendezvous round; check that "
            f"every node was started for this job") from None
    finally:
        store.set_timeout(old)
