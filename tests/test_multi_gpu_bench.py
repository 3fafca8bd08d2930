"""benchmarks/multi_gpu.py on the CPU: 2 gloo ranks it starts itself, one model, a tiny graph (a few seconds each).

A smoke test of the benchmark's code paths (ranks, identical builds, training on 1 and 2 ranks with and without
DDP, sharded inference gathered in node order, ratios, JSON), not a timing; and a rank that raises in the middle
of a DDP epoch ends the job with its error.
"""
import json
import os
import subprocess
import sys

import pytest

import pyg_quant as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "multi_gpu.py")
TINY = ["--small", "--models", "GIN", "--bits", "4", "--no-h2d", "--accuracy-seeds", "", "--reps", "1",
        "--infer-reps", "1", "--timeout", "120"]

pytestmark = pytest.mark.skipif(not pq.backends()["cpu"], reason="needs pyg_quant's compiled CPU backend")


def run(tmp_path, *extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "multi_gpu.json"
    done = subprocess.run([sys.executable, SCRIPT, *TINY, "--out", str(out), *extra], env=env, capture_output=True,
                          text=True, timeout=150)
    return done, json.loads(out.read_text())


def test_multi_gpu_bench_on_two_cpu_ranks(tmp_path):
    done, saved = run(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert saved["graph"]["build_identical_on_every_rank"] and not saved["errors"] and not saved["skipped"]
    rows = {(r["section"], r["variant"], r["world"]): r for r in saved["rows"]}
    trained = ("QAT 4-bit", "QAT 4-bit captured", "QAT 4-bit, torch DDP", "PyG fp32 CSR")
    assert set(rows) == {("train", v, w) for v in trained for w in ("1", "1 DDP", "2")} | \
        {("infer", v, w) for v in ("pyg_quant 4-bit", "PyG fp32 CSR") for w in ("1", "2")}
    for row in rows.values():
        assert row["median_ms"] > 0 and len(row["times_ms"]) == 1, row
    # 5 batches: training pads to 3 steps a rank, inference shares 3 + 2
    assert rows[("train", "QAT 4-bit", "2")]["batches_per_rank"] == [3, 3]
    assert rows[("infer", "pyg_quant 4-bit", "2")]["batches_per_rank"] == [3, 2]
    assert all(row["rounds"] == "interleaved" for row in rows.values())
    for variant in ("pyg_quant 4-bit", "PyG fp32 CSR"):  # the gathered output equals one process's
        assert rows[("infer", variant, "2")]["equal_to_1gpu"]
    for variant in trained:  # DDP over one rank trains exactly as the plain model (each its own noise, interleaved)
        assert rows[("train", variant, "1 DDP")]["loss_per_epoch"] == rows[("train", variant, "1")]["loss_per_epoch"]
        assert 0 <= rows[("train", variant, "2")]["test_acc"] <= 1
    # pyg_quant's wrapper (buffers synced once) trains as DDP's defaults do: the ranks' ranges are all-reduced anyway
    assert rows[("train", "QAT 4-bit", "2")]["loss_per_epoch"] == rows[("train", "QAT 4-bit, torch DDP", "2")][
        "loss_per_epoch"]
    # CapturedTrainStep runs these steps eagerly on the CPU: the plain loop's losses, one warm-up epoch more
    for world in ("1", "1 DDP", "2"):
        plain, captured = (rows[("train", v, world)]["loss_per_epoch"] for v in ("QAT 4-bit", "QAT 4-bit captured"))
        assert len(captured) == len(plain) + 1 and captured[:-1] == plain, world
    assert len(saved["summary"]["speedup_2_vs_1"]) == 6 and saved["targets"]
    assert "| GIN | QAT 4-bit | resident |" in saved["tables_markdown"]


def test_multi_gpu_bench_failing_rank_ends_the_job(tmp_path):
    done, saved = run(tmp_path, "--fail-rank", "1")
    assert done.returncode == 1
    assert "rank 1:" in done.stderr and "injected failure on rank 1" in done.stderr
    assert "injected failure on rank 1" in saved["fatal"]


def test_multi_gpu_accuracy_on_one_and_two_cpu_ranks(tmp_path):
    """benchmarks/multi_gpu_accuracy.py: the example once in one process and once on 2 gloo ranks (torchrun), the
    accuracies and the comparison in its JSON; --summarize rebuilds the summary of a job stopped after its runs."""
    script = os.path.join(ROOT, "benchmarks", "multi_gpu_accuracy.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "accuracy.json"
    done = subprocess.run([sys.executable, script, "--cpu", "--seeds", "3", "--out", str(out), "--timeout", "240",
                           "--", "--small", "--epochs", "2", "--nodes", "600", "--parts", "4"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert [(r["world"], r["seed"], r["backend"]) for r in saved["runs"]] == [(1, 3, "one process"), (2, 3, "gloo")]
    for r in saved["runs"]:
        assert 0.0 <= r["test"] <= 1.0 and r["ranks"] == r["world"] and r["epochs"] == 2
    comparison, = saved["comparisons"]
    assert comparison["world"] == 2 and comparison["against"] == 1 and comparison["seeds"] == [3]
    assert abs(comparison["mean_diff"] - (saved["runs"][1]["test"] - saved["runs"][0]["test"])) < 1e-4
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps(dict(meta=saved["meta"], runs=saved["runs"])))
    done = subprocess.run([sys.executable, script, "--summarize", str(partial)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(partial.read_text())["comparisons"] == saved["comparisons"]
