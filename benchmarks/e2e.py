r"""End-to-end benchmark against PyG: inference and training epochs on products-scale cluster batches (issue 8).

One device call: builds the workload of ``benchmarks/workload`` on the GPU (an ogbn-products-sized synthetic graph
in 75 Cluster-GCN batches of 32,000 nodes and ~1.27M edges; GCN 3 layers 100 → 16 → 16 → 47, GIN 3 layers of
hidden 64) and times whole epochs (all batches) of PyG's GCN / GIN against pyg_quant's QGCNConv / QGINConv stacks,
in inference (with and without the host-to-device copy of every batch, eagerly and as per-batch CUDA-graph
replays) and in training (PyG fp32 vs ``pyg_quant.qat.prepare(model, bits=4)``).  Prints markdown tables, writes
``--out`` JSON after every configuration and a PNG plot at the end.  Measurements: ``benchmarks/RESULTS.md``.

Usage (repository root; the extension must be built for the device's torch first)::

    python benchmarks/e2e.py --out $OUT/e2e.json          # GPU, products scale (< 6 min)
    python benchmarks/e2e.py --small                       # CPU check: 40K nodes, < 2 min

Variants
--------
* PyG: ``GCNConv`` / ``GINConv`` in fp32 and bf16, with ``edge_index`` (GCN normalizes every call, as in
  PyG's Cluster-GCN example) and with a torch CSR ``adj_t`` (GCN: pre-normalized ``D^-1/2 (A+I) D^-1/2``
  built once per batch, ``normalize=False``: PyG's fastest path).
* pyg_quant: ``QGCNConv`` / ``QGINConv`` at 8/4/2/1 bits in ``eval()`` under ``inference_mode``, fed
  what ``QuantClusterLoader`` hands over: a ``QuantBatch`` (one wire buffer) holding the adjacency's tile
  plan (``CompactAdjacency``, a byte an edge, decoded into a ``BitAdjacency`` on the device;
  ``self_loops=1`` for GCN) and ``BitTensor`` features (``dim=0``, ``layout="col"``, one range per column
  over all 2.4M nodes, as ``QuantizedFeatures``).  GIN hidden layers pass ``out_bits=bits``; GCN cannot
  (no activation before the requantization: ReLU runs on floats between its layers).
* ``pyg_quant N-bit static``: the same layers with static activation ranges (``pyg_quant.nn.calibrate``): the
  per-channel ranges of what each layer requantizes for the next aggregation (GIN: its hidden outputs; GCN:
  ``D^-1/2 X W``) recorded over ``--calibration-batches`` (4) batches -- the last ones of the epoch, so that the
  accuracy column's batch 0 is not among them -- and fixed; the fused MLP kernel then writes the codes itself
  (no column quantizer, no column-key reduction).  Values outside a calibrated range clamp to its end codes.
* ``pq-kernels``: not a layer of the package, a diagnostic: the same models written directly on
  ``pyg_quant.bit_spmm`` with its fused epilogue (GIN: ``A·X̃ + (1+ε)X̃`` in the kernel; GCN:
  ``relu(D^-1/2 (A+I) X̃ + b)`` in the kernel) and fp32 dense layers, to show what the kernels allow.
* Training (forward + backward + Adam): PyG fp32 on ``edge_index`` and on CSR, and QAT at ``--qat-bits`` on
  ``edge_index`` (also fed the loader's bit features) and on the loader's batches (their ``BitAdjacency``, with float
  or bit features), eagerly, under ``torch.compile`` (on the GPU by default) and as a
  ``pyg_quant.CapturedTrainStep``; ``--train-variants`` picks some.  After a model's variants, ``--train-rounds``
  rounds time one resident epoch of each in turn (the comparison the host's drift spreads over all alike).

Method
------
* Transfer: every batch sits in pinned host memory and is copied per batch with ``non_blocking`` copies
  on the compute stream (no prefetch overlap, for every variant alike): PyG fp32 ships float32 ``x`` +
  int64 ``edge_index`` or CSR (int64 ``crow``/``col``, fp32 values); bf16 ships bf16 ``x`` / values;
  pyg_quant ships the ``QuantBatch`` buffer (one copy) and decodes it on the device.  "Resident" means the
  batches were copied (and decoded) before.
* Timing: CUDA events around a whole epoch (75 batches, no host sync inside the loop from the script),
  one warm-up epoch, median of ``--reps`` (3) epochs.  Ratios are taken within this run.  The CUDA-graph
  variant captures one graph per batch (shared memory pool, replayed in capture order); for "+H2D" the
  batch is copied into the captured input buffers before its replay (pyg_quant: into the wire buffer, and
  the decode is captured with the forward).  Kernel launches per batch come from
  ``torch.profiler`` (device kernels in one eager forward of batch 0), host syncs per batch from
  ``torch.cuda.set_sync_debug_mode``.  Each configuration is wrapped: an error is recorded and the run
  goes on; ``--time-budget`` (s) skips what would start after it.
* Several streams ("3 streams" columns, ``--streams``, default 3): the graph variants again, with batch i's graph
  captured from pool i % 3 and replayed on stream i % 3 (for +H2D its copies too, on that stream), so that one
  batch's kernels can run beside the next ones' and its copies beside the other streams' kernels; the epoch ends
  when every stream is done.  Same for PyG's graphs and ours; "PyG's fastest" takes the best of all its columns.
* Stream: every variant runs on one dedicated stream, because on torch's legacy default stream each graph launch
  waits longer once other streams exist (``benchmarks/RESULTS.md``, section 3); ``graph_profile`` in the JSON gives,
  per batch, the kernels' time, the span and the gaps inside and between graphs.
* The tables' "predicted" column: the ms an epoch predicted for an H100 at products scale before the first run
  (``workload.e2e_report.PREDICTED``; how they were derived is in git history).

The sections live in ``workload/e2e_inference.py`` (inference, CUDA graphs, the pq-kernels diagnostic),
``workload/e2e_training.py`` (transfer, training) and ``workload/e2e_report.py`` (ratios, targets, tables, plot).

``--time-budget`` (280 s) stops starting new configurations, so that a slow run still ends inside 6 minutes with
everything measured so far in the JSON.  Device memory: ~8 GB of batches in every format plus ~10 GB transient
while building the graph.
"""
import contextlib
import datetime
import os
import sys
import time
import warnings

import torch

# The workload first: it finds pyg_quant in a checkout without an install.
from workload import Recorder, Runner, build_formats, build_graph, device_name, log, parse_args, pq, torch_geometric
from workload.e2e_inference import run_inference
from workload.e2e_report import plot, summarize, tables, targets
from workload.e2e_training import run_training, run_transfer


def main(argv=None):
    args = parse_args(argv, description=__doc__.split("\n\n")[0])
    device = torch.device(args.device)
    if args.threads is None and device.type == "cpu":
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.cuda.init()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    meta = dict(date=date, device=str(device), device_name=device_name(device),
                capability=".".join(map(str, torch.cuda.get_device_capability(device))) if device.type == "cuda" else None,
                torch=torch.__version__, cuda=torch.version.cuda, torch_geometric=torch_geometric.__version__,
                pyg_quant=pq.__version__, backends=pq.backends(), threads=torch.get_num_threads(),
                allow_tf32=torch.backends.cuda.matmul.allow_tf32, args=vars(args),
                command=" ".join([os.path.basename(sys.executable)] + sys.argv))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rec = Recorder(args.out, meta, device.type)
    runner = Runner(args, device, rec)
    print(f"# pyg_quant end-to-end benchmark ({date})")
    print(f"device {device} ({meta['device_name']}), torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"torch_geometric {torch_geometric.__version__}, pyg_quant backends {pq.backends()}, "
          f"threads {torch.get_num_threads()}", flush=True)
    if device.type == "cuda" and not pq.backends()["cuda"]:
        print("WARNING: pyg_quant's CUDA kernels are not loaded (build the extension for this torch first); "
              "pyg_quant rows will be skipped", flush=True)
    rec.save()

    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")  # PyG/torch beta-state notices, once per call
    try:
        t = time.perf_counter()
        data = build_graph(args, device, rec)
        data.adjacency = args.adjacency
        build_formats(args, device, data, rec, runner)
        rec.data["timeline"]["build_s"] = round(time.perf_counter() - t, 1)
        rec.save()
    except Exception as error:  # noqa: BLE001  (nothing to measure without the graph)
        rec.error("build", error)
        raise
    if device.type == "cuda":
        log(f"device memory after build: {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated, "
            f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB peak")
        rec.data["meta"]["device_memory_after_build_gib"] = torch.cuda.memory_allocated() / 2**30

    # Every variant runs on one dedicated stream, the same for PyG and pyg_quant: on torch's legacy default stream,
    # once other streams exist (each graph capture makes one), every graph launch waits longer (RESULTS.md, section 3).
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    rec.data["meta"]["stream"] = "dedicated (torch.cuda.Stream)" if stream is not None else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for section, fn in (("inference", run_inference), ("training", run_training), ("transfer", run_transfer)):
            if section not in args.sections:
                continue
            t = time.perf_counter()
            try:
                fn(args, device, data, rec, runner)
            except Exception as error:  # noqa: BLE001
                rec.error(section, error)
            rec.data["timeline"][f"{section}_s"] = round(time.perf_counter() - t, 1)
            summarize(rec, args)
            rec.save()

    if device.type == "cuda":
        rec.data["meta"]["device_memory_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    summarize(rec, args)
    text = tables(rec, args)
    print(text)
    s = rec.data["summary"]
    print("\n### Summary (ratios within this run)")
    for kind in args.models:
        for mode in ("resident", "+H2D"):
            best = s.get(kind, {}).get(f"pyg_fastest_{mode}")
            if best:  # the per-variant ratios are the table's "× vs PyG fastest" column
                print(f"- {kind} {mode}: PyG fastest = {best['path']} {best['ms']:.2f} ms/epoch")
    rec.data["targets"] = targets(rec, args)
    if rec.data["targets"]:
        print("\n### Targets (issue 8)")
        for t in rec.data["targets"]:
            print(f"- {'MET   ' if t['met'] else 'MISSED'} {t['target']}: measured {t['measured']}")
    rec.finish(text)
    if args.png:
        try:
            plot(rec, args, args.png)
            print(f"wrote {args.png}")
        except Exception as error:  # noqa: BLE001
            rec.error("plot", error)
    if args.out:
        rec.save()
        print(f"wrote {args.out}")
    log("done")
    return rec.data


if __name__ == "__main__":
    main()
