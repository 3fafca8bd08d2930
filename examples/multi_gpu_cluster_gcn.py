"""Cluster-GCN QAT on several GPUs: one process per GPU (torchrun, or Lightning's DDP strategy), sharded inference.

    torchrun --nproc_per_node=2 examples/multi_gpu_cluster_gcn.py            # NCCL, one GPU per process
    torchrun --nproc_per_node=2 examples/multi_gpu_cluster_gcn.py --cpu      # gloo on the CPU (also without GPUs)
    torchrun --nproc_per_node=2 examples/multi_gpu_cluster_gcn.py --small --cpu   # seconds (what the tests run)
    python examples/multi_gpu_cluster_gcn.py --lightning --accelerator gpu --devices 2   # Lightning, strategy="ddp"
    python examples/multi_gpu_cluster_gcn.py                                 # one process works too

What each rank does (``pyg_quant.distributed``):

1. ``QuantClusterData`` partitions the graph once: METIS on rank 0 (cached under ``--cache``), the
   other ranks wait and read its file (or receive its result);
2. ``QuantClusterLoader`` shards itself over the ranks: each gets a disjoint share of the parts every
   epoch (``set_epoch`` reshuffles; the same number of batches on every rank);
3. the ``qat.prepare``-d GCN trains under ``DistributedDataParallel`` (``pqd.ddp``: buffers synced once): gradients
   are averaged, the observers' ranges are all-reduced (equal on every rank), stochastic rounding draws each rank's own
   noise (``seed_everything``).  A batch without training nodes still runs backward with a zero loss:
   a rank that skipped it would leave the others waiting in the gradient all-reduce;
4. ``sharded_inference`` runs every batch once, on some rank, and gathers the ``[N, C]`` output in node
   order on every rank: validation every epoch (QAT model), test after ``qat.convert`` (bit kernels);
5. rank 0 saves the checkpoint (``--save``: the DDP module's ``.module.state_dict()``), which loads into
   a one-process model.

A rank that raises ends the job with its error (torchrun stops the other processes).
"""
import argparse
import json
import os
import sys
import time
from typing import Dict

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_gcn import GCN, SMALL  # noqa: E402  (QGCNConv layers reading BitAdjacency batches)
from cluster_gcn import parser as cluster_parser  # noqa: E402

try:
    import pyg_quant  # noqa: F401
except ImportError:  # run from a checkout without an install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pyg_quant import distributed as pqd  # noqa: E402
from pyg_quant import qat  # noqa: E402
from pyg_quant.demo import load_data  # noqa: E402
from pyg_quant.loader import QuantClusterData, QuantClusterLoader  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = cluster_parser(__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU (the default without CUDA)")
    p.add_argument("--save", default=None, help="rank 0 saves the trained QAT model's state dict here")
    p.add_argument("--json", default=None, help="rank 0 writes the run's result (accuracies, times) here as JSON")
    p.add_argument("--lightning", action="store_true", help="train with Lightning's DDP strategy instead")
    p.add_argument("--accelerator", default="auto", help="Lightning's accelerator (--lightning)")
    p.add_argument("--devices", type=int, default=2, help="Lightning's processes (--lightning)")
    p.add_argument("--fast-dev-run", action="store_true", help="one batch of each loop (--lightning)")
    if "--small" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**SMALL)
    return p.parse_args(argv)


def setup(args) -> torch.device:
    """Joins the process group torchrun describes (none when started as one plain process); the rank's device."""
    cuda = torch.cuda.is_available() and not args.cpu
    if "RANK" in os.environ and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def train_epoch(ddp, loader, optimizer, device) -> float:
    """One epoch of this rank's share; the mean training loss over every rank's batches."""
    ddp.train()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, batches with training nodes
    for batch in loader:
        batch = batch.to(device)
        optimizer.zero_grad()
        out = ddp(batch.x, batch.adj)
        mask = batch.train_mask
        if bool(mask.any()):
            loss = F.cross_entropy(out[mask], batch.y[mask])
            total += torch.stack([loss.detach().double(), torch.ones((), dtype=torch.float64, device=device)])
        else:
            loss = out.sum() * 0.0  # every rank runs every step's backward: the gradient all-reduce needs all
        loss.backward()
        optimizer.step()
    if dist.is_initialized():
        total = total.to(pqd.group.collective_device())
        dist.all_reduce(total)
    return float(total[0] / total[1].clamp_min(1))


def accuracy(out: torch.Tensor, data, split: str) -> float:
    mask = data[f"{split}_mask"].to(out.device)
    return float((out[mask].argmax(-1) == data.y.to(out.device)[mask]).float().mean())


def run(args) -> Dict[str, object]:
    device = setup(args)
    rank, world = pqd.world()
    log = rank == 0 and not args.no_progress
    data, source = load_data(args.root, args.synthetic, num_nodes=args.nodes, seed=args.seed)
    start = time.perf_counter()
    cluster_data = QuantClusterData(data, args.parts, save_dir=args.cache, log=log)  # METIS on rank 0 only
    partition_s = time.perf_counter() - start
    kwargs = dict(batch_size=args.batch_size, bits=args.bits, self_loops=1, num_workers=args.workers,
                  device=device if device.type == "cuda" else None)
    train_loader = QuantClusterLoader(cluster_data, shuffle=True, seed=args.seed, **kwargs)  # shards itself
    eval_loader = QuantClusterLoader(cluster_data, shuffle=False, shard=False, **kwargs)  # sharded_inference's

    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP broadcasts rank 0's anyway)
    model = qat.prepare(GCN(data.num_features, args.hidden, int(data.y.max()) + 1, args.layers), bits=args.bits,
                        seed=args.seed).to(device)
    pqd.seed_everything(args.seed)  # from here each rank draws its own dropout and rounding noise
    # DDP whose buffers are synced once, not before every forward: the observers keep the ranks' ranges equal
    ddp = pqd.ddp(model, device_ids=[device.index] if device.type == "cuda" else None) if dist.is_initialized() \
        else model
    optimizer = torch.optim.Adam(ddp.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    best, best_state, epoch_s = -1.0, None, []
    for epoch in range(args.epochs):
        train_loader.set_epoch(epoch)
        start = time.perf_counter()
        loss = train_epoch(ddp, train_loader, optimizer, device)
        epoch_s.append(time.perf_counter() - start)
        val = accuracy(pqd.sharded_inference(model, eval_loader), data, "val")  # the same on every rank
        if val > best:
            best, best_state = val, {k: v.detach().clone() for k, v in model.state_dict().items()}
        if log:
            print(f"epoch {epoch + 1:3d}  loss {loss:.4f}  val {val:.3f}  {epoch_s[-1]:.2f} s", flush=True)
    model.load_state_dict(best_state)
    if args.save and rank == 0:
        torch.save(model.state_dict(), args.save)  # loads into a one-process prepared model (then qat.convert)
    converted = qat.convert(model)
    start = time.perf_counter()
    out = pqd.sharded_inference(converted, eval_loader)
    inference_s = time.perf_counter() - start
    result = {"ranks": world, "data": source, "val": best, "test": accuracy(out, data, "test"),
              "partition_s": partition_s, "epoch_s": sum(epoch_s) / len(epoch_s), "inference_s": inference_s}
    if rank == 0:
        backend = dist.get_backend() if dist.is_initialized() else "one process"
        print(f"{world} ranks ({backend}), {args.bits}-bit GCN on {source}: best val {best:.3f}, "
              f"test accuracy {result['test']:.3f} (converted, bit kernels); "
              f"epoch {result['epoch_s']:.2f} s, inference {inference_s:.2f} s, partition {partition_s:.1f} s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(result, seed=args.seed, bits=args.bits, epochs=args.epochs,
                               backend=backend, device=str(device)), f)
    return result


def run_lightning(args) -> Dict[str, object]:
    """The Lightning example's DataModule and module under ``strategy="ddp"``: Lightning keeps the loader's own
    sharding sampler (it is a DistributedSampler) and calls its ``set_epoch``."""
    import lightning_cluster_gcn as lcg

    class DDPQuantGCNModule(lcg.QuantGCNModule):
        def setup(self, stage=None):
            pqd.seed_everything(self.hparams.seed)  # the process group exists here: each rank its own noise

        def on_train_start(self):
            self.sampler_name = type(self.trainer.train_dataloader.sampler).__name__  # Lightning kept the loader's

        def training_step(self, batch, batch_idx):
            if not bool(batch.train_mask.any()):  # no skipped backward under DDP (see the module docstring)
                self.skipped_batches += 1
                return self(batch.x, batch.adj).sum() * 0.0
            return super().training_step(batch, batch_idx)

    L = lcg.L
    L.seed_everything(args.seed, verbose=False)
    data, source = load_data(args.root, args.synthetic, num_nodes=args.nodes, seed=args.seed)
    datamodule = lcg.QuantClusterDataModule(data, args.parts, args.batch_size, args.bits, self_loops=1,
                                            num_workers=args.workers, save_dir=args.cache)
    module = DDPQuantGCNModule(datamodule.num_features, datamodule.num_classes, args.hidden, args.layers, args.bits,
                               seed=args.seed)
    trainer = L.Trainer(max_epochs=args.epochs, accelerator=args.accelerator, devices=args.devices,
                        strategy="ddp" if args.devices > 1 else "auto", fast_dev_run=args.fast_dev_run,
                        enable_progress_bar=not args.no_progress, enable_model_summary=False, logger=False,
                        enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=datamodule)
    trainer.test(module, datamodule=datamodule, verbose=False)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    sampler = getattr(module, "sampler_name", "no training")
    if trainer.global_rank == 0:
        print(f"{trainer.world_size} ranks (Lightning {trainer.strategy.__class__.__name__}, {sampler}), "
              f"{args.bits}-bit GCN on {source}: test accuracy {metrics.get('test_acc', float('nan')):.3f}", flush=True)
    return {"metrics": metrics, "trainer": trainer}


def main(argv=None):
    args = parse_args(argv)
    if args.lightning:
        return run_lightning(args)
    try:
        return run(args)
    finally:  # after run's DDP wrapper is gone (a DDP freed after the group is destroyed can wait forever)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
