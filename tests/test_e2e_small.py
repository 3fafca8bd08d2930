"""benchmarks/e2e.py end to end on a tiny graph on the CPU: every section runs, nothing errors, the JSON is complete.

A smoke test of the benchmark's code paths (graph build, batch formats, PyG and pyg_quant inference, QAT
training, tables, JSON, plot), not a timing.  The scale is far below ``--small`` (4 parts of 512 nodes,
2 parts a batch) so that it stays a few seconds.
"""
import json
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

import pyg_quant as pq  # noqa: E402

pytestmark = pytest.mark.skipif(not pq.backends()["cpu"], reason="needs pyg_quant's compiled CPU backend")


def test_e2e_tiny_cpu(tmp_path):
    import e2e

    out = tmp_path / "e2e.json"
    data = e2e.main(["--device", "cpu", "--small", "--num-parts", "4", "--part-size", "512", "--parts-per-batch", "2",
                     "--avg-degree", "20", "--bits", "4,1", "--kernel-bits", "4", "--reps", "1", "--train-reps", "1",
                     "--train-rounds", "1", "--warmup", "0", "--time-budget", "600", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["graph"]["batches"] == 2 and saved["graph"]["batch_nodes"] == 1024
    assert os.path.exists(tmp_path / "e2e.png")

    inference = saved["inference"]
    # 4 PyG variants + pyg_quant at 2 widths + pyg_quant with calibrated ranges at 4 bits (--static-bits 8,4 of
    # --bits 4,1) + pq-kernels at 1 width, for GIN and GCN
    assert len(inference) == 2 * (4 + 2 + 1 + 1)
    assert {r["label"] for r in inference if "static" in r["label"]} == {"pyg_quant 4-bit static"}
    for row in inference:
        if row["label"] == "PyG bf16 CSR":  # torch's CPU CSR matmul has no bf16 kernel
            continue
        assert "error" not in row and not row.get("skipped"), row
        assert row["resident"]["median_ms"] > 0 and row["h2d"]["median_ms"] > 0
        assert row["h2d_mb_per_epoch"] > 0
        assert torch.isfinite(torch.tensor(row["rel_err_vs_pyg_fp32"])), row
    by_label = {(r["model"], r["label"]): r for r in inference}
    for kind in ("GIN", "GCN"):
        # the pre-normalized CSR path and PyG's own normalization compute the same function
        assert by_label[(kind, "PyG fp32 CSR")]["rel_err_vs_pyg_fp32"] < 1e-5
        # 4-bit operands: close to fp32, and the bit batch ships fewer bytes than fp32 CSR
        assert by_label[(kind, "pq-kernels 4-bit")]["rel_err_vs_pyg_fp32"] < 0.1
        assert by_label[(kind, "pyg_quant 4-bit")]["h2d_mb_per_epoch"] < by_label[(kind, "PyG fp32 CSR")]["h2d_mb_per_epoch"]

    training = saved["training"]
    # (PyG: edge_index, CSR, captured; QAT: edge_index, captured, 4-bit x, and on the loader's BitAdjacency with
    # float and 4-bit x: torch.compile's variants run on the GPU by default)
    assert len(training) == 2 * 8
    assert sum(row["captured"] for row in training) == 2 * 2  # run eagerly on the CPU: nothing captured
    for row in training:
        assert "error" not in row and not row.get("skipped"), row
        first, last = row["mean_loss_first_last_epoch"]
        assert torch.isfinite(torch.tensor([first, last])).all()
        # every variant with resident batches also ran in the interleaved rounds
        assert ("resident" in row) == ("resident_interleaved" in row), row["label"]
        assert "resident" not in row or row["resident_interleaved"]["median_ms"] > 0
    assert not [e for e in saved["errors"] if "bf16 CSR" not in e["where"]], saved["errors"]
    assert data["tables_markdown"].startswith("\n### Inference")


def test_e2e_tiny_cpu_tile_free_batches(tmp_path):
    """``--adjacency csr``: the pyg_quant batches decode without tiles and the inference variants still run."""
    import e2e

    out = tmp_path / "e2e_csr.json"
    e2e.main(["--device", "cpu", "--small", "--num-parts", "4", "--part-size", "512", "--parts-per-batch", "2",
              "--avg-degree", "20", "--bits", "4", "--kernel-bits", "4", "--reps", "1", "--warmup", "0",
              "--sections", "inference", "--models", "GIN", "--adjacency", "csr", "--time-budget", "600",
              "--out", str(out), "--png", str(tmp_path / "e2e_csr.png")])
    saved = json.loads(out.read_text())
    assert saved["meta"]["args"]["adjacency"] == "csr"
    rows = {r["label"]: r for r in saved["inference"]}
    for label in ("pyg_quant 4-bit", "pq-kernels 4-bit"):
        assert "error" not in rows[label] and not rows[label].get("skipped"), rows[label]
        assert torch.isfinite(torch.tensor(rows[label]["rel_err_vs_pyg_fp32"])), rows[label]
