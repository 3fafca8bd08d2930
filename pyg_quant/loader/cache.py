r"""The on-disk cache of METIS partitions, keyed by what the partition depends on.

PyG's ``ClusterData`` caches under ``part_{num_parts}/metis.pt`` whatever the
graph, so a second graph in the same ``save_dir`` silently reuses the first
one's partition (and later fails with an IndexError).  Here the key holds a
fingerprint of the graph (node count, edge count, SHA-256 of ``edge_index``),
``num_parts``, ``recursive`` and the backend; it is part of the file name and is
stored in the file and checked again on load.  A file that cannot be read, or
that holds something else, is recomputed with a warning.

Only the part of every node is stored (int64 ``[N]``, 8 bytes a node); the
node and edge permutations are rebuilt from it by one sort, far cheaper than
METIS, and PyG's stored CSR would take 16 bytes an edge.
"""
import hashlib
import json
import os
import os.path as osp
import tempfile
import warnings
from typing import Dict, Optional

import torch

FORMAT = "pyg_quant.cluster/1"


def graph_fingerprint(edge_index: torch.Tensor, num_nodes: int) -> Dict[str, object]:
    r"""Node count, edge count and the SHA-256 of ``edge_index`` as int64 ``[2, E]`` (row-major bytes).

    int32 and int64 copies of one graph share a fingerprint; any change of an
    index, of the edge order or of ``num_nodes`` changes it.
    """
    edges = edge_index.detach().to("cpu", torch.int64).contiguous()
    digest = hashlib.sha256(memoryview(edges.numpy()).cast("B")).hexdigest()
    return {"num_nodes": int(num_nodes), "num_edges": int(edges.size(1)), "edge_sha256": digest}


def cache_key(fingerprint: Dict[str, object], num_parts: int, recursive: bool, backend: str) -> Dict[str, object]:
    return {"format": FORMAT, **fingerprint, "num_parts": int(num_parts), "recursive": bool(recursive),
            "backend": backend}


def cache_path(save_dir: str, filename: Optional[str], key: Dict[str, object]) -> str:
    """``save_dir/<filename>``, or a name built from the key so that different graphs never share a file."""
    if filename is not None:
        return osp.join(save_dir, filename)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    recursive = "_recursive" if key["recursive"] else ""
    return osp.join(save_dir, f"metis_{key['num_parts']}{recursive}_{key['backend']}_{digest}.pt")


def load_cluster(path: str, key: Dict[str, object]) -> Optional[torch.Tensor]:
    r"""The cached part vector (int64 ``[num_nodes]``) for ``key``, or None.

    None, without a word, when there is no file; None with a warning when the
    file is unreadable, malformed or was written for another key.
    """
    if not osp.exists(path):
        return None
    try:
        stored = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated, not a torch file, unpickling refused, ...
        warnings.warn(f"partition cache {path!r} is unreadable ({type(error).__name__}: {error}); "
                      "recomputing it", RuntimeWarning, stacklevel=3)
        return None
    problem = _check_stored(stored, key)
    if problem is not None:
        warnings.warn(f"partition cache {path!r} {problem}; recomputing it", RuntimeWarning, stacklevel=3)
        return None
    return stored["cluster"]


def _check_stored(stored, key: Dict[str, object]) -> Optional[str]:
    if not isinstance(stored, dict) or not isinstance(stored.get("key"), dict) or "cluster" not in stored:
        return "does not hold a pyg_quant partition"
    if stored["key"] != key:
        differs = sorted(k for k in set(key) | set(stored["key"]) if stored["key"].get(k) != key.get(k))
        return f"was written for another graph or setting (differs in {', '.join(differs)})"
    cluster = stored["cluster"]
    if (not isinstance(cluster, torch.Tensor) or cluster.dtype != torch.int64
            or cluster.shape != (key["num_nodes"],)):
        return "holds a part vector of the wrong type or shape"
    if cluster.numel() and (int(cluster.min()) < 0 or int(cluster.max()) >= key["num_parts"]):
        return f"holds part ids outside [0, {key['num_parts']})"
    return None


def save_cluster(path: str, key: Dict[str, object], cluster: torch.Tensor) -> None:
    """Writes atomically (a temporary file, then a rename), so a crash never leaves a half-written cache."""
    directory = osp.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp_", suffix=".pt")
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save({"key": key, "cluster": cluster.to(torch.int64).contiguous()}, file)
        os.replace(tmp, path)
    except BaseException:
        if osp.exists(tmp):
            os.remove(tmp)
        raise
