"""Converted QAT GCN / GIN layers on a BitAdjacency run pyg_quant/qat/eval_path.py: the general forward's bit path, bit
for bit.

Each case compares the short path with the layer's general forward (the short path switched off) on the same
inputs: float features, the loader's per-column codes and (GCN) its per-node codes, which the first layer multiplies
as they are (on the CPU; the general path on a GPU), static ranges per channel and per tensor and dynamic ones, 2 to
8 bits.  Then what must not take it, and what non-finite inputs do.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.nn import Linear, ReLU, Sequential
from torch_geometric.nn import GCNConv, GINConv

import pyg_quant as pq
import pyg_quant.qat.conv as qat_conv
from pyg_quant import qat

from conftest import gen, requires_compiled

pytestmark = requires_compiled


class GCN(torch.nn.Module):
    def __init__(self, channels=24, hidden=32, classes=5):
        super().__init__()
        self.conv1, self.conv2, self.conv3 = GCNConv(channels, hidden), GCNConv(hidden, hidden), GCNConv(hidden, classes)

    def forward(self, x, adj):
        return self.conv3(F.relu(self.conv2(F.relu(self.conv1(x, adj)), adj)), adj)


class GIN(torch.nn.Module):
    def __init__(self, channels=24, hidden=32, classes=5):
        super().__init__()
        self.conv1 = GINConv(Sequential(Linear(channels, hidden), ReLU(), Linear(hidden, hidden)), train_eps=True)
        self.conv2 = GINConv(Sequential(Linear(hidden, hidden), ReLU(), Linear(hidden, hidden)))
        self.conv3 = GINConv(Sequential(Linear(hidden, classes)))

    def forward(self, x, adj):
        return self.conv3(F.relu(self.conv2(F.relu(self.conv1(x, adj)), adj)), adj)


def converted(device, bits=4, seed=0, kind="gcn", net=None, **observers):
    """A trained-for-three-steps, converted QAT GCN (or GIN; ``net()``: that float model of the kind, 24 features in
    and 5 classes out), its data and its BitAdjacency (A + I; GIN: A)."""
    g = gen(seed)
    n = 400
    edge_index = torch.randint(n, (2, 3000), generator=g)
    x = torch.randn(n, 24, generator=g) * 2 + 0.5
    y = torch.randint(5, (n,), generator=g)
    torch.manual_seed(seed)
    net = net if net is not None else GCN if kind == "gcn" else GIN
    model = qat.prepare(net(), bits=bits, seed=seed, **observers).to(device)
    x, edge_index, y = x.to(device), edge_index.to(device), y.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(x, edge_index), y).backward()
        opt.step()
    adj = pq.BitAdjacency.from_edge_index(edge_index, n, self_loops=1 if kind == "gcn" else 0)
    return qat.convert(model), x, adj, edge_index


def general(model, *args):
    """``model(*args)`` with the short paths off."""
    saved = qat_conv.gcn_eval, qat_conv.gin_eval
    qat_conv.gcn_eval = qat_conv.gin_eval = lambda *a: None
    try:
        return model(*args)
    finally:
        qat_conv.gcn_eval, qat_conv.gin_eval = saved


def short_calls(monkeypatch, kind="gcn"):
    import pyg_quant.qat.eval_path as eval_path
    calls = []
    name = f"{kind}_eval"
    real = getattr(eval_path, name)
    monkeypatch.setattr(qat_conv, name, lambda *a: calls.append(real(*a)) or calls[-1])
    return calls


@pytest.mark.parametrize("observers", [{}, {"agg_observer": "ema"}, {"agg_observer": "minmax", "agg_granularity":
                                                                        "tensor"}, {"agg_observer": "dynamic"},
                                       {"weight_observer": "learned"}],
                         ids=["mse", "ema", "minmax-tensor", "dynamic", "learned-weights"])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("kind", ["gcn", "gin"])
def test_short_path_is_the_general_path(device, kind, bits, observers, monkeypatch):
    model, x, adj, _ = converted(device, bits, kind=kind, **observers)
    xq = pq.to_bit(x, bits, dim=0, layout="col")  # what the loader ships (GIN's aggregation operand as it is)
    inputs = [(x, 2), (xq, 2)]  # (input, layers on the short path: both quantized ones, the last stays fp32)
    if kind == "gcn":  # codes the first layer takes as they are: per node (feature_dim=1), narrower, per tensor
        short = 2 if device == "cpu" else 1
        inputs += [(pq.to_bit(x, bits, dim=1), short), (pq.to_bit(x, max(bits - 1, 1), dim=1), short),
                   (pq.to_bit(x, bits, dim=None, layout="col"), short)]
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            for inp, short in inputs:
                want = general(model, inp, adj)
                calls = short_calls(monkeypatch, kind)
                got = model(inp, adj)
                monkeypatch.undo()
                assert sum(c is not None for c in calls) == short
                assert torch.equal(got, want)
    # grad mode on, nothing asks for one (a converted model's parameters): the bit kernels, the same numbers
    assert torch.equal(model(x, adj), general(model, x, adj))


def test_gin_on_codes_takes_its_self_term_in_the_aggregation():
    """The loader's codes and no diagonal: ``(1 + eps)·x`` is the aggregation's epilogue self term in both the short
    path (which decodes no x) and the general one (no separate ``addcmul``, which may fuse its multiply and add),
    the same floats as multiplying and adding after the aggregation."""
    model, x, adj, _ = converted("cpu", kind="gin")
    xq = pq.to_bit(x, 4, dim=0, layout="col")
    for short, run in ((True, model.conv1), (False, lambda *a: general(model.conv1, *a))):
        with torch.no_grad(), torch.profiler.profile() as prof:
            out = run(xq, adj)
        names = {e.name for e in prof.events()}
        assert "aten::addcmul" not in names and not (short and "pyg_quant::dequantize" in names), names
    with torch.no_grad():  # the aggregation, then + (1 + eps)·to_val(x): a float32 multiply and add, unfused
        conv = model.conv1
        want = conv.nn(pq.bit_spmm(adj, xq) + conv._one_plus_eps() * pq.to_val(xq))
    assert torch.equal(out, want)


def test_what_keeps_the_general_path(monkeypatch):
    model, x, adj, edge_index = converted("cpu")
    calls = short_calls(monkeypatch)
    with torch.no_grad():
        model(x, pq.BitAdjacency.from_edge_index(edge_index, x.size(0)))  # no diagonal: self-loops added by the rule
        assert calls == [None, None]
        model(pq.to_bit(x, 4, dim=1), adj)  # the input quantizer's own codes: multiplied as they are, here too
        assert calls[2] is not None and calls[3] is not None
        model(x, edge_index)  # not a BitAdjacency
        assert calls[4:] == [None, None]
    model.conv1.lin.register_forward_hook(lambda *a: None)
    with torch.no_grad():
        model(x, adj)
    assert calls[6] is None and calls[7] is not None
    model, x, adj, _ = converted("cpu", input_observer="dynamic_mse")
    calls = short_calls(monkeypatch)
    with torch.no_grad():
        model(x, adj)
    assert calls == [None, None]
    prepared_in_eval = qat.prepare(GCN(), bits=4).eval()  # observers still on: ranges may move
    calls = short_calls(monkeypatch)
    with torch.no_grad():
        prepared_in_eval(x, adj)
    assert calls == [None, None]


def test_stored_keys_follow_the_range(monkeypatch):
    model, x, adj, _ = converted("cpu", agg_observer="ema")
    with torch.no_grad():
        first = model(x, adj)
        model.conv1.agg_quant.observer.max_val.mul_(0.5)  # narrower: more values clamp
        narrowed = model(x, adj)
        assert torch.equal(narrowed, general(model, x, adj)) and not torch.equal(narrowed, first)


@pytest.mark.parametrize("kind", ["gcn", "gin"])
def test_the_kept_plan_follows_every_edit(kind, monkeypatch):
    """What a layer keeps of its modules between calls (the op's weight arguments, its stored keys, 1 + eps) is made
    again after anything it was made from changes: every call after an edit equals the general path's, and an
    unchanged layer skips the checks that made it."""
    import pyg_quant.qat.eval_path as eval_path
    model, x, adj, _ = converted("cpu", kind=kind, agg_observer="ema")
    conv = model.conv1
    lin = conv.lin if kind == "gcn" else conv.nn[0]
    edits = [
        ("a weight step", lambda: lin.weight.mul_(0.9)),
        ("a bias step", lambda: (conv.bias if kind == "gcn" else lin.bias).add_(0.1)),
        ("a stored range", lambda: conv.agg_quant.observer.min_val.mul_(0.5)),
        ("a weight moved", lambda: setattr(lin.weight, "data", lin.weight.data.clone())),
        ("the weight quantizer observing", lambda: lin.weight_quant.enable_observer()),
        ("and frozen again", lambda: lin.weight_quant.disable_observer()),
        ("the aggregation quantizer off", lambda: conv.agg_quant.disable_fake_quant()),
        ("and on again", lambda: conv.agg_quant.enable_fake_quant()),
        ("a hook", lambda: lin.weight_quant.register_forward_hook(lambda *a: None)),
    ]
    if kind == "gin":
        edits += [("an eps step", lambda: conv.eps.add_(0.25)),
                  ("a module swapped", lambda: conv.nn.__setitem__(1, torch.nn.Identity()))]
    checks = []
    real = eval_path._aggregation_keys
    monkeypatch.setattr(eval_path, "_aggregation_keys", lambda *a: checks.append(1) or real(*a))
    with torch.no_grad():
        model(x, adj)
        checks.clear()
        assert torch.equal(model(x, adj), general(model, x, adj)) and checks == []  # the kept plan, unchecked
        for what, edit in edits:
            edit()
            assert torch.equal(model(x, adj), general(model, x, adj)), what


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("kind", ["gcn", "gin"])
def test_non_finite_input(device, kind, bad):
    """The CPU raises as the general path does; a GPU runs on without a host synchronization, and nothing comes out
    silently finite (the stored ranges would have given finite codes).  GCN: the value makes its row's range, so its
    row of ``D^-1/2 X W``, so every channel's range non-finite.  GIN: its column takes a NaN range, so that column of
    the aggregation is NaN in every row, and so is every row's MLP output."""
    model, x, adj, _ = converted(device, kind=kind, agg_observer="ema")
    x = x.clone()
    x[7, 3] = bad
    with torch.no_grad():
        if device == "cpu":
            with pytest.raises(ValueError, match="NaN or inf"):
                model(x, adj)
        else:
            assert not torch.isfinite(model.conv1(x, adj)).any()


def test_gin_what_keeps_the_general_path(monkeypatch):
    model, x, adj, edge_index = converted("cpu", kind="gin")
    calls = short_calls(monkeypatch, "gin")
    with torch.no_grad():
        model.conv1((x, x), adj)  # a pair
        model.conv1(pq.to_bit(x, 4, dim=1), adj)  # codes per node: read as floats and quantized again
        model.conv1(x, edge_index)
    assert calls == [None, None, None]
    model.conv1.nn[0].register_forward_pre_hook(lambda *a: None)
    with torch.no_grad():
        model(x, adj)
    assert calls[3] is None and calls[4] is not None


@pytest.mark.parametrize("kind", ["gcn", "gin"])
def test_ops_equal_their_reference(device, kind, monkeypatch):
    """qat_gcn_conv_eval / qat_gin_conv_eval, as the layers call them (float features and per-column and per-tensor
    codes, GCN's per-node codes; stored ranges and each channel's own), against pyg_quant/ops/reference.py's
    composition, and opcheck (schema, fake kernel) on the CPU.  On a GPU, a NaN in a column with stored ranges too.
    GCN's codes taken as they are (per tensor, per node) run qat_gcn_conv_eval_quantized, on the CPU only."""
    from pyg_quant import ops
    from pyg_quant.ops import reference

    name = f"qat_{kind}_conv_eval"
    recorded = []
    real = getattr(ops, name)
    monkeypatch.setattr(ops, name, lambda *a, **k: recorded.append((a, k)) or real(*a, **k))
    for observers in ({"agg_observer": "ema"}, {"agg_observer": "dynamic"}):
        model, x, adj, _ = converted(device, 4, kind=kind, **observers)
        bad = x.clone()
        bad[7, 3] = float("nan")
        inputs = [x, pq.to_bit(x, 4, dim=0, layout="col"), pq.to_bit(x, 3, dim=None, layout="col")]
        inputs += [pq.to_bit(x, 4, dim=1)] if kind == "gcn" else []
        with torch.no_grad():
            for inp in inputs + ([bad] if device == "cuda" else []):
                model.conv1(inp, adj)
    # on a GPU, GCN's codes taken as they are (per tensor, per node) keep the general path
    assert len(recorded) == {("cpu", "gcn"): 8, ("cpu", "gin"): 6, ("cuda", "gcn"): 6, ("cuda", "gin"): 8}[
        (device, kind)]
    assert sum(k.get("x_quantized", False) for _, k in recorded) == (4 if (device, kind) == ("cpu", "gcn") else 0)
    for args, kwargs in recorded:
        op = getattr(torch.ops.pyg_quant, name + ("_quantized" if kwargs.get("x_quantized") else "")).default
        got, want = op(*args), getattr(reference, name)(*args, **kwargs)
        assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want) or (
            torch.isnan(got).equal(torch.isnan(want)) and torch.equal(got.nan_to_num(), want.nan_to_num()))
        if device == "cpu":
            torch.library.opcheck(op, args)


@pytest.mark.parametrize("norm", [None, "batch_norm"])
def test_pyg_gin_model_takes_the_short_path(device, norm, monkeypatch):
    """PyG's own ``GIN`` model (``torch_geometric.nn.models.GIN``: its layers' ``nn`` a PyG ``MLP``, ``norm=None`` by
    default), prepared, trained and converted: each quantized layer is one op, the general path's bits; with batch
    normalization inside the MLP the general path runs (the same model, its own numbers)."""
    from torch_geometric.nn.models import GIN as PyGGIN

    model, x, adj, _ = converted(device, kind="gin",
                                 net=lambda: PyGGIN(24, 32, num_layers=3, out_channels=5, norm=norm))
    with torch.no_grad():
        want = general(model, x, adj)
        calls = short_calls(monkeypatch, "gin")
        got = model(x, adj)
        monkeypatch.undo()
    assert sum(c is not None for c in calls) == (2 if norm is None else 0)  # the last layer stays fp32
    assert torch.equal(got, want)
