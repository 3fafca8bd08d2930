r"""Where this process stands among the others: rank, world size, the device collectives run on, seeds.

Everything here reads the default process group of :mod:`torch.distributed` (made by
``torch.distributed.init_process_group``, as ``torchrun`` scripts and Lightning's DDP strategy
do); without one, a process is rank 0 of a world of 1 and nothing communicates.

Seeds: rank ``r`` of a job seeded with ``s`` draws from :func:`rank_seed` ``(s, r)``: rank 0 from
``s`` itself (so a one-process run draws what rank 0 of a larger one draws), every other rank
from a seed of its own, so that the ranks' stochastic rounding and dropout noise differ (the
same noise on every rank would make the ranks' gradients errors correlated, and averaging them
would not reduce them) while a run stays reproducible for a given seed and world size.
"""
import random
from typing import Optional, Tuple

import torch
import torch.distributed as dist

#: Odd 64-bit constant (2^64 / golden ratio) that spaces the ranks' seeds: quantizer ``k``'s seed ``s + k`` on rank
#: ``r`` is ``s + k + r·G mod 2^64``, which no other (quantizer, rank) pair of a run reaches.
_GOLDEN = 0x9E3779B97F4A7C15


def initialized() -> bool:
    """Whether a default process group exists (``torch.distributed`` available and initialized)."""
    return dist.is_available() and dist.is_initialized()


def world() -> Tuple[int, int]:
    """``(rank, world_size)`` in the default process group; ``(0, 1)`` without one."""
    if not initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def world_size() -> int:
    return world()[1]


def collective_device() -> torch.device:
    """The device whose tensors the default group's collectives take: the current CUDA device for NCCL, else the CPU.

    NCCL moves CUDA tensors only (each rank must have called ``torch.cuda.set_device(local_rank)``); gloo takes CPU
    tensors.
    """
    if initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    """Waits for every rank (an all-reduce of one element on :func:`collective_device`: on NCCL, ``dist.barrier``
    guesses a device when none was set)."""
    if world_size() > 1:
        dist.all_reduce(torch.zeros(1, device=collective_device()))


def check_seed(seed, name: str = "seed") -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"{name} must be an int in [0, 2**64), got {seed!r}")
    return seed


def rank_seed(seed: int, rank: Optional[int] = None) -> int:
    """The seed rank ``rank`` (default: this process's) draws from in a job seeded with ``seed``: ``seed`` on rank 0,
    ``seed + rank·G mod 2^64`` on the others (``G`` an odd 64-bit constant; see the module docstring)."""
    check_seed(seed)
    if rank is None:
        rank = world()[0]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    return (seed + rank * _GOLDEN) % 2**64


def seed_everything(seed: int, rank: Optional[int] = None) -> int:
    r"""Seeds torch (CPU and every CUDA device), ``random`` and numpy with :func:`rank_seed` ``(seed, rank)``.

    Call it after ``init_process_group``: each rank then draws its own dropout masks and stochastic rounding noise
    from torch's global generator (``QGCNConv`` / ``QGINConv`` in training, quantizers made with ``seed=None``);
    quantizers with a seed of their own (``qat.prepare(..., seed=s)``) derive their rank's generator themselves.
    A model built after it is built differently on every rank: ``DistributedDataParallel`` broadcasts rank 0's
    parameters and buffers when it wraps the model (build the model before seeding if anything else needs equal
    weights).  Returns the seed used.
    """
    used = rank_seed(seed, rank)
    torch.manual_seed(used)  # seeds every CUDA device too
    random.seed(used)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch_geometric
        return used
    np.random.seed(used % 2**32)
    return used
