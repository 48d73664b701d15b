"""Which gradient slices are reduced together, and in which order: pure functions of the plan's slice list.

A bucket is every finest slice (`groups.SliceHolders`) that needs a reduction and shares one holder set and one
backward-order key, packed into one flat buffer for one collective. Two bucketings:

- `holder_set_buckets`: one bucket per holder set, sorted by the holder tuple (the blocking reduction after the
  whole backward);
- `overlap_buckets`: one bucket per (layer, holder set), in the order the backward pass finishes them
  (semantics/buckets.py `backward_key`: head, final norm, layers from the last to the first, embedding).

Every rank reduces the subsequence of the GLOBAL bucket list that it holds, so any two ranks post the buckets
they share in the same order, and the collectives cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...semantics.buckets import KEY_UNORDERED, backward_key, overlap_order
from .groups import SliceHolders


@dataclass(frozen=True)
class Bucket:
    """Slices reduced by one collective among `ranks` (sorted global ranks); `key`: backward order (see
    `backward_key`; 0 for holder-set buckets); `slices` in the global slice order."""

    key: int
    ranks: tuple[int, ...]
    slices: tuple[SliceHolders, ...]

    @property
    def after_schedule(self) -> bool:
        """True for a tied embedding's bucket (both ends of one pipeline hold it): reduced only after the whole
        pipeline schedule, never from inside it. The first stage's copy is final only after that stage's last
        backward, which needs the input gradient the last stage sends; a reduction the last stage issued from
        inside its backward would be in flight ahead of that send, and on NCCL its kernel would wait on the
        device for a peer that waits for the send: safe only while the GPU runs the two kernels side by side,
        which NCCL does not promise. Megatron-LM reduces these gradients after the schedule for the same reason."""
        return any(sl.tied for sl in self.slices)

    @property
    def names(self) -> frozenset[str]:
        """The global parameter names whose gradients this bucket reads."""
        return frozenset(sl.name for sl in self.slices)


def holder_set_buckets(slices: list[SliceHolders]) -> list[Bucket]:
    """One bucket per holder set of the slices that need a reduction, sorted by holder tuple."""
    by_set: dict[tuple[int, ...], list[SliceHolders]] = {}
    for sl in slices:
        if sl.needs_reduce:
            by_set.setdefault(sl.ranks, []).append(sl)
    return [Bucket(KEY_UNORDERED, members, tuple(by_set[members])) for members in sorted(by_set)]


def overlap_buckets(slices: list[SliceHolders]) -> list[Bucket]:
    """One bucket per (backward key, holder set), sorted by descending key, then holder tuple."""
    by_key: dict[tuple[int, tuple[int, ...]], list[SliceHolders]] = {}
    for sl in slices:
        if sl.needs_reduce:
            by_key.setdefault((backward_key(sl.name), sl.ranks), []).append(sl)
    order = sorted(by_key, key=lambda k: overlap_order(*k))
    return [Bucket(key, members, tuple(by_key[(key, members)])) for key, members in order]


def rank_buckets(buckets: list[Bucket], rank: int) -> list[Bucket]:
    """The buckets `rank` takes part in, in the global order."""
    return [b for b in buckets if rank in b.ranks]
