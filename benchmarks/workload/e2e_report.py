"""e2e.py's report: the summary ratios, the targets, the markdown tables and the plot."""
from .recording import Recorder


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
