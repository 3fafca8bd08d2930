"""Model inputs: each variant's batches on the device, in host memory, and the copies between them."""
import torch

from pyg_quant.loader import QuantBatch

from .graph import Data


class Inputs:
    """One variant's batches: ``resident`` (args of the forward, on the device), ``host`` (pinned),
    ``load(hb)`` (host batch -> forward args, non-blocking copies) and ``copies`` (per batch, the
    (device tensor, host tensor) pairs that refill the resident inputs: a CUDA graph's H2D)."""

    def __init__(self, resident, host, load, copies, bytes_of):
        self.resident, self.host, self.load, self.copies = resident, host, load, copies
        self.bytes_per_batch = [bytes_of(h) for h in host]
        self.wire = None  # pyg_quant: (device buffer, specs, meta) per batch, decoded inside the graph


def pq_host_batches(data: Data, kind: str, bits: int, pinned: bool, indices=None):
    """The loader's batches (all, or those of ``indices``): the adjacency's tile plan and the bit features in one
    (pinned) wire buffer, decoded in the form ``--adjacency`` names (the wire bytes are the same for every form)."""
    plans = data.plan_gcn if kind == "GCN" else data.plan_gin
    return [QuantBatch.from_fields({"adj": plans[b], "x": data.feats[bits][b].to("cpu")}, pin_memory=pinned,
                                   adjacency=data.adjacency) for b in (range(data.nb) if indices is None else indices)]


def pq_inputs(data: Data, kind: str, bits: int, device, pinned: bool) -> Inputs:
    """pyg_quant's inputs at ``bits``: ``host`` the loader's batches (:func:`pq_host_batches`, pinned when
    ``pinned``), ``resident`` ``(x, adj)`` of each decoded on ``device`` once (``BitTensor`` features and the
    ``--adjacency`` form), ``load`` a copy of the batch's one buffer and its decode, ``copies`` that one buffer; and
    ``wire`` the device buffers with their layout, for a CUDA graph that decodes what it was copied."""
    host = pq_host_batches(data, kind, bits, pinned)
    batches = [h.to(device) for h in host]  # what QuantClusterLoader + .to(device) hands over
    resident = [(b.x, b.adj) for b in batches]  # decoded on the device once, kept

    def load(hb):
        b = hb.to(device)  # one copy of the batch's buffer, then the decode kernels
        return b.x, b.adj
    copies = [[(b.buffer, h.buffer)] for b, h in zip(batches, host)]
    inputs = Inputs(resident, host, load, copies, lambda h: h.nbytes)
    # For a CUDA graph fed by copies: the decode is captured with the forward (it reads the buffer).
    inputs.wire = [(b.buffer, b._specs, b._meta) for b in batches]
    return inputs


def pyg_inputs(data: Data, kind: str, adjacency: str, precision: str, device) -> Inputs:
    """PyG's inputs in ``precision`` (``"fp32"`` or ``"bf16"``: ``x`` and the CSR values) on ``adjacency``:
    ``"edge_index"`` gives ``(x, edge_index)``, ``"CSR"`` gives ``(x, adj_t)`` with a torch ``sparse_csr_tensor``
    ``n × n`` (GIN: A; GCN: the normalized A+I); ``host`` ships ``x`` and the index tensors (``crow``, ``col``,
    ``val`` for CSR) as they are, ``load`` copies them non-blocking and rebuilds the CSR on the device."""
    n, bf16 = data.n, precision == "bf16"
    x_dev = data.x16 if bf16 else data.x
    x_host = data.x16_host if bf16 else data.x_host
    bytes_of = lambda hb: sum(t.numel() * t.element_size() for t in hb)  # noqa: E731
    if adjacency == "edge_index":
        resident = [(x_dev[b], data.edge_index[b]) for b in range(data.nb)]
        host = [(x_host[b], data.ei_host[b]) for b in range(data.nb)]

        def load(hb):
            return hb[0].to(device, non_blocking=True), hb[1].to(device, non_blocking=True)
        copies = [list(zip(r, h)) for r, h in zip(resident, host)]
        return Inputs(resident, host, load, copies, bytes_of)
    name = "csr_gcn" if kind == "GCN" else "csr_gin"
    dev_triples, host_triples = getattr(data, name), getattr(data, name + "_host")
    v_dev = getattr(data, name + "_v16") if bf16 else [tr[2] for tr in dev_triples]
    v_host = getattr(data, name + "_v16_host") if bf16 else [tr[2] for tr in host_triples]

    def csr(crow, col, val):
        return torch.sparse_csr_tensor(crow, col, val, (n, n))

    dev = [(x_dev[b], dev_triples[b][0], dev_triples[b][1], v_dev[b]) for b in range(data.nb)]
    host = [(x_host[b], host_triples[b][0], host_triples[b][1], v_host[b]) for b in range(data.nb)]
    resident = [(d[0], csr(*d[1:])) for d in dev]

    def load(hb):
        x, crow, col, val = (t.to(device, non_blocking=True) for t in hb)
        return x, csr(crow, col, val)
    copies = [list(zip(d, h)) for d, h in zip(dev, host)]
    return Inputs(resident, host, load, copies, bytes_of)

