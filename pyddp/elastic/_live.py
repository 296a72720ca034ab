"""The live record of an in-place elastic job: what a process that finds a store needs
to know about the job running there, before it asks to join.

``/pyddp/elastic/live`` (one per store) holds the job's key space (``base``), its
membership epoch, pyddp's version, a nonce and an HMAC of the nonce under the job's
PYDDP_AUTH_TOKEN, and ``done`` once the job finished. Rank 0's watcher raises
``<base>/beat`` twice a second (``_membership``): a record whose heartbeat stands still
belongs to a job that is gone. A joiner checks the version and the token itself
(``check_joiner``), so a misconfigured process is refused on its own side and never
disturbs the job.
"""
import hashlib
import hmac
import json
import logging
import time
import uuid

from .. import _C
from .._version import __version__

log = logging.getLogger("pyddp")

LIVE_KEY = "/pyddp/elastic/live"


def get_optional(st, key, timeout_s):
    """A key another process writes right after it took its ticket, or None when it
    does not appear within timeout_s (that process died in between): a hole, skipped."""
    from datetime import timedelta
    try:
        st.wait([key], timeout=timedelta(seconds=timeout_s))
    except _C.DistTimeoutError:
        return None
    return st.get(key)


def publish(store, base):
    """Rank 0 of a job's first ranks: the live record of epoch 0."""
    nonce = uuid.uuid4().hex
    store.set(LIVE_KEY, json.dumps({"base": base, "epoch": 0, "version": __version__,
                                    "nonce": nonce, "proof": _proof(nonce)}))


def update_live(st, **fields):
    """Rewrite the live record with fields changed (its version and proof kept)."""
    rec = json.loads(st.get(LIVE_KEY))
    rec.update(fields)
    st.set(LIVE_KEY, json.dumps(rec))


def _token():
    """This process's PYDDP_AUTH_TOKEN (or its file's content), or b"" without one."""
    tok = _C.setting_text("PYDDP_AUTH_TOKEN")
    if not tok:
        path = _C.setting_text("PYDDP_AUTH_TOKEN_FILE")
        if path:
            try:
                with open(path, "rb") as f:
                    return f.read().rstrip(b"\r\n")
            except OSError:
                return b""
        return b""
    return tok.encode()


def _proof(nonce):
    """HMAC of the job's nonce under this process's token: equal proofs, equal tokens."""
    return hmac.new(_token(), b"pyddp-elastic-live:" + nonce.encode(),
                    hashlib.sha256).hexdigest()


def live_job(store):
    """The live record of the in-place job running on store, or None (none ever ran
    there, or the one that did has finished)."""
    if not store.check([LIVE_KEY]):
        return None
    rec = json.loads(store.get(LIVE_KEY))
    return None if rec.get("done") else rec


def job_alive(store, rec):
    """Whether the job of live record rec still runs. On etcd its ranks hold leases
    (``E/alive/<id>``, each expiring within a few seconds of its process); on a TCP store
    its rank 0 raises E/beat twice a second (a change in progress pauses it for up to
    PYDDP_ELASTIC_SETTLE_S and a rebuild). A job that is gone (all its ranks died, the
    store lived on) is marked done, so that the processes started now make a new job."""
    deadline = time.monotonic() + max(5.0, 2 * float(_C.setting("PYDDP_ELASTIC_SETTLE_S")) + 3)
    if store.recoverable:
        while True:      # a job's first ranks take their leases just after publishing
            if store.keys_under(f"{rec['base']}/alive/"):
                return True
            if time.monotonic() >= deadline:
                break
            time.sleep(0.5)
    else:
        beat = f"{rec['base']}/beat"
        first = store.add(beat, 0)
        while time.monotonic() < deadline:
            time.sleep(0.1)
            if store.add(beat, 0) != first:
                return True
    raw = store.get(LIVE_KEY)
    store.compare_set(LIVE_KEY, raw, json.dumps(dict(json.loads(raw), done=True,
                                                     gone=True)))
    log.warning("pyddp: elastic: the in-place job recorded at %s no longer runs (no "
                "heartbeat); starting a new one", store.where)
    return False


def check_joiner(store, rec):
    """Refuse, before it asks, a process that cannot be part of the job of live record
    rec: another pyddp version, or another PYDDP_AUTH_TOKEN."""
    where = store.where
    if rec.get("version") != __version__:
        raise _C.VersionMismatchError(
            f"the in-place elastic job at {where} runs pyddp {rec.get('version')}, this "
            f"process pyddp {__version__}: install the same pyddp on every node")
    if "proof" in rec and not hmac.compare_digest(rec["proof"], _proof(rec["nonce"])):
        raise _C.AuthenticationError(
            f"the in-place elastic job at {where} was started with another "
            f"PYDDP_AUTH_TOKEN than this process's (or with none, or this one has none): "
            f"set the same token on every node")


