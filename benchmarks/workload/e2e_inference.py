"""e2e.py's inference section: every variant's epochs resident and with copies, eager and as CUDA-graph
replays (also on several streams), and the pq-kernels diagnostic (the models written on ``pyg_quant.bit_spmm``)."""
import contextlib
import time

import torch

from pyg_quant.loader import QuantBatch
from pyg_quant.quantization.quantize import quantize as pq_quantize  # the layers' quantizer: no host checks

from . import pq
from .graph import Data
from .inputs import pq_host_batches, pq_inputs, pyg_inputs
from .models import Net, make_pq, make_pyg
from .profiling import count_syncs, kernel_totals, profile_batch, rel_err
from .recording import Recorder, Runner, log


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
