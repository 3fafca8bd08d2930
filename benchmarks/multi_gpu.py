r"""Several GPUs (issue 39 item 7): QAT training and inference epochs on 1 and 2 GPUs, pyg_quant against PyG fp32.

One device call on two GPUs: the workload of ``benchmarks/workload`` (its graph and batch builders and models are
imported from there: a products-scale planted-partition graph cut into 75 Cluster-GCN batches of 32,000 nodes and
~1.27M edges; GIN 3 layers hidden 64 and GCN 3 layers 100 → 16 → 16 → 47), timed with one process per GPU
(``torch.distributed``, NCCL) against one process on one GPU, in the same run.  Prints markdown tables and writes
``--out`` JSON after every configuration.

Usage (repository root; the extension built for the device's torch first)::

    python benchmarks/multi_gpu.py --out $OUT/multi_gpu.json     # 2 GPUs: ~3-5 min (--time-budget 300 s)
    python benchmarks/multi_gpu.py --small --out ''              # CPU check: gloo, 2 processes, a tiny graph

Processes.  The script starts ``--world`` (2) ranks itself (``torch.multiprocessing``, spawned: one per GPU,
NCCL; ``--small``: forked, gloo on the CPU), meeting through a file store, plus a gloo group for the script's
own coordination.  Every rank builds the batches itself from the same seed on its own device (the build is
deterministic: the ranks compare checksums of the edges, features, labels and GCN's CSR values, and stop if
they differ).  Each configuration runs on 1 GPU (rank 0 alone, the other rank waiting on the gloo group, its
GPU idle) and then on 2 GPUs (both ranks), back to back, so that ``--time-budget`` (s, from the launch) skips
whole configurations, recorded as skipped.  A rank that raises ends the job with its error: the launcher stops
the other ranks, prints every rank's traceback and adds it to the JSON; ``--timeout`` (s) kills a run that
outlives it.  Errors that every rank meets before a collective (a model that fails to build or compile) are
recorded in their row and the run goes on.

Training (``train`` rows): forward, cross-entropy, backward and Adam (lr 0.01) over every batch, batches in
their fixed order (no shuffle).  Variants: ``QAT 4-bit`` (``pyg_quant.qat.prepare(model, bits=4)`` of PyG's
``GCNConv`` / ``GINConv`` model with the default QConfig, on ``edge_index``: e2e.py's "QAT 4-bit edge_index")
and ``PyG fp32 CSR`` (PyG ``GCNConv`` / ``GINConv`` on a torch CSR ``adj_t``, GCN pre-normalized with
``normalize=False``: e2e.py's fastest eager training path), the same initial weights.  Paths: ``resident``
(the batches on the GPU before the epoch) and ``+H2D`` (each batch copied from pinned host memory with
non-blocking copies on the compute stream, as e2e.py's training "+H2D").  World sizes: ``1`` (the plain model,
what one GPU runs), ``1 DDP`` (the same under ``DistributedDataParallel`` over a group of one rank: DDP's own
cost, no communication) and ``2`` (``DistributedDataParallel`` over both ranks; the observers' ranges all-reduced
each step, ``pyg_quant.distributed.seed_everything`` per rank).  ``QAT 4-bit`` is wrapped by
``pyg_quant.distributed.ddp`` (buffers synced once, not before every forward), ``QAT 4-bit captured`` the same
steps through ``pyg_quant.CapturedTrainStep`` (``pqd.ddp(..., capturable=True)``, a capturable Adam; every batch
captured in the second warm-up epoch, at least two warm-up epochs), ``QAT 4-bit, torch DDP`` by
``DistributedDataParallel`` with its defaults (a broadcast of every buffer before each forward), ``PyG fp32 CSR``
too.  Rank ``r`` of ``R`` takes
batches ``r, r + R, ...``; with 75 batches and 2 ranks the shares are padded to 38 steps each as
``QuantClusterLoader``'s ``DistributedPartSampler`` pads (rank 1's last step repeats batch 0), so a 2-GPU epoch
covers all 75 batches in 38 steps (ideal speedup 75 / 38 = 1.97x).  The loss is taken over 4 nodes in 5 of
every batch (local index mod 5 != 0); the fifth is the test split of the planted classes (the workload's label: the
argmax of the first 47 features).  Recorded after the timed epochs: the mean training loss of every epoch
(all ranks' steps), and the train / test accuracy of the trained model (``eval()``, every batch once, counts
all-reduced).  ``--accuracy-seeds`` trains ``QAT 4-bit`` again from other seeds (as many epochs, untimed
detail) on 1 and 2 GPUs, for the accuracy comparison.

Inference (``infer`` rows): ``eval()`` under ``torch.inference_mode()``; ``pyg_quant N-bit`` (``QGCNConv`` /
``QGINConv`` at ``--bits``, ``workload.make_pq`` with the PyG model's weights, fed ``QuantBatch``es decoded on the
GPU once: ``BitTensor`` features and ``BitAdjacency``), ``PyG fp32 CSR`` (as in training) and, on the GPU,
``pyg_quant 4-bit compile RO`` (``torch.compile(mode="reduce-overhead")``, compiled and recorded in untimed
passes).  Rank ``r`` runs batches ``r, r + R, ...`` (75 = 38 + 37, as ``pyg_quant.distributed.sharded_inference``
shares them) and hands each output with its node ids to a ``pyg_quant.distributed.BatchGather`` to rank 0 (as
``sharded_inference(..., dst=0)``: the rows staged in one buffer, sent at the end), which puts them in node
order (the row order of the workload's batch-major feature matrix: batch b's nodes at rows ``b·32000 ...``); one GPU
keeps its outputs and puts them in node order at the end, as ``BatchGather`` does in one process.
Each 2-GPU output is compared with the 1-GPU one (``max_abs_diff_vs_1gpu``).

Timing: one epoch is the wall time between two synchronisations of every rank in the configuration (an
all-reduce of one element on the default group, then ``torch.cuda.synchronize()``), so a 2-GPU epoch lasts
until its slower rank is done and includes the gradient all-reduces (training) or the gather (inference);
before any configuration, two untimed QAT epochs on 1 GPU and on all (``warm_up``); then per variant its
configurations (1 GPU, 1 GPU under DDP, every GPU) interleaved: round by round one epoch of each in turn (each
training configuration drawing its noise from its own generator states), ``--warmup`` rounds (two for captured steps),
then the median of each over ``--reps`` (training) / ``--infer-reps`` (inference) rounds: the lent hosts' speed
drifts within seconds, and measured one after the other a slow stretch would fall on one side of a ratio.
Inference rows also give each rank's busy time (from the epoch's start to its last batch's end on the GPU, CUDA
events).  The default CUDA stream.
Each rank runs on its own share of the CPUs, whole physical cores (``rank_cpus``; ``--no-bind-cpus`` leaves them
all to every rank): the eager loops are bound by host time, and a rank whose thread waits for a core runs its
batches slower.
Ratios within this run: ``speedup_2_vs_1`` (1-GPU time over 2-GPU time, per variant and path),
``pyg_quant_vs_pyg`` (PyG fp32 CSR time over pyg_quant's, per world size; above 1: pyg_quant faster), and the
issue's targets (2 vs 1: training ≥ 1.8x, inference ≥ 1.9x; pyg_quant's advantage over PyG on 2 GPUs at least
its 1-GPU one).
"""
import argparse
import contextlib
import datetime
import gc
import io
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from typing import Optional
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import workload  # noqa: E402  (the workload: graph, batches, models)
from workload import first_line, pq  # noqa: E402

from pyg_quant import distributed as pqd  # noqa: E402
from pyg_quant.graph.adjacency_form import ADJACENCY_FORMS, DEFAULT_ADJACENCY  # noqa: E402
from pyg_quant.distributed.group import barrier as group_barrier  # noqa: E402

TRAIN_VARIANTS = ("QAT 4-bit", "QAT 4-bit captured", "QAT 4-bit, torch DDP", "PyG fp32 CSR")


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - workload.T0:7.1f}s] {msg}", flush=True)


class Skip(Exception):
    """A configuration every rank gave up on before any collective (recorded in its row; the run goes on)."""


# --- shares ---------------------------------------------------------------------------------------
def train_share(nb: int, rank: int, size: int):
    """Batches of rank ``rank`` in a training epoch: ``rank, rank + size, ...`` of the batches padded by repeating
    the first ones to a multiple of ``size`` (as ``DistributedPartSampler`` pads): equal step counts."""
    order = list(range(nb))
    missing = -nb % size
    order += (order * -(-missing // nb))[:missing]
    return order[rank::size]


def infer_share(nb: int, rank: int, size: int):
    """Batches of rank ``rank`` in an inference epoch: ``rank, rank + size, ...`` (as ``sharded_inference``)."""
    return list(range(rank, nb, size))


class OneProcessGather:
    """What ``pyg_quant.distributed.BatchGather`` does in one process (the 1-GPU configuration runs on rank 0 of a
    two-rank group, where a BatchGather would wait for rank 1): the rows kept, put in place at the end."""

    def __init__(self, num_rows: int):
        self.num_rows, self.ids, self.rows = num_rows, [], []

    def add(self, ids, rows) -> None:
        self.ids.append(ids)
        self.rows.append(rows)

    def result(self):
        rows = torch.cat(self.rows)
        full = rows.new_empty((self.num_rows,) + tuple(rows.shape[1:]))
        return full.index_copy_(0, torch.cat(self.ids), rows)


# --- one rank -------------------------------------------------------------------------------------
class Bench:
    def __init__(self, rank: int, args, start_wall: float, ctrl, solo):
        self.rank, self.args, self.world = rank, args, args.world
        self.start_wall, self.ctrl, self.solo = start_wall, ctrl, solo
        self.cuda = args.device == "cuda"
        self.device = torch.device("cuda", rank) if self.cuda else torch.device("cpu")
        self.lead = rank == 0
        self.ref_out = {}  # rank 0: (model, variant) -> the 1-GPU inference output in node order
        self.compiled, self.eager = {}, {}  # (model, variant) -> what infer() runs, kept for both world sizes

    # --- coordination (the gloo group: never blocks the GPUs' collectives) ---
    def time_left(self) -> float:
        return self.args.time_budget - (time.time() - self.start_wall)

    def decide(self, what: str, need_s: float) -> bool:
        """Rank 0 decides whether ``what`` starts (time budget); every rank gets the answer."""
        flag = [self.time_left() >= need_s] if self.lead else [None]
        dist.broadcast_object_list(flag, src=0, group=self.ctrl)
        if not flag[0] and self.lead:
            reason = f"skipped: time budget ({self.args.time_budget:.0f} s) reached"
            self.rec.data["skipped"].append(dict(what=what, reason=reason))
            log(f"  {what}: {reason}")
        return bool(flag[0])

    def agree(self, error):
        """Every rank's error (or None) at a point without pending collectives: their messages, or None."""
        if self.world == 1:
            return error
        errors = [None] * self.world
        dist.all_gather_object(errors, error, group=self.ctrl)
        bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        return "; ".join(bad) or None

    def wait(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.ctrl)

    def gather_objects(self, obj):
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    # --- timing ---
    def sync(self, size: int) -> None:
        """Every rank of the configuration done (size > 1: an all-reduce on the default group) and this GPU idle."""
        if size > 1:
            group_barrier()
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time_epoch(self, epoch, size: int):
        """``(ms, busy ms)`` of one ``epoch()`` between two syncs of the configuration's ranks.  An inference
        ``epoch()`` returns a function of the start time giving this rank's busy ms (its batches done, before the
        gather), read after the sync; a training one returns None, and so is its busy time."""
        self.sync(size)
        t0 = time.perf_counter()
        busy = epoch()
        self.sync(size)
        return (time.perf_counter() - t0) * 1e3, None if busy is None else busy(t0)

    def timing(self, times, busy, size: int, reps: int, warmup: int) -> dict:
        out = dict(median_ms=statistics.median(times), times_ms=[round(t, 3) for t in times], reps=reps,
                   warmup=warmup)
        if busy:
            out["busy_ms_by_rank"] = [round(statistics.median(b), 3) for b in self.gather_objects(busy)[:size]] \
                if size > 1 else [round(statistics.median(busy), 3)]
        return out

    # --- build ---
    def build(self) -> None:
        args = self.args
        t = time.perf_counter()
        data = workload.build_graph(args, self.device, self.rec)
        data.adjacency = args.adjacency
        workload.build_formats(args, self.device, data, self.rec, workload.Runner(args, self.device, self.rec))
        self.data = data
        n = data.n
        self.test_idx = torch.arange(0, n, 5, device=self.device)
        keep = torch.ones(n, dtype=torch.bool)
        keep[::5] = False
        self.train_idx = keep.nonzero().view(-1).to(self.device)
        sums = self.gather_objects(self.checksum())
        same = all(s == sums[0] for s in sums)
        self.rec.data["timeline"]["build_s"] = round(time.perf_counter() - t, 1)
        self.rec.data["graph"]["build_identical_on_every_rank"] = same
        self.rec.data["graph"]["checksums_rank0"] = sums[0]
        if not same:
            raise RuntimeError(f"the ranks built different batches from seed {args.seed}: checksums {sums}")
        self.rec.save()
        if self.lead:
            log(f"batches built on every rank ({self.rec.data['timeline']['build_s']} s), identical: checksums "
                f"agree on {self.world} rank(s)")

    def checksum(self) -> dict:
        """Exact integer sums (order-free, so equal exactly when the tensors are) of what every rank built."""
        def weighted(t):
            t = t.reshape(-1).to(torch.int64)
            return int((t * (torch.arange(t.numel(), device=t.device) % 65521 + 1)).sum())
        d = self.data
        edges = sum(weighted(ei[0] * (d.n + 1) + ei[1]) for ei in d.edge_index)
        return dict(edges=edges, x=weighted(d.x.view(torch.int32)), y=weighted(d.y),
                    gcn_csr_values=sum(weighted(tr[2].view(torch.int32)) for tr in d.csr_gcn))

    # --- models and inputs ---
    def init_state(self, kind: str, seed: int):
        torch.manual_seed(seed)
        return workload.make_pyg(self.args, kind).state_dict()  # e2e.py's initial weights, the same on every rank

    def release(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()

    # --- training ---
    def train(self, kind: str, variant: str, path: str, size: int, ddp: bool, seed: int, epochs: int) -> dict:
        """One training configuration on its own, ``epochs`` untimed epochs (the warm-up, the accuracy seeds)."""
        epoch, finish, _ = self.train_epoch(kind, variant, path, size, ddp, seed)
        for _ in range(epochs):
            epoch()
        return finish()

    def train_epoch(self, kind: str, variant: str, path: str, size: int, ddp: bool, seed: int):
        """``(epoch, finish, warm-up epochs)`` of a training configuration: ``epoch()`` runs one epoch (a single
        process's observers record their own batches), ``finish()`` the row's fields besides the timing (the loss of
        every epoch over all ranks, the accuracy) and frees the model."""
        args, data, dev = self.args, self.data, self.device
        qat = variant.startswith("QAT")
        adjacency = "edge_index" if qat else "CSR"
        model = workload.make_pyg(args, kind, normalize=(qat or kind != "GCN"))  # GCN's CSR is pre-normalized
        model.load_state_dict(self.init_state(kind, seed))
        model = model.to(dev)
        if qat:
            model = pq.qat.prepare(model, bits=args.qat_bits)
        model.train()
        pqd.seed_everything(seed)  # each rank its own stochastic-rounding noise (rank 0: `seed`, as one process)
        net = model
        captured = variant.endswith("captured")
        if ddp:  # pyg_quant's wrapper for QAT (buffers synced once); torch's defaults for the others
            group = dict(device_ids=[dev.index] if self.cuda else None,
                         process_group=self.solo if size < self.world else None)
            if variant.startswith("QAT 4-bit") and not variant.endswith("torch DDP"):
                net = pqd.ddp(model, capturable=captured, **group)
            else:
                net = DistributedDataParallel(model, **group)
        opt = torch.optim.Adam(net.parameters(), lr=args.lr, **({"capturable": True} if captured and self.cuda
                                                                 else {}))
        inp = workload.pyg_inputs(data, kind, adjacency, "fp32", dev)
        share = train_share(data.nb, self.rank, size)
        tr = self.train_idx
        if captured:  # every batch shape captured in the second epoch (after 11 eager steps under DDP), then replayed
            captured_step = pq.CapturedTrainStep(net, opt, lambda out, y: F.cross_entropy(out.index_select(0, tr),
                                                                               y.index_select(0, tr)))

        def batch_args(b):
            if path == "resident":
                return inp.resident[b] + (data.y[b],)
            x, adj = inp.load(inp.host[b])  # non-blocking copies from pinned memory, then the forward
            return x, adj, data.y_host[b].to(dev, non_blocking=True)

        losses = []
        fail = size > 1 and args.fail_rank == self.rank  # the tests' failing rank: raises in its second step

        def epoch():
            total = torch.zeros((), device=dev)
            for step, b in enumerate(share):
                if fail and step == 1:
                    raise RuntimeError(f"injected failure on rank {self.rank} (--fail-rank)")
                x, adj, y = batch_args(b)
                if captured:
                    total += captured_step(x, adj, target=y)
                    continue
                opt.zero_grad(set_to_none=True)
                out = net(x, adj)
                loss = F.cross_entropy(out.index_select(0, tr), y.index_select(0, tr))
                loss.backward()
                opt.step()
                total += loss.detach()
            losses.append(total)  # read after the timed epochs: no host sync inside an epoch from the script

        # One process's observers record their own batches (the default group holds every rank, idle here).
        local = pqd.local_ranges if size == 1 else contextlib.nullcontext
        # Each configuration draws its own noise from where its seeding left it, whichever ran between its epochs.
        rng = [torch.get_rng_state(), torch.cuda.get_rng_state(dev) if self.cuda else None]

        def run_epoch():
            torch.set_rng_state(rng[0])
            if self.cuda:
                torch.cuda.set_rng_state(rng[1], dev)
            with local():
                epoch()
            rng[0] = torch.get_rng_state()
            if self.cuda:
                rng[1] = torch.cuda.get_rng_state(dev)

        def finish() -> dict:
            nonlocal net, opt, model
            # Mean loss of each epoch over every rank's steps (rank 1's padded step counted as it ran).
            sums = torch.stack(losses).double()
            if size > 1:
                sums = sums.to(pqd.group.collective_device())
                dist.all_reduce(sums)
            result = dict(loss_per_epoch=[round(float(v), 5) for v in (sums / (len(share) * size)).cpu()])
            result.update(self.accuracy(model, kind, adjacency, size))
            if captured:
                result.update(graphs=captured_step.num_graphs, capture_disabled=captured_step.disabled_reason)
            result.update(steps_per_rank=len(share), batches_per_rank=[len(train_share(data.nb, r, size))
                                                                         for r in range(size)],
                          ideal_speedup=data.nb / len(share))
            net = opt = model = None
            self.release()
            return result

        return run_epoch, finish, max(args.warmup, 2) if captured else args.warmup

    @torch.no_grad()
    def accuracy(self, model, kind: str, adjacency: str, size: int) -> dict:
        """Train / test accuracy of the planted classes over every batch once (this rank's share), counts summed."""
        data = self.data
        inp = workload.pyg_inputs(data, kind, adjacency, "fp32", self.device)
        model.eval()
        counts = torch.zeros(3, dtype=torch.float64, device=self.device)  # train hits, test hits, batches
        for b in infer_share(data.nb, self.rank, size):
            hit = model(*inp.resident[b]).argmax(1) == data.y[b]
            counts += torch.stack([hit[self.train_idx].sum(), hit[self.test_idx].sum(), hit.new_ones(())]).double()
        model.train()
        if size > 1:
            counts = counts.to(pqd.group.collective_device())
            dist.all_reduce(counts)
        hits_train, hits_test, batches = counts.cpu().tolist()
        return dict(train_acc=round(hits_train / (batches * self.train_idx.numel()), 5),
                    test_acc=round(hits_test / (batches * self.test_idx.numel()), 5))

    # --- inference ---
    def infer_model(self, kind: str, variant: str):
        args = self.args
        state = self.init_state(kind, args.seed)
        if variant.startswith("pyg_quant"):
            bits = int(variant.split()[1].split("-")[0])
            model = workload.make_pq(args, kind, bits)
            model.load_state_dict(state)
            inputs = workload.pq_inputs(self.data, kind, bits, self.device, self.cuda).resident
        else:
            model = workload.make_pyg(args, kind, normalize=kind != "GCN")
            model.load_state_dict(state)
            inputs = workload.pyg_inputs(self.data, kind, "CSR", "fp32", self.device).resident
        return model.to(self.device).eval(), inputs

    def infer_epoch(self, kind: str, variant: str, size: int):
        """``(epoch, finish)`` of an inference configuration: ``epoch()`` runs one epoch and returns when this
        rank's batches were done; ``finish()`` the row's fields besides the timing (batch counts, the output
        compared with the 1-GPU one).  Raises Skip (agreed by the ranks) where the model cannot be built."""
        args, data, dev = self.args, self.data, self.device
        n, nb, rank = data.n, data.nb, self.rank
        compiled = variant.endswith("compile RO")
        share = infer_share(nb, rank, size)
        grad_mode = "inference_mode"
        error = None
        try:  # everything before the first collective: an error here is every rank's to agree on
            key = (kind, variant)
            if compiled:
                if key not in self.compiled:  # compiled once per rank; rank 0's serves 1 and 2 GPUs
                    torch._dynamo.reset()
                    model, inputs = self.infer_model(kind, variant.replace(" compile RO", ""))
                    self.compiled[key] = self.compile_ro(torch.compile(model, mode="reduce-overhead"), inputs)
                forward, inputs, grad_mode, compile_info = self.compiled[key]
            else:
                if key not in self.eager:  # built once per rank for both world sizes
                    self.eager[key] = self.infer_model(kind, variant)
                forward, inputs = self.eager[key]
                compile_info = {}
        except Exception as e:  # noqa: BLE001
            error = first_line(e)
        error = self.agree(error) if size > 1 else error
        if error:
            raise Skip(error)
        mark = torch.compiler.cudagraph_mark_step_begin if compiled and self.cuda else (lambda: None)
        context = torch.inference_mode if grad_mode == "inference_mode" else torch.no_grad
        with context():
            # batch b's nodes are rows b·n ... b·n + n - 1 of the output
            node_ids = {b: torch.arange(b * n, (b + 1) * n, device=dev) for b in share}
            rows_by_rank = [[n] * len(infer_share(nb, r, size)) for r in range(size)]
            last = {}  # the last epoch's output

        def epoch():
            start = end = None
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            with context():
                # the rows to rank 0, as sharded_inference(..., dst=0) gathers them
                gather = pqd.BatchGather(rows_by_rank, nb * n, dst=0) if size > 1 else OneProcessGather(nb * n)
                for b in share:
                    mark()
                    gather.add(node_ids[b], forward(*inputs[b]))
                if end is not None:
                    end.record()
                done = time.perf_counter()
                last["full"] = gather.result()
            return lambda t0: start.elapsed_time(end) if end is not None else (done - t0) * 1e3

        def finish() -> dict:
            result = dict(compile_info, grad_mode=grad_mode, batches_per_rank=[len(infer_share(nb, r, size))
                                                                               for r in range(size)],
                          ideal_speedup=nb / len(infer_share(nb, 0, size)))
            if self.lead:
                full = last["full"]
                ref_key = (kind, variant.replace(" compile RO", ""))
                if size == 1 and not compiled:
                    self.ref_out[ref_key] = full
                elif ref_key in self.ref_out:
                    ref = self.ref_out[ref_key]
                    result["max_abs_diff_vs_1gpu"] = float((full - ref).abs().max())
                    result["equal_to_1gpu"] = bool(torch.equal(full, ref))
            return result

        return epoch, finish

    def compile_ro(self, compiled, inputs):
        """Compiles and records ``compiled`` on this rank's batches of a 2-rank share and of one rank (untimed, local:
        no collective), under inference_mode, else no_grad. Returns (forward, inputs, grad mode, info)."""
        mark = torch.compiler.cudagraph_mark_step_begin if self.cuda else (lambda: None)
        batches = sorted(set(infer_share(self.data.nb, self.rank, self.world)) |
                         (set(range(self.data.nb)) if self.lead else set()))
        failures = []
        for grad_mode, context in (("inference_mode", torch.inference_mode), ("no_grad", torch.no_grad)):
            try:
                t = time.perf_counter()
                with context():
                    for _ in range(3):  # compile (dynamic shapes after the second), warm up, record
                        for b in batches:
                            mark()
                            compiled(*inputs[b])
                if self.cuda:
                    torch.cuda.synchronize(self.device)
                info = dict(compile_and_record_s=round(time.perf_counter() - t, 2))
                if failures:
                    info["fallback"] = failures[0]
                return compiled, inputs, grad_mode, info
            except Exception as e:  # noqa: BLE001
                failures.append(f"{grad_mode}: {first_line(e)}")
                torch._dynamo.reset()
        raise RuntimeError("; ".join(failures))

    # --- configurations ---
    def row(self, **fields):
        row = dict(fields)
        if self.lead:
            self.rec.data["rows"].append(row)
        return row

    def run_mode(self, row, size: int, fn) -> None:
        """``fn()`` on ranks ``0 .. size-1`` (the others wait); its dict (or its error) goes into ``row``."""
        if self.rank < size:
            try:
                row.update(fn())
            except Skip as e:
                row["error"] = str(e)
            except Exception as e:  # noqa: BLE001
                if size > 1:
                    raise  # a rank may have left a collective waiting: the job ends with this error
                row["error"] = self.rec.error(f"{row['section']} {row['model']} {row['variant']} {row['world']}", e)
        self.wait()
        self.report(row)

    def report(self, row) -> None:
        """Rank 0 logs ``row``, updates the summary and saves the record."""
        if self.lead:
            if "median_ms" in row:
                extra = f" loss {row['loss_per_epoch'][-1]:.4f}, test acc {row['test_acc']:.4f}" \
                    if "loss_per_epoch" in row else ""
                if "max_abs_diff_vs_1gpu" in row:
                    extra += f", max |out - 1 GPU| {row['max_abs_diff_vs_1gpu']:.3g}"
                log(f"  {row['section']} {row['model']} {row['variant']:28s} {row.get('path', ''):9s} "
                    f"{row['world']:>5s}: {row['median_ms']:9.2f} ms/epoch{extra}")
            elif row.get("error"):
                log(f"  {row['section']} {row['model']} {row['variant']} {row['world']}: ERROR {row['error'][:160]}")
            summarize(self.rec)
            self.rec.save()

    def train_config(self, kind, variant, path, need_s) -> None:
        """Training on 1 GPU (and on 1 GPU under DDP with ``--ddp1``) and on every GPU, interleaved
        (:meth:`interleaved`)."""
        if not self.decide(f"train {kind} {variant} {path}", need_s):
            return
        modes = [(1, False)] + ([(1, True)] if self.args.ddp1 else []) + ([(self.world, True)] if self.world > 1 else [])
        rows = {mode: self.row(section="train", model=kind, variant=variant, path=path, rounds="interleaved",
                               world=f"{mode[0]}{' DDP' if mode[1] and mode[0] == 1 else ''}", ddp=mode[1])
                for mode in modes}
        self.interleaved(rows, lambda mode: self.train_epoch(kind, variant, path, *mode, self.args.seed),
                         self.args.reps)

    def infer_config(self, kind, variant, need_s) -> None:
        """Inference on 1 GPU and on every GPU, their epochs interleaved (:meth:`interleaved`)."""
        if not self.decide(f"infer {kind} {variant}", need_s):
            return
        rows = {size: self.row(section="infer", model=kind, variant=variant, path="resident", world=str(size),
                               rounds="interleaved") for size in sorted({1, self.world})}
        self.interleaved(rows, lambda size: self.infer_epoch(kind, variant, size) + (self.args.warmup,),
                         self.args.infer_reps)
        self.eager.pop((kind, variant), None)
        self.release()

    def interleaved(self, rows: dict, setup, reps: int) -> None:
        """Times the configurations ``rows`` holds (``mode``: a world size, or ``(size, ddp)``; value: its row)
        interleaved: ``setup(mode)`` gives ``(epoch, finish, warm-up epochs)`` on the ranks that run it; then round
        by round one epoch of each configuration in turn (the lent hosts' speed drifts within seconds; interleaved, a
        slow stretch costs every configuration alike, where measured one after the other it would fall on one of
        them), the median of each over ``reps`` rounds after the warm-up ones; then each row gets ``finish()``."""
        def size_of(mode):
            return mode if isinstance(mode, int) else mode[0]

        runs = {}

        def attempt(mode, fn):
            """``fn()``; a configuration of one process that fails is recorded and dropped (the others go on), one of
            several ranks ends the job with its error (a rank may have left a collective waiting)."""
            row = rows[mode]
            try:
                return fn()
            except Skip as e:
                row["error"] = str(e)
            except Exception as e:  # noqa: BLE001
                if size_of(mode) > 1:
                    raise
                row["error"] = self.rec.error(f"{row['section']} {row['model']} {row['variant']} {row['world']}", e)
            runs.pop(mode, None)
            return None

        for mode in rows:
            if self.rank < size_of(mode):
                run = attempt(mode, lambda: setup(mode))
                if run is not None:
                    runs[mode] = run
            self.wait()
        warmup = max([run[2] for run in runs.values()] + [self.args.warmup])
        if self.world > 1:  # every rank runs as many rounds (rank 0 may have configurations the others do not)
            warmup = max(self.gather_objects(warmup))
        times = {mode: [] for mode in rows}
        busy = {mode: [] for mode in rows}
        for round_ in range(warmup + reps):
            for mode in rows:  # every rank waits after each configuration, whether it ran it or not
                if mode in runs:
                    timed = attempt(mode, lambda: self.time_epoch(runs[mode][0], size_of(mode)))
                    if timed is not None and round_ >= warmup:
                        times[mode].append(timed[0])
                        if timed[1] is not None:
                            busy[mode].append(timed[1])
                self.wait()
        for mode, row in rows.items():
            if mode in runs:
                row.update(self.timing(times[mode], busy[mode], size_of(mode), reps, warmup))
                finished = attempt(mode, runs[mode][1])
                row.update(finished or {})
            self.wait()
            self.report(row)
        runs.clear()
        self.release()

    def accuracy_config(self, kind, seed, need_s) -> None:
        if not self.decide(f"accuracy {kind} seed {seed}", need_s):
            return
        epochs = self.args.warmup + self.args.reps
        for size in sorted({1, self.world}):
            row = dict(section="accuracy", model=kind, variant=f"QAT {self.args.qat_bits}-bit", path="resident",
                       world=str(size), seed=seed, epochs=epochs)
            if self.lead:
                self.rec.data["accuracy"].append(row)
            self.run_mode(row, size, lambda: self.train(kind, "QAT", "resident", size, size > 1, seed, epochs))

    def warm_up(self) -> None:
        """Two untimed QAT training epochs of the first model on one GPU, then on every GPU: a process's first epochs
        also grow the allocator's pools, load the kernels and set up the communicators (without this, the first
        configuration measured came out up to 2x slower than the same one measured later)."""
        for size in sorted({1, self.world}):
            if self.rank < size:
                self.train(self.args.models[0], TRAIN_VARIANTS[0], "resident", size, size > 1, self.args.seed, epochs=2)
            self.wait()

    def run(self) -> None:
        args = self.args
        self.build()
        self.warm_up()
        big = not args.small
        for kind in args.models:  # the core: resident training and eager inference, both models
            for variant in args.train_variants:
                self.train_config(kind, variant, "resident", 25 if big else 2)
            for variant in [f"pyg_quant {b}-bit" for b in args.bits[:1]] + ["PyG fp32 CSR"]:
                self.infer_config(kind, variant, 10 if big else 1)
        for kind in args.models:  # then what the budget may cut: copies, more bit widths, seeds, compiled
            if args.h2d:
                for variant in args.train_variants:
                    self.train_config(kind, variant, "+H2D", 25 if big else 2)
            for b in args.bits[1:]:
                self.infer_config(kind, f"pyg_quant {b}-bit", 10 if big else 1)
        for seed in args.accuracy_seeds:
            for kind in args.models:
                self.accuracy_config(kind, seed, 15 if big else 2)
        if args.compile:
            for kind in args.models:
                self.infer_config(kind, f"pyg_quant {args.bits[0]}-bit compile RO", 60 if big else 20)
            self.compiled.clear()
            torch._dynamo.reset()
        if self.lead:
            summarize(self.rec)
            text = tables(self.rec)
            print(text, flush=True)
            self.rec.data["tables_markdown"] = text
            self.rec.data["timeline"]["total_s"] = round(time.time() - self.start_wall, 1)
            self.rec.save()
            log("done")


# --- report ---------------------------------------------------------------------------------------------
def med(row):
    return row.get("median_ms") if row else None


def find(rows, **keys):
    return next((r for r in rows if all(r.get(k) == v for k, v in keys.items()) and med(r)), None)


def summarize(rec) -> None:
    """Ratios within this run (time over time: above 1 means faster) and the issue's targets."""
    rows, world = rec.data["rows"], str(rec.data["meta"]["world"])
    speedups, versus, targets = [], [], []
    keys = list(dict.fromkeys((r["section"], r["model"], r["variant"], r["path"]) for r in rows))
    for section, model, variant, path in keys:
        one = find(rows, section=section, model=model, variant=variant, path=path, world="1")
        ddp1 = find(rows, section=section, model=model, variant=variant, path=path, world="1 DDP")
        two = find(rows, section=section, model=model, variant=variant, path=path, world=world)
        if one and two and world != "1":
            entry = dict(section=section, model=model, variant=variant, path=path,
                         speedup=round(med(one) / med(two), 3), ideal=round(two.get("ideal_speedup", 0), 3))
            if ddp1:
                entry["ddp1_over_plain"] = round(med(ddp1) / med(one), 3)
                entry["speedup_vs_ddp1"] = round(med(ddp1) / med(two), 3)
            speedups.append(entry)
            goal = 1.8 if section == "train" else 1.9
            if variant in ("QAT 4-bit", "QAT 4-bit captured", "pyg_quant 4-bit"):
                targets.append(dict(target=f"{section} {model} {variant} {path}: 2 GPUs ≥ {goal}x 1 GPU",
                                    measured=entry["speedup"], met=entry["speedup"] >= goal))
    for section, ours_list in (("train", ["QAT 4-bit", "QAT 4-bit captured"]), ("infer", [v for v in {r["variant"] for r in rows}
                                                                    if v.startswith("pyg_quant")])):
        for ours in sorted(ours_list):
            for model in sorted({r["model"] for r in rows}):
                for path in ("resident", "+H2D"):
                    ratio = {}
                    for w in ("1", world):
                        a = find(rows, section=section, model=model, variant=ours, path=path, world=w)
                        b = find(rows, section=section, model=model, variant="PyG fp32 CSR", path=path, world=w)
                        if a and b:
                            ratio[w] = round(med(b) / med(a), 3)
                    if ratio:
                        versus.append(dict(section=section, model=model, variant=ours, path=path,
                                           x_vs_pyg_by_world=ratio))
                    if "1" in ratio and world in ratio and world != "1" and ours in ("QAT 4-bit", "QAT 4-bit captured",
                                                                                     "pyg_quant 4-bit"):
                        targets.append(dict(target=f"{section} {model} {ours} {path}: × PyG on {world} GPUs ≥ × PyG "
                                                   f"on 1 GPU", measured=f"{ratio[world]} vs {ratio['1']}",
                                            met=ratio[world] >= ratio["1"]))
    rec.data["summary"] = dict(speedup_2_vs_1=speedups, pyg_quant_vs_pyg=versus)
    rec.data["targets"] = targets


def fmt(v, digits=2):
    if v is None:
        return "–"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def cell(row):
    if row is None:
        return "–"
    if row.get("error"):
        return f"error: {row['error'][:40]}"
    return fmt(med(row))


def tables(rec) -> str:
    rows, world = rec.data["rows"], str(rec.data["meta"]["world"])
    sp = {(e["section"], e["model"], e["variant"], e["path"]): e for e in rec.data["summary"]["speedup_2_vs_1"]}
    vs = {(e["section"], e["model"], e["variant"], e["path"]): e["x_vs_pyg_by_world"]
          for e in rec.data["summary"]["pyg_quant_vs_pyg"]}
    keys = list(dict.fromkeys((r["section"], r["model"], r["variant"], r["path"]) for r in rows))
    lines = ["", f"### Training epochs (ms, median): 1 GPU, 1 GPU under DDP, {world} GPUs", "",
             f"| model | variant | path | 1 GPU | 1 GPU DDP | {world} GPUs | {world} vs 1 (ideal) | × PyG fp32 CSR "
             f"(1 / {world}) | loss last epoch (1 / {world}) | test acc (1 / {world}) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for k in keys:
        if k[0] != "train":
            continue
        get = {w: next((r for r in rows if (r["section"], r["model"], r["variant"], r["path"]) == k
                        and r["world"] == w), None) for w in ("1", "1 DDP", world)}
        s = sp.get(k)
        x = vs.get(k, {})
        loss = " / ".join(fmt(r["loss_per_epoch"][-1], 4) if r and "loss_per_epoch" in r else "–"
                          for r in (get["1"], get[world]))
        acc = " / ".join(fmt(r.get("test_acc"), 4) if r else "–" for r in (get["1"], get[world]))
        lines.append(f"| {k[1]} | {k[2]} | {k[3]} | {cell(get['1'])} | {cell(get['1 DDP'])} | {cell(get[world])} | "
                     f"{fmt(s and s['speedup'])}× ({fmt(s and s['ideal'])}) | "
                     f"{fmt(x.get('1'))} / {fmt(x.get(world))} | {loss} | {acc} |")
    lines += ["", f"### Inference epochs (ms, median; gathered in node order on rank 0): 1 GPU, {world} GPUs", "",
              f"| model | variant | 1 GPU | {world} GPUs | {world} vs 1 (ideal) | busy ms by rank | × PyG fp32 CSR "
              f"(1 / {world}) | max abs diff vs 1 GPU |", "|---|---|---:|---:|---:|---|---:|---:|"]
    for k in keys:
        if k[0] != "infer":
            continue
        get = {w: next((r for r in rows if (r["section"], r["model"], r["variant"], r["path"]) == k
                        and r["world"] == w), None) for w in ("1", world)}
        s, x, two = sp.get(k), vs.get(k, {}), get[world]
        busy = ", ".join(fmt(b) for b in two.get("busy_ms_by_rank", [])) if two else "–"
        lines.append(f"| {k[1]} | {k[2]} | {cell(get['1'])} | {cell(two)} | {fmt(s and s['speedup'])}× "
                     f"({fmt(s and s['ideal'])}) | {busy} | {fmt(x.get('1'))} / {fmt(x.get(world))} | "
                     f"{fmt(two and two.get('max_abs_diff_vs_1gpu'), 3)} |")
    acc = rec.data.get("accuracy") or []
    if acc:
        lines += ["", "### QAT accuracy over seeds (loss of the last epoch, train / test accuracy)", "",
                  "| model | seed | epochs | world | loss | train acc | test acc |", "|---|---:|---:|---|---:|---:|---:|"]
        timed = [r for r in rows if r["section"] == "train" and r["variant"].startswith("QAT")
                 and r["path"] == "resident" and r["world"] in ("1", world)]
        for r in timed + acc:
            if "loss_per_epoch" not in r:
                continue
            lines.append(f"| {r['model']} | {r.get('seed', rec.data['meta']['args']['seed'])} | "
                         f"{len(r['loss_per_epoch'])} | {r['world']} | {r['loss_per_epoch'][-1]:.4f} | "
                         f"{r['train_acc']:.4f} | {r['test_acc']:.4f} |")
    if rec.data.get("targets"):
        lines += ["", "### Targets (issue 39)", ""]
        lines += [f"- {'MET   ' if t['met'] else 'MISSED'} {t['target']}: {t['measured']}" for t in rec.data["targets"]]
    if rec.data["skipped"]:
        lines += ["", f"{len(rec.data['skipped'])} configuration(s) skipped: " +
                  "; ".join(s["what"] for s in rec.data["skipped"])]
    if rec.data["errors"]:
        lines += ["", f"{len(rec.data['errors'])} error(s): " +
                  "; ".join(f"{e['where']}: {e['error'][:100]}" for e in rec.data["errors"][:6])]
    return "\n".join(lines)


# --- processes ------------------------------------------------------------------------------------------
def nccl_version() -> str:
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _core_of(cpu: int) -> str:
    """The CPUs that share ``cpu``'s physical core (its SMT siblings), as the kernel lists them; ``cpu`` alone where
    the topology cannot be read."""
    for name in ("core_cpus_list", "thread_siblings_list"):
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/{name}") as f:
                return f.read().strip()
        except OSError:
            continue
    return str(cpu)


def rank_cpus(rank: int, world: int) -> list:
    """This rank's share of the launcher's CPUs: ``world`` disjoint shares of whole physical cores (a core's SMT
    siblings stay in one share, so that two ranks' busy threads never share a core; a contiguous split of logical
    CPUs can pair CPU k with its sibling k + cores in the other rank), every CPU where there are fewer cores than
    ranks."""
    cpus = sorted(os.sched_getaffinity(0))
    cores: dict = {}
    for cpu in cpus:
        cores.setdefault(_core_of(cpu), []).append(cpu)
    groups = sorted(cores.values())
    share = len(groups) // world
    if not share:
        return cpus
    return sorted(cpu for group in groups[rank * share:(rank + 1) * share] for cpu in group)


def placement(rank: int, cuda: bool) -> dict:
    """Where this rank runs: its CPUs' NUMA nodes and, on a GPU, the GPU's PCI address and NUMA node (from sysfs;
    None where unknown): a rank whose CPUs sit on another node than its GPU launches across the sockets' link."""
    def cpu_node(cpu: int) -> Optional[int]:
        try:
            names = os.listdir(f"/sys/devices/system/cpu/cpu{cpu}")
        except OSError:
            return None
        nodes = [int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit()]
        return nodes[0] if nodes else None

    out = dict(cpu_numa_nodes=sorted({n for n in map(cpu_node, os.sched_getaffinity(0)) if n is not None}))
    if cuda:
        props = torch.cuda.get_device_properties(rank)
        bus = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
        if None not in bus:
            address = "{:04x}:{:02x}:{:02x}.0".format(*bus)
            out["gpu_pci"] = address
            try:
                with open(f"/sys/bus/pci/devices/{address}/numa_node") as f:
                    out["gpu_numa_node"] = int(f.read())
            except (OSError, ValueError):
                out["gpu_numa_node"] = None
    return out


def cpu_quota() -> Optional[str]:
    """The cgroup's CPU limit (``cpu.max``: quota and period in µs), where there is one."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            return f.read().strip()
    except OSError:
        return None


def worker(rank: int, args, store: str, start_wall: float) -> None:
    """One rank: joins the process group, builds the batches, runs every configuration (rank 0 records)."""
    cuda = args.device == "cuda"
    if args.bind_cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, rank_cpus(rank, args.world))
    torch.set_num_threads(args.threads)
    if cuda:
        torch.cuda.set_device(rank)
    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")  # PyG/torch beta-state notices
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=args.world, timeout=timeout)
    ctrl = dist.new_group(backend="gloo", timeout=timeout)  # the script's own waits and decisions
    solo = dist.new_group([0]) if args.world > 1 else None  # "1 GPU under DDP"
    bench = Bench(rank, args, start_wall, ctrl, solo)
    names = bench.gather_objects(workload.device_name(bench.device))
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    meta = dict(date=date, world=args.world, backend=dist.get_backend(), device=args.device, device_names=names,
                capability=".".join(map(str, torch.cuda.get_device_capability(rank))) if cuda else None,
                torch=torch.__version__, cuda=torch.version.cuda,
                nccl=nccl_version() if cuda else None,
                torch_geometric=workload.torch_geometric.__version__, pyg_quant=pq.__version__, backends=pq.backends(),
                cpu_count=os.cpu_count(), threads_per_rank=torch.get_num_threads(), args=vars(args), command=args.command,
                cpus_by_rank=bench.gather_objects(sorted(os.sched_getaffinity(0))), cpu_quota=cpu_quota(),
                placement_by_rank=bench.gather_objects(placement(rank, cuda)),
                stream="default (a user's loop)", ddp="QAT 4-bit: pyg_quant.distributed.ddp (captured: capturable=True); "
                "QAT 4-bit, torch DDP "
                "and PyG fp32 CSR: DistributedDataParallel's defaults")
    bench.rec = workload.Recorder(args.out if rank == 0 else None, meta, args.device)
    for key in ("inference", "transfer", "training", "profiles"):
        del bench.rec.data[key]  # e2e.py's sections; this script's are its rows
    bench.rec.data.update(rows=[], accuracy=[], targets=[])
    if rank == 0:
        print(f"# pyg_quant on several GPUs ({date}): {args.world} rank(s), {meta['backend']}, {', '.join(names)}, "
              f"torch {torch.__version__}, backends {pq.backends()}, {torch.get_num_threads()} threads a rank",
              flush=True)
    bench.rec.save()
    quiet = contextlib.redirect_stdout(io.StringIO()) if rank else contextlib.nullcontext()
    with quiet:
        bench.run()
    del bench
    gc.collect()  # DDP wrappers gone before their process group (a DDP freed after it can wait forever)
    dist.destroy_process_group()  # only after a clean run: a failing rank just exits (the launcher stops the rest)


def launch(args) -> int:
    """Starts the ranks; returns 0, or 1 after a rank failed or the run outlived ``--timeout`` (the others stopped,
    every rank's error printed and added to the JSON)."""
    start_wall = time.time()
    tmp = tempfile.mkdtemp(prefix="multi_gpu_")
    method = "spawn" if args.device == "cuda" else "fork"  # CUDA cannot be forked
    context = mp.start_processes(worker, args=(args, os.path.join(tmp, "store"), start_wall), nprocs=args.world,
                                 join=False, start_method=method)
    failure = None
    try:
        while not context.join(timeout=0.5):
            if time.time() - start_wall > args.timeout:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                failure = f"the ranks ran past --timeout {args.timeout:.0f} s and were killed"
                break
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
        messages = []
        for rank, path in enumerate(context.error_files):
            if os.access(path, os.R_OK) and os.path.getsize(path):
                with open(path, "rb") as file:
                    messages.append(f"rank {rank}: {pickle.load(file)}")
        failure = "\n".join(messages) or str(error)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failure is None:
        if args.out:
            print(f"wrote {args.out}")
        return 0
    print(f"\nFAILED:\n{failure}", file=sys.stderr, flush=True)
    if args.out and os.path.exists(args.out):
        import json
        with open(args.out) as f:
            data = json.load(f)
        data["fatal"] = failure
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1, default=str)
        print(f"wrote {args.out} (with the failure)", file=sys.stderr)
    return 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--world", type=int, default=None,
                   help="ranks of the multi-GPU run (default 2; the GPUs there are if fewer; --small: 2 on the CPU)")
    p.add_argument("--small", action="store_true",
                   help="CPU check: gloo, 10 parts of 250 nodes, 2 parts a batch (5 batches of 500 nodes)")
    workload.add_workload_arguments(p)
    p.add_argument("--bits", default="4,8", help="pyg_quant inference bit widths; the first is in the core set")
    p.add_argument("--qat-bits", type=int, default=4)
    p.add_argument("--adjacency", default=DEFAULT_ADJACENCY, choices=ADJACENCY_FORMS,
                   help="form of the decoded pyg_quant batches")
    p.add_argument("--models", default="GIN,GCN")
    p.add_argument("--train-variants", default=";".join(TRAIN_VARIANTS),
                   help=f"training variants, separated by ';' (of {'; '.join(TRAIN_VARIANTS)}; empty: no training)")
    p.add_argument("--no-h2d", dest="h2d", action="store_false", help="skip the +H2D training variants")
    p.add_argument("--no-ddp1", dest="ddp1", action="store_false", help="skip the '1 GPU under DDP' training rows")
    p.add_argument("--compile", dest="compile", action="store_true", default=None,
                   help="the torch.compile(mode='reduce-overhead') inference variant (default: on the GPU)")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--accuracy-seeds", default="1,2",
                   help="seeds of the extra untimed QAT runs for the accuracy comparison ('' for none)")
    p.add_argument("--reps", type=int, default=3, help="timed training epochs (median)")
    p.add_argument("--infer-reps", type=int, default=5, help="timed inference epochs (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds from the launch after which configurations are skipped (default 300; --small 120)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds from the launch after which the ranks are killed (default 480; --small 240)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads a rank (default: the cores shared among the ranks; --small 1)")
    p.add_argument("--no-bind-cpus", dest="bind_cpus", action="store_false",
                   help="leave every rank on every CPU (default: each rank on its own share, see rank_cpus)")
    p.add_argument("--fail-rank", type=int, default=None, help=argparse.SUPPRESS)  # tests: this rank raises
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/out/multi_gpu[_small].json); '' for none")
    args = p.parse_args(argv)
    args.command = " ".join([os.path.basename(sys.executable)] + sys.argv)
    if args.small:
        args.device = "cpu"
    small = dict(num_parts=10, part_size=250, parts_per_batch=2, avg_degree=20, time_budget=120.0, timeout=240.0,
                 threads=1, world=2)
    full = dict(num_parts=1500, part_size=1600, parts_per_batch=20, avg_degree=50, time_budget=300.0, timeout=480.0,
                threads=None, world=2)
    for key, value in (small if args.small else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device == "cuda":
        args.world = max(1, min(args.world, torch.cuda.device_count()))
        if not dist.is_nccl_available():
            raise SystemExit("NCCL is not available in this torch build")
    if args.threads is None:
        args.threads = max(1, len(rank_cpus(0, args.world)))
    if args.compile is None:
        args.compile = args.device == "cuda"
    args.bits = tuple(int(b) for b in args.bits.split(",") if b)
    args.models = tuple(m.strip().upper() for m in args.models.split(",") if m.strip())
    args.accuracy_seeds = tuple(int(s) for s in args.accuracy_seeds.split(",") if s.strip())
    args.train_variants = tuple(v.strip() for v in args.train_variants.split(";") if v.strip())
    unknown = [v for v in args.train_variants if v not in TRAIN_VARIANTS]
    if unknown:
        p.error(f"--train-variants: unknown {unknown}; choose from {TRAIN_VARIANTS}")
    if args.out is None:
        args.out = os.path.join(HERE, "out", "multi_gpu_small.json" if args.small else "multi_gpu.json")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    return args


def main(argv=None) -> int:
    return launch(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
