"""Where a rank's local tensor sits inside its full, plan-independent tensor: ShardSpec (for checkpoints), and
`slice_view`, the part of a local shard that is one slice of the data-parallel reduction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...semantics.parameters import ParamInfo
from ...semantics.process_groups import SliceHolders


@dataclass(frozen=True)
class ShardSpec:
    """A local tensor: global name, full shape, the slice [start, stop) along `dim` held here (dim None: the
    whole tensor; start/stop then span dim 0), and `owner`: True on exactly one rank per (name, dim, start,
    stop) in the whole job (the rank that writes it to a checkpoint). `optional`: as a load target, a tensor a
    checkpoint may lack (it then keeps the value it holds)."""

    name: str
    full_shape: tuple[int, ...]
    dim: int | None
    start: int
    stop: int
    owner: bool
    optional: bool = False

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This shard of a full tensor (a view)."""
        return full if self.dim is None else full.narrow(self.dim, self.start, self.stop - self.start)

    @property
    def key(self) -> str:
        """The checkpoint key of this slice: "NAME@DIM:START:STOP", or "NAME@full" for a whole tensor."""
        return f"{self.name}@full" if self.dim is None else f"{self.name}@{self.dim}:{self.start}:{self.stop}"


def slice_view(tensor: torch.Tensor, info: ParamInfo, holders: SliceHolders, tp: int, tp_rank: int) -> torch.Tensor:
    """The part of this rank's shard `tensor` (local shape) that is slice `holders` of the full tensor (a view)."""
    if holders.dim is None:
        return tensor
    start, _ = info.bounds(tp, tp_rank)
    return tensor.narrow(holders.dim, holders.start - start, holders.stop - holders.start)
