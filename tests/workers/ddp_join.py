"""Worker for tests/test_ddp_join.py, run under torchrun: uneven inputs under Join.
Rank r trains 4 + 3r steps. Each configuration trains the same model, data and
optimizer with torch's own DistributedDataParallel over gloo under torch's Join (the
reference) and with pyddp's DDP under a join context, from the same rank-dependent
initial weights, and checks:

* every rank's per-step losses agree with the reference's (relative 1e-5);
* after the join every rank holds the same weights, equal to the reference's (relative
  1e-5), buffers included;

for ``model.join()`` (pyddp's Join, on pyddp's group), torch's ``Join([model])`` (its
all-reduces on torch's gloo group; divided by the ranks still training, which DDP reads
from torch's notify), ``divide_by_initial_world_size=False``, ``no_sync``
accumulation, ``find_unused_parameters``, BatchNorm buffers, ``gradient_as_bucket_view``,
the generic data path, ``static_graph``, ``Join([model, ZeroRedundancyOptimizer])`` and
torch's own DDP over the "pyddp" backend (its parameters against gloo's); ``disabled``
that ``enable=False`` does nothing. ``throw`` checks that with
``throw_on_early_termination=True`` every rank raises once rank 0 runs out (as torch's
does, same messages), and that the group works afterwards; ``errors`` that bad uses
fail before any communication. With ``--pyddp-only`` no torch.distributed group is
made: ``model.join()`` against the training computed alone. Prints "PASS <config>
rank=<r> ..." per configuration and rank; exits non-zero on the first failure.
Usage: torchrun ... ddp_join.py [config ... | --pyddp-only]
"""
import copy
import sys
from datetime import timedelta

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.distributed.optim import ZeroRedundancyOptimizer

import pyddp
from ddp_parity import RTOL, Net, _always, batch, rel_diff, states_agree, train_step


def _sometimes(step, rank):
    return (step + rank) % 3 != 1


# name -> (model kwargs, DDP kwargs, join kwargs, micro-batches per step, branch rule,
#          how ours joins: "model" (model.join()), "torch" (torch's Join), "zero")
CONFIGS = {
    "plain": ({}, {}, {}, 1, _always, "model"),
    "torch_join": ({}, {}, {"divide_by_initial_world_size": False}, 1, _always, "torch"),
    "divide_false": ({}, {}, {"divide_by_initial_world_size": False}, 1, _always, "model"),
    "no_sync": ({}, {}, {}, 2, _always, "model"),
    "unused": ({}, {"find_unused_parameters": True}, {"divide_by_initial_world_size": False},
               1, _sometimes, "model"),
    "buffers": ({"bn": True}, {}, {}, 1, _always, "model"),
    "view": ({}, {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.002}, {}, 1, _always,
             "model"),
    "generic": ({}, {"bucket_cap_mb": 0.002, "pyddp": {"_generic_path": True}},
                {"divide_by_initial_world_size": False}, 1, _always, "model"),
    "zero": ({}, {}, {}, 1, _always, "zero"),
    "static": ({}, {"static_graph": True}, {}, 1, _always, "model"),
}


def steps_of(rank):
    return 4 + 3 * rank


def train(ddp, model, accum, use_branch, rank, context, opt):
    """rank's steps under context (made from the optimizer: the ZeRO case joins both)."""
    losses = []
    with context(opt):
        for step in range(steps_of(rank)):
            train_step(ddp, opt, step, accum, use_branch, rank, losses)
    return losses


def optimizer(model, zero):
    if zero:
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                       lr=0.05, momentum=0.9)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def same_everywhere(model, what):
    flat = torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()])
    everyone = [None] * pyddp.get_world_size()
    pyddp.all_gather_object(everyone, flat)
    for r, other in enumerate(everyone):
        assert torch.equal(other, everyone[0]), \
            f"{what}: rank {r}'s state differs from rank 0's"


def compare(name, rank, ref_model, our_model, ref_losses, our_losses):
    worst = rel_diff(torch.tensor(our_losses), torch.tensor(ref_losses))
    assert len(our_losses) == len(ref_losses) and worst <= RTOL, \
        f"{name}: losses differ from torch's: {our_losses} vs {ref_losses}"
    worst = max(worst, states_agree(name, ref_model, our_model))
    same_everywhere(our_model, name)
    return worst


def run_parity(name, rank, pyddp_group):
    model_kw, ddp_kw, join_kw, accum, use_branch, how = CONFIGS[name]
    ddp_kw = dict(ddp_kw)
    pyddp_only = ddp_kw.pop("pyddp", {})
    torch.manual_seed(1234 + rank)             # ranks start different: DDP broadcasts
    base = Net(**model_kw)
    ref_model, our_model = copy.deepcopy(base), copy.deepcopy(base)
    ref = nn.parallel.DistributedDataParallel(ref_model, **ddp_kw)
    ours = pyddp.DistributedDataParallel(our_model, **ddp_kw, **pyddp_only)
    ref_losses = train(ref, ref_model, accum, use_branch, rank,
                       lambda opt: TorchJoin([ref] + ([opt] if how == "zero" else []),
                                             **join_kw),
                       optimizer(ref_model, how == "zero"))
    if how == "model":
        def ours_join(opt):
            return ours.join(**join_kw)
    elif how == "torch":
        def ours_join(opt):
            return TorchJoin([ours], **join_kw)
    else:
        def ours_join(opt):
            return pyddp.Join([ours, opt], **join_kw)
    our_losses = train(ours, our_model, accum, use_branch, rank, ours_join,
                       optimizer(our_model, how == "zero"))
    worst = compare(name, rank, ref_model, our_model, ref_losses, our_losses)
    assert ours._join_config.enable == (how != "model"), "pyddp.Join resets the config"
    print(f"PASS {name} rank={rank} steps={steps_of(rank)} max_rel_diff={worst:.3g}",
          flush=True)


def run_torch_over_pyddp(rank, pyddp_group):
    """torch's own DDP on a "pyddp" torch group, under torch's Join (whose all-reduces
    then run on that group too), against torch's DDP over gloo."""
    torch.manual_seed(99 + rank)
    base = Net(bn=True)
    ref_model, our_model = copy.deepcopy(base), copy.deepcopy(base)
    ref = nn.parallel.DistributedDataParallel(ref_model)
    ours = nn.parallel.DistributedDataParallel(our_model, process_group=pyddp_group)
    ref_losses = train(ref, ref_model, 1, _always, rank, lambda opt: TorchJoin([ref]),
                       optimizer(ref_model, False))
    our_losses = train(ours, our_model, 1, _always, rank, lambda opt: TorchJoin([ours]),
                       optimizer(our_model, False))
    worst = compare("torch_over_pyddp", rank, ref_model, our_model, ref_losses, our_losses)
    print(f"PASS torch_over_pyddp rank={rank} max_rel_diff={worst:.3g}", flush=True)


def run_disabled(rank):
    """enable=False (inputs even): the context does nothing, on either side, and the
    result is torch's."""
    torch.manual_seed(11 + rank)
    base = Net()
    ref_model, our_model = copy.deepcopy(base), copy.deepcopy(base)
    ref = nn.parallel.DistributedDataParallel(ref_model)
    ours = pyddp.DistributedDataParallel(our_model)
    results = []
    for ddp, model in ((ref, ref_model), (ours, our_model)):
        opt, losses = optimizer(model, False), []
        with ddp.join(enable=False):
            assert not ddp._join_config.enable
            for step in range(3):
                train_step(ddp, opt, step, 1, _always, rank, losses)
        results.append(losses)
    worst = compare("disabled", rank, ref_model, our_model, results[0], results[1])
    print(f"PASS disabled rank={rank} max_rel_diff={worst:.3g}", flush=True)


def _raised(fn):
    try:
        fn()
    except RuntimeError as e:
        return type(e), str(e)
    return None, None


def run_throw(rank):
    """throw_on_early_termination=True: rank 0 runs out first; every rank raises, with
    the messages torch's DDP gives (pyddp's with its DistError, a RuntimeError), and the
    groups work afterwards."""
    torch.manual_seed(7 + rank)
    base = Net()
    ref_model, our_model = copy.deepcopy(base), copy.deepcopy(base)
    ref = nn.parallel.DistributedDataParallel(ref_model)
    ours = pyddp.DistributedDataParallel(our_model)
    ref_cls, ref_msg = _raised(lambda: train(
        ref, ref_model, 1, _always, rank,
        lambda opt: ref.join(throw_on_early_termination=True), optimizer(ref_model, False)))
    results = {}
    for how, context in (("model", lambda opt: ours.join(throw_on_early_termination=True)),
                         ("torch", lambda opt: TorchJoin([ours],
                                                         throw_on_early_termination=True))):
        cls, msg = _raised(lambda: train(ours, our_model, 1, _always, rank, context,
                                         optimizer(our_model, False)))
        assert cls is not None, f"throw ({how}): rank {rank} did not raise"
        assert msg == ref_msg, f"throw ({how}): rank {rank} raised {msg!r}, torch {ref_msg!r}"
        results[how] = cls.__name__
    # pyddp's Join raises pyddp's DistError (a RuntimeError); torch's Join its own
    assert ref_cls is RuntimeError, ref_cls
    assert results == {"model": "DistError", "torch": "RuntimeError"}, results
    expect = "exhausted all inputs" if rank == 0 else "Detected at least one rank"
    assert expect in ref_msg, ref_msg
    t = torch.ones(3)
    pyddp.all_reduce(t)
    assert t.tolist() == [pyddp.get_world_size()] * 3
    # the model trains on, without a join, after the error
    x, y = batch(0, 0, rank)
    F.cross_entropy(ours(x), y).backward()
    print(f"PASS throw rank={rank} classes={results} msg={ref_msg!r}", flush=True)


def run_errors(rank):
    """Bad uses fail at once, on this rank alone, before anything is sent."""
    torch.manual_seed(3)
    ours = pyddp.DistributedDataParallel(Net())
    for bad, needle in ((lambda: pyddp.Join([]), "at least one joinable"),
                        (lambda: pyddp.Join([ours, pyddp.DistributedDataParallel(
                            Net(), process_group=pyddp.new_group())]), "same process group")):
        try:
            bad()
        except pyddp.DistValueError as e:
            assert needle in str(e), str(e)
        else:
            raise AssertionError(f"errors: {needle!r} was not raised")
    sub = pyddp.new_group([0, 1])
    if rank in (0, 1) and pyddp.get_world_size() > 2:
        on_sub = pyddp.DistributedDataParallel(Net(), process_group=sub)
        try:
            TorchJoin([on_sub])
        except pyddp.DistValueError as e:
            assert "model.join()" in str(e), str(e)
        else:
            raise AssertionError("torch's Join over a subgroup DDP was accepted")
    pyddp.barrier()
    print(f"PASS errors rank={rank}", flush=True)


def run_no_torch_group(rank):
    """No torch.distributed group at all: model.join() runs on pyddp's group alone, and
    the weights equal the training computed alone from rank 0's initial weights (at each
    step the gradients of the ranks still training, divided by the world size); torch's
    Join, which needs torch's default group, says to use model.join()."""
    world = pyddp.get_world_size()
    torch.manual_seed(1234 + rank)
    our_model = Net()
    ours = pyddp.DistributedDataParallel(our_model)
    torch.manual_seed(1234)
    ref_model = Net()
    ref_opt = optimizer(ref_model, False)
    for step in range(steps_of(world - 1)):
        ref_opt.zero_grad()
        for r in range(world):
            if steps_of(r) > step:
                x, y = batch(step, 0, r)
                (F.cross_entropy(ref_model(x), y) / world).backward()
        ref_opt.step()
    train(ours, our_model, 1, _always, rank, lambda opt: ours.join(),
          optimizer(our_model, False))
    worst = states_agree("no_torch_group", ref_model, our_model)
    same_everywhere(our_model, "no_torch_group")
    try:
        TorchJoin([ours])
    except pyddp.DistValueError as e:
        assert "model.join()" in str(e) and "not initialized" in str(e), str(e)
    else:
        raise AssertionError("torch's Join without torch's group was accepted")
    print(f"PASS no_torch_group rank={rank} max_rel_diff={worst:.3g}", flush=True)


def main():
    if sys.argv[1:] == ["--pyddp-only"]:
        pyddp.init_process_group("cpu", timeout=timedelta(seconds=60))
        run_no_torch_group(pyddp.get_rank())
        assert not tdist.is_initialized()
        pyddp.destroy_process_group()
        return
    names = sys.argv[1:] or list(CONFIGS) + ["torch_over_pyddp", "disabled", "throw",
                                             "errors"]
    tdist.init_process_group("gloo")
    pyddp.init_process_group("cpu", timeout=timedelta(seconds=60))
    pyddp_group = tdist.new_group(backend="pyddp")
    rank = pyddp.get_rank()
    assert rank == tdist.get_rank()
    for name in names:
        if name == "torch_over_pyddp":
            run_torch_over_pyddp(rank, pyddp_group)
        elif name == "disabled":
            run_disabled(rank)
        elif name == "throw":
            run_throw(rank)
        elif name == "errors":
            run_errors(rank)
        else:
            run_parity(name, rank, pyddp_group)
    pyddp.destroy_process_group()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
