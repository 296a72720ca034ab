"""Tests for pyddp.sampler.DistributedSampler against torch's own DistributedSampler.

The module is loaded straight from its file, so these tests need neither the C
extension nor an initialized process group. The reference is
torch.utils.data.DistributedSampler (full index lists, len, num_samples, total_size)
and, for the NumPy fallback, numpy.random.default_rng itself.
"""

import importlib.util
import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SAMPLER_PATH = ROOT / "pyddp" / "sampler.py"


def _load_sampler_module():
    """Import pyddp/sampler.py in isolation (no pyddp package, no extension)."""
    spec = importlib.util.spec_from_file_location("_pyddp_sampler_under_test", SAMPLER_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sampler_mod = _load_sampler_module()
DistributedSampler = sampler_mod.DistributedSampler

try:
    import torch
    from torch.utils.data import DataLoader
    from torch.utils.data import DistributedSampler as TorchSampler
except ImportError:  # the fallback tests still run
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

LENGTHS = list(range(41)) + [97, 1000, 4099]
SEEDS = [0, 7, -3]
EPOCHS = range(4)


def _all_ranks(cls, n, replicas, **kw):
    """Return (per-rank index lists, per-rank samplers) for a dataset of length n."""
    epoch = kw.pop("epoch", 0)
    samplers = [cls(range(n), num_replicas=replicas, rank=r, **kw) for r in range(replicas)]
    for s in samplers:
        s.set_epoch(epoch)
    return [list(s) for s in samplers], samplers


def _interleave(per_rank):
    """Rebuild the global padded/truncated index list from the ranks' strided slices."""
    return [per_rank[r][i] for i in range(len(per_rank[0])) for r in range(len(per_rank))]


@needs_torch
@pytest.mark.parametrize("replicas", range(1, 8))
def test_matches_torch_over_grid(replicas):
    for n in LENGTHS:
        for drop_last in (False, True):
            configs = [dict(shuffle=False, seed=0, epoch=0)]
            configs += [dict(shuffle=True, seed=s, epoch=e) for s in SEEDS for e in EPOCHS]
            for cfg in configs:
                ours, our_samplers = _all_ranks(DistributedSampler, n, replicas,
                                                drop_last=drop_last, **cfg)
                ref, ref_samplers = _all_ranks(TorchSampler, n, replicas,
                                               drop_last=drop_last, **cfg)
                where = f"n={n} replicas={replicas} drop_last={drop_last} {cfg}"
                assert ours == ref, where
                for a, b in zip(our_samplers, ref_samplers):
                    assert (len(a), a.num_samples, a.total_size) == \
                        (len(b), b.num_samples, b.total_size), where
                    assert len(a) == len(list(a)), where


@needs_torch
@pytest.mark.parametrize("shuffle", [False, True])
def test_partition_and_padding_structure(shuffle):
    for n in range(1, 41):
        for replicas in range(1, 8):
            per_rank, samplers = _all_ranks(DistributedSampler, n, replicas,
                                            shuffle=shuffle, seed=5, epoch=2)
            total = samplers[0].total_size
            assert total == -(-n // replicas) * replicas
            glob = _interleave(per_rank)
            assert len(glob) == total
            # The first n form the (shuffled) dataset; the rest repeat it from the start.
            assert sorted(glob[:n]) == list(range(n))
            assert all(glob[i] == glob[i % n] for i in range(n, total))
            if total == n:
                flat = [i for share in per_rank for i in share]
                assert sorted(flat) == list(range(n)), "ranks overlap or miss indices"
            if shuffle:
                g = torch.Generator()
                g.manual_seed(5 + 2)
                assert glob[:n] == torch.randperm(n, generator=g).tolist()


def test_small_dataset_wraps_several_times():
    per_rank, samplers = _all_ranks(DistributedSampler, 2, 7, shuffle=False)
    assert [s.total_size for s in samplers] == [7] * 7
    assert per_rank == [[0], [1], [0], [1], [0], [1], [0]]


def test_drop_last_truncates_to_multiple():
    for n in range(0, 41):
        for replicas in range(1, 8):
            per_rank, samplers = _all_ranks(DistributedSampler, n, replicas,
                                            shuffle=True, drop_last=True, seed=1)
            total = (n // replicas) * replicas
            assert samplers[0].total_size == total
            assert all(len(share) == total // replicas for share in per_rank)
            flat = [i for share in per_rank for i in share]
            assert len(set(flat)) == len(flat) == total
            assert set(flat) <= set(range(n))


def test_indices_are_python_ints():
    for shuffle in (False, True):
        s = DistributedSampler(range(10), num_replicas=3, rank=1, shuffle=shuffle)
        assert all(type(i) is int for i in s)


def test_set_epoch_changes_order_and_is_deterministic():
    s = DistributedSampler(range(50), num_replicas=2, rank=0, seed=3)
    first = list(s)
    assert list(s) == first
    s.set_epoch(1)
    assert s.epoch == 1
    second = list(s)
    assert second != first and len(second) == len(first)
    s.set_epoch(0)
    assert list(s) == first


def test_numpy_fallback_without_torch(monkeypatch):
    # A None entry in sys.modules makes `import torch` raise ImportError.
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError):
        import torch as _  # noqa: F401
    for n in (0, 1, 9, 40, 101):
        for replicas in (1, 3, 4, 7):
            for seed, epoch in ((0, 0), (11, 3), (-5, 1)):
                per_rank, samplers = _all_ranks(DistributedSampler, n, replicas,
                                                seed=seed, epoch=epoch)
                glob = _interleave(per_rank)
                expected = np.random.default_rng((seed + epoch) % 2**64).permutation(n)
                assert glob[:n] == expected.tolist()
                assert all(glob[i] == glob[i % n] for i in range(n, len(glob)))
                if samplers[0].total_size == n:
                    flat = sorted(i for share in per_rank for i in share)
                    assert flat == list(range(n))
                # drop_last: disjoint shares, no padding
                per_rank, _ = _all_ranks(DistributedSampler, n, replicas, seed=seed,
                                         epoch=epoch, drop_last=True)
                flat = [i for share in per_rank for i in share]
                assert len(set(flat)) == len(flat) == (n // replicas) * replicas


@needs_torch
def test_works_as_dataloader_sampler():
    data = torch.arange(23, dtype=torch.float32) * 10
    dataset = torch.utils.data.TensorDataset(data)
    seen = []
    for rank in range(4):
        ours = DistributedSampler(dataset, num_replicas=4, rank=rank, seed=9)
        ref = TorchSampler(dataset, num_replicas=4, rank=rank, seed=9)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            ref.set_epoch(epoch)
            got = [b[0] for b in DataLoader(dataset, batch_size=4, sampler=ours)]
            want = [b[0] for b in DataLoader(dataset, batch_size=4, sampler=ref)]
            assert len(got) == len(want) == 2  # 6 samples per rank -> batches of 4, 2
            for g, w in zip(got, want):
                assert torch.equal(g, w)
            if epoch == 0:
                seen += torch.cat(got).tolist()
    # 23 samples padded to 24: every sample seen, exactly one repeated.
    assert sorted(set(seen)) == [10.0 * i for i in range(23)]
    assert len(seen) == 24


@pytest.mark.parametrize("rank", [-1, 4, 5])
def test_rank_out_of_range_raises(rank):
    with pytest.raises(ValueError, match=r"Invalid rank .*\[0, 3\]"):
        DistributedSampler(range(10), num_replicas=4, rank=rank)


def test_bad_num_replicas_and_types():
    with pytest.raises(ValueError, match="num_replicas"):
        DistributedSampler(range(10), num_replicas=0, rank=0)
    with pytest.raises(TypeError, match="rank must be an integer"):
        DistributedSampler(range(10), num_replicas=2, rank=0.5)
    s = DistributedSampler(range(10), num_replicas=np.int64(2), rank=np.int32(1))
    assert (s.num_replicas, s.rank) == (2, 1) and type(s.num_replicas) is int


@needs_torch
@pytest.mark.parametrize("drop_last,new_len", [(False, 14), (True, 7)])
def test_resized_dataset_raises_like_torch(drop_last, new_len):
    # Growing (no drop_last) or shrinking (drop_last) the dataset after construction
    # leaves the index list the wrong length; torch and pyddp both refuse it.
    data = list(range(10))
    ours = DistributedSampler(data, num_replicas=3, rank=0, drop_last=drop_last)
    ref = TorchSampler(data, num_replicas=3, rank=0, drop_last=drop_last)
    data[:] = range(new_len)
    for s in (ours, ref):
        with pytest.raises(AssertionError, match="total_size"):
            list(s)


def test_emptied_dataset_raises_clearly():
    data = list(range(10))
    s = DistributedSampler(data, num_replicas=3, rank=0)
    data.clear()
    with pytest.raises(AssertionError, match="resized"):
        list(s)


def _fake_pyddp(initialized, world=3, rank=2):
    """A stand-in pyddp package whose _group module answers the sampler's questions."""
    mod = types.ModuleType("pyddp")
    mod._group = types.ModuleType("pyddp._group")
    mod._group.is_initialized = lambda: initialized
    mod._group.get_world_size = lambda: world
    mod._group.get_rank = lambda: rank
    return mod


def test_defaults_come_from_process_group(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyddp", _fake_pyddp(True, world=3, rank=2))
    s = DistributedSampler(range(10), shuffle=False)
    assert (s.num_replicas, s.rank) == (3, 2)
    assert list(s) == [2, 5, 8, 1]
    s = DistributedSampler(range(10), rank=0, shuffle=False)
    assert (s.num_replicas, s.rank) == (3, 0)


def test_defaults_without_process_group_raise(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyddp", _fake_pyddp(False))
    with pytest.raises(RuntimeError, match="init_process_group.*num_replicas and rank"):
        DistributedSampler(range(10))
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedSampler(range(10), num_replicas=2)
    # Both given: the process group is never consulted.
    assert len(DistributedSampler(range(10), num_replicas=2, rank=1)) == 5


def test_import_does_not_import_torch():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('s', {str(SAMPLER_PATH)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "s = m.DistributedSampler(range(5), num_replicas=2, rank=0, shuffle=False)\n"
        "assert list(s) == [0, 2, 4]\n"
        "assert 'torch' not in sys.modules, 'importing the sampler imported torch'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
