r"""Test accuracy of data-parallel QAT on 1 and on several ranks, over seeds (issue 39: "final test accuracy within
noise of the 1-GPU run").

Runs ``examples/multi_gpu_cluster_gcn.py`` as a user does, once per seed and world size: one plain process for 1,
``torchrun --standalone --nproc_per_node=W`` for ``W`` ranks (NCCL on ``W`` GPUs, or gloo with ``--cpu``).  Each run
trains the ``qat.prepare``-d GCN for the example's epochs on its Cluster-GCN batches (sharded over the ranks, so a
step of ``W`` ranks averages ``W`` batches' gradients), keeps the best validation epoch, converts it and reports its
test accuracy (the bit kernels, ``sharded_inference``).  Per world size: the mean and sample standard deviation over
the seeds; against world size 1: the difference of the means with its standard error
(``sqrt(s1²/n1 + sW²/nW)``), "within noise" when the difference is at most two of them.

Usage (repository root)::

    python benchmarks/multi_gpu_accuracy.py --cpu --root ../shared/datasets/planetoid --seeds 0-9   # gloo, 2 ranks
    python benchmarks/multi_gpu_accuracy.py --seeds 0-4 --out out.json        # 1 GPU against 2 GPUs (NCCL)

Options after ``--`` go to the example (``--epochs``, ``--bits``, ...).
"""
import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "multi_gpu_cluster_gcn.py")


def seeds_arg(text: str) -> list:
    """``"0-4"`` or ``"0,3,7"`` as a list of ints."""
    seeds = []
    for piece in text.split(","):
        piece = piece.strip()
        if "-" in piece:
            a, b = piece.split("-")
            seeds.extend(range(int(a), int(b) + 1))
        elif piece:
            seeds.append(int(piece))
    if not seeds:
        raise argparse.ArgumentTypeError("no seeds")
    return seeds


def run_once(world: int, seed: int, args, extra: list, port: int) -> dict:
    """One run of the example; its result dict (rank 0's JSON)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        example_args = ["--seed", str(seed), "--no-progress", "--json", out] + extra
        if args.cpu:
            example_args.append("--cpu")
        if args.root:
            example_args += ["--root", args.root]
        if world == 1:
            cmd = [sys.executable, EXAMPLE] + example_args
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                   f"--master_port={port}", EXAMPLE] + example_args
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stdout + proc.stderr)[-2000:]
            raise RuntimeError(f"world {world}, seed {seed}: exit {proc.returncode}\n{tail}")
        with open(out) as f:
            result = json.load(f)
        result["wall_s"] = round(time.perf_counter() - start, 2)
        return result


def summary(values: list) -> dict:
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else float("nan")
    return dict(n=len(values), mean=round(mean, 5), sd=round(sd, 5))


def summarize(runs: list, worlds: list) -> tuple:
    """``(table, comparisons)``: per world size the test and validation accuracy over the seeds; each world size
    against the first on the seeds both ran (mean difference, its standard error, the per-seed differences)."""
    seeds = set.intersection(*({r["seed"] for r in runs if r["world"] == w} for w in worlds))
    runs = [r for r in runs if r["seed"] in seeds]
    table = {}
    for world in worlds:
        mine = [r for r in runs if r["world"] == world]
        table[world] = dict(test=summary([r["test"] for r in mine]), val=summary([r["val"] for r in mine]),
                            epoch_s=round(statistics.median(r["epoch_s"] for r in mine), 4))
    ref = worlds[0]
    comparisons = []
    for world in worlds[1:]:
        a, b = table[ref]["test"], table[world]["test"]
        se = math.sqrt(a["sd"] ** 2 / a["n"] + b["sd"] ** 2 / b["n"])
        diff = b["mean"] - a["mean"]
        paired = [rb["test"] - ra["test"] for ra in runs if ra["world"] == ref
                  for rb in runs if rb["world"] == world and rb["seed"] == ra["seed"]]
        comparisons.append(dict(world=world, against=ref, seeds=sorted(seeds), mean_diff=round(diff, 5),
                                se=round(se, 5), within_noise=abs(diff) <= 2 * se, paired_diff=summary(paired)))
    return table, comparisons


def print_summary(table: dict, comparisons: list, worlds: list) -> None:
    print()
    print("| ranks | seeds | test accuracy (mean ± sd) | best val (mean ± sd) | epoch s (median) |")
    print("|---:|---:|---:|---:|---:|")
    for world in worlds:
        t, v = table[world]["test"], table[world]["val"]
        print(f"| {world} | {t['n']} | {100 * t['mean']:.2f} ± {100 * t['sd']:.2f} | "
              f"{100 * v['mean']:.2f} ± {100 * v['sd']:.2f} | {table[world]['epoch_s']:.3f} |")
    for c in comparisons:
        print(f"{c['world']} ranks against {c['against']}: {100 * c['mean_diff']:+.2f} pt, standard error "
              f"{100 * c['se']:.2f} pt ({'within' if c['within_noise'] else 'NOT within'} two of them); per seed "
              f"{100 * c['paired_diff']['mean']:+.2f} ± {100 * c['paired_diff']['sd']:.2f} pt")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=seeds_arg, default=seeds_arg("0-4"), help="seeds, e.g. 0-9 or 0,2,5")
    p.add_argument("--worlds", default="1,2", help="world sizes; the first is the reference")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU (the example's --cpu)")
    p.add_argument("--root", default=None, help="Planetoid root holding Cora/raw (default: the example's choice)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    p.add_argument("--out", default=None, help="JSON file for the runs and the summary")
    p.add_argument("--summarize", default=None, metavar="JSON",
                   help="no runs: the summary of the runs in this --out file (of a job stopped early), written back")
    args, extra = p.parse_known_args(argv)
    if args.summarize:
        with open(args.summarize) as f:
            record = json.load(f)
        worlds = record["meta"]["worlds"]
        table, comparisons = summarize(record["runs"], worlds)
        print_summary(table, comparisons, worlds)
        record.update(table={str(k): v for k, v in table.items()}, comparisons=comparisons)
        with open(args.out or args.summarize, "w") as f:
            json.dump(record, f, indent=1)
        return record
    extra = [a for a in extra if a != "--"]
    worlds = [int(w) for w in args.worlds.split(",")]
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=" ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
                seeds=args.seeds, worlds=worlds, cpu=args.cpu)
    runs = []
    for seed in args.seeds:  # each seed on every world size in turn: a drift of the host touches them alike
        for world in worlds:
            result = run_once(world, seed, args, extra, 29400 + (seed * 7 + world) % 500)
            result["world"] = world
            runs.append(result)
            print(f"seed {seed} world {world}: test {result['test']:.4f} val {result['val']:.4f} "
                  f"({result['data']}, {result['backend']}, {result['wall_s']} s)", flush=True)
            if args.out:  # the runs so far, should the job be stopped
                with open(args.out, "w") as f:
                    json.dump(dict(meta=meta, runs=runs), f, indent=1)
    table, comparisons = summarize(runs, worlds)
    print_summary(table, comparisons, worlds)
    record = dict(meta=meta, runs=runs, table={str(k): v for k, v in table.items()}, comparisons=comparisons)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
