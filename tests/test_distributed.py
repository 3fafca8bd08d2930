r"""Several processes: sharded cluster batches, partitioning once, QAT under DDP, sharded inference, failures.

The multi-process tests start 2 ranks of ``torch.distributed`` with the ``gloo`` backend on the CPU
(forked from this process, so they share its imports and the graph built here; each rank runs one
thread, as a DataLoader worker does), meeting through a file store in ``tmp_path``.  Each rank writes
what it saw with ``torch.save`` and the test compares the ranks' files here.  A rank that fails ends
the run with its error (``torch.multiprocessing`` terminates the others); a run that outlives its
timeout fails the test.  The ``cuda`` versions run the same workers with NCCL on 2 GPUs (spawned).
"""
import os
import pickle
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

import pyg_quant as pq
from pyg_quant import distributed as pqd
from pyg_quant import qat
from pyg_quant.demo import planted_class_graph
from pyg_quant.loader import QuantClusterData, QuantClusterLoader
from pyg_quant.loader import cluster_data as cluster_data_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 2
NCCL_OK = torch.cuda.is_available() and torch.cuda.device_count() >= 2 and dist.is_nccl_available()
requires_two_gpus = pytest.mark.skipif(not NCCL_OK, reason="needs 2 CUDA GPUs and NCCL")


# --- running ranks ----------------------------------------------------------------------------------
def _rank_entry(rank, fn, world, store, backend, args):
    torch.set_num_threads(1)  # each rank one thread (a forked OpenMP pool is not safe to use)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, tmp_path, *args, world=WORLD, backend="gloo", timeout=60.0):
    """Runs ``fn(rank, *args)`` on ``world`` ranks; raises the first rank's error; fails the test after ``timeout``."""
    store = tmp_path / f"store_{time.monotonic_ns()}"
    method = "spawn" if backend == "nccl" else "fork"  # CUDA cannot be forked
    context = mp.start_processes(_rank_entry, args=(fn, world, str(store), backend, args), nprocs=world,
                                 join=False, start_method=method)
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=0.2):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                pytest.fail(f"the ranks ran past {timeout} s (a hang?)")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
        # join reports the first rank it finds dead, which may be one whose collective broke because the failing
        # rank left: report every rank's error.
        messages = []
        for rank, path in enumerate(context.error_files):
            if os.access(path, os.R_OK) and os.path.getsize(path):
                with open(path, "rb") as file:
                    messages.append(f"rank {rank}: {pickle.load(file)}")
        raise RanksFailed("\n".join(messages) or str(error)) from error


class RanksFailed(RuntimeError):
    """Some rank raised (the message holds every rank's traceback)."""


def saved(tmp_path, name):
    return [torch.load(tmp_path / f"{name}_{rank}.pt", weights_only=False) for rank in range(WORLD)]


# --- data and model ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def graph():
    return planted_class_graph(num_nodes=480, num_features=16, num_classes=4, community=40, seed=3)


@pytest.fixture(scope="module")
def parts(graph):
    return QuantClusterData(graph, 10, log=False, across_ranks=False)


class GCN(torch.nn.Module):
    def __init__(self, in_channels, hidden, out_channels):
        super().__init__()
        self.convs = torch.nn.ModuleList([pq.QGCNConv(in_channels, hidden), pq.QGCNConv(hidden, out_channels)])

    def forward(self, x, adj):
        x = F.relu(self.convs[0](x, adj))
        return self.convs[1](x, adj)


def qat_model(init=0, **qconfig):
    torch.manual_seed(init)
    return qat.prepare(GCN(16, 16, 4), bits=4, skip_last=False, **qconfig)


DETERMINISTIC = dict(stochastic=False, weight_observer="dynamic", input_observer="dynamic", agg_observer="dynamic")


def train_step(model, optimizer, batch):
    """One step; a batch without training nodes still runs backward (zero loss), so every rank reduces."""
    optimizer.zero_grad()
    out = model(batch.x, batch.adj)
    mask = batch.train_mask
    loss = F.cross_entropy(out[mask], batch.y[mask]) if bool(mask.any()) else out.sum() * 0.0
    loss.backward()
    optimizer.step()
    return loss


# --- the loader's shares (no process group needed) ------------------------------------------------
def shares(parts, epoch, world=3, **kwargs):
    out = []
    for rank in range(world):
        loader = QuantClusterLoader(parts, batch_size=2, bits=4, num_replicas=world, rank=rank, **kwargs)
        loader.set_epoch(epoch)
        out.append([b.part.tolist() for b in loader])
    return out


def test_sharded_loader_shares_are_disjoint_complete_and_equal(parts):
    nonempty = parts.nonempty_parts()
    for epoch in (0, 1):
        batches = shares(parts, epoch, shuffle=True)
        assert len({len(b) for b in batches}) == 1  # every rank the same number of batches
        flat = [[p for batch in rank_batches for p in batch] for rank_batches in batches]
        assert sorted(set(sum(flat, []))) == nonempty  # every part, on some rank
        padded = len(nonempty) % 3 and 3 - len(nonempty) % 3
        assert sum(map(len, flat)) == len(nonempty) + padded  # padded by repeating parts, nothing else
        assert all(len(set(f)) == len(f) for f in flat)  # no part twice on one rank
    assert shares(parts, 0, shuffle=True) != shares(parts, 1, shuffle=True)  # set_epoch reshuffles
    assert shares(parts, 1, shuffle=True) == shares(parts, 1, shuffle=True)  # the same order for an epoch
    assert shares(parts, 0, shuffle=False) == shares(parts, 5, shuffle=False)
    # drop_last of a passed DistributedSampler drops the tail instead
    dropped = [[b.part.tolist() for b in QuantClusterLoader(
        parts, batch_size=1, bits=4, sampler=DistributedSampler(parts, 3, r, shuffle=False, drop_last=True))]
        for r in range(3)]
    assert [len(d) for d in dropped] == [len(parts.nonempty_parts()) // 3] * 3


def test_sharded_loader_follows_a_passed_distributed_sampler(parts):
    sampler = DistributedSampler(parts, num_replicas=2, rank=1, shuffle=True, seed=7)
    loader = QuantClusterLoader(parts, batch_size=1, bits=4, sampler=sampler)
    assert isinstance(loader.sampler, pqd.DistributedPartSampler) and loader.sampler.rank == 1
    first = [b.part.tolist() for b in loader]
    sampler.set_epoch(3)  # the user's sampler's epoch is followed
    assert [b.part.tolist() for b in loader] != first
    loader.set_epoch(0)
    assert [b.part.tolist() for b in loader] == first and sampler.epoch == 0


def test_sharded_loader_argument_errors(parts):
    with pytest.raises(ValueError, match="shard=True needs torch.distributed"):
        QuantClusterLoader(parts, bits=4, shard=True)
    with pytest.raises(ValueError, match="contradict shard=False"):
        QuantClusterLoader(parts, bits=4, shard=False, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="rank must be in"):
        QuantClusterLoader(parts, bits=4, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="cannot be sharded"):
        QuantClusterLoader(parts, bits=4, sampler=[0, 1], num_replicas=2, rank=0)
    with pytest.raises(TypeError, match="shard must be"):
        QuantClusterLoader(parts, bits=4, shard="yes")
    with pytest.raises(ValueError, match="epoch must be"):
        QuantClusterLoader(parts, bits=4).set_epoch(-1)


def test_lightning_keeps_the_sharded_loader_and_recreates_others(parts):
    """Lightning's DDP strategy replaces a loader's sampler only when it is not a DistributedSampler, by re-creating
    the loader from its saved __init__ arguments (made inside the *_dataloader hooks) or from its attributes."""
    pytest.importorskip("lightning")
    from lightning.fabric.utilities.data import _replace_dunder_methods, _update_dataloader
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSamplerWrapper

    sharded = QuantClusterLoader(parts, batch_size=2, bits=4, shuffle=True, num_replicas=2, rank=0)
    assert isinstance(sharded.sampler, DistributedSampler)  # what Lightning checks before injecting its own
    for wrapped in (True, False):
        covered = []
        for rank in range(2):
            if wrapped:
                with _replace_dunder_methods(torch.utils.data.DataLoader, "dataset"):
                    loader = QuantClusterLoader(parts, batch_size=2, bits=3, shuffle=True, shard=False)
            else:
                loader = QuantClusterLoader(parts, batch_size=2, bits=3, shuffle=True, shard=False)
            sampler = DistributedSamplerWrapper(loader.sampler, num_replicas=2, rank=rank, shuffle=True, seed=0)
            again = _update_dataloader(loader, sampler)
            assert type(again) is QuantClusterLoader and again.bits == 3
            assert isinstance(again.sampler, pqd.DistributedPartSampler) and again.sampler.rank == rank
            covered.append([p for b in again for p in b.part.tolist()])
        assert sorted(covered[0] + covered[1]) == parts.nonempty_parts() and len(covered[0]) == len(covered[1])
    # the prediction loop's sampler repeats nothing: shares without padding
    predict = [[p for b in _update_dataloader(sharded, UnrepeatedDistributedSamplerWrapper(
        sharded.sampler, num_replicas=3, rank=rank, shuffle=False)) for p in b.part.tolist()] for rank in range(3)]
    assert sorted(sum(predict, [])) == sorted(set(sum(predict, [])))


def test_rank_seeds_differ_and_repeat():
    assert pqd.rank_seed(5, 0) == 5
    seeds = {pqd.rank_seed(5 + k, r) for k in range(8) for r in range(8)}
    assert len(seeds) == 64  # quantizer k's seed on rank r: no collisions
    draws = []
    for rank in (1, 1, 0):
        pqd.seed_everything(11, rank=rank)
        draws.append(torch.rand(4))
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    torch.manual_seed(11)
    assert torch.equal(torch.rand(4), draws[2])


# --- partitioning once ------------------------------------------------------------------------------
def _partition_worker(rank, graph, save_dir, out):
    calls = []
    real = cluster_data_module.partition_nodes

    def counting(*args, **kwargs):
        calls.append(rank)
        return real(*args, **kwargs)

    cluster_data_module.partition_nodes = counting
    try:
        cd = QuantClusterData(graph, 6, save_dir=save_dir, log=False)
    finally:
        cluster_data_module.partition_nodes = real
    torch.save({"calls": calls, "cluster": cd.cluster, "from_cache": cd.from_cache, "timings": cd.timings,
                "files": sorted(os.listdir(save_dir)) if save_dir else []}, f"{out}_{rank}.pt")


@pytest.mark.parametrize("cached", [True, False])
def test_partition_runs_once_and_reaches_every_rank(graph, tmp_path, cached):
    save_dir = str(tmp_path / "cache") if cached else None
    run_ranks(_partition_worker, tmp_path, graph, save_dir, str(tmp_path / "part"))
    first, second = saved(tmp_path, "part")
    assert first["calls"] == [0] and second["calls"] == []  # METIS on rank 0 only
    assert torch.equal(first["cluster"], second["cluster"])
    assert not first["from_cache"] and second["from_cache"] == cached  # rank 1 read rank 0's file, or got it
    assert "wait" in second["timings"]
    if cached:
        assert [f for f in second["files"] if not f.startswith(".tmp_")] == second["files"]  # no temporary left
        run_ranks(_partition_worker, tmp_path, graph, save_dir, str(tmp_path / "again"))
        assert [s["calls"] for s in saved(tmp_path, "again")] == [[], []]  # the second job only reads


# --- QAT under DDP ------------------------------------------------------------------------------------
def _ddp_worker(rank, parts, out, device):
    pqd.seed_everything(0)
    model = qat_model(init=rank, seed=0, weight_observer="learned", input_observer="minmax", agg_observer="mse")
    model = model.to(device)
    ddp = pqd.ddp(model, device_ids=[rank] if device != "cpu" else None)  # buffers synced once: the ranks keep them
    assert ddp.gradient_as_bucket_view  # (pqd.ddp's default: no copy of each gradient into its bucket and back)
    if device != "cpu":  # DDP made on the default stream: its gradient accumulators cannot be captured
        with pytest.raises(TypeError, match="capturable=True"):
            pq.CapturedTrainStep(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), F.cross_entropy)
    # the bare model, whose observers all-reduce their ranges: one process's step cannot capture that
    alone = pq.CapturedTrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy)
    with pytest.raises(ValueError, match="all-reduce their ranges"):
        alone(torch.zeros(3, 16, device=device), torch.zeros(2, 0, dtype=torch.long, device=device),
              target=torch.zeros(3, dtype=torch.long, device=device))
    loader = QuantClusterLoader(parts, batch_size=2, bits=4, shuffle=True)  # shards itself
    optimizer = torch.optim.Adam(ddp.parameters(), lr=0.01)
    fq = next(m for m in model.modules() if isinstance(m, qat.FakeQuantize) and m.stochastic)
    noise = fq.noise((8,), torch.device(device)).cpu()
    for epoch in range(2):
        loader.set_epoch(epoch)
        for i, batch in enumerate(loader):
            train_step(ddp, optimizer, batch.to(device))
            if rank == 0 and epoch == 0 and i == 0:
                model.state_dict()  # rank 0 alone reads the ranges (a checkpoint): the ranks' steps still match
    grads = {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}
    state = {k: v.cpu() for k, v in ddp.module.state_dict().items()}
    batch = next(iter(QuantClusterLoader(parts, batch_size=3, bits=4, shard=False))).to(device)
    model.eval()
    with torch.no_grad():
        eval_out = model(batch.x, batch.adj).cpu()
    torch.save({"grads": grads, "state": state, "noise": noise, "eval_out": eval_out,
                "parts": [p for b in loader for p in b.part.tolist()]}, f"{out}_{rank}.pt")


def check_ddp_results(tmp_path, parts, device):
    first, second = saved(tmp_path, "ddp")
    assert set(first["parts"]).isdisjoint(second["parts"]) or len(parts.nonempty_parts()) % 2
    for name in first["grads"]:
        assert torch.equal(first["grads"][name], second["grads"][name]), name  # all-reduced gradients
    ranges = [k for k in first["state"] if k.endswith(("min_val", "max_val", "range_lo", "log_step", ".lo",
                                                       ".scale"))]
    assert any(k.endswith("min_val") for k in ranges) and any(k.endswith("range_lo") for k in ranges)
    for key, value in first["state"].items():
        assert torch.equal(value, second["state"][key]), key  # weights, observed and learned ranges alike
    assert torch.equal(first["eval_out"], second["eval_out"])
    assert not torch.equal(first["noise"], second["noise"])  # each rank its own rounding noise
    # rank 0's noise is a one-process run's: seeded with the quantizer's seed itself
    model = qat_model(seed=0, weight_observer="learned", input_observer="minmax", agg_observer="mse")
    fq = next(m for m in model.modules() if isinstance(m, qat.FakeQuantize) and m.stochastic)
    assert torch.equal(fq.noise((8,), torch.device(device)).cpu(), first["noise"])  # the device's own generator
    # the checkpoint rank 0 saved loads into a one-process model and converts
    model.load_state_dict(first["state"])
    converted = qat.convert(model)
    batch = next(iter(QuantClusterLoader(parts, batch_size=3, bits=4)))
    with torch.no_grad():
        assert torch.allclose(converted(batch.x, batch.adj), first["eval_out"], atol=1e-5)


def test_ddp_qat_keeps_gradients_and_ranges_equal(parts, tmp_path):
    run_ranks(_ddp_worker, tmp_path, parts, str(tmp_path / "ddp"), "cpu")
    check_ddp_results(tmp_path, parts, "cpu")


def _synced_step_worker(rank, out):
    """Each static EMA / MSE quantizer (per tensor, column and row) fed three rank-specific batches twice: through its
    synced step in ``ema_range`` (the path that runs), and op by op (``Observer.forward``'s all-reduce and foreach
    steps, then ``fake_quantize``)."""
    from pyg_quant.quantization.observers import EMAMinMaxObserver
    runs = {}
    for fused in (True, False):
        steps = [0]
        original_fused, original_range = EMAMinMaxObserver.fused_step, EMAMinMaxObserver.step_range

        def counted(self, x, step):
            steps[0] += 1
            return original_range(self, x, step)

        EMAMinMaxObserver.step_range = counted
        if not fused:
            EMAMinMaxObserver.fused_step = lambda self, x: None
        try:
            for observer in ("ema", "mse"):
                for dim in (None, 0, 1):
                    fq = qat.FakeQuantize(3, observer, dim=dim, seed=5).train()
                    g = torch.Generator().manual_seed(10 * rank + (dim or 0))
                    xs = [torch.randn(24, 6, generator=g) * (rank + 1) for _ in range(3)]
                    outs = [fq(x.clone().requires_grad_()) for x in xs]
                    runs[(fused, observer, dim)] = (torch.stack(outs).detach(), fq.observer.min_val.clone(),
                                                    fq.observer.max_val.clone(), torch.stack(xs))
        finally:
            EMAMinMaxObserver.fused_step, EMAMinMaxObserver.step_range = original_fused, original_range
        runs[(fused, "steps")] = steps[0]
    torch.save(runs, f"{out}_{rank}.pt")


def test_synced_observer_step_in_one_op_equals_the_op_by_op_path(tmp_path):
    """Both paths give the same outputs and ranges bit for bit, the same ranges on both ranks, and those are the EMA
    of the batch ranges reduced over the ranks (extrema for "ema", the mean for "mse") that one process computes."""
    from pyg_quant.quantization.ranges import mse_ranges, tensor_range
    run_ranks(_synced_step_worker, tmp_path, str(tmp_path / "synced"))
    first, second = saved(tmp_path, "synced")
    assert first[(True, "steps")] == 12 and first[(False, "steps")] == 0  # 6 quantizers, steps 2 and 3 each
    for key in first:
        if key[1] == "steps":
            continue
        fused, observer, dim = key
        for a, b in zip(first[key][:3], first[(not fused, observer, dim)][:3]):
            assert torch.equal(a, b), key  # the same outputs and ranges, bit for bit
        for a, b in zip(first[key][1:3], second[key][1:3]):
            assert torch.equal(a, b), key  # the same ranges on both ranks
        stored = None
        for x0, x1 in zip(first[key][3], second[key][3]):
            ranges = [tensor_range(x, dim) if observer == "ema" else mse_ranges(x, dim, 3) for x in (x0, x1)]
            if observer == "ema":
                batch = (torch.minimum(ranges[0][0], ranges[1][0]), torch.maximum(ranges[0][1], ranges[1][1]))
            else:
                batch = ((ranges[0][0] + ranges[1][0]) / 2, (ranges[0][1] + ranges[1][1]) / 2)
            stored = batch if stored is None else tuple(s + (b - s) * 0.1 for s, b in zip(stored, batch))
        for got, want in zip(first[key][1:3], stored):
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), key


def _buffer_sync_worker(rank, parts, out, forward_sync_param):
    from pyg_quant.distributed import data_parallel as ddp_module
    ddp_module._FORWARD_SYNC = forward_sync_param  # both paths: torch >= 2.13's DDP argument, and the broadcast here
    model = qat_model(init=rank, seed=0)
    batch = next(iter(QuantClusterLoader(parts, batch_size=2, bits=4, shard=False)))
    with pqd.local_ranges():
        model(batch.x, batch.adj)  # the observers' ranges exist
    for buffer in model.buffers():  # each rank its own values
        if buffer.is_floating_point():
            buffer.fill_(float(rank + 1))
    pqd.ddp(model)
    at_wrap = {k: v.clone() for k, v in model.named_buffers()}
    # a module whose eval forward writes no buffer: a later change on rank 1 only stays (DDP's default would restore
    # rank 0's before the forward)
    torch.manual_seed(0)
    norm = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).eval()
    wrapped = pqd.ddp(norm)
    if rank == 1:
        norm[1].running_mean.fill_(7.0)
    with torch.no_grad():
        wrapped(torch.ones(2, 3))
    torch.save({"at_wrap": at_wrap, "mean": norm[1].running_mean.clone()}, f"{out}_{rank}.pt")


@pytest.mark.parametrize("forward_sync_param", [True, False])
def test_ddp_syncs_buffers_once(parts, tmp_path, forward_sync_param):
    """``pqd.ddp``: rank 0's buffers everywhere when it wraps the model (torch's ``forward_sync_buffers=False``, or its
    own broadcast on an older torch), and no broadcast before a forward."""
    from pyg_quant.distributed import data_parallel as ddp_module
    if forward_sync_param and not ddp_module._FORWARD_SYNC:
        pytest.skip("this torch's DistributedDataParallel has no forward_sync_buffers")
    with pytest.raises(TypeError, match="broadcast_buffers"):
        pqd.ddp(torch.nn.Linear(2, 2), broadcast_buffers=True)
    run_ranks(_buffer_sync_worker, tmp_path, parts, str(tmp_path / "bufs"), forward_sync_param)
    first, second = saved(tmp_path, "bufs")
    assert any(k.endswith("min_val") and v.numel() for k, v in first["at_wrap"].items())
    for key in first["at_wrap"]:
        assert torch.equal(first["at_wrap"][key], second["at_wrap"][key]), key  # rank 0's at the start
        if first["at_wrap"][key].is_floating_point() and first["at_wrap"][key].numel():
            assert bool((first["at_wrap"][key] == 1.0).all()), key
    assert bool((second["mean"] == 7.0).all()) and not bool((first["mean"] == 7.0).any())


def _match_worker(rank, parts, out, steps):
    model = qat_model(**DETERMINISTIC)
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    loader = QuantClusterLoader(parts, batch_size=1, bits=4, shuffle=True, seed=3)
    for _, batch in zip(range(steps), loader):
        train_step(ddp, optimizer, batch)
    torch.save({k: v.detach() for k, v in model.state_dict().items()}, f"{out}_{rank}.pt")


def test_two_ranks_match_one_process_on_the_same_batches(parts, tmp_path):
    steps = 3
    run_ranks(_match_worker, tmp_path, parts, str(tmp_path / "match"), steps)
    first, second = saved(tmp_path, "match")
    # one process: each step the mean of the two ranks' losses (DDP averages the ranks' gradients)
    model = qat_model(**DETERMINISTIC)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loaders = [QuantClusterLoader(parts, batch_size=1, bits=4, shuffle=True, seed=3, num_replicas=2, rank=r)
               for r in range(2)]
    for _, b0, b1 in zip(range(steps), *loaders):
        optimizer.zero_grad()
        losses = []
        for batch in (b0, b1):
            out = model(batch.x, batch.adj)
            mask = batch.train_mask
            losses.append(F.cross_entropy(out[mask], batch.y[mask]) if bool(mask.any()) else out.sum() * 0.0)
        ((losses[0] + losses[1]) / 2).backward()
        optimizer.step()
    moved = False
    for key, value in model.state_dict().items():
        assert torch.equal(first[key], second[key]), key
        assert torch.allclose(first[key], value, rtol=1e-4, atol=1e-6), (key, (first[key] - value).abs().max())
        moved |= key.endswith("weight") and not torch.equal(value, qat_model(**DETERMINISTIC).state_dict()[key])
    assert moved


# --- captured steps under DDP ------------------------------------------------------------------------------------
CAPTURED_QCONFIG = dict(stochastic=False, weight_observer="dynamic", input_observer="ema", agg_observer="ema")


def _rank_batches(rank, device):
    """Two graphs of this rank's own sizes (four shapes over both ranks): ``(x, edge_index, y)``."""
    out = []
    for i, nodes in enumerate((120 + 40 * rank, 90 + 20 * rank)):
        data = planted_class_graph(num_nodes=nodes, num_features=16, num_classes=4, community=30, seed=10 * rank + i)
        out.append((data.x.to(device), data.edge_index.to(device), data.y.to(device)))
    return out


def _captured_ddp_worker(rank, out, device, steps):
    """The same steps twice from the same weights: through ``CapturedTrainStep`` on a ``pqd.ddp(capturable=True)``
    model, and as the eager loop on a plain ``pqd.ddp`` one."""
    device = device if device == "cpu" else f"cuda:{rank}"
    batches = _rank_batches(rank, device)
    runs = {}
    for captured in (True, False):
        torch.manual_seed(0)
        model = qat.prepare(GCN(16, 16, 4), bits=4, skip_last=False, **CAPTURED_QCONFIG).to(device).train()
        ddp = pqd.ddp(model, capturable=captured, device_ids=None if device == "cpu" else [rank])
        opt = torch.optim.Adam(ddp.parameters(), lr=0.01, **({} if device == "cpu" else {"capturable": True}))
        step = pq.CapturedTrainStep(ddp, opt, F.cross_entropy) if captured else None
        losses = []
        for i in range(steps):
            x, edge_index, y = batches[i % 2]
            if captured:
                loss = step(x, edge_index, target=y)
            else:
                opt.zero_grad(set_to_none=False)
                loss = F.cross_entropy(ddp(x, edge_index), y)
                loss.backward()
                opt.step()
            losses.append(loss.detach())
        runs[captured] = {"losses": torch.stack(losses).cpu(), "state": {k: v.detach().cpu() for k, v in
                                                                          model.state_dict().items()},
                          "graphs": step.num_graphs if captured else 0,
                          "disabled": step.disabled_reason if captured else None}
    torch.save(runs, f"{out}_{rank}.pt")


def check_captured_ddp(tmp_path, device):
    first, second = saved(tmp_path, "cap")
    for rank in (first, second):
        assert rank[True]["disabled"] is None
        assert rank[True]["graphs"] == (2 if device == "cuda" else 0)  # one per pair of the ranks' shapes
        assert torch.allclose(rank[True]["losses"], rank[False]["losses"], rtol=1e-5, atol=1e-6)
        for key, value in rank[False]["state"].items():
            assert torch.allclose(rank[True]["state"][key], value, rtol=1e-5, atol=1e-6), key
    for key, value in first[True]["state"].items():
        assert torch.equal(value, second[True]["state"][key]), key  # weights and synced ranges equal on the ranks
    assert any(k.endswith("min_val") and v.numel() for k, v in first[True]["state"].items())
    assert not torch.equal(first[True]["losses"], second[True]["losses"])  # each rank its own batches


def test_captured_step_under_ddp_runs_the_eager_steps_on_the_cpu(tmp_path):
    """On the CPU the step runs eagerly, in step with the other rank (the ranks exchange their shapes each step)."""
    run_ranks(_captured_ddp_worker, tmp_path, str(tmp_path / "cap"), "cpu", 4)
    check_captured_ddp(tmp_path, "cpu")


# --- sharded inference --------------------------------------------------------------------------------
def _inference_worker(rank, parts, model, out, dst):
    loader = QuantClusterLoader(parts, batch_size=2, bits=4, shuffle=True)  # its sampler is not used
    wrapped = DDP(model) if any(p.requires_grad for p in model.parameters()) else model  # a QAT or converted model
    result = pqd.sharded_inference(wrapped, loader, dst=dst)
    torch.save(result, f"{out}_{rank}.pt")


@pytest.mark.parametrize("converted", [False, True])
def test_sharded_inference_gathers_every_node_in_order(parts, graph, tmp_path, converted):
    model = qat_model(init=1, agg_observer="dynamic_mse")
    model = qat.convert(model) if converted else model
    run_ranks(_inference_worker, tmp_path, parts, model, str(tmp_path / "inf"), None)
    first, second = saved(tmp_path, "inf")
    one = pqd.sharded_inference(model, QuantClusterLoader(parts, batch_size=2, bits=4))  # no process group
    assert one.shape == (graph.num_nodes, 4) and torch.equal(first, one) and torch.equal(second, one)
    batches = QuantClusterLoader(parts, batch_size=2, bits=4, shuffle=False)
    expected = torch.empty_like(one)
    assert model.training != converted  # sharded_inference restored the mode
    model.eval()
    with torch.no_grad():
        for batch in batches:
            expected[batch.n_id] = model(batch.x, batch.adj)
    assert torch.equal(one, expected)
    run_ranks(_inference_worker, tmp_path, parts, model, str(tmp_path / "dst"), 0)
    first, second = saved(tmp_path, "dst")
    assert torch.equal(first, one) and second is None


def _gather_worker(rank, out):
    rows = torch.arange(3 * rank, dtype=torch.float32).view(-1, 1).repeat(1, 2) if rank else torch.empty(0, 5)
    ids = torch.arange(4 + rank, dtype=torch.int64) * 10 + rank
    torch.save((pqd.all_gather_rows(rows), pqd.gather_rows(rows, 1), pqd.all_gather_rows([ids, rows]),
                pqd.gather_rows((ids,), 0)), f"{out}_{rank}.pt")


def test_all_gather_rows_gathers_uneven_pieces(tmp_path):
    """Every rank gets every piece (all_gather_rows), or rank 1 only (gather_rows to rank 1); several tensors at
    once."""
    run_ranks(_gather_worker, tmp_path, str(tmp_path / "gather"))
    (first, first_to_1, first_many, first_ids), (second, second_to_1, second_many, second_ids) = saved(tmp_path,
                                                                                                     "gather")
    assert first_to_1 is None and second_ids is None
    for pieces in (first, second, second_to_1, first_many[1], second_many[1]):
        assert [tuple(p.shape) for p in pieces] == [(0, 2), (3, 2)] and pieces[0].dtype == torch.float32
        assert torch.equal(pieces[1][:, 0], torch.arange(3.0))
    expected_ids = [torch.arange(4) * 10, torch.arange(5) * 10 + 1]
    for pieces in (first_many[0], second_many[0], first_ids[0]):
        assert len(pieces) == 2 and all(torch.equal(p, e) for p, e in zip(pieces, expected_ids))


def test_gather_rows_checks_its_arguments():
    with pytest.raises(TypeError, match="tensor must be"):
        pqd.all_gather_rows([torch.zeros(2), "rows"])
    with pytest.raises(ValueError, match="dimensions"):
        pqd.all_gather_rows(torch.zeros(()))
    with pytest.raises(TypeError, match="tensors must be"):
        pqd.gather_rows({"rows": torch.zeros(2)}, 0)
    with pytest.raises(ValueError, match="at least one"):
        pqd.all_gather_rows([])
    assert pqd.all_gather_rows(torch.ones(2))[0].tolist() == [1.0, 1.0]  # one process: the tensor itself


# Rank 0: batches of 3, 0, 5 and 2 rows; rank 1: 4 and 1; the 15 row ids in a fixed shuffled order.
_BATCH_ROWS = [[3, 0, 5, 2], [4, 1]]
_BATCH_IDS = torch.randperm(15, generator=torch.Generator().manual_seed(0))


def _batch_rows(ids):
    return torch.stack([ids * 10.0, ids * 10.0 + 1], 1)  # row i holds (10 i, 10 i + 1)


def _batch_gather_worker(rank, out, rows_by_rank, dst, trailing, device="cpu"):
    gather = pqd.BatchGather(rows_by_rank, sum(map(sum, rows_by_rank)), dst=dst)
    start = sum(sum(rows) for rows in rows_by_rank[:rank])
    for count in rows_by_rank[rank]:
        ids = _BATCH_IDS[start:start + count].to(device)
        rows = _batch_rows(ids)
        gather.add(ids, rows if trailing is None or rank == 0 else rows.repeat(1, trailing))
        start += count
    result = gather.result()
    torch.save(None if result is None else result.cpu(), f"{out}_{rank}.pt")


def _batch_gather_worker_cuda(rank, out, rows_by_rank, dst):
    _batch_gather_worker(rank, out, rows_by_rank, dst, None, f"cuda:{rank}")


@pytest.mark.parametrize("dst", [None, 0, 1])
def test_batch_gather_puts_every_rank_s_batches_in_place(tmp_path, dst):
    run_ranks(_batch_gather_worker, tmp_path, str(tmp_path / "bg"), _BATCH_ROWS, dst, None)
    expected = _batch_rows(torch.arange(15))
    for rank, result in enumerate(saved(tmp_path, "bg")):
        if dst is None or rank == dst:
            assert torch.equal(result, expected)
        else:
            assert result is None


@pytest.mark.cuda
@requires_two_gpus
@pytest.mark.parametrize("dst", [None, 0])
def test_batch_gather_on_two_gpus(tmp_path, dst):
    """NCCL: every rank's rows and ids in one group of sends and receives."""
    run_ranks(_batch_gather_worker_cuda, tmp_path, str(tmp_path / "bg"), _BATCH_ROWS, dst, backend="nccl",
              timeout=300)
    for rank, result in enumerate(saved(tmp_path, "bg")):
        if dst is None or rank == dst:
            assert torch.equal(result, _batch_rows(torch.arange(15)))
        else:
            assert result is None


def _batch_gather_apart_worker(rank, out, rows_by_rank):
    """Rank 1 makes its BatchGather only once rank 0 has added all of its batches."""
    marker = f"{out}_added"
    if rank == 1:
        deadline = time.monotonic() + 30
        while not os.path.exists(marker):
            if time.monotonic() > deadline:
                raise TimeoutError("rank 0's add() waited for rank 1")
            time.sleep(0.01)
    gather = pqd.BatchGather(rows_by_rank, sum(map(sum, rows_by_rank)), dst=0)
    start = sum(sum(rows) for rows in rows_by_rank[:rank])
    for count in rows_by_rank[rank]:
        ids = _BATCH_IDS[start:start + count]
        gather.add(ids, _batch_rows(ids))
        start += count
    if rank == 0:
        open(marker, "w").close()
    result = gather.result()
    torch.save(None if result is None else result.cpu(), f"{out}_{rank}.pt")


def test_batch_gather_adds_without_waiting_for_the_other_ranks(tmp_path):
    """add() exchanges nothing: rank 0 adds all of its batches before rank 1 has begun."""
    run_ranks(_batch_gather_apart_worker, tmp_path, str(tmp_path / "bg"), _BATCH_ROWS, timeout=60)
    first, second = saved(tmp_path, "bg")
    assert torch.equal(first, _batch_rows(torch.arange(15))) and second is None


def test_batch_gather_with_a_rank_without_batches(tmp_path):
    run_ranks(_batch_gather_worker, tmp_path, str(tmp_path / "bg"), [[], [6, 9]], None, None)
    for result in saved(tmp_path, "bg"):
        assert torch.equal(result, _batch_rows(torch.arange(15)))


def test_batch_gather_raises_on_every_rank_where_the_rows_differ(tmp_path):
    with pytest.raises(RanksFailed) as failure:
        run_ranks(_batch_gather_worker, tmp_path, str(tmp_path / "bg"), _BATCH_ROWS, None, 3, timeout=30)
    first, second = str(failure.value).split("rank 1:")
    assert "differ in trailing shape" in first and "differ in trailing shape" in second


def test_batch_gather_checks_its_arguments():
    with pytest.raises(ValueError, match="rows_by_rank"):
        pqd.BatchGather([[2], [3]], 5)  # one process: one rank
    with pytest.raises(ValueError, match="num_rows"):
        pqd.BatchGather([[2, 3]], 4)
    with pytest.raises(ValueError, match="dst"):
        pqd.BatchGather([[2, 3]], 5, dst=1)
    gather = pqd.BatchGather([[2, 3]], 5)
    with pytest.raises(ValueError, match="rows of batch 0"):
        gather.add(torch.arange(3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="ids of batch 0"):
        gather.add(torch.arange(2, dtype=torch.int32), torch.zeros(2, 2))
    gather.add(torch.tensor([4, 0]), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="like the first"):
        gather.add(torch.tensor([1, 2, 3]), torch.zeros(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="added 1 of its 2"):
        gather.result()
    gather.add(torch.tensor([1, 2, 3]), torch.ones(3, 2))
    with pytest.raises(ValueError, match="one more"):
        gather.add(torch.tensor([1]), torch.ones(1, 2))
    assert gather.result()[:, 0].tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]
    with pytest.raises(RuntimeError, match="twice"):
        gather.result()


# --- failures -------------------------------------------------------------------------------------------
def _failing_worker(rank):
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.all_reduce(torch.zeros(1))  # rank 0 waits for rank 1, which never comes


def test_a_failing_rank_ends_the_job_with_its_error(tmp_path):
    start = time.monotonic()
    with pytest.raises(RanksFailed, match="rank 1 fails on purpose"):
        run_ranks(_failing_worker, tmp_path, timeout=30)
    assert time.monotonic() - start < 30


# --- the example ------------------------------------------------------------------------------------------
def test_multi_gpu_example_under_torchrun_on_the_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           os.path.join(ROOT, "examples", "multi_gpu_cluster_gcn.py"), "--small", "--cpu",
                           "--no-progress", "--cache", str(tmp_path / "cache")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 ranks" in proc.stdout and "test accuracy" in proc.stdout, proc.stdout
    accuracy = float(proc.stdout.split("test accuracy")[1].split()[0])
    assert accuracy >= 0.8, proc.stdout


def test_multi_gpu_example_with_lightning_ddp_on_the_cpu(tmp_path):
    pytest.importorskip("lightning")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "multi_gpu_cluster_gcn.py"), "--lightning",
                           "--accelerator", "cpu", "--devices", "2", "--small", "--epochs", "2", "--no-progress"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 ranks (Lightning DDPStrategy, DistributedPartSampler)" in proc.stdout, proc.stdout


# --- on 2 GPUs (NCCL) ----------------------------------------------------------------------------------------
@pytest.mark.cuda
@requires_two_gpus
def test_ddp_qat_on_two_gpus(parts, tmp_path):
    run_ranks(_ddp_worker_cuda, tmp_path, parts, str(tmp_path / "ddp"), backend="nccl", timeout=300)
    check_ddp_results(tmp_path, parts, "cuda")


@pytest.mark.cuda
@requires_two_gpus
def test_captured_step_under_ddp_on_two_gpus(tmp_path):
    """Captured with the gradient and range all-reduces inside (from the 12th step on), the steps equal the eager
    loop's on both ranks."""
    run_ranks(_captured_ddp_worker, tmp_path, str(tmp_path / "cap"), "cuda", 16, backend="nccl", timeout=300)
    check_captured_ddp(tmp_path, "cuda")


def _ddp_worker_cuda(rank, parts, out):
    _ddp_worker(rank, parts, out, f"cuda:{rank}")


@pytest.mark.cuda
@requires_two_gpus
def test_partition_and_inference_on_two_gpus(graph, parts, tmp_path):
    run_ranks(_partition_worker, tmp_path, graph, None, str(tmp_path / "part"), backend="nccl", timeout=300)
    first, second = saved(tmp_path, "part")
    assert first["calls"] == [0] and second["calls"] == [] and torch.equal(first["cluster"], second["cluster"])
    model = qat.convert(qat_model(init=1, agg_observer="dynamic_mse"))
    run_ranks(_inference_worker_cuda, tmp_path, parts, model, str(tmp_path / "inf"), backend="nccl", timeout=300)
    one = pqd.sharded_inference(model, QuantClusterLoader(parts, batch_size=2, bits=4))
    for result in saved(tmp_path, "inf"):
        assert torch.allclose(result.cpu(), one, atol=1e-5)


def _inference_worker_cuda(rank, parts, model, out):
    loader = QuantClusterLoader(parts, batch_size=2, bits=4, device=f"cuda:{rank}")
    torch.save(pqd.sharded_inference(model.to(f"cuda:{rank}"), loader).cpu(), f"{out}_{rank}.pt")
