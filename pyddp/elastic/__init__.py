"""pyddp.elastic: in-place elastic training. A lost rank or host never ends the job and
a returning node is admitted, without restarting the processes that go on.

Shaped after Horovod Elastic::

    from pyddp import elastic
    state = elastic.TorchState(model=model, optimizer=opt, epoch=0)   # + user counters
    state.register_reset_callbacks([remake_sampler])

    @elastic.run                  # re-enters train(state) after a membership change
    def train(state):
        while state.epoch < EPOCHS:
            ...                   # DDP steps as usual
            state.epoch += 1
            state.commit()        # a point every rank can roll back to
    train(state)

The package: ``_state`` (the State kinds), ``_sampler`` (ElasticSampler: the data
position in the state), ``_rng`` (per-rank random streams), ``_run`` (run, the graceful
leave), ``_membership`` (who is in the job, agreed through its store), ``_joiners``
(admission), ``_live`` (the live record), ``_liveness`` (paused or dead), ``_persist``
(commits on each node's disk), ``_plug`` (its hooks in the world: a returning process
joins at init), ``_handler`` (torchrun's ``--rdzv-backend=pyddp``: the job's store on
etcd or with the endpoint, returning nodes admitted in place), ``_agents`` (torchrun's
exit barrier), ``_torchworld`` (torch's default group as the job's world).

On a change (a collective failed because a peer died or vanished, a node asks to
join at a commit, ranks leave on SIGTERM) every rank's watcher thread aborts the collective in flight, the live
ranks agree on the new membership through the store (``_membership``), the
default group is made again with dense ranks (pyddp's DDP on it follows; groups made
from the old one raise), each rank rolls back to its last commit, the state of the
rank with the newest commit is broadcast to all (so a joiner gets the model and the
optimizer from a live rank, and every rank holds identical state), the reset callbacks
run, and ``train(state)`` is called again, in the same processes.

``commit()``, ``sync()`` and the function under ``run`` are collective: every rank calls
them at the same points.

The package (elastic) may import the core, DDP's ``_common`` (to move DDPs to a new
world) and the torch integration (torch's default group made again); nothing outside
it imports it: it plugs into the world through ``_world.WorldHooks`` (``_plug``) when
imported, so a script imports it before ``init_process_group``.
"""
from . import _membership, _plug
from ._run import joined, run
from ._sampler import ElasticSampler
from ._state import NumPyState, ObjectState, State, TorchState

__all__ = ["State", "ObjectState", "TorchState", "NumPyState", "ElasticSampler", "run",
           "joined", "StoreLost", "LeftOut"]

StoreLost = _membership.StoreLost
LeftOut = _membership.LeftOut

_plug.install()     # a process of a running in-place job joins it at init
