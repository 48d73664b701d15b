"""Runtime switches: each communication improvement can be turned off for comparison (benchmarks, debugging).

Defaults are the fast paths; the plan does not carry them (they change speed, never the numbers beyond
floating-point reassociation).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeOptions:
    """`lean_p2p`: stage-boundary transfers in the compute dtype, each sending TP rank sending 1/t of the
    activation and the receiving TP group all-gathering it (False: every TP rank sends the full fp32 tensor).
    `overlap_dp`: a layer's gradient slices start reducing (asynchronously, bucketed) as soon as the last
    micro-batch's backward through it is done (False: one blocking reduction after the whole backward).
    `hierarchical_dp`: holders of a slice on several nodes reduce inside each node first, then across nodes with
    one rank per node (False: one flat ring over all holders)."""

    lean_p2p: bool = True
    overlap_dp: bool = True
    hierarchical_dp: bool = True
