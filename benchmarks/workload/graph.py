"""The graph and its batches: a planted-partition graph of products' size cut into Cluster-GCN batches, and each
batch in every format the benchmarks feed (PyG's ``edge_index`` and CSR, pyg_quant's tile plans and bit features),
on the device and in host memory."""
import time

import torch

import pyg_quant as pq
from pyg_quant import ops

from .recording import Recorder, Runner, log


class Data:
    """Everything built once: the batches in every format, on the device and in (pinned) host memory.
    :func:`build_graph` fills the graph's fields, :func:`build_formats` the formats; the benchmarks set
    ``adjacency`` (``--adjacency``: the form the pyg_quant batches decode to) before making inputs."""


def build_graph(args, device, rec: Recorder) -> Data:
    """The graph on ``device``, from ``args.seed``, cut into batches.

    Graph: ``args.num_parts`` parts of ``args.part_size`` nodes, numbered part by part (as after ``ClusterData``'s
    reordering; the planted parts are the clusters, no METIS); ``nodes · args.avg_degree / 2`` random undirected
    pairs, a fraction ``args.inside`` of them inside the first endpoint's part, both directions, self-loops and
    repeats dropped; ``args.features`` standard-normal features and ``args.classes`` classes, the label being the
    argmax of the first ``args.classes`` features (something to learn).  Defaults: 1,500 parts of 1,600 nodes =
    2.4M nodes and ~119M directed edges (ogbn-products: 2.45M nodes, 123.7M edges), 100 features, 47 classes.

    Batches: a random permutation of the parts, ``args.parts_per_batch`` parts a batch (default 20: 75 batches of
    32,000 nodes); a batch's graph is every edge with both ends in its parts, as ``ClusterLoader`` builds it
    (default: ~1.27M edges).

    Returns a :class:`Data` with ``n`` (nodes a batch), ``nb`` (batches), ``num_edges`` (the whole graph's),
    ``x`` ``[nb, n, features]`` and ``y`` ``[nb, n]`` (batch b's rows, part by part), ``feat_lo`` / ``feat_hi``
    ``[1, features]`` (each column's range over all nodes, as ``QuantizedFeatures``) and ``edge_index`` (a
    ``[2, E_b]`` int64 tensor a batch: local ``[src; dst]`` sorted by ``(dst, src)``, CSR order).  The graph's
    counts go to ``rec.data["graph"]``."""
    g = torch.Generator(device=device)
    g.manual_seed(args.seed)
    parts, size, ppb = args.num_parts, args.part_size, args.parts_per_batch
    if parts % ppb:
        raise ValueError(f"--num-parts ({parts}) must be a multiple of --parts-per-batch ({ppb})")
    n_all = parts * size
    pairs = n_all * args.avg_degree // 2
    t = time.perf_counter()
    u = torch.randint(n_all, (pairs,), device=device, generator=g)
    inside = torch.rand(pairs, device=device, generator=g) < args.inside
    v = torch.where(inside, u // size * size + torch.randint(size, (pairs,), device=device, generator=g),
                    torch.randint(n_all, (pairs,), device=device, generator=g))
    del inside
    src, dst = torch.cat([u, v]), torch.cat([v, u])
    del u, v
    keys = dst * n_all + src  # target-major, so each batch's edges come out in CSR (adj_t) order
    keys = keys[src != dst]
    del src, dst
    keys = torch.unique(keys)  # sorted; repeated pairs dropped (a coalesced graph, like products)
    num_edges = keys.numel()
    dst, src = keys // n_all, keys % n_all
    del keys
    part_dst, part_src = dst // size, src // size
    intra = float((part_dst == part_src).float().mean())

    nb = parts // ppb
    n = ppb * size
    perm = torch.randperm(parts, device=device, generator=g)
    batch_of_part = torch.empty(parts, dtype=torch.int64, device=device)
    slot_of_part = torch.empty(parts, dtype=torch.int64, device=device)
    batch_of_part[perm] = torch.arange(parts, device=device) // ppb
    slot_of_part[perm] = torch.arange(parts, device=device) % ppb
    b_dst = batch_of_part[part_dst]
    keep = b_dst == batch_of_part[part_src]
    local_dst = slot_of_part[part_dst] * size + dst % size
    local_src = slot_of_part[part_src] * size + src % size
    del dst, src, part_dst, part_src
    key2 = ((b_dst * n + local_dst) * n + local_src)[keep]
    del b_dst, local_dst, local_src, keep
    key2 = torch.sort(key2).values
    counts = torch.bincount(key2 // (n * n), minlength=nb).tolist()
    edge_index = []
    for chunk in key2.split(counts):
        local = chunk % (n * n)
        edge_index.append(torch.stack([local % n, local // n]))  # [src; dst], sorted by (dst, src)
    del key2

    x = torch.randn(n_all, args.features, device=device, generator=g)
    y = x[:, :args.classes].argmax(1)
    node = (perm.view(nb, ppb, 1) * size + torch.arange(size, device=device)).view(nb, n)
    data = Data()
    data.n, data.nb, data.num_edges = n, nb, num_edges
    data.x = x[node]  # [nb, n, F]: batch b's rows, part by part
    data.y = y[node]
    data.feat_lo = x.amin(0, keepdim=True)  # QuantizedFeatures: one range per column over all nodes
    data.feat_hi = x.amax(0, keepdim=True)
    del x, y, node
    data.edge_index = edge_index
    if device.type == "cuda":
        torch.cuda.synchronize()
    e = torch.tensor(counts, dtype=torch.float64)
    rec.data["graph"] = dict(nodes=n_all, directed_edges=num_edges, edges_per_node=num_edges / n_all,
                             intra_part_fraction=intra, parts=parts, part_size=size, parts_per_batch=ppb,
                             batches=nb, batch_nodes=n, batch_edges_mean=float(e.mean()),
                             batch_edges_min=int(e.min()), batch_edges_max=int(e.max()),
                             batch_edges_total=int(e.sum()), features=args.features, classes=args.classes,
                             build_s=round(time.perf_counter() - t, 2))
    log(f"graph: {n_all:,} nodes, {num_edges:,} directed edges ({intra:.1%} inside parts), {nb} batches of "
        f"{n:,} nodes, {e.mean():,.0f} edges a batch ({time.perf_counter() - t:.1f} s)")
    return data


def nbytes(*tensors) -> int:
    """Bytes of the tensors' elements (``None`` counts 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def host_copy(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    """A pinned host copy of ``t``; ``t`` itself when not ``pinned`` (a CPU run)."""
    if not pinned:
        return t  # CPU run: "host" and "device" are the same memory
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)
    return out


def build_formats(args, device, data: Data, rec: Recorder, runner: Runner) -> None:
    """Every batch of ``data`` in every format, as fields of ``data`` (lists of ``nb``, batch b at index b):

    * ``csr_gin``: ``(crow, col, val)`` of A (int64, int64, fp32 ones); ``csr_gcn``: of ``D^-1/2 (A+I) D^-1/2`` with
      ``gcn_norm``'s float32 steps (PyG's GCN on a pre-normalized ``adj_t``, ``normalize=False``); ``*_v16``: their
      values in bf16; ``x16``: ``x`` in bf16 (``[nb, n, features]``).
    * ``plan_gin`` / ``plan_gcn``: the adjacency's compact tile plan built on the host (a byte an edge; GCN with
      ``self_loops=1``), what ``QuantClusterLoader`` ships.
    * ``feats[bits]`` for each of ``args.bits``: each batch's features as an ``n × features`` ``BitTensor``
      (``dim=0``, ``layout="col"``, the ranges ``feat_lo`` / ``feat_hi``).
    * Host copies, pinned on the GPU (one allocation a kind, per-batch views) and the same tensors on the CPU:
      ``x_host``, ``x16_host``, ``y_host``, ``ei_host``, ``csr_gin_host`` / ``csr_gcn_host``, ``*_v16_host``.

    ``BitAdjacency.from_edge_index`` runs on the device over every batch to time it (batch 0's result kept for its
    sizes).  Build times and batch 0's bytes in every format go to ``rec.data["batches"]``."""
    pinned = device.type == "cuda"
    n, nb = data.n, data.nb
    t = time.perf_counter()
    data.csr_gin, data.csr_gcn = [], []
    for ei in data.edge_index:
        src, dst = ei[0], ei[1]
        counts = torch.bincount(dst, minlength=n)
        crow = torch.zeros(n + 1, dtype=torch.int64, device=device)
        crow[1:] = torch.cumsum(counts, 0)
        data.csr_gin.append((crow, src.clone(), torch.ones(src.numel(), device=device)))
        # gcn_norm's D^-1/2 (A + I) D^-1/2 with the same float32 steps (deg at the target, w = 1)
        dinv = (counts.to(torch.float32) + 1).pow(-0.5)
        loop = torch.arange(n, device=device)
        rows, cols = torch.cat([dst, loop]), torch.cat([src, loop])
        vals = torch.cat([dinv[src] * dinv[dst], dinv * dinv])
        order = torch.argsort(rows * n + cols)
        crow2 = torch.zeros(n + 1, dtype=torch.int64, device=device)
        crow2[1:] = torch.cumsum(counts + 1, 0)
        data.csr_gcn.append((crow2, cols[order].contiguous(), vals[order].contiguous()))
    runner.sync()
    csr_s = time.perf_counter() - t

    # Packing on the device is timed over every batch; only batch 0's result is kept (for its sizes): the
    # benchmark's batches are the host plans below, decoded where they land.
    t = time.perf_counter()
    a = None
    for ei in data.edge_index:
        packed = pq.BitAdjacency.from_edge_index(ei, n)
        a = packed if a is None else a
    runner.sync()
    pack_s = time.perf_counter() - t
    gcn_extra_diag_bytes = pq.BitAdjacency.from_edge_index(data.edge_index[0], n, self_loops=1).nbytes - a.nbytes
    # What QuantClusterLoader ships: the adjacency's tile plan (a byte an edge), built on the host.
    t = time.perf_counter()
    data.plan_gin = [pq.BitAdjacency.compact_from_edge_index(ei.cpu(), n) for ei in data.edge_index]
    plan_s = time.perf_counter() - t
    data.plan_gcn = [pq.BitAdjacency.compact_from_edge_index(ei.cpu(), n, self_loops=1) for ei in data.edge_index]
    data.feats = {}
    t = time.perf_counter()
    for bits in args.bits:
        scale = (data.feat_hi - data.feat_lo) / torch.full_like(data.feat_hi, float(2**bits - 1))
        inv = torch.where(scale > 0, torch.ones_like(scale) / scale, torch.zeros_like(scale))
        feats = []
        for b in range(nb):
            planes = ops.quantize_pack(data.x[b].contiguous(), data.feat_lo, inv, bits, True, None)
            feats.append(pq.BitTensor(planes, (n, args.features), bits, "col", data.feat_lo.reshape(-1),
                                      scale.reshape(-1), 0))
        data.feats[bits] = feats
    runner.sync()
    feat_s = time.perf_counter() - t

    tiles = [plan.num_tiles for plan in data.plan_gin]
    rec.data["batches"] = dict(
        csr_build_ms_per_batch=1e3 * csr_s / nb, bit_adjacency_pack_ms_per_batch=1e3 * pack_s / nb,
        compact_plan_host_ms_per_batch=1e3 * plan_s / nb, compact_bytes_gin=data.plan_gin[0].nbytes,
        compact_bytes_gcn=data.plan_gcn[0].nbytes,
        feature_pack_ms_per_batch_all_bits=1e3 * feat_s / nb,
        tiles_mean=sum(tiles) / nb, tiles_min=min(tiles), tiles_max=max(tiles),
        batch0=dict(tiles=a.num_tiles, fill=a.fill_ratio, residual_entries=a.res_nnz, nnz=a.nnz,
                    bits=a.bits, nbytes=a.nbytes, tile_bytes=nbytes(a.tile_bits),
                    residual_bytes=nbytes(a.res_ptr, a.res_col, a.res_val),
                    index_bytes=nbytes(a.window_ptr, a.tile_col), row_sums_bytes=nbytes(a.row_sums),
                    bits_per_edge=8 * a.nbytes / max(a.nnz, 1),
                    gcn_extra_diag_bytes=gcn_extra_diag_bytes,
                    feature_bytes={str(bits): data.feats[bits][0].nbytes for bits in args.bits},
                    csr_gin_bytes=nbytes(*data.csr_gin[0]), csr_gcn_bytes=nbytes(*data.csr_gcn[0]),
                    edge_index_bytes=nbytes(data.edge_index[0]), x_fp32_bytes=nbytes(data.x[0])))
    log(f"formats: CSR {1e3 * csr_s / nb:.2f} ms/batch, BitAdjacency pack {1e3 * pack_s / nb:.2f} ms/batch on "
        f"{device.type}; batch 0: {a.num_tiles} tiles (fill {a.fill_ratio:.3f}), {a.res_nnz} residual, "
        f"{a.nbytes / 1e6:.2f} MB = {8 * a.nbytes / max(a.nnz, 1):.1f} bits/edge")

    # Pinned host copies of the PyG formats (one allocation per kind; per-batch views of it).
    t = time.perf_counter()
    data.x16 = data.x.to(torch.bfloat16)
    data.x_host = host_copy(data.x, pinned)
    data.x16_host = host_copy(data.x16, pinned)
    data.y_host = host_copy(data.y, pinned)

    def flat_host(tensors):
        if not pinned:
            return tensors
        flat = torch.cat([t.reshape(-1) for t in tensors])
        flat_h = host_copy(flat, True)
        out, offset = [], 0
        for t in tensors:
            out.append(flat_h[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()
        return out

    data.ei_host = flat_host(data.edge_index)
    for name in ("csr_gin", "csr_gcn"):
        triples = getattr(data, name)
        crows, cols, vals = (flat_host([tr[i] for tr in triples]) for i in range(3))
        setattr(data, name + "_host", list(zip(crows, cols, vals)))
        vals16 = [tr[2].to(torch.bfloat16) for tr in triples]
        setattr(data, name + "_v16", vals16)
        setattr(data, name + "_v16_host", flat_host(vals16))
    runner.sync()
    log(f"host copies ({'pinned' if pinned else 'CPU run: shared'}): {time.perf_counter() - t:.1f} s")


def probe_workload(args):
    """``(device, recorder, runner, data)`` of a probe that records no JSON: the workload's graph and every batch
    format (:func:`build_graph`, :func:`build_formats`) on ``args.device``, its batches decoding to
    ``args.adjacency``."""
    device = torch.device(args.device)
    rec = Recorder("", {}, device.type)
    runner = Runner(args, device, rec)
    data = build_graph(args, device, rec)
    data.adjacency = args.adjacency
    build_formats(args, device, data, rec, runner)
    return device, rec, runner, data
