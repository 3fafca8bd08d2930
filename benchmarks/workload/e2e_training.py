"""e2e.py's transfer and training sections: the copies alone, and forward + backward + Adam epochs of PyG
and of QAT models (eager, ``torch.compile``, ``CapturedTrainStep``), then interleaved rounds of every variant."""
import time

import torch
import torch.nn.functional as F

from pyg_quant.loader import QuantBatch

from . import pq
from .e2e_report import fmt
from .graph import Data
from .inputs import pq_host_batches, pq_inputs, pyg_inputs
from .models import make_pyg
from .recording import Recorder, Runner, epoch_stats, log


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
