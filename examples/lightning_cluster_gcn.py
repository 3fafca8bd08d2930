"""Cluster-GCN with PyTorch Lightning: a LightningDataModule around QuantClusterLoader, a LightningModule with QGCNConv.

    pip install -e ".[lightning]"                 # lightning>=2.0, from the repository root
    python examples/lightning_cluster_gcn.py                        # synthetic graph, 4-bit QAT, 20 epochs
    python examples/lightning_cluster_gcn.py --root ../shared/datasets/planetoid --parts 16
    python examples/lightning_cluster_gcn.py --fast-dev-run         # one batch of each loop (tests)

* :class:`QuantClusterDataModule` partitions the graph once (``QuantClusterData``, METIS) in
  ``setup`` and serves ``QuantClusterLoader`` batches: the adjacency as bit tiles and the
  features as ``--bits``-bit planes, one buffer per batch. ``transfer_batch_to_device`` moves
  that buffer in one copy (``QuantBatch.to``).
* :class:`QuantGCNModule` holds a GCN written with ``pyg_quant.QGCNConv`` and made ``--bits``
  wide by ``pyg_quant.qat.prepare`` (QAT; last layer fp32). Every per-batch ``self.log`` gets
  ``batch_size`` = the number of nodes the value averages over (Lightning cannot infer it from
  a QuantBatch). A cluster batch without training nodes returns ``None`` from
  ``training_step``: no loss, no backward, no weight change; the count is logged per epoch.
  ``on_test_start`` swaps in ``pyg_quant.qat.convert``-ed weights: testing runs on the bit kernels.

Uses the GPU when there is one (``accelerator="auto"``).
"""
import argparse
import os
import sys
import tempfile
from typing import Optional

import torch
import torch.nn.functional as F

try:
    import lightning as L
except ImportError:  # the standalone package of older installs
    import pytorch_lightning as L

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_gcn import GCN  # noqa: E402  (QGCNConv layers reading BitAdjacency batches)
from cluster_gcn import parse_args as cluster_parse_args  # noqa: E402  (--small defaults)

from pyg_quant import qat  # noqa: E402
from pyg_quant.demo import load_data  # noqa: E402
from pyg_quant.loader import QuantClusterData, QuantClusterLoader  # noqa: E402


class QuantClusterDataModule(L.LightningDataModule):
    """Cluster-GCN batches as bits: METIS parts (computed once) joined ``batch_size`` at a time.

    Args:
        data (Data): the whole graph, with ``train_mask`` / ``val_mask`` / ``test_mask``.
        num_parts (int): METIS parts.
        batch_size (int): parts per batch.
        bits (int): feature bits in the batches.
        self_loops (int): 1 for GCN (``A + I``), 0 for GIN.
        num_workers (int): DataLoader workers.
        save_dir (str, optional): partition cache directory (default: a temporary one).
    """

    def __init__(self, data, num_parts: int = 40, batch_size: int = 4, bits: int = 4, self_loops: int = 1,
                 num_workers: int = 0, save_dir: Optional[str] = None):
        super().__init__()
        self.data, self.num_parts, self.batch_size = data, num_parts, batch_size
        self.bits, self.self_loops, self.num_workers, self.save_dir = bits, self_loops, num_workers, save_dir
        self.cluster_data = None

    @property
    def num_features(self) -> int:
        return self.data.num_features

    @property
    def num_classes(self) -> int:
        return int(self.data.y.max()) + 1

    def setup(self, stage: Optional[str] = None) -> None:
        if self.cluster_data is None:  # setup runs once per stage: partition once
            with tempfile.TemporaryDirectory() as tmp:
                self.cluster_data = QuantClusterData(self.data, self.num_parts, save_dir=self.save_dir or tmp,
                                                     log=False)

    def _loader(self, shuffle: bool) -> QuantClusterLoader:
        return QuantClusterLoader(self.cluster_data, batch_size=self.batch_size, shuffle=shuffle, bits=self.bits,
                                  self_loops=self.self_loops, num_workers=self.num_workers,
                                  persistent_workers=self.num_workers > 0,
                                  pin_memory=torch.cuda.is_available())

    def train_dataloader(self) -> QuantClusterLoader:
        return self._loader(shuffle=True)

    def val_dataloader(self) -> QuantClusterLoader:
        return self._loader(shuffle=False)

    def test_dataloader(self) -> QuantClusterLoader:
        return self._loader(shuffle=False)

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        return batch.to(device)  # one copy of the batch's single buffer (non-blocking from pinned memory)


class QuantGCNModule(L.LightningModule):
    """A ``bits``-wide QAT GCN (``qat.prepare`` of QGCNConv layers; last layer fp32) trained on cluster batches."""

    def __init__(self, in_channels: int, num_classes: int, hidden_channels: int = 64, num_layers: int = 2,
                 bits: int = 4, lr: float = 0.01, weight_decay: float = 5e-4, seed: int = 0):
        super().__init__()
        self.save_hyperparameters()
        self.model = qat.prepare(GCN(in_channels, hidden_channels, num_classes, num_layers), bits=bits, seed=seed)
        self.skipped_batches = 0  # batches without training nodes, over the whole run
        self._epoch_skipped = 0
        self._qat_model = None

    def on_train_epoch_start(self) -> None:
        self._epoch_skipped = 0

    def on_train_epoch_end(self) -> None:
        self.log("skipped_batches", float(self._epoch_skipped))  # this epoch's

    def forward(self, x, adj):
        return self.model(x, adj)

    def training_step(self, batch, batch_idx: int):
        mask = batch.train_mask
        num_train = int(mask.sum())
        if num_train == 0:
            # A cluster batch without training nodes has no loss (an empty mean would be NaN).
            # Returning None makes Lightning skip the backward pass; with no gradient, the
            # optimizer step that follows changes no weight.
            self.skipped_batches += 1
            self._epoch_skipped += 1
            return None
        out = self(batch.x, batch.adj)
        loss = F.cross_entropy(out[mask], batch.y[mask])
        acc = (out[mask].argmax(-1) == batch.y[mask]).float().mean()
        self.log("train_loss", loss, batch_size=num_train, prog_bar=True, on_step=False, on_epoch=True)
        self.log("train_acc", acc, batch_size=num_train, on_step=False, on_epoch=True)
        return loss

    def _evaluate(self, batch, split: str) -> None:
        mask = batch[f"{split}_mask"]
        num = int(mask.sum())
        if num == 0:
            return  # nothing of this split in the batch: log nothing (a weight-0 entry would be NaN)
        pred = self(batch.x, batch.adj).argmax(-1)
        acc = (pred[mask] == batch.y[mask]).float().mean()
        # batch_size = the nodes the accuracy averages over: the epoch value is then exact over all nodes
        self.log(f"{split}_acc", acc, batch_size=num, prog_bar=True, on_step=False, on_epoch=True)

    def validation_step(self, batch, batch_idx: int):
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx: int):
        self._evaluate(batch, "test")

    def on_test_start(self) -> None:
        # Test the deployable model: frozen ranges, no gradients, the bit kernels.
        object.__setattr__(self, "_qat_model", self.model)  # kept aside, not registered as a submodule
        self.model = qat.convert(self.model)  # a frozen copy (Lightning runs this hook under inference_mode)

    def on_test_end(self) -> None:
        self.model = self._qat_model  # the QAT model again, should training resume

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default=None, help="Planetoid root holding Cora/raw (default: found, else synthetic)")
    p.add_argument("--synthetic", action="store_true")
    p.add_argument("--nodes", type=int, default=20000, help="nodes of the synthetic graph")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--parts", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=4, help="parts per batch")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fast-dev-run", action="store_true", help="one batch of train/val/test (Lightning's check)")
    p.add_argument("--small", action="store_true",
                   help="quick run: defaults of 2,000 synthetic nodes, 8 parts, 2 per batch, hidden 32, 15 epochs")
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--no-progress", action="store_true")
    return cluster_parse_args(p, argv)


def main(argv=None):
    args = parse_args(argv)
    L.seed_everything(args.seed, verbose=False)
    data, source = load_data(args.root, args.synthetic, num_nodes=args.nodes, seed=args.seed)
    print(f"data: {source}")
    datamodule = QuantClusterDataModule(data, args.parts, args.batch_size, args.bits, self_loops=1,
                                        num_workers=args.workers)
    module = QuantGCNModule(datamodule.num_features, datamodule.num_classes, args.hidden, args.layers, args.bits,
                            seed=args.seed)
    trainer = L.Trainer(max_epochs=args.epochs, accelerator=args.accelerator, devices=1,
                        fast_dev_run=args.fast_dev_run, enable_progress_bar=not args.no_progress,
                        enable_model_summary=False, logger=False, enable_checkpointing=False,
                        num_sanity_val_steps=0)
    trainer.fit(module, datamodule=datamodule)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}  # train_loss, train_acc, val_acc
    trainer.test(module, datamodule=datamodule, verbose=not args.no_progress)  # on the converted model
    metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    metrics["skipped_batches"] = module.skipped_batches
    print(f"{args.bits}-bit GCN (Lightning): " + ", ".join(
        f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in sorted(metrics.items())))
    return {"metrics": metrics, "module": module, "trainer": trainer}


if __name__ == "__main__":
    main()
