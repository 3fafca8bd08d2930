r"""The products-scale workload the end-to-end benchmarks share (``e2e.py``, ``user_paths.py``, ``host_profile.py``,
``multi_gpu.py``): an ogbn-products-sized graph in Cluster-GCN batches, its batches in PyG's and pyg_quant's
formats, the models, and the run's recording and timing.  Measured numbers: ``benchmarks/RESULTS.md``.

* :mod:`.graph`: :func:`build_graph` (by default a planted partition of 1,500 parts × 1,600 nodes = 2.4M nodes,
  ~119M directed edges with 80% inside a part, 100 features, 47 classes; 75 batches of 20 parts = 32,000 nodes and
  ~1.27M edges, built once) and :func:`build_formats` (every batch as ``edge_index``, torch CSR, bit features and
  the loader's tile plan, with host copies); :func:`probe_workload`, both for a probe that records no JSON.
* :mod:`.models`: :func:`make_pyg` / :func:`make_pq` (GCN 3 layers 100 → 16 → 16 → 47, GIN 3 layers of hidden 64)
  on :class:`Net`.
* :mod:`.inputs`: :func:`pyg_inputs` / :func:`pq_inputs`, a variant's batches resident, on the host, and copied.
* :mod:`.recording`: :class:`Recorder` (the JSON document), :class:`Runner` (timed epochs under a time budget),
  :func:`log`.
* :mod:`.profiling`: :func:`rel_err`, :func:`count_syncs`, :func:`profile_batch`.
* :mod:`.options`: :func:`add_workload_arguments`, and :func:`parse_args` (``e2e.py``'s command line).
* ``e2e.py``'s sections (imported by it, not here): :mod:`.e2e_inference`, :mod:`.e2e_training` (transfer and
  training) and :mod:`.e2e_report` (ratios, targets, tables, plot).

Each script puts ``benchmarks/`` on ``sys.path`` and imports ``workload``.
"""
import os
import sys

try:
    import pyg_quant as pq
except ImportError:  # run from a checkout without an install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import pyg_quant as pq
import torch_geometric

from .graph import Data, build_formats, build_graph, host_copy, nbytes, probe_workload
from .inputs import Inputs, pq_host_batches, pq_inputs, pyg_inputs
from .models import Net, gcn_dims, gin_dims, gin_mlp, make_pq, make_pyg
from .options import add_workload_arguments, parse_args
from .profiling import count_syncs, kernel_category, kernel_totals, profile_batch, rel_err
from .recording import T0, Recorder, Runner, cuda_alive, device_name, epoch_stats, first_line, log

__all__ = ["pq", "torch_geometric", "Data", "build_graph", "build_formats", "host_copy", "nbytes", "probe_workload",
           "Inputs", "pq_host_batches", "pq_inputs", "pyg_inputs", "Net", "gcn_dims", "gin_dims", "gin_mlp", "make_pq",
           "make_pyg", "add_workload_arguments", "parse_args", "count_syncs", "kernel_category", "kernel_totals",
           "profile_batch", "rel_err", "T0", "Recorder", "Runner", "cuda_alive", "device_name", "epoch_stats",
           "first_line", "log"]
