r"""Do two processes slow each other's host loops, and on which CPUs (issue 39: a rank runs its batches slower
while the other rank runs)?

Two worker processes, each pinned to one CPU and (on a GPU host) holding a CUDA context on its own GPU, run a
fixed amount of host work, first one alone, then both at once; the slowdown is the time together over the time
alone (1.00: no interference).  The work:

* ``python``: a pure-Python loop (the interpreter on one core: what a layer's Python costs);
* ``launch``: one-element ``torch.add`` calls on the worker's GPU without synchronizing (the host path of a kernel
  launch: dispatch, the CUDA runtime and driver; ``--device cpu``: on the CPU);
* ``mixed``: both, interleaved (an eager forward's shape).

Worker A stays on the first CPU of rank 0's share (``multi_gpu.rank_cpus``), worker B moves over partner CPUs: A's
SMT sibling where the guest sees one, the next core of A's share, the first and the middle CPU of rank 1's share (what
``multi_gpu.py`` gives rank 1), and the last CPU.  A partner that slows A although the guest sees separate cores
points at the host's placement of the guest's CPUs (two vCPUs on one physical core, one memory controller or
power budget), which no guest-side binding by topology can see.  Each number is the median of ``--reps`` runs.

Usage: ``python benchmarks/host_contention.py [--out FILE.json]`` (~30 s; GPU workers when two GPUs are visible).
"""
import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from multi_gpu import _core_of, rank_cpus  # noqa: E402

KINDS = ("python", "launch", "mixed")


def _python_work(n: int) -> int:
    s = 0
    for i in range(n):
        s += i * i
    return s


def _work(kind: str, n: int, probe: torch.Tensor, out: torch.Tensor) -> None:
    if kind == "python":
        _python_work(40 * n)
    elif kind == "launch":
        for _ in range(n):
            torch.add(probe, probe, out=out)
    else:
        for _ in range(n // 10):
            _python_work(40)
            for _ in range(10):
                torch.add(probe, probe, out=out)


def worker(index: int, device: str, commands, results, start) -> None:
    """Runs ``(cpu, kind, n)`` commands: pin, warm up, wait for ``start``, time the work, report."""
    if device == "cuda":
        torch.cuda.set_device(index)
    probe = torch.ones(1, device=device)
    out = torch.empty_like(probe)
    torch.set_num_threads(1)
    while True:
        command = commands.get()
        if command is None:
            return
        cpu, kind, n = command
        os.sched_setaffinity(0, {cpu})
        _work(kind, max(1, n // 20), probe, out)  # warm-up on this CPU
        if device == "cuda":
            torch.cuda.synchronize()
        results.put(("ready", index))
        start.wait()
        t = time.perf_counter()
        _work(kind, n, probe, out)
        host = time.perf_counter() - t
        if device == "cuda":
            torch.cuda.synchronize()
        results.put(("done", index, host))


def relation(a: int, b: int, share0: list, share1: list) -> str:
    if _core_of(a) == _core_of(b):
        return "SMT sibling (the guest's view)"
    if b in share0:
        return "another core of rank 0's share"
    if b in share1:
        return "rank 1's share"
    return "outside both shares"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.device_count() >= 2 else "cpu")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--n", type=int, default=20000, help="launches a run (python: 40x as many loop steps)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    share0, share1 = rank_cpus(0, 2), rank_cpus(1, 2)
    a = share0[0]
    candidates = [c for c in sorted(os.sched_getaffinity(0)) if c != a and _core_of(c) == _core_of(a)][:1]
    candidates += [c for c in share0 if _core_of(c) != _core_of(a)][:1]
    candidates += [share1[0], share1[len(share1) // 2], max(os.sched_getaffinity(0))]
    partners = list(dict.fromkeys(c for c in candidates if c != a))

    ctx = mp.get_context("spawn")
    commands = [ctx.Queue(), ctx.Queue()]
    results = ctx.Queue()
    procs = []
    rows = []
    try:
        start = ctx.Event()  # set by the parent once every worker of a run is warm and waiting
        for i in range(2):
            proc = ctx.Process(target=worker, args=(i, args.device, commands[i], results, start), daemon=True)
            proc.start()
            procs.append(proc)

        def run(assign: dict) -> dict:
            """``{worker: (cpu, kind)}`` run at once; each worker's host seconds."""
            start.clear()
            for w, (cpu, kind) in assign.items():
                commands[w].put((cpu, kind, args.n))
            ready = 0
            while ready < len(assign):
                msg = results.get(timeout=300)
                ready += msg[0] == "ready"
            start.set()
            times = {}
            while len(times) < len(assign):
                msg = results.get(timeout=300)
                if msg[0] == "done":
                    times[msg[1]] = msg[2]
            return times

        for kind in KINDS:
            alone = statistics.median(run({0: (a, kind)})[0] for _ in range(args.reps))
            for b in partners:
                together, b_times, b_alone = [], [], []
                for _ in range(args.reps):
                    b_alone.append(run({1: (b, kind)})[1])
                    t = run({0: (a, kind), 1: (b, kind)})
                    together.append(t[0])
                    b_times.append(t[1])
                row = dict(kind=kind, cpu_a=a, cpu_b=b, relation=relation(a, b, share0, share1),
                           a_alone_us=alone / args.n * 1e6, a_together_us=statistics.median(together) / args.n * 1e6,
                           b_alone_us=statistics.median(b_alone) / args.n * 1e6,
                           b_together_us=statistics.median(b_times) / args.n * 1e6)
                row["slowdown_a"] = row["a_together_us"] / row["a_alone_us"]
                row["slowdown_b"] = row["b_together_us"] / row["b_alone_us"]
                rows.append(row)
                print(f"{kind:7s} A cpu {a:3d} + B cpu {b:3d} ({row['relation']}): A {row['a_alone_us']:.2f} -> "
                      f"{row['a_together_us']:.2f} us a step ({row['slowdown_a']:.2f}x), B {row['b_alone_us']:.2f} -> "
                      f"{row['b_together_us']:.2f} ({row['slowdown_b']:.2f}x)", flush=True)
    finally:
        for q in commands:
            q.put(None)
        for proc in procs:
            proc.join(timeout=10)
    if args.out:
        meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    device=args.device, gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                    cpus=sorted(os.sched_getaffinity(0)), share0=share0, share1=share1, torch=torch.__version__,
                    command=" ".join([os.path.basename(sys.executable)] + sys.argv), n=args.n, reps=args.reps)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
