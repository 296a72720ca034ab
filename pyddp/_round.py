"""The rendezvous round: one key prefix that every rank of one start of a world agrees
on, whatever each node's restart count and whatever earlier rounds left in the store.

Under torchrun's elastic agents a round is no number any worker can read: each node
counts its own restarts (a node restarted because another joined counts none), and the
agent's store keeps every earlier round's keys. So on a store that outlives the workers
the ranks agree on a round in the rendezvous itself: ``_world.make_group(...,
agree_round=True)`` makes the C core's ``ProcessGroup`` with the start's base
(``/pyddp/<run id>/<generation>``, or ``/pyddp/<run id>/torch/<name>``), and the core
(csrc/core/ddp_comm_round.c) runs, in the requests that publish every rank's address:

1. every rank but 0 writes its rendezvous line with a fresh nonce to ``<base>/hello/<r>``;
2. rank 0 reads every hello in one request, checks versions and settings, names the round
   ``R`` after its own nonce and an attempt number, and writes ``R`` with the member table
   (or the error every rank raises) to ``<base>/round/<nonce of r>`` for every rank in
   one request;
3. rank r reads ``<base>/round/<its nonce>``, writes ``<base>/ack/<R>/<r>`` and reads
   ``<base>/go/<R>``;
4. rank 0 waits for every ack in one request and sets ``go/<R>`` to ``go``. A hello read
   in step 2 may be a dead process's from an earlier round (its successor has not
   started yet): that rank never acknowledges, and when its ``hello`` key changes rank 0
   names a new round ``R'`` for the lines it now sees, writes every rank's round key
   again, then sets ``go/<R>`` to ``void`` so that the ranks that acknowledged ``R``
   read theirs again.

Only live processes of this start acknowledge, so the ranks that receive ``go`` hold one
round and one table, and keys under ``<base>/<R>`` (the group's prefix,
``ProcessGroup.prefix``) are never an earlier round's. When every rank is live it costs
every rank but 0 six store requests (SET, a GET: WAIT and GET, SET, a GET) and rank 0
five (a MULTI_GET: WAIT and MULTI_GET, MULTI_SET, WAIT, SET), whatever the world size,
the member table included: before the agreement moved into the core it cost each rank
seven requests in Python, ahead of the rendezvous's three. A store that rank 0 of this
start hosts holds only this start's keys; its round is ``0``, with no agreement
(``_world._agree_round``).
"""
