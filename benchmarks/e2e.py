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
  (``PREDICTED``; how they were derived is in this file's history).

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
import torch.nn.functional as F

# The workload first: it finds pyg_quant in a checkout without an install.
from workload import (Data, Net, Recorder, Runner, build_formats, build_graph, count_syncs, device_name, kernel_totals,
                      log, make_pq, make_pyg, parse_args, pq, pq_host_batches, pq_inputs, profile_batch,
                      epoch_stats, pyg_inputs, rel_err, torch_geometric)

from pyg_quant.loader import QuantBatch
from pyg_quant.quantization.quantize import quantize as pq_quantize  # the layers' quantizer: no host checks

# Predicted ms per epoch on an H100 at the default (products) scale, before the first run (the tables'
# "predicted" column).
PREDICTED = {
    ("GIN", "PyG fp32 CSR", "resident"): 32, ("GIN", "PyG fp32 CSR", "+H2D"): 74,
    ("GIN", "PyG fp32 edge_index", "resident"): 68, ("GIN", "PyG fp32 edge_index", "+H2D"): 118,
    ("GCN", "PyG fp32 CSR", "resident"): 14, ("GCN", "PyG fp32 CSR", "+H2D"): 57,
    ("GCN", "PyG fp32 edge_index", "resident"): 54, ("GCN", "PyG fp32 edge_index", "+H2D"): 104,
    ("GIN", "pyg_quant 4-bit", "resident"): 100, ("GIN", "pyg_quant 4-bit", "+H2D"): 115,
    ("GIN", "pyg_quant 4-bit", "graph resident"): 55, ("GIN", "pyg_quant 4-bit", "graph +H2D"): 70,
    ("GCN", "pyg_quant 4-bit", "resident"): 75, ("GCN", "pyg_quant 4-bit", "+H2D"): 90,
    ("GCN", "pyg_quant 4-bit", "graph resident"): 35, ("GCN", "pyg_quant 4-bit", "graph +H2D"): 50,
    ("GIN", "pq-kernels 4-bit", "resident"): 26, ("GIN", "pq-kernels 4-bit", "graph resident"): 23,
    ("GIN", "pq-kernels 4-bit", "graph +H2D"): 38,
    ("GCN", "pq-kernels 4-bit", "resident"): 20, ("GCN", "pq-kernels 4-bit", "graph resident"): 15,
    ("GIN", "train PyG fp32 edge_index", "+H2D"): 260, ("GIN", "train PyG fp32 CSR", "+H2D"): 132,
    ("GIN", "train QAT 4-bit edge_index", "+H2D"): 340,
    ("GCN", "train PyG fp32 edge_index", "+H2D"): 200, ("GCN", "train QAT 4-bit edge_index", "+H2D"): 250,
}


# --- the pq-kernels diagnostic, CUDA graphs ----------------------------------------------------------
class KernelNet(torch.nn.Module):
    """pq-kernels: the PyG model's weights run on bit_spmm's fused epilogue + fp32 dense layers."""

    def __init__(self, pyg_model: Net, kind: str, bits: int):
        super().__init__()
        self.model, self.kind, self.bits = pyg_model, kind, bits
        if kind == "GIN":
            self.self_weight = [1.0 + float(conv.eps) for conv in pyg_model.convs]  # read once, not per call

    def forward(self, x, adj):
        last = len(self.model.convs) - 1
        if self.kind == "GIN":
            h = x
            for i, conv in enumerate(self.model.convs):
                hq = h if isinstance(h, pq.BitTensor) else pq_quantize(h, self.bits, 0, "col")
                h = conv.nn(pq.bit_spmm(adj, hq, self_weight=self.self_weight[i]))
            return h
        dinv = adj.degree().pow(-0.5)
        h = pq.to_val(x) if isinstance(x, pq.BitTensor) else x
        for i, conv in enumerate(self.model.convs):
            hq = pq_quantize(conv.lin(h) * dinv.view(-1, 1), self.bits, 0, "col")
            h = pq.bit_spmm(adj, hq, row_scale=dinv, bias=conv.bias, relu=i < last)
        return h


@contextlib.contextmanager
def no_finite_checks():
    """The layers' isfinite checks are host syncs, which a CUDA graph capture refuses: off while capturing."""
    import pyg_quant.graph.quant_graph as m_graph
    import pyg_quant.nn.qgin_conv as m_gin
    import pyg_quant.nn.quant_linear as m_lin
    saved = [(m, m.check_finite) for m in (m_graph, m_gin, m_lin) if hasattr(m, "check_finite")]
    for m, _ in saved:
        m.check_finite = lambda *a, **k: None
    try:
        yield
    finally:
        for m, fn in saved:
            m.check_finite = fn



def profile_graph_epoch(runner: Runner, replay_epoch, batches: int) -> dict:
    """Where a graph-replay epoch's time goes, per batch: the device kernels of one profiled epoch (CUPTI records
    the kernels a graph launches), their sum, the span from the first kernel's start to the last one's end, and the
    idle time between consecutive kernels, split at the batch boundaries: "between" is the gap from one batch's last
    kernel to the next batch's first, "inside" every other gap.  No split when the batches' kernel counts differ."""
    from torch.profiler import ProfilerActivity, profile
    from torch.autograd import DeviceType
    replay_epoch()
    runner.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay_epoch()
        runner.sync()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA
                      and not e.name.startswith(("Memcpy", "Memset"))), key=lambda e: e.time_range.start)
    if not kernels:
        return dict(note="the profiler saw no kernels inside the graphs")
    per_graph = len(kernels) / batches
    inside = between = 0.0
    for i in range(1, len(kernels)):
        gap = max(0.0, kernels[i].time_range.start - kernels[i - 1].time_range.end)
        if per_graph.is_integer() and i % int(per_graph) == 0:
            between += gap
        else:
            inside += gap
    by_name = kernel_totals(kernels, lambda e: e.name[:90])
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    return dict(kernels_per_batch=per_graph, kernel_us_per_batch=sum(v[1] for v in by_name.values()) / batches,
                span_us_per_batch=span / batches, gap_inside_us_per_batch=inside / batches,
                gap_between_us_per_batch=between / batches if per_graph.is_integer() else None,
                top_kernels=[dict(name=k, per_batch=v[0] / batches, us_per_batch=round(v[1] / batches, 2))
                             for k, v in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:14]])


class GraphSet:
    """One CUDA graph per batch, captured in order.  ``pools=1``: every graph from one shared pool, replayed in
    capture order on one stream.  ``pools=k > 1``: batch i's graph from pool i % k, so that k batches can replay on
    k streams at once (:meth:`replay_on_streams`): graphs of one pool reuse each other's memory and must run in
    capture order, which one stream a pool keeps."""

    def __init__(self, runner: Runner, forward, inputs, pools: int = 1):
        self.graphs, self.outputs = [], []
        handles = [torch.cuda.graph_pool_handle() for _ in range(pools)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward(*inputs[0])  # warm-up on a side stream, as torch.cuda.graph's docs ask
        torch.cuda.current_stream().wait_stream(side)
        runner.sync()
        for i, inp in enumerate(inputs):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=handles[i % pools]):
                out = forward(*inp)
            self.graphs.append(graph)
            self.outputs.append(out)
        runner.sync()
        self.streams = [torch.cuda.Stream() for _ in range(pools)] if pools > 1 else None

    def replay_on_streams(self, copies=None) -> None:
        """Batch i (its copies, if given, then its graph) on stream i % k: one batch's kernels run beside the
        next ones', and its copies beside the other streams' kernels.  The current stream waits for all."""
        main = torch.cuda.current_stream()
        for stream in self.streams:
            stream.wait_stream(main)
        for i, graph in enumerate(self.graphs):
            with torch.cuda.stream(self.streams[i % len(self.streams)]):
                if copies is not None:
                    for dst, src in copies[i]:
                        dst.copy_(src, non_blocking=True)
                graph.replay()
        for stream in self.streams:
            main.wait_stream(stream)



# --- inference ---------------------------------------------------------------------------------------
def pq_calibration_batches(data: Data, kind: str, bits: int, device, count: int):
    """``(x, adj)`` of the epoch's last ``count`` batches on ``device``, for ``pyg_quant.nn.calibrate``."""
    for host in pq_host_batches(data, kind, bits, False, range(max(data.nb - count, 0), data.nb)):
        batch = host.to(device)
        yield batch.x, batch.adj



def run_inference(args, device, data: Data, rec: Recorder, runner: Runner) -> None:
    pinned = device.type == "cuda"
    for kind in args.models:
        torch.manual_seed(args.seed)
        base = make_pyg(args, kind).to(device).eval()
        state = base.state_dict()
        with torch.inference_mode():
            ref = base(data.x[0], data.edge_index[0]).float().clone()
        del base

        variants = []  # (label, impl, precision, adjacency, make model, make inputs, graphable)
        for adjacency in ("CSR", "edge_index"):
            for precision in ("fp32", "bf16"):
                def make(adjacency=adjacency, precision=precision):
                    m = make_pyg(args, kind, normalize=(adjacency == "edge_index" or kind != "GCN"))
                    m.load_state_dict(state)
                    m = m.to(device).eval()
                    return m.to(torch.bfloat16) if precision == "bf16" else m

                def inputs(adjacency=adjacency, precision=precision):
                    return pyg_inputs(data, kind, adjacency, precision, device)
                variants.append((f"PyG {precision} {adjacency}", "PyG", precision, adjacency, make, inputs,
                                 adjacency == "CSR"))
        for bits in args.bits:
            def make_q(bits=bits):
                m = make_pq(args, kind, bits)
                m.load_state_dict(state)
                return m.to(device).eval()

            def make_k(bits=bits):
                m = make_pyg(args, kind)
                m.load_state_dict(state)
                return KernelNet(m.to(device).eval(), kind, bits)

            def inputs_q(bits=bits):
                return pq_inputs(data, kind, bits, device, pinned)
            variants.append((f"pyg_quant {bits}-bit", "pyg_quant", f"{bits}-bit", "BitAdjacency", make_q, inputs_q,
                             True))
            if bits in args.static_bits:
                def make_s(bits=bits):
                    m = make_q(bits)
                    with torch.inference_mode(), pq.nn.calibrate(m):
                        for x, adj in pq_calibration_batches(data, kind, bits, device, args.calibration_batches):
                            m(x, adj)
                    return m
                variants.append((f"pyg_quant {bits}-bit static", "pyg_quant", f"{bits}-bit static", "BitAdjacency",
                                 make_s, inputs_q, True))
            if bits in args.kernel_bits:
                variants.append((f"pq-kernels {bits}-bit", "pq-kernels", f"{bits}-bit", "BitAdjacency", make_k,
                                 inputs_q, True))

        pq_ok = pq.backends()["cuda" if device.type == "cuda" else "cpu"]
        log(f"== inference {kind}: {len(variants)} variants")
        for label, impl, precision, adjacency, make, inputs, graphable in variants:
            row = dict(model=kind, label=label, impl=impl, precision=precision, adjacency=adjacency)
            rec.data["inference"].append(row)
            if impl != "PyG" and not pq_ok:
                row["error"] = "pyg_quant's compiled kernels are not loaded here (reference path: not timed)"
                rec.save()
                continue
            if not runner.allowed(f"{kind} {label}", need_s=8):
                row["skipped"] = True
                rec.save()
                continue
            try:
                run_variant(args, device, rec, runner, kind, row, make, inputs, ref, graphable)
            except Exception as error:  # noqa: BLE001  (record, clean up, go on)
                row["error"] = rec.error(f"inference {kind} {label}", error)
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                rec.save()


def run_variant(args, device, rec, runner: Runner, kind, row, make, inputs, ref, graphable) -> None:
    model = make()
    inp = inputs()
    row["h2d_bytes_per_batch"] = inp.bytes_per_batch[0]
    row["h2d_mb_per_epoch"] = sum(inp.bytes_per_batch) / 1e6
    resident, host, load = inp.resident, inp.host, inp.load

    with torch.inference_mode():
        row["rel_err_vs_pyg_fp32"] = rel_err(model(*resident[0]), ref)

        def epoch_resident():
            for args_ in resident:
                model(*args_)

        def epoch_h2d():
            for hb in host:
                model(*load(hb))

        row["resident"] = runner.measure(epoch_resident)
        log(f"  {kind} {row['label']:22s} resident {row['resident']['median_ms']:9.2f} ms/epoch  "
            f"rel.err vs PyG fp32 {row['rel_err_vs_pyg_fp32']:.2e}")
        rec.save()
        # On the CPU the "host" batches are the resident ones: one epoch exercises the code path.
        row["h2d"] = runner.measure(epoch_h2d, **({} if runner.cuda else dict(warmup=0, reps=1)))
        log(f"  {kind} {row['label']:22s} +H2D     {row['h2d']['median_ms']:9.2f} ms/epoch  "
            f"({row['h2d_mb_per_epoch']:.0f} MB/epoch)")
        rec.save()

        try:  # launches and host syncs per batch (eager, batch 0)
            row["syncs_per_batch"] = count_syncs(runner, lambda: model(*resident[0]))
            prof = profile_batch(runner, lambda: model(*resident[0]))
            row["kernels_per_batch"] = prof.get("kernels") or prof.get("top_level_ops")
            row["gpu_kernel_us_per_batch"] = prof.get("kernel_us")
            rec.data["profiles"].append(dict(model=kind, label=row["label"], **prof))
        except Exception as error:  # noqa: BLE001
            row["profile_error"] = rec.error(f"profile {kind} {row['label']}", error)
        rec.save()

        if graphable and runner.cuda and args.graphs and runner.allowed(f"{kind} {row['label']} graphs", 10):
            try:
                t = time.perf_counter()
                with no_finite_checks():
                    gs = GraphSet(runner, model, resident)
                row["graph_capture_s"] = round(time.perf_counter() - t, 2)
                gs.graphs[0].replay()
                row["graph_rel_err_vs_eager"] = rel_err(gs.outputs[0], model(*resident[0]).float())

                def graph_resident():
                    for graph in gs.graphs:
                        graph.replay()

                row["graph_resident"] = runner.measure(graph_resident)
                try:
                    row["graph_profile"] = gp = profile_graph_epoch(runner, graph_resident, len(gs.graphs))
                    if "span_us_per_batch" in gp:
                        log(f"  {kind} {row['label']:22s} graph profile, per batch: {gp['kernels_per_batch']:.0f} "
                            f"kernels, {gp['kernel_us_per_batch']:.1f} us of kernels in a {gp['span_us_per_batch']:.1f}"
                            f" us span (gaps {gp['gap_inside_us_per_batch']:.1f} inside the graph, "
                            f"{gp['gap_between_us_per_batch'] or 0:.1f} between graphs)")
                except Exception as error:  # noqa: BLE001
                    row["graph_profile_error"] = rec.error(f"graph profile {kind} {row['label']}", error)
                if inp.wire is not None:  # H2D graphs decode the refilled buffer, then run the forward
                    del gs
                    def forward_from_wire(buffer, specs, meta):
                        batch = QuantBatch(buffer, specs, meta)
                        return model(batch.x, batch.adj)
                    with no_finite_checks():
                        gs = GraphSet(runner, forward_from_wire, inp.wire)
                    gs.graphs[0].replay()
                    row["graph_decode_rel_err_vs_eager"] = rel_err(gs.outputs[0], model(*resident[0]).float())

                def graph_h2d():
                    for copies, graph in zip(inp.copies, gs.graphs):
                        for dst, src in copies:
                            dst.copy_(src, non_blocking=True)
                        graph.replay()
                row["graph_h2d"] = runner.measure(graph_h2d)
                log(f"  {kind} {row['label']:22s} graph    {row['graph_resident']['median_ms']:9.2f} ms/epoch, "
                    f"+H2D {row['graph_h2d']['median_ms']:.2f} (capture {row['graph_capture_s']:.1f} s, "
                    f"graph vs eager rel.err {row['graph_rel_err_vs_eager']:.1e})")
                del gs
                if args.streams > 1 and runner.allowed(f"{kind} {row['label']} graphs on {args.streams} streams", 10):
                    multi_stream_graphs(runner, row, model, resident, inp, args.streams)
            except Exception as error:  # noqa: BLE001
                row["graph_error"] = rec.error(f"graphs {kind} {row['label']}", error)
            rec.save()


def multi_stream_graphs(runner: Runner, row, model, resident, inp, streams: int) -> None:
    """The graph variants again with batch i on stream i % ``streams`` (a graph pool each): resident, and +H2D with
    each batch's copies on its own stream, so that they overlap the other streams' kernels."""
    row["streams"] = streams
    with no_finite_checks():
        gs = GraphSet(runner, model, resident, pools=streams)
    for graph in gs.graphs[:streams]:
        graph.replay()
    runner.sync()
    row["graph_streams_rel_err_vs_eager"] = rel_err(gs.outputs[0], model(*resident[0]).float())
    row["graph_resident_streams"] = runner.measure(gs.replay_on_streams)
    if inp.wire is not None:
        del gs

        def forward_from_wire(buffer, specs, meta):
            batch = QuantBatch(buffer, specs, meta)
            return model(batch.x, batch.adj)
        with no_finite_checks():
            gs = GraphSet(runner, forward_from_wire, inp.wire, pools=streams)
    row["graph_h2d_streams"] = runner.measure(lambda: gs.replay_on_streams(inp.copies))
    log(f"  {row['model']} {row['label']:22s} {streams} streams {row['graph_resident_streams']['median_ms']:8.2f} "
        f"ms/epoch, +H2D {row['graph_h2d_streams']['median_ms']:.2f} "
        f"(rel.err vs eager {row['graph_streams_rel_err_vs_eager']:.1e})")
    del gs


# --- transfer only -----------------------------------------------------------------------------------
def host_nbytes(hb) -> int:
    if isinstance(hb, QuantBatch):
        return hb.nbytes
    return sum(t.numel() * t.element_size() for t in hb)


def run_transfer(args, device, data: Data, rec: Recorder, runner: Runner) -> None:
    pinned = device.type == "cuda"
    log("== transfer-only epochs (pinned host -> device copies, no compute)" if pinned else
        "== transfer-only epochs: on the CPU nothing is copied (a code-path check)")
    formats = [("PyG fp32 edge_index", lambda: pyg_inputs(data, "GIN", "edge_index", "fp32", device).host),
               ("PyG fp32 CSR (GIN: A)", lambda: pyg_inputs(data, "GIN", "CSR", "fp32", device).host),
               ("PyG fp32 CSR (GCN: A+I)", lambda: pyg_inputs(data, "GCN", "CSR", "fp32", device).host),
               ("PyG bf16 CSR (GIN: A)", lambda: pyg_inputs(data, "GIN", "CSR", "bf16", device).host)]
    for bits in args.bits:
        formats.append((f"pyg_quant {bits}-bit (GIN batch)", lambda bits=bits: pq_host_batches(data, "GIN", bits, pinned)))
    formats.append((f"pyg_quant {min(args.bits)}-bit (GCN batch)",
                    lambda: pq_host_batches(data, "GCN", min(args.bits), pinned)))
    base = None
    for label, factory in formats:
        row = dict(label=label)
        rec.data["transfer"].append(row)
        if not runner.allowed(f"transfer {label}", 4):
            continue
        try:
            host = factory()
            total = sum(host_nbytes(h) for h in host)

            def epoch():
                for hb in host:
                    if isinstance(hb, QuantBatch):
                        hb.to(device)
                    else:
                        for t in hb:
                            t.to(device, non_blocking=True)
            row.update(mb_per_batch=total / len(host) / 1e6, mb_per_epoch=total / 1e6,
                       copies_per_batch=1 if isinstance(host[0], QuantBatch) else len(host[0]))
            row["copy"] = runner.measure(epoch)
            row["gb_per_s"] = total / (row["copy"]["median_ms"] * 1e-3) / 1e9 if pinned else None
            if label.startswith("PyG fp32 CSR (GIN"):
                base = total
            if base:
                row["bytes_vs_pyg_fp32_csr"] = base / total
            log(f"  {label:32s} {row['mb_per_epoch']:8.0f} MB/epoch  {row['copy']['median_ms']:8.2f} ms  "
                f"{fmt(row['gb_per_s'], 1)} GB/s")
        except Exception as error:  # noqa: BLE001
            row["error"] = rec.error(f"transfer {label}", error)
        rec.save()


# --- training ----------------------------------------------------------------------------------------
def run_training(args, device, data: Data, rec: Recorder, runner: Runner) -> None:
    pinned = device.type == "cuda"
    qb = args.qat_bits
    for kind in args.models:
        torch.manual_seed(args.seed)
        init = make_pyg(args, kind).state_dict()
        # The last field: None (eager), "captured" (CapturedTrainStep) or "compile" (torch.compile(model)).
        variants = [("PyG fp32 edge_index", "PyG", "edge_index", "fp32 x", None),
                    ("PyG fp32 CSR", "PyG", "CSR", "fp32 x", None),
                    ("PyG fp32 edge_index, torch.compile", "PyG", "edge_index", "fp32 x", "compile"),
                    ("PyG fp32 edge_index, captured step", "PyG", "edge_index", "fp32 x", "captured"),
                    (f"QAT {qb}-bit edge_index", "QAT", "edge_index", "fp32 x", None),
                    (f"QAT {qb}-bit edge_index, torch.compile", "QAT", "edge_index", "fp32 x", "compile"),
                    (f"QAT {qb}-bit edge_index, captured step", "QAT", "edge_index", "fp32 x", "captured"),
                    (f"QAT {qb}-bit edge_index, {qb}-bit x", "QAT", "edge_index", "bit x", None),
                    (f"QAT {qb}-bit BitAdjacency", "QAT", "BitAdjacency", "fp32 x", None),
                    (f"QAT {qb}-bit BitAdjacency, {qb}-bit x", "QAT", "BitAdjacency", "bit x", None),
                    (f"QAT {qb}-bit BitAdjacency, torch.compile", "QAT", "BitAdjacency", "fp32 x", "compile")]
        # torch.compile's variants by default on the GPU only (inductor takes minutes to compile them on a small CPU)
        variants = [v for v in variants if (any(want in v[0] for want in args.train_variants)
                                            if args.train_variants is not None
                                            else v[4] != "compile" or device.type == "cuda")]
        log(f"== training {kind}: {len(variants)} variants")
        torch._dynamo.reset()
        timed = []  # (row, one resident epoch) of every variant measured, for the interleaved rounds
        for label, impl, adjacency, xform, mode in variants:
            row = dict(model=kind, label="train " + label, impl=impl, adjacency=adjacency, features=xform,
                       captured=mode == "captured", compiled=mode == "compile")
            rec.data["training"].append(row)
            if not runner.allowed(f"train {kind} {label}", 10):
                row["skipped"] = True
                rec.save()
                continue
            try:
                resident_epoch = run_train_variant(args, device, data, rec, runner, kind, row, init, impl, adjacency,
                                                   xform, pinned, mode)
                if resident_epoch is not None:
                    timed.append((row, resident_epoch))
            except Exception as error:  # noqa: BLE001
                row["error"] = rec.error(f"training {kind} {label}", error)
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                rec.save()
        interleave_training(args, runner, rec, kind, timed)


def interleave_training(args, runner: Runner, rec: Recorder, kind: str, timed) -> None:
    """``--train-rounds`` rounds of one resident epoch of every measured variant in turn; each row gets the median
    as ``resident_interleaved``, and × = PyG fp32 CSR's median over the variant's (a stall of the host costs a
    variant one epoch, not its whole measurement)."""
    if args.train_rounds <= 0 or not timed:
        return
    times = [[] for _ in timed]
    for _ in range(args.train_rounds):
        if runner.time_left() < 30:
            break
        for k, (_, epoch) in enumerate(timed):
            times[k].append(runner.epoch_ms(epoch))
    if not times[0]:
        return
    for (row, _), t in zip(timed, times):
        row["resident_interleaved"] = epoch_stats(t)
    pyg = [row["resident_interleaved"]["median_ms"] for row, _ in timed if row["label"] == "train PyG fp32 CSR"]
    log(f"  {kind}: resident epochs, {len(times[0])} interleaved rounds (median ms, × PyG fp32 CSR's time)")
    for row, _ in timed:
        median = row["resident_interleaved"]["median_ms"]
        ratio = f" ({pyg[0] / median:.2f}×)" if pyg else ""
        log(f"    {row['label']:50s} {median:9.1f}{ratio}")
    rec.save()


def run_train_variant(args, device, data, rec, runner, kind, row, init, impl, adjacency, xform, pinned,
                      mode=None):
    captured = mode == "captured"
    # (PyG's GCN on the CSR takes the matrix normalized already; every other adjacency is normalized by the layer)
    model = make_pyg(args, kind, normalize=(adjacency != "CSR" or kind != "GCN"))
    model.load_state_dict(init)
    model = model.to(device)
    if impl == "QAT":
        model = pq.qat.prepare(model, bits=args.qat_bits)
    model.train()
    # A captured step takes Adam's update into its graph when the optimizer is capturable (step counts on the device).
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, **({"capturable": True} if captured and runner.cuda else {}))
    step = pq.CapturedTrainStep(model, opt, F.cross_entropy) if captured else None
    if mode == "compile":  # (compiled models share Net.forward's cache: reset once per model kind, for the rounds)
        model = torch.compile(model)  # the default backend; compiled in the untimed warm-up epoch
    nb = data.nb
    if adjacency == "BitAdjacency":  # the loader's batches (README's QAT loop): x and the adjacency in one buffer
        inp = pq_inputs(data, kind, args.qat_bits, device, pinned)
        resident = [(bx if xform == "bit x" else data.x[b], adj, data.y[b]) for b, (bx, adj) in enumerate(inp.resident)]
        if xform == "bit x":
            host = list(inp.host)
        else:
            plans = data.plan_gcn if kind == "GCN" else data.plan_gin
            host = [QuantBatch.from_fields({"adj": plans[b], "x": data.x_host[b]}, pin_memory=pinned,
                                           adjacency=data.adjacency) for b in range(nb)]
        row["h2d_mb_per_epoch"] = sum(h.nbytes for h in host) / 1e6

        def batches_h2d():
            for b, hb in enumerate(host):
                batch = hb.to(device)
                yield batch.x, batch.adj, data.y_host[b].to(device, non_blocking=True)
    elif xform == "bit x":  # the QAT model fed the loader's 4-bit features: one QuantBatch copy a batch
        host = [QuantBatch.from_fields({"x": data.feats[args.qat_bits][b], "edge_index": data.edge_index[b],
                                        "y": data.y[b]}, pin_memory=pinned) for b in range(nb)]
        resident = None
        row["h2d_mb_per_epoch"] = sum(h.nbytes for h in host) / 1e6

        def batches_h2d():
            for hb in host:
                b = hb.to(device)
                yield b.x, b.edge_index, b.y
    else:
        inp = pyg_inputs(data, kind, adjacency, "fp32", device)
        resident = [(x, adj, data.y[b]) for b, (x, adj) in enumerate(inp.resident)]
        host = [(hb, data.y_host[b]) for b, hb in enumerate(inp.host)]
        row["h2d_mb_per_epoch"] = sum(host_nbytes(hb) + host_nbytes([y]) for hb, y in host) / 1e6

        def batches_h2d():
            for hb, y in host:
                x, adj = inp.load(hb)
                yield x, adj, y.to(device, non_blocking=True)

    losses = []

    def epoch(batches):
        total = torch.zeros((), device=device)
        for x, adj, y in batches():
            if step is not None:
                total += step(x, adj, target=y)
                continue
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x, adj), y)
            loss.backward()
            opt.step()
            total += loss.detach()
        losses.append(total)  # read after timing: no host sync inside the epoch from the script

    # A captured step runs its first epoch eagerly and captures in its second (one graph per batch shape).
    warm = {} if step is None or not runner.cuda else dict(warmup=max(2, args.warmup))
    if mode == "compile":
        warm = dict(warmup=max(2, args.warmup))
    if resident is not None:
        t = time.perf_counter()
        row["resident"] = runner.measure(lambda: epoch(lambda: iter(resident)), reps=args.train_reps, **warm)
        if step is not None:
            row["captured_graphs"] = step.num_graphs
            row["capture_disabled"] = step.disabled_reason
            row["warmup_and_capture_s"] = round(time.perf_counter() - t - sum(row["resident"]["times_ms"]) / 1e3, 2)
        log(f"  {kind} {row['label']:40s} resident {row['resident']['median_ms']:9.1f} ms/epoch")
        rec.save()
    row["h2d"] = runner.measure(lambda: epoch(batches_h2d), reps=args.train_reps,
                                **(warm if runner.cuda else dict(warmup=0)))
    row["mean_loss_first_last_epoch"] = [float(losses[0]) / nb, float(losses[-1]) / nb]
    row["epochs_trained"] = len(losses)
    log(f"  {kind} {row['label']:40s} +H2D     {row['h2d']['median_ms']:9.1f} ms/epoch  "
        f"loss {row['mean_loss_first_last_epoch'][0]:.3f} -> {row['mean_loss_first_last_epoch'][1]:.3f}")
    return None if resident is None else (lambda: epoch(lambda: iter(resident)))


# --- report ------------------------------------------------------------------------------------------
# How each timed key of an inference row ran (the summary names PyG's fastest path with it).
HOW = {"resident": "eager", "h2d": "eager", "graph_resident": "graph", "graph_h2d": "graph",
       "graph_resident_streams": "graphs on several streams", "graph_h2d_streams": "graphs on several streams"}


def med(row, key):
    value = row.get(key)
    return value["median_ms"] if isinstance(value, dict) else None


def summarize(rec: Recorder, args) -> None:
    s = rec.data["summary"]
    for kind in args.models:
        rows = [r for r in rec.data["inference"] if r["model"] == kind]
        for mode, keys in (("resident", ("resident", "graph_resident", "graph_resident_streams")),
                           ("+H2D", ("h2d", "graph_h2d", "graph_h2d_streams"))):
            pyg = [(med(r, k), f"{r['label']} ({HOW[k]})")
                   for r in rows if r["impl"] == "PyG" for k in keys if med(r, k)]
            if not pyg:
                continue
            best_ms, best_label = min(pyg)
            s.setdefault(kind, {})[f"pyg_fastest_{mode}"] = dict(ms=best_ms, path=best_label)
            for r in rows:
                if r["impl"] == "PyG":
                    continue
                times = [(med(r, k), k) for k in keys if med(r, k)]
                if times:
                    ms, how = min(times)
                    r.setdefault("speedup_vs_pyg_fastest", {})[mode] = best_ms / ms
                    s[kind][f"{r['label']} {mode}"] = dict(ms=ms, how=how, speedup_vs_pyg_fastest=best_ms / ms)
        train = [r for r in rec.data["training"] if r["model"] == kind]
        for mode in ("resident", "h2d"):
            ref = next((med(r, mode) for r in train if r["label"] == "train PyG fp32 edge_index"), None)
            fastest = min([med(r, mode) for r in train if r["impl"] == "PyG" and med(r, mode)] or [None],
                          key=lambda v: v or float("inf"))
            for r in train:
                ms = med(r, mode)
                if ms and ref:
                    r.setdefault("time_vs_pyg_fp32_edge_index", {})[mode] = ms / ref
                if ms and fastest:
                    r.setdefault("time_vs_pyg_fastest", {})[mode] = ms / fastest


def rel_text(r) -> str:
    v = r.get("rel_err_vs_pyg_fp32")
    return f"{v:.1e}" if isinstance(v, float) else ""


def targets(rec: Recorder, args) -> list:
    """Issue 8's targets, evaluated on this run's numbers."""
    out = []
    s = rec.data["summary"]
    for kind in args.models:
        inf = {r["label"]: r for r in rec.data["inference"] if r["model"] == kind}
        for bits, goal in ((4, 5.0), (8, 3.0)):
            for ranges, suffix in (("", ""), (" static", " (static ranges)")):
                for mode in ("resident", "+H2D"):
                    q = s.get(kind, {}).get(f"pyg_quant {bits}-bit{ranges} {mode}")
                    if q:
                        out.append(dict(target=f"{kind} inference {bits}-bit{suffix} {mode}: >= {goal:g}x faster than "
                                               f"PyG's fastest", measured=round(q["speedup_vs_pyg_fastest"], 3),
                                        met=q["speedup_vs_pyg_fastest"] >= goal))
        base, q4 = inf.get("PyG fp32 CSR", {}), inf.get("pyg_quant 4-bit", {})
        if base.get("h2d_mb_per_epoch") and q4.get("h2d_mb_per_epoch"):
            ratio = base["h2d_mb_per_epoch"] / q4["h2d_mb_per_epoch"]
            out.append(dict(target=f"{kind} H2D bytes at 4 bits: >= 8x fewer than PyG fp32 CSR", measured=round(ratio, 2),
                            met=ratio >= 8))
        for r in rec.data["training"]:
            if r["model"] != kind or r["impl"] != "QAT":
                continue
            for key, what in (("time_vs_pyg_fp32_edge_index", "PyG fp32 on the same edge_index"),
                              ("time_vs_pyg_fastest", "PyG fp32's fastest path")):
                for mode, v in r.get(key, {}).items():
                    out.append(dict(target=f"{kind} {r['label']} ({mode}): no slower than {what} (time ratio)",
                                    measured=round(v, 3), met=v <= 1.0))
    return out


def fmt(v, digits=2):
    return "" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))


def tables(rec: Recorder, args) -> str:
    small = args.small
    lines = ["", "### Inference epochs (ms, median; all batches)", "",
             f"| model | implementation | resident | +H2D | graph resident | graph +H2D | {args.streams} streams resident | "
             f"{args.streams} streams +H2D | H2D MB/epoch | kernels/batch | syncs/batch | × vs PyG fastest (resident / +H2D) | "
             "rel. err | predicted |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rec.data["inference"]:
        if r.get("error") or r.get("skipped"):
            lines.append(f"| {r['model']} | {r['label']} | {'skipped' if r.get('skipped') else 'error'} | | | | | | | | | "
                         f"| | {(r.get('error') or '')[:60]} |")
            continue
        sp = r.get("speedup_vs_pyg_fastest", {})
        pred = "" if small else " / ".join(
            f"{PREDICTED[(r['model'], r['label'], m)]}" for m in ("resident", "+H2D", "graph resident", "graph +H2D")
            if (r["model"], r["label"], m) in PREDICTED)
        ratio = f"{fmt(sp.get('resident'))} / {fmt(sp.get('+H2D'))}" if sp else ""
        lines.append(f"| {r['model']} | {r['label']} | {fmt(med(r, 'resident'))} | {fmt(med(r, 'h2d'))} | "
                     f"{fmt(med(r, 'graph_resident'))} | {fmt(med(r, 'graph_h2d'))} | "
                     f"{fmt(med(r, 'graph_resident_streams'))} | {fmt(med(r, 'graph_h2d_streams'))} | "
                     f"{fmt(r.get('h2d_mb_per_epoch'), 0)} | {fmt(r.get('kernels_per_batch'))} | "
                     f"{fmt(r.get('syncs_per_batch'))} | {ratio} | {rel_text(r)} | {pred} |")
    if rec.data["transfer"]:
        lines += ["", "### Transfer only (pinned → device, one epoch of batches)", "",
                  "| format | MB/batch | MB/epoch | copies/batch | ms/epoch | GB/s | bytes: PyG fp32 CSR ÷ this |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in rec.data["transfer"]:
            if "copy" not in r:
                lines.append(f"| {r['label']} | {r.get('error', 'skipped')[:60]} | | | | | |")
                continue
            lines.append(f"| {r['label']} | {r['mb_per_batch']:.2f} | {r['mb_per_epoch']:.0f} | {r['copies_per_batch']} | "
                         f"{r['copy']['median_ms']:.2f} | {fmt(r['gb_per_s'], 1)} | {fmt(r.get('bytes_vs_pyg_fp32_csr'))} |")
    lines += ["", "### Training epochs (ms, median; forward + backward + Adam over all batches)", "",
              "| model | implementation | resident | +H2D | H2D MB/epoch | time ÷ PyG fp32 edge_index (res. / +H2D) | "
              "time ÷ PyG fastest (res. / +H2D) | loss first → last epoch | predicted +H2D |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rec.data["training"]:
        if r.get("error") or r.get("skipped"):
            lines.append(f"| {r['model']} | {r['label']} | {'skipped' if r.get('skipped') else 'error'} | | | | | "
                         f"{(r.get('error') or '')[:60]} | |")
            continue
        a, b = r.get("time_vs_pyg_fp32_edge_index", {}), r.get("time_vs_pyg_fastest", {})
        loss = r.get("mean_loss_first_last_epoch")
        pred = "" if small else fmt(PREDICTED.get((r["model"], r["label"], "+H2D")))
        label = r["label"]
        if r.get("capture_disabled"):
            label += f" (ran eagerly: {r['capture_disabled'][:50]})"
        elif r.get("captured_graphs"):
            label += f" ({r['captured_graphs']} graphs, {fmt(r.get('warmup_and_capture_s'), 1)} s to warm up)"
        lines.append(f"| {r['model']} | {label} | {fmt(med(r, 'resident'), 1)} | {fmt(med(r, 'h2d'), 1)} | "
                     f"{fmt(r.get('h2d_mb_per_epoch'), 0)} | {fmt(a.get('resident'))} / {fmt(a.get('h2d'))} | "
                     f"{fmt(b.get('resident'))} / {fmt(b.get('h2d'))} | "
                     f"{f'{loss[0]:.3f} → {loss[1]:.3f}' if loss else ''} | {pred} |")
    return "\n".join(lines)


def plot(rec: Recorder, args, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    # One panel per model with inference rows (none in a training-only run), then training.
    models = [kind for kind in args.models if any(r["model"] == kind and med(r, "resident")
                                                  for r in rec.data["inference"])]
    training = [r for r in rec.data["training"] if med(r, "h2d")]
    panels = len(models) + (1 if training else 0)  # no empty training panel in an inference-only run
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 7), squeeze=False)
    axes = axes[0]
    for ax, kind in zip(axes, models):
        rows = [r for r in rec.data["inference"] if r["model"] == kind and med(r, "resident")]
        labels = [r["label"] for r in rows]
        ys = range(len(rows))
        series = [("resident", "eager, resident"), ("h2d", "eager, +H2D"), ("graph_resident", "graph, resident"),
                  ("graph_h2d", "graph, +H2D"), ("graph_resident_streams", f"graphs on {args.streams} streams, resident"),
                  ("graph_h2d_streams", f"graphs on {args.streams} streams, +H2D")]
        height = 0.8 / len(series)
        for k, (key, name) in enumerate(series):
            vals = [med(r, key) or 0 for r in rows]
            ax.barh([y + (k - (len(series) - 1) / 2) * height for y in ys], vals, height=height, label=name)
        ax.set_yticks(list(ys))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ms per inference epoch (log)")
        ax.set_title(f"{kind} inference, {rec.data['graph'].get('batches')} batches")
        ax.legend(fontsize=8)
    if not training:
        return finish_plot(fig, rec, path)
    ax = axes[-1]
    rows = training
    labels = [f"{r['model']} {r['label'].replace('train ', '')}" for r in rows]
    ys = range(len(rows))
    ax.barh([y - 0.2 for y in ys], [med(r, "resident") or 0 for r in rows], height=0.4, label="resident")
    ax.barh([y + 0.2 for y in ys], [med(r, "h2d") or 0 for r in rows], height=0.4, label="+H2D")
    ax.set_yticks(list(ys))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms per training epoch")
    ax.set_title("training")
    ax.legend(fontsize=8)
    return finish_plot(fig, rec, path)


def finish_plot(fig, rec: Recorder, path: str) -> None:
    import matplotlib.pyplot as plt
    meta = rec.data["meta"]
    fig.suptitle(f"pyg_quant e2e — {meta['device_name']} — {meta['date']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
