r"""DistributedPartSampler: each rank's share of a graph's cluster parts, every epoch.

The rule, as :class:`torch.utils.data.DistributedSampler`'s: at epoch ``e`` every rank
computes the same order of the parts (shuffled with a generator seeded ``seed + e``, or in
order), the order is made a multiple of the world size ``R`` (``even="pad"``: the first parts
repeated; ``"drop"``: the tail left out), and rank ``r`` takes every ``R``-th part starting at
``r``.  The shares are disjoint and, with ``"pad"``, cover every part (a few twice in that
epoch), and every rank gets the same number of parts, hence of batches: a rank that ran out
of batches while the others still all-reduce gradients would hang the job.  ``even=None``
(no padding, shares differing by one part) is for loops without collectives.

It *is* a ``DistributedSampler``, so Lightning's DDP strategy keeps it instead of injecting
its own, and calls its ``set_epoch`` every epoch.
"""
from typing import Iterator, List, Optional, Sequence

import torch
from torch.utils.data import DistributedSampler

from .group import initialized, world

#: What makes the ranks' shares equal (see the module docstring).
EVEN = ("pad", "drop", None)


def resolve_world(num_replicas, rank):
    """``(num_replicas, rank)`` with the missing ones taken from the default process group, checked."""
    for name, value in (("num_replicas", num_replicas), ("rank", rank)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if num_replicas is None or rank is None:
        if not initialized():
            raise ValueError("num_replicas and rank are needed when torch.distributed is not initialized")
        group_rank, group_size = world()
        num_replicas = group_size if num_replicas is None else num_replicas
        rank = group_rank if rank is None else rank
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive int, got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, num_replicas={num_replicas}), got {rank}")
    return num_replicas, rank


class DistributedPartSampler(DistributedSampler):
    r"""Yields this rank's share of ``parts`` for the current epoch (see the module docstring).

    Args:
        parts (sequence of int): the part ids to share (``QuantClusterLoader`` passes the non-empty parts).
        num_replicas (int, optional): the number of ranks (default: the default process group's world size).
        rank (int, optional): this rank (default: its rank in the default process group).
        shuffle (bool): a new order every epoch (seeded ``seed + epoch``, the same on every rank).
        seed (int): the base seed of the order.
        even (str or None): ``"pad"`` (default), ``"drop"`` or None.
        follow (DistributedSampler, optional): a sampler whose ``epoch`` this one reads (the one a user passed to
            the loader, so that calling ``set_epoch`` on either reshuffles).
    """

    def __init__(self, parts: Sequence[int], num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, even: Optional[str] = "pad",
                 follow: Optional[DistributedSampler] = None):
        parts = [int(p) for p in parts]
        if not parts:
            raise ValueError("parts must not be empty")
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be a bool, got {type(shuffle).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if even not in EVEN:
            raise ValueError(f"even must be one of {EVEN}, got {even!r}")
        num_replicas, rank = resolve_world(num_replicas, rank)
        if even == "drop" and len(parts) < num_replicas:
            raise ValueError(f"even='drop' leaves no part: {len(parts)} parts for {num_replicas} ranks")
        super().__init__(parts, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=even == "drop")
        self._follow = follow  # after DistributedSampler's `self.epoch = 0`, which must not reset it
        self.parts, self.even = parts, even
        if even is None:  # rank r takes r, r + R, ...: shares differ by at most one part
            self.total_size = len(parts)
            self.num_samples = len(range(rank, len(parts), num_replicas))

    # DistributedSampler keeps the epoch as a plain attribute; here it can follow another sampler's.
    @property
    def epoch(self) -> int:
        return self._follow.epoch if self.__dict__.get("_follow") is not None else self.__dict__.get("_epoch", 0)

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.__dict__["_epoch"] = value
        if self.__dict__.get("_follow") is not None:
            self._follow.set_epoch(value)

    def order(self) -> List[int]:
        """Every part in this epoch's order (the same list on every rank), before padding or dropping."""
        if not self.shuffle:
            return list(self.parts)
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return [self.parts[i] for i in torch.randperm(len(self.parts), generator=g).tolist()]

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        if self.even == "pad" and len(order) < self.total_size:
            missing = self.total_size - len(order)
            order += (order * -(-missing // len(order)))[:missing]
        elif self.even == "drop":
            order = order[:self.total_size]
        share = order[self.rank:self.total_size:self.num_replicas]
        assert len(share) == self.num_samples
        return iter(share)

    @classmethod
    def following(cls, sampler: DistributedSampler, parts: Sequence[int]) -> "DistributedPartSampler":
        r"""The part sampler with ``sampler``'s world, rank, shuffle, seed and padding rule, following its epoch.

        ``drop_last=True`` drops; a sampler that repeats nothing although its dataset does not divide evenly
        (Lightning's prediction sampler) shares without padding; any other pads.
        """
        dataset_size = len(sampler.dataset)
        if sampler.drop_last:
            even = "drop"
        elif sampler.total_size == dataset_size and dataset_size % sampler.num_replicas:
            even = None
        else:
            even = "pad"
        return cls(parts, sampler.num_replicas, sampler.rank, bool(sampler.shuffle), int(sampler.seed), even,
                   follow=sampler)
