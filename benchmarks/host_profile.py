r"""Host time of one eager forward, and where it goes: Python, each op's dispatch, the kernels (issue 37 item 1).

One products-scale cluster batch (``benchmarks/workload``'s builder with ``--num-parts 20 --parts-per-batch 20``:
32,000 nodes, ~1.27M edges), the models of ``benchmarks/user_paths.py`` (GIN 3×64, GCN 3×16; PyG fp32 CSR and
pyg_quant 8/4-bit on the loader's decoded batch) in ``eval()`` under ``torch.inference_mode()``.  Per forward:

* ``host µs``: the time to issue ``--reps`` forwards back to back, without synchronizing, over ``--reps`` (the
  launch queue does not fill at these counts, so this is the host's own time), the median of 7 such blocks, the
  variants of a model interleaved block by block (the host's speed drifts within a run);
* ``wall µs``: the same loops with a synchronization at the end of each, over ``--reps`` (median);
* ``kernel µs`` / ``kernels``: the device kernels' summed time and count (``torch.profiler``);
* ``ops``: the top-level ops (those not called from another op) with their host µs each; ``Python µs`` is the host
  time they do not cover (the layers' own code, module calls).

GIN at 4 bits also as the drop-in model (PyG's GIN with ``QGINConv`` in place of ``GINConv``: floats between the
layers, no ``out_bits``), and the same model with its float-features layers on their general forward ("general
path": what they ran before their one op).  The same 4-bit models reached by the QAT route (``qat.prepare``, three training steps, ``qat.convert``) run as a
last variant, with the host synchronizations of a forward.  Then, per pyg_quant layer, where a layer call's host time goes: the call, its one op alone (``torch.ops``, the same
arguments), each step of the op alone (the op's kernels' own ops, called one by one as ``ops/reference.py`` composes
them) and, for scale, an empty allocation and a one-element ``aten::add`` on the device.

Usage: ``python benchmarks/host_profile.py [--out FILE.json]`` (GPU: ~1 min); ``--small`` for a CPU check.
"""
import argparse
import collections
import datetime
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import workload  # noqa: E402
from workload import pq  # noqa: E402


BLOCKS = 7  # each timing is the median of this many blocks of back-to-back calls: the host's speed drifts


def time_block(model, args_, runner, reps: int) -> tuple:
    """``(host, wall)`` seconds a forward over one block of ``reps`` back-to-back forwards."""
    with torch.inference_mode():
        runner.sync()
        t = time.perf_counter()
        for _ in range(reps):
            model(*args_)
        host = (time.perf_counter() - t) / reps
        runner.sync()
        return host, (time.perf_counter() - t) / reps


def time_interleaved(variants, runner, reps: int) -> list:
    """Median ``(host, wall)`` of each ``(model, args)`` over BLOCKS rounds, a block of each variant a round: the
    lent host's speed drifts within a run, and interleaving spreads a slow stretch over every variant alike."""
    with torch.inference_mode():
        for model, args_ in variants:
            for _ in range(10):
                model(*args_)
    blocks = [[] for _ in variants]
    for _ in range(BLOCKS):
        for i, (model, args_) in enumerate(variants):
            blocks[i].append(time_block(model, args_, runner, reps))
    return [(statistics.median(h for h, _ in b), statistics.median(w for _, w in b)) for b in blocks]


def profile_forward(model, args_, runner, timing: tuple) -> dict:
    host, wall = timing
    with torch.inference_mode():
        model(*args_)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if runner.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(5):
                model(*args_)
            runner.sync()
    ops, kernels, kernel_us = collections.Counter(), 0, 0.0
    op_us = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            kernel_us += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        elif e.cpu_parent is None and "::" in e.name:
            ops[e.name] += 1
            op_us[e.name] += e.cpu_time_total
    top = sorted(op_us, key=op_us.get, reverse=True)
    return dict(host_us=round(1e6 * host, 1), wall_us=round(1e6 * wall, 1), kernels=kernels / 5,
                kernel_us=round(kernel_us / 5, 1), ops=sum(ops.values()) / 5,
                op_host_us=round(sum(op_us.values()) / 5, 1),
                python_us=round(1e6 * host - sum(op_us.values()) / 5, 1),
                by_op={name: dict(calls=ops[name] / 5, host_us=round(op_us[name] / 5, 1)) for name in top})


def host_us(fn, reps: int) -> float:
    """Host µs of one call of ``fn``: ``reps`` calls back to back without a synchronization."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(BLOCKS):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t) / reps)
    return 1e6 * statistics.median(times)


_STEPS = ("bit_spmm_affine", "quant_mlp_keys", "quant_mlp_planes_keys", "quant_mlp", "quantize_pack_ranges",
          "dequantize")


def layer_breakdown(model, args_, runner, reps: int) -> list:
    """Per layer: host µs of the call, of its op alone, of each of the op's steps alone (see the module docstring)."""
    from pyg_quant import ops
    from pyg_quant.ops import reference

    def patched(module, names, record):
        """``module``'s functions ``names`` replaced by ``record(name, args)`` for the block; the originals back after."""
        saved = {n: getattr(module, n) for n in names}
        for n in names:
            setattr(module, n, lambda *a, _n=n, **kw: record(_n, a, kw))
        return saved

    # Each layer's input and its op's arguments, from one forward.
    convs = ("gin_conv_eval", "gcn_conv_eval", "qat_gin_conv_eval", "qat_gcn_conv_eval")
    calls, layer_inputs = [], []
    # (qat_gcn_conv_eval's x_quantized=True is the op qat_gcn_conv_eval_quantized)
    saved = patched(ops, convs, lambda n, a, kw: calls.append((n + "_quantized" if kw.get("x_quantized") else n, a, kw))
                    or saved[n](*a, **kw))
    hooks = [conv.register_forward_pre_hook(lambda m, inp: layer_inputs.append((m, inp))) for conv in model.convs]
    try:
        with torch.inference_mode():
            model(*args_)
    finally:
        for n, f in saved.items():
            setattr(ops, n, f)
        for h in hooks:
            h.remove()
    # Each op's steps: the reference composition with every step the compiled op, their arguments recorded.
    steps_of = []
    saved_steps = patched(reference, _STEPS, lambda n, a, kw: steps_of[-1].append((n, a)) or
                          getattr(torch.ops.pyg_quant, n).default(*a, **kw))
    try:
        with torch.inference_mode():
            for name, op_args, kw in calls:
                steps_of.append([])
                getattr(reference, name.replace("_quantized", ""))(*op_args, **kw)
    finally:
        for n, f in saved_steps.items():
            setattr(reference, n, f)
    rows = []
    with torch.inference_mode():
        for (conv, inp), (name, op_args, _), steps in zip(layer_inputs, calls, steps_of):
            op = getattr(torch.ops.pyg_quant, name).default
            call_us, op_us = host_us(lambda: conv(*inp), reps), host_us(lambda: op(*op_args), reps)
            step_us = collections.Counter()
            for n, a in steps:
                step = getattr(torch.ops.pyg_quant, n).default
                step_us[n] += host_us(lambda: step(*a), reps)
            runner.sync()
            rows.append(dict(layer=type(conv).__name__, call_us=round(call_us, 1), op_us=round(op_us, 1),
                             python_us=round(call_us - op_us, 1), steps={n: round(v, 1) for n, v in step_us.items()}))
    return rows


def inference_forward(model, inputs) -> None:
    with torch.inference_mode():
        model(*inputs)


class FloatFeaturesGeneralPath(torch.nn.Module):
    """``model`` with QGINConv's one op on float features off: those layers run their general forward (what the
    drop-in GIN's second and third layers ran before that op), the rest as it is."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        from pyg_quant.nn import _eval_path
        saved = _eval_path._gin_float_features
        _eval_path._gin_float_features = lambda *a: None
        try:
            return self.model(*inputs)
        finally:
            _eval_path._gin_float_features = saved


def pyg_gin_model(args):
    """PyG's own ``GIN`` model (``torch_geometric.nn.models.GIN``: each layer's ``nn`` a PyG ``MLP``, a ReLU between
    the layers) of the workload's sizes, as a PyG user builds it."""
    from torch_geometric.nn.models import GIN
    torch.manual_seed(args.seed)
    return GIN(args.features, args.gin_hidden, num_layers=args.layers, out_channels=args.classes)


def converted_qat(kind: str, args, data, device, pyg_model=None):
    """The QAT route to the same 4-bit model: ``qat.prepare`` on the PyG model (``pyg_model``, else the workload's),
    three training steps on the batch (so that the static ranges have observed data), ``qat.convert``; it runs on the
    loader's batch as the others do."""
    import warnings
    import torch.nn.functional as F
    torch.manual_seed(args.seed)
    fp32 = pyg_model if pyg_model is not None else workload.make_pyg(args, kind, normalize=True)
    model = pq.qat.prepare(fp32.to(device), bits=4).train()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, edge_index = workload.pyg_inputs(data, kind, "edge_index", "fp32", device).resident[0]
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x, edge_index), data.y[0]).backward()
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pq.qat.convert(model)


def training_syncs(kind: str, args, data, runner, steps: int = 3) -> dict:
    """Host synchronizations in one eager QAT training step (forward, backward, Adam) on an ``edge_index`` batch, as
    e2e.py's QAT epoch runs it, and where they come from."""
    import torch.nn.functional as F
    torch.manual_seed(args.seed)
    model = pq.qat.prepare(workload.make_pyg(args, kind, normalize=True).to(runner.device), bits=4).train()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, edge_index = workload.pyg_inputs(data, kind, "edge_index", "fp32", runner.device).resident[0]
    y = data.y[0]

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x, edge_index), y).backward()
        opt.step()

    for _ in range(2):
        step()
    sites = collections.Counter()
    count = workload.count_syncs(runner, lambda: [step() for _ in range(steps)], sites)
    return dict(syncs_per_step=count / steps, sites={k: v / steps for k, v in sites.most_common()})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a CPU check on a tiny batch")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=None)
    own, rest = p.parse_known_args(argv)
    base = ["--num-parts", "20", "--parts-per-batch", "20"] if not own.small else \
        ["--small", "--num-parts", "2", "--parts-per-batch", "2", "--part-size", "250", "--avg-degree", "20"]
    args = workload.parse_args(base + rest + ["--out", ""])
    torch.manual_seed(args.seed)
    device, _, runner, data = workload.probe_workload(args)
    rows = []
    for kind in ("GIN", "GCN"):
        torch.manual_seed(args.seed)
        pyg = workload.make_pyg(args, kind, normalize=kind != "GCN").to(device).eval()
        state = pyg.state_dict()
        variants = [("PyG fp32 CSR", pyg, workload.pyg_inputs(data, kind, "CSR", "fp32", device).resident[0])]
        for bits in (8, 4):
            model = workload.make_pq(args, kind, bits)
            model.load_state_dict(state)
            variants.append((f"pyg_quant {bits}-bit", model.to(device).eval(),
                             workload.pq_inputs(data, kind, bits, device, False).resident[0]))
        if kind == "GIN":  # PyG's GIN with QGINConv in place of GINConv: floats between the layers (no out_bits)
            model = workload.make_pq(args, kind, 4, requantize=False)
            model.load_state_dict(state)
            inputs = workload.pq_inputs(data, kind, 4, device, False).resident[0]
            variants.append(("pyg_quant 4-bit drop-in", model.to(device).eval(), inputs))
            variants.append(("drop-in, general path", FloatFeaturesGeneralPath(model), inputs))
        variants.append(("qat.convert 4-bit", converted_qat(kind, args, data, device),
                         workload.pq_inputs(data, kind, 4, device, False).resident[0]))
        if kind == "GIN":  # PyG's GIN model itself, in fp32 and through the QAT route
            variants.append(("PyG GIN model fp32 CSR", pyg_gin_model(args).to(device).eval(),
                             workload.pyg_inputs(data, kind, "CSR", "fp32", device).resident[0]))
            variants.append(("PyG GIN model, qat.convert 4-bit",
                             converted_qat(kind, args, data, device, pyg_gin_model(args)),
                             workload.pq_inputs(data, kind, 4, device, False).resident[0]))
        timings = time_interleaved([(model, inputs) for _, model, inputs in variants], runner, own.reps)
        for (label, model, inputs), timing in zip(variants, timings):
            row = dict(model=kind, label=label, **profile_forward(model, inputs, runner, timing))
            if runner.cuda:
                row["syncs"] = workload.count_syncs(runner, lambda: inference_forward(model, inputs))
            rows.append(row)
            top = ", ".join(f"{k.split('::')[-1]} {v['calls']:g}x {v['host_us']:.0f}" for k, v in
                            list(row["by_op"].items())[:6])
            print(f"{kind} {label:16s} host {row['host_us']:7.1f} us  wall {row['wall_us']:7.1f}  kernels "
                  f"{row['kernels']:4.0f} ({row['kernel_us']:6.1f} us)  ops {row['ops']:4.0f} ({row['op_host_us']:6.1f} "
                  f"us)  Python {row['python_us']:6.1f} us  syncs {row.get('syncs')} | {top}", flush=True)
            if label.startswith("pyg_quant") or "qat" in label:
                row["layers"] = layer_breakdown(model, inputs, runner, own.reps * 3)
                for i, lr in enumerate(row["layers"]):
                    steps = ", ".join(f"{k} {v:.1f}" for k, v in lr["steps"].items())
                    print(f"    layer {i}: call {lr['call_us']:6.1f} us = op {lr['op_us']:6.1f} + Python "
                          f"{lr['python_us']:6.1f} | steps alone: {steps}", flush=True)
    if runner.cuda:
        for kind in ("GIN", "GCN"):
            found = training_syncs(kind, args, data, runner)
            rows.append(dict(model=kind, label="QAT 4-bit training step (edge_index)", **found))
            sites = ", ".join(f"{k} {v:g}x" for k, v in list(found["sites"].items())[:8])
            print(f"{kind} QAT 4-bit training step: {found['syncs_per_step']:g} host syncs | {sites}", flush=True)
    with torch.inference_mode():
        probe = torch.zeros(1, device=device)
        scale = dict(empty_us=round(host_us(lambda: torch.empty(256, device=device), own.reps * 10), 1),
                     add_us=round(host_us(lambda: torch.ops.aten.add.Tensor(probe, probe), own.reps * 10), 1))
        runner.sync()
    print(f"for scale: torch.empty {scale['empty_us']} us, aten::add (one element) {scale['add_us']} us", flush=True)
    if own.out:
        meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    device=workload.device_name(device), torch=torch.__version__, command=" ".join(sys.argv))
        with open(own.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows, scale=scale), f, indent=1)


if __name__ == "__main__":
    main()
