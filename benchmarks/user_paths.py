r"""User paths against PyG (issue 37 item 5): a user's inference loop, resident, with copies and compiled.

One device call: the workload of ``benchmarks/workload`` (its graph, batches and models: products-scale Cluster-GCN
batches, 75 of 32,000 nodes and ~1.27M edges; GCN 3 layers 100 → 16 → 16 → 47, GIN 3 layers hidden 64), every
variant in ``eval()`` under ``torch.inference_mode()``, each path timed over whole epochs.  Prints markdown tables
and writes ``--out`` JSON after every configuration.

Usage (repository root; the extension built for the device's torch first)::

    python benchmarks/user_paths.py --out $OUT/user_paths.json    # GPU (H200): 6-9 min (--time-budget 450 s)
    python benchmarks/user_paths.py --small                        # CPU check: a tiny graph, ~1 min

Variants (rows): PyG ``GCNConv`` / ``GINConv`` on a torch CSR ``adj_t`` in fp32 and bf16 (GCN: pre-normalized,
``normalize=False``: PyG's fastest eager path) and on ``edge_index`` in fp32 (the form ``torch.compile`` traces
whole; ``--pyg`` picks the PyG variants, --small the CSRs only), and pyg_quant ``QGCNConv`` / ``QGINConv`` at
``--bits`` (8 and 4) fed ``QuantBatch``es (the adjacency's tile plan and the bit features in one wire buffer,
decoded on the device), all with the same weights.  pyg_quant's GIN hands its hidden layers' outputs on as codes
(``out_bits``); its ``drop-in`` rows (``--drop-in`` bit widths, default 4) are PyG's GIN with ``QGINConv`` in place of
``GINConv``, floats between the layers (GCN's model is that already).

Paths (columns):

* ``resident``: the batches already on the device (pyg_quant: decoded once), eager.
* ``loop``: the loop users write. PyG: ``ClusterLoader``'s, ``batch = batch.to(device)`` per batch from pageable
  memory (``ClusterLoader`` without ``pin_memory``); pyg_quant: the README's, ``batch = batch.to("cuda")`` on
  ``QuantClusterLoader``'s default (pageable) batch.  Each copy blocks the host, on the compute stream.
* ``pinned loop``: the same from pinned memory (``pin_memory=True``), non-blocking copies, still on the compute
  stream: nothing overlaps a copy but the host's own work.
* ``prefetch``: PyG: ``torch_geometric.loader.PrefetchLoader`` over the pinned batches; pyg_quant:
  ``pyg_quant.loader.prefetch`` over them (what ``QuantClusterLoader(..., device="cuda")`` iterates with): each
  batch's copy queued one batch ahead without waiting (on the compute stream; PyG's on a side stream).
* ``resident, interleaved``: the resident epochs again, every variant of a model in turn for ``--rounds`` rounds
  (one epoch each a round), the median of each variant's: a stall of the lent host then costs each variant one
  epoch at most, where the back-to-back epochs of one variant above can all fall inside it.
* ``compile`` / ``compile RO``: ``torch.compile(model)`` and ``torch.compile(model, mode="reduce-overhead")`` on the
  resident batches, ``torch._dynamo.reset()`` first; the compilation (and the CUDA-graph recording) runs in untimed
  warm-up epochs; the JSON gives the compile time, dynamo's graph count and graph breaks, and the error under
  ``inference_mode`` when it had to fall back to ``no_grad``.  PyG's CSR forms are sparse tensors, which dynamo
  does not trace: those frames run eagerly (their graph count says so).

Timing: CUDA events around each whole epoch (the host's loop, the copies and the kernels), ``--warmup`` epochs
first, the median of ``--reps``; ratios ("×": PyG fp32 CSR's time over this one, so above 1 is faster) are taken
within this run against PyG fp32 CSR eager, on the same path for the eager columns and resident for the compiled
ones.  For the eager paths, host syncs per batch (``torch.cuda.set_sync_debug_mode``: a blocking copy counts) and
device kernels per batch (``torch.profiler``) over the first ``--profile-batches`` batches, counted after all the
timing (a CUDA profiler session leaves callbacks behind that slow every later launch).  Each configuration is
wrapped: an error is recorded (its first line in the table) and the run goes on; ``--time-budget`` skips what
would start after it, recorded as skipped.  Runs on the default stream, as a user's loop does.

Plan (H200).  Counts from e2e.py: a batch ships 28.3 MB for PyG fp32 CSR (2.1 GB an epoch), 19.3 MB bf16, 3.2 MB
for pyg_quant 4-bit and 4.8 MB 8-bit (0.24 / 0.36 GB an epoch).  e2e.py's recorded H200 runs
(``benchmarks/results/e2e_h200_*.json``, eager, one stream): PyG fp32 CSR GIN 34-79 ms an epoch resident and
~73 with pinned copies on the compute stream; pyg_quant 4-bit GIN ~60 resident (up to ~270 in one run: host-bound,
its layers sync with the host) and 88-100 with copies, so its copies and decode cost ~30 ms an epoch where the
bytes alone take ~5 ms at ~50 GB/s.  Predicted: ``loop`` adds PyG's pageable copies (2.1 GB at ~10-25 GB/s:
+85-210 ms) and pyg_quant's (+10-25 ms plus the decode); ``pinned loop`` ≈ e2e's +H2D; ``prefetch``: PyG ≈ the
longer of its kernels and its copies (~42 ms), pyg_quant ≈ resident + the decode kernels (a few ms), the copies
hidden.  ``compile``: dynamo does not trace PyG's sparse CSR (≈ eager); edge_index compiles whole; pyg_quant as
its layers allow (an inductor error is recorded, not fatal).
"""
import argparse
import datetime
import os
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import workload  # noqa: E402  (the workload: graph, batches, models, timing helpers)
from workload import first_line, log, pq  # noqa: E402
from torch_geometric.loader import PrefetchLoader  # noqa: E402

from pyg_quant.graph.adjacency_form import ADJACENCY_FORMS, DEFAULT_ADJACENCY  # noqa: E402
from pyg_quant.loader import prefetch  # noqa: E402

EAGER_PATHS = ("resident", "loop", "pinned_loop", "prefetch")
INTERLEAVED = "resident_interleaved"  # the resident epochs with the variants taking turns
COMPILE_PATHS = ("compile", "compile_ro")
DROP_IN = "drop-in"  # GIN: PyG's model with QGINConv in place of GINConv, floats between the layers (no out_bits)
HEADERS = dict(resident="resident", loop="loop (.to)", pinned_loop="pinned loop", prefetch="prefetch",
               resident_interleaved="resident, interleaved", compile="compile", compile_ro="compile RO")


# --- one variant's inputs on every path ------------------------------------------------------------------
class Paths:
    """A variant's batch source for each path: ``epoch(path, model, batches)`` runs those batches through it."""

    def __init__(self, data, kind: str, label: str, device, pinned: bool):
        self.device, self.kind, self.label = device, kind, label
        self.data, self.is_pinned, self._pageable = data, pinned, None
        self.quant = label.startswith("pyg_quant")
        if self.quant:
            self.bits = int(label.split()[1].split("-")[0])
            inp = workload.pq_inputs(data, kind, self.bits, device, pinned)
        else:
            precision, adjacency = label.split()[1:3]
            inp = workload.pyg_inputs(data, kind, "CSR" if adjacency == "CSR" else "edge_index", precision, device)
            self.csr = adjacency == "CSR"
        self.pinned, self.resident, self.bytes_per_batch = inp.host, inp.resident, inp.bytes_per_batch
        self.nb = len(self.resident)

    @property
    def pageable(self):
        """The host batches as the loaders hand them over without ``pin_memory`` (made when first asked for)."""
        if self._pageable is None:
            if not self.is_pinned:
                self._pageable = self.pinned  # a CPU run: host and device memory are the same
            elif self.quant:  # QuantClusterLoader's default batch: the same wire buffer, pageable
                self._pageable = workload.pq_host_batches(self.data, self.kind, self.bits, False)
            else:  # ClusterLoader's: clones of the pinned views
                self._pageable = [tuple(t.clone() for t in hb) for hb in self.pinned]
        return self._pageable

    def _pyg_args(self, tensors):
        x, *adj = tensors
        if self.csr:
            crow, col, val = adj
            n = crow.numel() - 1
            return x, torch.sparse_csr_tensor(crow, col, val, (n, n))
        return x, adj[0]

    def epoch(self, path: str, model, count=None, step=None) -> None:
        """One pass of ``model`` over the first ``count`` batches (all by default) along ``path``."""
        count = self.nb if count is None else count
        step = step or (lambda: None)
        if path == "resident":
            for args in self.resident[:count]:
                step()
                model(*args)
        elif path in ("loop", "pinned_loop"):
            host = (self.pageable if path == "loop" else self.pinned)[:count]
            for hb in host:
                if self.quant:
                    batch = hb.to(self.device)  # the README's batch.to("cuda")
                    model(batch.x, batch.adj)
                else:
                    blocking = path == "loop"  # Data.to(device) copies with non_blocking=False
                    model(*self._pyg_args([t.to(self.device, non_blocking=not blocking) for t in hb]))
        elif path == "prefetch":
            if self.quant:
                for batch in prefetch(self.pinned[:count], self.device):
                    model(batch.x, batch.adj)
            else:
                for tensors in PrefetchLoader(self.pinned[:count], self.device):
                    model(*self._pyg_args(tensors))
        else:
            raise ValueError(f"unknown path {path!r}")


def variant_labels(args, kind: str):
    labels = [f"PyG {v}" for v in args.pyg]
    labels += [f"pyg_quant {bits}-bit" for bits in args.bits]
    if kind == "GIN":  # (GCN's model is the drop-in one: floats between its layers)
        labels += [f"pyg_quant {bits}-bit {DROP_IN}" for bits in args.drop_in]
    return labels


def make_model(args, kind: str, label: str, state, device):
    if label.startswith("pyg_quant"):
        model = workload.make_pq(args, kind, int(label.split()[1].split("-")[0]), requantize=DROP_IN not in label)
        model.load_state_dict(state)
        return model.to(device).eval()
    precision, adjacency = label.split()[1:3]
    # GCN's CSR is pre-normalized (PyG's fastest path); edge_index and GIN normalize as PyG does.
    model = workload.make_pyg(args, kind, normalize=(adjacency != "CSR" or kind != "GCN"))
    model.load_state_dict(state)
    model = model.to(device).eval()
    return model.to(torch.bfloat16) if precision == "bf16" else model


# --- measuring ---------------------------------------------------------------------------------------------
def cell(runner, rec, row, key, what, need_s, fn) -> None:
    """Runs ``fn()`` (returning a dict) into ``row[key]``; an error goes there as its first line, the run goes on."""
    if not runner.allowed(f"{row['model']} {row['label']} {what}", need_s=need_s):
        row[key] = dict(skipped=True)
        rec.save()
        return
    try:
        row[key] = fn()
    except Exception as error:  # noqa: BLE001  (recorded; the other configurations still run)
        row[key] = dict(error=rec.error(f"{row['model']} {row['label']} {what}", error))
    finally:
        if runner.cuda:
            torch.cuda.empty_cache()
        rec.save()


def eager_path(args, runner, paths: Paths, model, path: str, ref) -> dict:
    with torch.inference_mode():
        out = {}
        if path == "resident":
            out["rel_err_vs_pyg_fp32"] = workload.rel_err(model(*paths.resident[0]), ref)
        out.update(runner.measure(lambda: paths.epoch(path, model)))
    log(f"  {paths.kind} {paths.label:20s} {HEADERS[path]:12s} {out['median_ms']:9.2f} ms/epoch")
    return out


def eager_counts(args, runner, paths: Paths, model, path: str, out: dict) -> None:
    """Host syncs and device kernels per batch of an eager path, into its cell ``out``.  Run after every timing: a
    CUDA profiler session leaves its callbacks behind, which slow every later kernel launch of the process."""
    k = min(args.profile_batches, paths.nb)
    with torch.inference_mode():
        syncs = workload.count_syncs(runner, lambda: paths.epoch(path, model, k))
        out["syncs_per_batch"] = None if syncs is None else syncs / k
        prof = workload.profile_batch(runner, lambda: paths.epoch(path, model, k))
    for key in ("kernels", "launch_calls", "memcpy_memset", "top_level_ops", "kernel_us"):
        if prof.get(key) is not None:
            out[f"{key}_per_batch"] = prof[key] / k
    if prof.get("note"):
        out["profile_note"] = prof["note"]
    log(f"  {paths.kind} {paths.label:20s} {HEADERS[path]:12s} syncs/batch {fmt(out.get('syncs_per_batch'))}, "
        f"kernels/batch {fmt(out.get('kernels_per_batch', out.get('top_level_ops_per_batch')))}")


def interleaved_resident(args, runner, rec, kept) -> None:
    """Each model's variants (``kept``: ``[(row, model, paths)]`` per model) run one resident epoch each in turn,
    ``--rounds`` times (fewer if the budget runs short, at least one): the median of each variant's epochs goes in
    its row."""
    for kind, variants in kept.items():
        times = [[] for _ in variants]
        for round_ in range(args.rounds):
            if round_ >= 1 and runner.time_left() < 10:
                break
            for (row, model, paths), out in zip(variants, times):
                with torch.inference_mode():
                    out.append(runner.epoch_ms(lambda: paths.epoch("resident", model)))
        for (row, _, _), out in zip(variants, times):
            row[INTERLEAVED] = workload.epoch_stats(out)
        log(f"  {kind} interleaved: " + ", ".join(f"{row['label']} {row[INTERLEAVED]['median_ms']:.2f}"
                                                  for row, _, _ in variants))
        rec.save()


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters
    return dict(graphs=int(counters["stats"]["unique_graphs"]),
                graph_breaks=int(sum(counters["graph_break"].values())),
                frames_ok=int(counters["frames"]["ok"]), frames_total=int(counters["frames"]["total"]))


def compiled_path(args, runner, paths: Paths, model, mode, ref) -> dict:
    """``torch.compile(model, mode=mode)`` over the resident batches under inference_mode (no_grad if that fails)."""
    from torch._dynamo.utils import counters
    reduce_overhead = mode == "reduce-overhead"
    # reduce-overhead's CUDA graphs: a warm-up run, a recording, then replays, per batch shape.
    warmup = args.warmup + (2 if reduce_overhead else 1)
    mark = torch.compiler.cudagraph_mark_step_begin if reduce_overhead else None
    out, failures = {}, []
    for grad_mode, context in (("inference_mode", torch.inference_mode), ("no_grad", torch.no_grad)):
        torch._dynamo.reset()  # each model compiles afresh (Net.forward's cache would fill up across variants)
        counters.clear()
        compiled = torch.compile(model, mode=mode)
        try:
            with context():
                t = time.perf_counter()
                first = compiled(*paths.resident[0])
                out["rel_err_vs_pyg_fp32"] = workload.rel_err(first, ref)
                del first
                runner.sync()
                out["first_call_s"] = round(time.perf_counter() - t, 2)
                t = time.perf_counter()
                for _ in range(warmup):
                    paths.epoch("resident", compiled, step=mark)
                runner.sync()
                out["warmup_s"] = round(time.perf_counter() - t, 2)
                out.update(runner.measure(lambda: paths.epoch("resident", compiled, step=mark), warmup=0))
            out.update(dynamo_counts(), grad_mode=grad_mode)
            break
        except Exception as error:  # noqa: BLE001  (inference_mode first, then no_grad; both recorded)
            failures.append(f"{grad_mode}: {first_line(error)}")
            if grad_mode == "no_grad":
                raise
        finally:
            del compiled
            if reduce_overhead:  # this model's CUDA graphs go with it, so that later variants run without them
                from torch._inductor import cudagraph_trees
                cudagraph_trees.reset_cudagraph_trees()
    if failures:
        out["fallback"] = failures[0]
    log(f"  {paths.kind} {paths.label:20s} {'compile' + (' RO' if reduce_overhead else ''):12s} "
        f"{out['median_ms']:9.2f} ms/epoch ({out['grad_mode']}; first call {out['first_call_s']} s, "
        f"{out['graphs']} graphs, {out['graph_breaks']} breaks)")
    return out


# --- report ------------------------------------------------------------------------------------------------
def fmt(v, digits=2):
    if v is None:
        return "–"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def ms_of(entry):
    return entry.get("median_ms") if isinstance(entry, dict) else None


def summarize(rec, args) -> None:
    """Ratios: PyG fp32 CSR eager's time over each cell's (same path; resident for the compiled paths)."""
    for kind in args.models:
        rows = [r for r in rec.data["rows"] if r["model"] == kind]
        ref = next((r for r in rows if r["label"] == "PyG fp32 CSR"), None)
        if ref is None:
            continue
        for r in rows:
            for path in EAGER_PATHS + (INTERLEAVED,) + COMPILE_PATHS:
                base = ms_of(ref.get(path if path not in COMPILE_PATHS else "resident"))
                ms = ms_of(r.get(path))
                if base and ms:
                    r[path]["x_vs_pyg_fp32_csr_eager"] = base / ms
        loop = ms_of(ref.get("loop"))
        for r in rows:
            for path in ("prefetch", "loop"):
                ms = ms_of(r.get(path))
                if loop and ms and r["label"].startswith("pyg_quant"):
                    rec.data["summary"][f"{kind} {r['label']} {path} vs PyG fp32 CSR loop"] = round(loop / ms, 3)


def tables(rec, args) -> str:
    paths = EAGER_PATHS + (INTERLEAVED,) + COMPILE_PATHS
    lines = ["", "### Epochs (ms, median) and × PyG fp32 CSR eager (its time over this one; same path, compiled: "
             "against resident)", "",
             "| model | variant | " + " | ".join(HEADERS[p] for p in paths) + " | MB/batch |",
             "|---|---|" + "---:|" * (len(paths) + 1)]
    for r in rec.data["rows"]:
        cells = []
        for p in paths:
            entry = r.get(p, {})
            if entry.get("error"):
                cells.append(f"error: {entry['error'][:50]}")
            elif entry.get("skipped"):
                cells.append("skipped")
            elif ms_of(entry) is not None:
                x = entry.get("x_vs_pyg_fp32_csr_eager")
                extra = f" ({x:.2f}×)" if x else ""
                if p in COMPILE_PATHS and entry.get("grad_mode") == "no_grad":
                    extra += " no_grad"
                cells.append(f"{entry['median_ms']:.2f}{extra}")
            else:
                cells.append("–")
        mb = r.get("h2d_bytes_per_batch")
        lines.append(f"| {r['model']} | {r['label']} | " + " | ".join(cells) + f" | {fmt(mb and mb / 1e6)} |")
    lines += ["", "### Per batch, eager paths: host syncs / device kernels (CPU: top-level ops)", "",
              "| model | variant | " + " | ".join(HEADERS[p] for p in EAGER_PATHS) + " |",
              "|---|---|" + "---:|" * len(EAGER_PATHS)]
    for r in rec.data["rows"]:
        cells = []
        for p in EAGER_PATHS:
            entry = r.get(p, {})
            kernels = entry.get("kernels_per_batch", entry.get("top_level_ops_per_batch"))
            cells.append("–" if ms_of(entry) is None else f"{fmt(entry.get('syncs_per_batch'), 1)} / {fmt(kernels, 1)}")
        lines.append(f"| {r['model']} | {r['label']} | " + " | ".join(cells) + " |")
    compiled = [(r, p) for r in rec.data["rows"] for p in COMPILE_PATHS if ms_of(r.get(p))]
    if compiled:
        lines += ["", "### Compiled: dynamo graphs / graph breaks, first call (s)", "",
                  "| model | variant | path | graphs | breaks | first call s | grad mode |",
                  "|---|---|---|---:|---:|---:|---|"]
        for r, p in compiled:
            e = r[p]
            mode = e["grad_mode"] + (f" (inference_mode failed: {e['fallback'][:60]})" if e.get("fallback") else "")
            lines.append(f"| {r['model']} | {r['label']} | {HEADERS[p]} | {e['graphs']} | {e['graph_breaks']} | "
                         f"{e['first_call_s']} | {mode} |")
    if rec.data["summary"]:
        lines += ["", "### pyg_quant's loops against PyG's ClusterLoader loop (fp32 CSR, .to per batch): ×", ""]
        lines += [f"- {k}: {v:.2f}×" for k, v in rec.data["summary"].items()]
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true",
                   help="CPU check: 8 parts of 250 nodes, 2 parts a batch (4 batches of 500 nodes)")
    workload.add_workload_arguments(p)
    p.add_argument("--bits", default=None, help="pyg_quant bit widths (default 8,4; --small: 4)")
    p.add_argument("--drop-in", default=None,
                   help="bit widths of GIN run also as the drop-in model, no out_bits (default 4; --small: none)")
    p.add_argument("--pyg", default=None,
                   help="PyG variants, comma-separated (default 'fp32 CSR,bf16 CSR,fp32 edge_index'; "
                        "--small: the CSRs)")
    p.add_argument("--adjacency", default=DEFAULT_ADJACENCY, choices=ADJACENCY_FORMS,
                   help="form of the decoded pyg_quant batches")
    p.add_argument("--models", default="GIN,GCN")
    p.add_argument("--compile", default="default,reduce-overhead",
                   help="torch.compile modes to run, comma-separated ('' for none)")
    p.add_argument("--compile-models", default=None,
                   help="models whose variants are compiled (default: all of --models; --small: GIN)")
    p.add_argument("--reps", type=int, default=None, help="timed epochs per measurement (median; default 3, --small 1)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of the interleaved resident epochs (default 5, --small 2; 0: none)")
    p.add_argument("--profile-batches", type=int, default=4, help="batches the syncs and kernels are counted over")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds after which configurations are skipped (default 450 on the GPU, 90 --small)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: 1 for a CPU run, as e2e.py)")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/out/user_paths[_small].json); '' for none")
    args = p.parse_args(argv)
    # --small compiles one model at one bit width: an inductor compile takes 10-30 s on a 2-core CPU.
    small = dict(num_parts=8, part_size=250, parts_per_batch=2, avg_degree=20, reps=1, rounds=2, time_budget=90.0,
                 bits="4", drop_in="", compile_models="GIN")
    full = dict(num_parts=1500, part_size=1600, parts_per_batch=20, avg_degree=50, reps=3, rounds=5,
                time_budget=450.0, bits="8,4", drop_in="4", compile_models=args.models)
    for key, value in (small if args.small else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.pyg is None:
        args.pyg = "fp32 CSR,bf16 CSR" if args.small else "fp32 CSR,bf16 CSR,fp32 edge_index"
    args.pyg = [v.strip() for v in args.pyg.split(",") if v.strip()]
    for v in args.pyg:
        parts = v.split()
        if len(parts) != 2 or parts[0] not in ("fp32", "bf16") or parts[1] not in ("CSR", "edge_index"):
            raise SystemExit(f"--pyg: each variant is '<fp32|bf16> <CSR|edge_index>', got {v!r}")
    if "fp32 CSR" not in args.pyg:
        args.pyg.insert(0, "fp32 CSR")  # the reference of every ratio
    args.bits = tuple(int(b) for b in args.bits.split(",") if b)
    args.drop_in = tuple(int(b) for b in args.drop_in.split(",") if b)
    args.models = tuple(m.strip().upper() for m in args.models.split(",") if m.strip())
    args.compile_models = tuple(m.strip().upper() for m in args.compile_models.split(",") if m.strip())
    args.compile = tuple(m.strip() for m in args.compile.split(",") if m.strip())
    for mode in args.compile:
        if mode not in ("default", "reduce-overhead"):
            raise SystemExit(f"--compile: modes are 'default' and 'reduce-overhead', got {mode!r}")
    if args.out is None:
        args.out = os.path.join(HERE, "out", "user_paths_small.json" if args.small else "user_paths.json")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads is None and device.type == "cpu":
        args.threads = 1  # shared CPU machines: OpenMP's waiting threads slowed the bit kernels (e2e.py)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.cuda.init()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    meta = dict(date=date, device=str(device), device_name=workload.device_name(device), torch=torch.__version__,
                cuda=torch.version.cuda, pyg_quant=pq.__version__, backends=pq.backends(),
                threads=torch.get_num_threads(), args=vars(args), stream="default (a user's loop)",
                command=" ".join([os.path.basename(sys.executable)] + sys.argv))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rec = workload.Recorder(args.out, meta, device.type)
    for key in ("inference", "transfer", "training", "profiles"):
        del rec.data[key]  # e2e.py's sections; this script's results are its rows
    rec.data["rows"] = []
    runner = workload.Runner(args, device, rec)
    print(f"# pyg_quant user paths ({date}): device {device} ({meta['device_name']}), torch {torch.__version__}, "
          f"backends {pq.backends()}, threads {torch.get_num_threads()}", flush=True)
    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")  # PyG/torch beta-state notices, once per call

    try:
        t = time.perf_counter()
        data = workload.build_graph(args, device, rec)
        data.adjacency = args.adjacency
        workload.build_formats(args, device, data, rec, runner)
        rec.data["timeline"]["build_s"] = round(time.perf_counter() - t, 1)
        rec.save()
    except Exception as error:  # noqa: BLE001  (nothing to measure without the batches)
        rec.error("build", error)
        raise
    pinned = device.type == "cuda"
    pq_ok = pq.backends()["cuda" if device.type == "cuda" else "cpu"]

    # Eager paths for every variant first, then the compiled ones: the budget cuts the slowest work.
    plan = []
    for kind in args.models:
        torch.manual_seed(args.seed)
        base = workload.make_pyg(args, kind).to(device).eval()
        with torch.inference_mode():
            ref = base(data.x[0], data.edge_index[0]).float().clone()
        state = base.state_dict()
        del base
        for label in variant_labels(args, kind):
            row = dict(model=kind, label=label)
            rec.data["rows"].append(row)
            plan.append((kind, label, row, state, ref))

    kept = {}  # model -> [(row, model, paths)] of the eager stage, for the interleaved epochs
    counted = []  # (row, model, paths) of the eager stage, for the syncs and kernels counted after all timing

    def run_paths(kind, label, row, state, ref, which):
        if label.startswith("pyg_quant") and not pq_ok:
            row["error"] = "pyg_quant's compiled kernels are not loaded here"
            return
        try:
            model = make_model(args, kind, label, state, device)
            paths = Paths(data, kind, label, device, pinned)
        except Exception as error:  # noqa: BLE001
            row["error"] = rec.error(f"{kind} {label} setup", error)
            return
        row["h2d_bytes_per_batch"] = paths.bytes_per_batch[0]
        for path in which:
            if path in EAGER_PATHS:
                cell(runner, rec, row, path, HEADERS[path], 5,
                     lambda: eager_path(args, runner, paths, model, path, ref))
            else:
                mode = "reduce-overhead" if path == "compile_ro" else None
                cell(runner, rec, row, path, HEADERS[path], 60 if runner.cuda else 10,
                     lambda: compiled_path(args, runner, paths, model, mode, ref))
        if which is EAGER_PATHS:
            counted.append((row, model, paths))
            if args.rounds and not row.get("resident", {}).get("error"):
                kept.setdefault(kind, []).append((row, model, paths))
        del model, paths

    stages = [("eager", EAGER_PATHS)]
    stages += [(mode, ("compile" if mode == "default" else "compile_ro",)) for mode in args.compile]
    for stage, which in stages:
        log(f"== {stage}")
        t = time.perf_counter()
        # Compiled stages: PyG's edge_index variant last, so that the budget cuts it before the CSR and ours.
        order = plan if stage == "eager" else sorted(plan, key=lambda item: "edge_index" in item[1])
        for kind, label, row, state, ref in order:
            if row.get("error") or (stage != "eager" and kind not in args.compile_models):
                continue
            run_paths(kind, label, row, state, ref, which)
            summarize(rec, args)
            rec.save()
        rec.data["timeline"][f"{stage}_s"] = round(time.perf_counter() - t, 1)
        if stage == "eager" and kept:
            log("== interleaved resident epochs")
            t = time.perf_counter()
            interleaved_resident(args, runner, rec, kept)
            kept.clear()  # (the compiled stages build their own)
            summarize(rec, args)
            rec.data["timeline"]["interleaved_s"] = round(time.perf_counter() - t, 1)
    torch._dynamo.reset()
    log("== syncs and kernels of the eager paths")
    for row, model, paths in counted:
        for path in EAGER_PATHS:
            entry = row.get(path)
            if isinstance(entry, dict) and ms_of(entry) is not None:
                try:
                    eager_counts(args, runner, paths, model, path, entry)
                except Exception as error:  # noqa: BLE001  (the timings stand)
                    entry["count_error"] = rec.error(f"{row['model']} {row['label']} {path} counts", error)
        rec.save()
    counted.clear()

    summarize(rec, args)
    text = tables(rec, args)
    print(text)
    rec.finish(text)
    if args.out:
        print(f"wrote {args.out}")
    log("done")
    return rec.data


if __name__ == "__main__":
    main()
