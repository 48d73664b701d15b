"""Time terms of a sharded optimizer (runtime/parallel/sharded_optimizer.py), on the DP buckets of cost/dp.py.

- Reduction: each holder's chunk is reduced to it (one reduce per holder). Together these move what a ring
  reduce-scatter moves, (n - 1) / n of the bucket through every link: half the ring all-reduce's bytes and
  steps, so a flat bucket costs half its all-reduce (`reduce_scatter_bucket`). A hierarchical bucket keeps its
  all-reduce (the runtime's fallback: the hierarchical all-reduce, each holder keeping its chunk).
- Update: the optimizer step runs over the parameters a device keeps (cost/estimate.py).
- Gather: after its update, each holder broadcasts its chunk to the bucket's other holders: an all-gather, the
  other half of a ring all-reduce, run bucket by bucket in the global order once every holder has updated,
  through the same per-node NIC queue as the reduction (`gather_timeline`); the step of a stage ends when its
  last gather does.
"""

from __future__ import annotations

from dataclasses import replace

from ..plan.schema import Plan
from .dp import DPBucket, NicQueue, StageKey


def shards_optimizer(plan: Plan) -> bool:
    """True when `plan` shards its optimizer state (the plan's `optimizer_sharding`)."""
    return plan.optimizer_sharding is not None


def is_hierarchical(bucket: DPBucket) -> bool:
    """The bucket runs the hierarchical schedule (an intra-node part and a cross-node part)."""
    return bucket.inside_s > 0 and bucket.across_s > 0


def reduce_scatter_bucket(bucket: DPBucket) -> DPBucket:
    """The bucket's reduction when sharded: half the flat all-reduce; a hierarchical one unchanged."""
    if is_hierarchical(bucket):
        return bucket
    return replace(bucket, inside_s=bucket.inside_s / 2, across_s=bucket.across_s / 2)


def gather_timeline(buckets: list[DPBucket], updated_s: dict[StageKey, float]) -> dict[StageKey, float]:
    """When each stage's gathers end (s): the buckets in their global order, each an all-gather (half the flat
    all-reduce of `buckets`, their unsharded times) starting when every holder has updated (`updated_s`) and
    finished its previous gather, its cross-node part through the nodes' NIC queue. Stages in no bucket end
    at their update."""
    nics = NicQueue()
    free = dict(updated_s)
    for bucket in buckets:
        start = max(free[h] for h in bucket.holders)
        end = nics.run(start, bucket.inside_s / 2, bucket.across_s / 2, bucket.nodes)
        for h in bucket.holders:
            free[h] = end
    return free
