"""CapturedTrainStep: a training step captured in a CUDA graph per batch shape and replayed.

The oracle is the plain eager step (``zero_grad``, forward, loss, backward, ``optimizer.step``) on
the same model, data and optimizer: with nearest rounding the captured steps must give the very
same losses and parameters, bit for bit.  On the CPU the class runs that eager step itself.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn import Linear, ReLU, Sequential
from torch_geometric.nn import GCNConv, GINConv

import pyg_quant as pq
from pyg_quant import qat
from pyg_quant.nn import QGINConv

from conftest import CUDA_OK, requires_compiled
from test_qat import GIN, planted_graph



def cuda_test(fn):
    """Marked ``cuda`` (``pytest -m cuda``) and skipped without a GPU."""
    skip = pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA GPU and pyg_quant's compiled CUDA backend")
    return pytest.mark.cuda(skip(fn))


class GCN(torch.nn.Module):
    def __init__(self, channels, hidden, classes):
        super().__init__()
        self.conv1, self.conv2 = GCNConv(channels, hidden), GCNConv(hidden, classes)

    def forward(self, x, edge_index):
        return self.conv2(F.relu(self.conv1(x, edge_index)), edge_index)


MODELS = {"gin": lambda: GIN(16, 32, 4), "gcn": lambda: GCN(16, 16, 4)}


def batches(device, sizes=(600, 450)):
    """Planted-class graphs of two sizes (two shapes, so two graphs)."""
    out = []
    for seed, nodes in enumerate(sizes):
        data = planted_graph(nodes=nodes, seed=seed)
        out.append((data.x.to(device), data.edge_index.to(device), data.y.to(device)))
    return out


def make(kind, device, quantized=True, capturable=True, **prepare_kwargs):
    torch.manual_seed(0)
    model = MODELS[kind]()
    if quantized:
        model = qat.prepare(model, bits=4, **prepare_kwargs)
    model = model.to(device).train()
    capturable = capturable and torch.device(device).type == "cuda"  # a capturable Adam takes CUDA params only
    opt = torch.optim.Adam(model.parameters(), lr=0.01, **({"capturable": True} if capturable else {}))
    return model, opt


def eager_step(model, opt, x, edge_index, y):
    opt.zero_grad(set_to_none=False)
    loss = F.cross_entropy(model(x, edge_index), y)
    loss.backward()
    opt.step()
    return loss.detach()


def train(kind, device, captured, steps=7, between=None, **make_kwargs):
    """Losses and final parameters of ``steps`` steps cycling over the batches; ``between(i, model, opt)`` runs
    after step ``i`` (the same in both runs)."""
    model, opt = make(kind, device, **make_kwargs)
    step = pq.CapturedTrainStep(model, opt, F.cross_entropy) if captured else None
    data = batches(device)
    losses = []
    for i in range(steps):
        x, edge_index, y = data[i % len(data)]
        loss = step(x, edge_index, target=y) if captured else eager_step(model, opt, x, edge_index, y)
        losses.append(loss.item())
        if between is not None:
            between(i, model, opt)
    return losses, [p.detach().clone() for p in model.parameters()], step


def assert_same_run(a, b):
    assert a[0] == b[0]
    assert all(torch.equal(p, q) for p, q in zip(a[1], b[1]))


# --- any device: arguments and the eager step --------------------------------------------
def test_arguments_are_checked():
    model, opt = make("gin", "cpu", quantized=False)
    with pytest.raises(TypeError, match="model"):
        pq.CapturedTrainStep(lambda x: x, opt, F.cross_entropy)
    with pytest.raises(TypeError, match="optimizer"):
        pq.CapturedTrainStep(model, "adam", F.cross_entropy)
    with pytest.raises(TypeError, match="loss_fn"):
        pq.CapturedTrainStep(model, opt, None)
    for name in ("warmup", "max_graphs"):
        with pytest.raises(ValueError, match=name):
            pq.CapturedTrainStep(model, opt, F.cross_entropy, **{name: 0})
    step = pq.CapturedTrainStep(model, opt, F.cross_entropy)
    x, edge_index, y = batches("cpu")[0]
    with pytest.raises(TypeError, match=r"target\[1\]"):
        step(x, edge_index, target=[y, 3])
    with pytest.raises(TypeError, match=r"inputs\[1\]"):
        step(x, [edge_index], target=y)
    with pytest.raises(TypeError, match=r"inputs\[0\] must be a strided"):
        step(x.to_sparse(), edge_index, target=y)
    with pytest.raises(ValueError, match="scalar"):
        pq.CapturedTrainStep(model, opt, lambda out, t: F.cross_entropy(out, t, reduction="none"))(
            x, edge_index, target=y)


@requires_compiled
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_cpu_steps_equal_the_eager_loop(kind):
    reference = train(kind, "cpu", captured=False, steps=4)
    got = train(kind, "cpu", captured=True, steps=4)
    assert_same_run(got, reference)
    assert got[2].num_graphs == 0  # nothing is captured on the CPU


def test_eager_steps_move_static_ranges_in_place():
    fq = qat.FakeQuantize(4, "ema", dim=0)
    fq.train()
    fq(torch.randn(50, 3))  # the first batch sets the range (fresh tensors)
    lo = fq.observer.min_val
    with pq.quantization.observers.ranges_in_place():
        fq(torch.randn(50, 3) + 1)
    assert fq.observer.min_val is lo  # same tensor, new values
    fresh = qat.FakeQuantize(4, "ema", dim=0).train()
    fresh(torch.randn(50, 3))
    fresh(torch.randn(50, 3) + 1)
    assert fresh.observer.min_val is not fresh.observer.max_val


# --- CUDA: captured graphs ----------------------------------------------------------------
@cuda_test
@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("capturable", [True, False])
def test_captured_steps_equal_the_eager_loop_bit_for_bit(kind, capturable):
    reference = train(kind, "cuda", captured=False, stochastic=False, capturable=capturable)
    got = train(kind, "cuda", captured=True, stochastic=False, capturable=capturable)
    assert got[2].num_graphs == 2 and got[2].disabled_reason is None
    assert_same_run(got, reference)


@cuda_test
def test_plain_pyg_model_is_captured_too():
    kind = "gin"
    reference = train(kind, "cuda", captured=False, quantized=False)
    got = train(kind, "cuda", captured=True, quantized=False)
    assert got[2].num_graphs == 2 and got[2].disabled_reason is None
    # PyG sums messages with atomic scatters: two eager runs differ in the last bits already.
    assert torch.allclose(torch.tensor(got[0]), torch.tensor(reference[0]), rtol=1e-5, atol=0)
    assert all(torch.allclose(p, q, rtol=1e-4, atol=1e-6) for p, q in zip(got[1], reference[1]))


@cuda_test
def test_plain_pyg_gcn_is_found_uncapturable_before_any_capture():
    """PyG's gcn_norm indexes with a mask (a host sync): the watched warm-up step finds it, nothing is captured,
    and the run goes on eagerly with torch's random generator intact."""
    with pytest.warns(RuntimeWarning, match="synchronizes with the host"):
        got = train("gcn", "cuda", captured=True, quantized=False)
    assert got[2].num_graphs == 0 and "synchronizes" in got[2].disabled_reason
    torch.rand(3, device="cuda")  # the default generator is not left mid-capture
    reference = train("gcn", "cuda", captured=False, quantized=False)
    assert torch.allclose(torch.tensor(got[0]), torch.tensor(reference[0]), rtol=1e-5, atol=0)


@cuda_test
@pytest.mark.parametrize("seed", [None, 5])
def test_stochastic_rounding_is_captured_and_seed_deterministic(seed):
    runs = []
    for _ in range(2):
        torch.manual_seed(1)
        runs.append(train("gin", "cuda", captured=True, steps=12, seed=seed))
    assert runs[0][2].num_graphs == 2 and runs[0][2].disabled_reason is None
    assert_same_run(runs[0], runs[1])
    losses = runs[0][0]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-4:]) < sum(losses[:4])  # it trains


@cuda_test
def test_zero_grad_to_none_and_state_reloads_between_steps():
    saved = {}

    def between(i, model, opt):
        opt.zero_grad()  # set_to_none=True: the step gives its gradient tensors back
        if i == 2:
            saved["model"] = {k: v.clone() for k, v in model.state_dict().items()}
            saved["opt"] = opt.state_dict()
        if i == 4:  # in-place copies into the same tensors, and fresh optimizer state tensors
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])

    reference = train("gin", "cuda", captured=False, steps=9, between=between, stochastic=False)
    got = train("gin", "cuda", captured=True, steps=9, between=between, stochastic=False)
    assert_same_run(got, reference)


@cuda_test
def test_bad_edge_index_is_rejected_before_a_replay():
    model, opt = make("gin", "cuda")
    step = pq.CapturedTrainStep(model, opt, F.cross_entropy)
    x, edge_index, y = batches("cuda")[0]
    for _ in range(3):
        step(x, edge_index, target=y)
    assert step.num_graphs == 1
    before = [p.detach().clone() for p in model.parameters()]
    bad = edge_index.clone()
    bad[1, 7] = x.size(0)  # one past the last node
    with pytest.raises(ValueError, match="out of range"):
        step(x, bad, target=y)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@cuda_test
def test_uncapturable_step_warns_and_runs_eagerly():

    def masked_loss(out, y):
        keep = y > 0
        return F.cross_entropy(out[keep], y[keep])  # boolean indexing: a data-dependent size

    model, opt = make("gin", "cuda", quantized=False)
    reference_model, reference_opt = make("gin", "cuda", quantized=False)
    step = pq.CapturedTrainStep(model, opt, masked_loss)
    x, edge_index, y = batches("cuda")[0]
    with pytest.warns(RuntimeWarning, match="synchronizes with the host"):
        for _ in range(3):
            step(x, edge_index, target=y)
    assert step.disabled_reason and step.num_graphs == 0
    for _ in range(3):
        reference_opt.zero_grad(set_to_none=False)
        masked_loss(reference_model(x, edge_index), y).backward()
        reference_opt.step()
    # PyG's atomic scatters: equal up to the order of float additions
    assert all(torch.allclose(p, q, rtol=1e-4, atol=1e-6) for p, q in zip(model.parameters(),
                                                                          reference_model.parameters()))


@cuda_test
def test_plain_capture_of_an_unchecked_edge_index_says_why():
    conv = QGINConv(Sequential(Linear(16, 16)), bits=None).cuda()
    x, edge_index, _ = batches("cuda")[0]
    fresh = edge_index.clone()
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="cannot be checked while a CUDA graph is captured"):
            with torch.cuda.graph(graph):
                conv(x, fresh)


@cuda_test
def test_failed_capture_leaves_the_random_generator_usable():
    """A sync that the watched warm-up step did not make (here: only from the second call on) fails the capture
    itself; the step reports it, runs eagerly, and random ops (stochastic rounding) still work."""
    calls = []

    def late_sync_loss(out, y):
        calls.append(None)
        if len(calls) > 1:
            float(out.sum())  # .item(): a host sync
        return F.cross_entropy(out, y)

    model, opt = make("gin", "cuda")  # stochastic rounding: torch's default generator is registered in captures
    step = pq.CapturedTrainStep(model, opt, late_sync_loss)
    x, edge_index, y = batches("cuda")[0]
    step(x, edge_index, target=y)
    with pytest.warns(RuntimeWarning, match="cannot be captured"):
        step(x, edge_index, target=y)
    assert step.num_graphs == 0 and step.disabled_reason
    losses = [step(x, edge_index, target=y) for _ in range(2)]
    assert all(torch.isfinite(loss) for loss in losses)
    torch.rand(3, device="cuda")
