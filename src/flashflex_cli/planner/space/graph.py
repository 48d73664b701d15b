"""The device graph the planner partitions: devices weighted by compute, links weighted by bandwidth.

Vertices are the cluster's devices in `Cluster.device_ids` order (index i). Arrays hold per-device
facts the search reads in its inner loops without touching pydantic objects:

- `flops[i]`: dense peak FLOP/s for the training dtype (emulation slowdown applied);
- `node[i]`: node index; `local[i]`: index inside the node;
- `island[i]`: fast-link island (`islands.device_islands`): TP groups stay inside one island;
- `node_class[n]`: nodes with equal content (devices, fabric, NIC; the name aside) share a class, so
  costs computed for one node are reused for every node of its class;
- `node_bw[a, b]`: bandwidth in bytes/s between nodes a and b (intra-node fabric on the diagonal).

Edges for METIS: a complete graph inside each node and, between two nodes, one edge per pair of devices
with the same local index (a sparse stand-in for the all-to-all fabric that keeps 1024-device graphs
small). Edge weights grow with bandwidth, so a minimum cut falls on the slowest links.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ...hardware.cluster import Cluster
from .islands import device_islands


@dataclass(frozen=True)
class DeviceGraph:
    """Per-device arrays and node-level links of one cluster (see module docstring)."""

    cluster: Cluster
    dtype: str

    @cached_property
    def ids(self) -> list[str]:
        """Device ids in cluster order."""
        return list(self.cluster.device_ids)

    @cached_property
    def cluster_sha256(self) -> str:
        """`Cluster.sha256()`, computed once (plans record it)."""
        return self.cluster.sha256()

    @property
    def size(self) -> int:
        """Number of devices."""
        return len(self.ids)

    @cached_property
    def index(self) -> dict[str, int]:
        """Device id -> vertex index."""
        return {d: i for i, d in enumerate(self.ids)}

    @cached_property
    def node(self) -> np.ndarray:
        """Node index of every device, shape [N] int64."""
        return np.array([n for n, node in enumerate(self.cluster.nodes) for _ in node.devices], dtype=np.int64)

    @cached_property
    def local(self) -> np.ndarray:
        """Index of every device inside its node, shape [N] int64."""
        return np.array([i for node in self.cluster.nodes for i in range(len(node.devices))], dtype=np.int64)

    @cached_property
    def island(self) -> np.ndarray:
        """Fast-link island of every device (numbered cluster-wide, ascending with node), shape [N] int64."""
        return np.array(device_islands(self.cluster), dtype=np.int64)

    @cached_property
    def flops(self) -> np.ndarray:
        """Dense peak FLOP/s of every device for the training dtype, shape [N] float64."""
        return np.array([dev.flops(self.dtype) for node in self.cluster.nodes for dev in node.devices])

    @cached_property
    def memory(self) -> np.ndarray:
        """Device memory in bytes, shape [N] float64."""
        return np.array([float(dev.memory_bytes) for node in self.cluster.nodes for dev in node.devices])

    @cached_property
    def node_class(self) -> list[int]:
        """Class of every node: nodes whose content (name and hostname aside) is equal share one class."""
        keys: dict[str, int] = {}
        out: list[int] = []
        for node in self.cluster.nodes:
            data = node.model_dump(mode="json", exclude={"name", "hostname"})
            key = json.dumps(data, sort_keys=True)
            out.append(keys.setdefault(key, len(keys)))
        return out

    @cached_property
    def node_bw(self) -> np.ndarray:
        """Bandwidth between nodes in bytes/s, shape [nodes, nodes]; the diagonal is the slowest intra link."""
        nodes = self.cluster.nodes
        count = len(nodes)
        out = np.zeros((count, count))
        for a in range(count):
            first = f"{nodes[a].name}/0"
            if len(nodes[a].devices) > 1:
                out[a, a] = min(self.cluster.link(first, f"{nodes[a].name}/{j}").bandwidth
                                for j in range(1, len(nodes[a].devices)))
            else:
                out[a, a] = float("inf")
            for b in range(a + 1, count):
                out[a, b] = out[b, a] = self.cluster.node_link(nodes[a].name, nodes[b].name).bandwidth
        return out

    @cached_property
    def node_list(self) -> list[int]:
        """`node` as a Python list (fast scalar reads in the inner loops)."""
        return [int(n) for n in self.node]

    @cached_property
    def local_list(self) -> list[int]:
        """`local` as a Python list (fast scalar reads in the inner loops)."""
        return [int(i) for i in self.local]

    @cached_property
    def node_bw_rows(self) -> list[list[float]]:
        """`node_bw` as Python lists of floats (equal values, fast scalar reads)."""
        return [[float(x) for x in row] for row in self.node_bw]

    def node_bw_key(self, nodes: Sequence[int]) -> bytes:
        """The bandwidths between `nodes` (`node_bw[nodes][:, nodes]`, row by row) as bytes: equal for equal
        matrices, a dictionary key without a Python float per pair (a 128-node group has 16,384 pairs)."""
        index = np.asarray(nodes, dtype=np.intp)
        return self.node_bw.take(index, 0).take(index, 1).tobytes()

    def device_key(self, i: int) -> tuple[int, int]:
        """(node class, local index): devices with equal keys are interchangeable inside their node class."""
        return self.node_class[int(self.node[i])], int(self.local[i])

    @cached_property
    def _csr(self) -> tuple[list[int], list[int], list[int]]:
        return self._build_csr()

    def csr(self) -> tuple[list[int], list[int], list[int]]:
        """(xadj, adjncy, eweights) of the METIS graph (see module docstring); integer weights >= 1."""
        return self._csr

    def _build_csr(self) -> tuple[list[int], list[int], list[int]]:
        """(xadj, adjncy, eweights) of the METIS graph (see module docstring); integer weights >= 1."""
        node_of, local = self.node_list, self.local_list
        by_node: dict[int, list[int]] = {}
        by_local: dict[int, list[int]] = {}
        for i in range(self.size):
            by_node.setdefault(node_of[i], []).append(i)
            by_local.setdefault(local[i], []).append(i)
        finite = self.node_bw[np.isfinite(self.node_bw)]
        scale = float(finite.min()) if finite.size else 1.0
        # the weight of an edge between a device of node a and one of node b (the same values as Python scalars)
        table = [[max(1, int(round(100 * (bw if math.isfinite(bw) else scale * 1e4) / scale))) for bw in row]
                 for row in self.node_bw_rows]
        xadj, adjncy, weights = [0], [], []
        for i in range(self.size):
            a = node_of[i]
            neighbours = [j for j in by_node[a] if j != i] + [j for j in by_local[local[i]] if node_of[j] != a]
            adjncy.extend(neighbours)
            row = table[a]
            weights.extend([row[node_of[j]] for j in neighbours])
            xadj.append(len(adjncy))
        return xadj, adjncy, weights

    @cached_property
    def _csr_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return tuple(np.asarray(x, dtype=np.int64) for x in self.csr())  # type: ignore[return-value]

    @cached_property
    def _sub_csr_memo(self) -> dict[tuple[int, ...], tuple[array, array, array, array]]:
        return {}

    @cached_property
    def partition_memo(self) -> dict[tuple, tuple]:
        """`partition.generators`' answers by (k, seed, active devices), kept as long as the graph."""
        return {}

    def sub_csr(self, active: tuple[int, ...]) -> tuple[array, array, array, array]:
        """(xadj, adjncy, eweights, vweights) of the METIS graph restricted to the `active` vertices
        (renumbered 0.. in the order given), as int64 arrays (pymetis reads them without a conversion);
        memoised per active set (every k partitions the same one)."""
        memo = self._sub_csr_memo
        hit = memo.get(active)
        if hit is None:
            xadj_full, adjncy_full, weights_full = self._csr_arrays
            chosen = np.asarray(active, dtype=np.int64)
            position = np.full(self.size, -1, dtype=np.int64)
            position[chosen] = np.arange(len(active))
            # every edge of the chosen vertices, vertex by vertex in the order given, edges in CSR order
            starts, lengths = xadj_full[chosen], xadj_full[chosen + 1] - xadj_full[chosen]
            before = np.concatenate(([0], np.cumsum(lengths)))
            edges = np.repeat(starts - before[:-1], lengths) + np.arange(before[-1])
            ends = position[adjncy_full[edges]]
            kept = ends >= 0  # the other end is chosen too
            xadj = np.concatenate(([0], np.cumsum(kept)))[before]
            vweights = np.asarray(self.compute_weights(), dtype=np.int64)[chosen]
            hit = tuple(_int64(x) for x in (xadj, ends[kept], weights_full[edges][kept], vweights))
            memo[active] = hit  # type: ignore[assignment]
        return hit  # type: ignore[return-value]

    @cached_property
    def _weights(self) -> list[int]:
        top = float(self.flops.max())
        return [max(1, int(round(1000 * f / top))) for f in self.flops]

    def compute_weights(self) -> list[int]:
        """Vertex weights for METIS: FLOP/s scaled so the fastest device weighs 1000; each >= 1."""
        return self._weights


def _int64(values: np.ndarray) -> array:
    """A numpy integer vector as a Python int64 `array` (its buffer read as is)."""
    out = array("q")
    out.frombytes(np.ascontiguousarray(values, dtype=np.int64).tobytes())
    return out
