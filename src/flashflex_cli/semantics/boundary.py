"""Which piece of a stage-boundary tensor goes from which sending TP rank to which receiving TP rank
(scatter-gather over the TP groups, the idea of Megatron-LM's scatter-gather optimisation, written here for
any pair of TP degrees).

A tensor of `numel` elements is replicated on the t ranks of the sending stage and needed, whole, on the t'
ranks of the receiving stage. Its flattened form, zero-padded to n * c elements, is cut into n = lcm(t, t')
equal chunks of c = ceil(numel / n) elements. Chunk k leaves sending rank k % t for receiving rank k % t', so
every sender sends n / t chunks (1/t of the tensor), every receiver receives n / t' chunks, and by the Chinese
remainder theorem each (sender, receiver) pair exchanges at most one chunk. Each receiver then all-gathers the
chunks inside its TP group: receiver j contributes chunks j, j + t', j + 2 t', ..., so the gathered
[t', n / t', c] buffer, read in [n / t', t', c] order, is the padded tensor.

The runtime sends by this mapping (runtime/parallel/pipeline.py) and the cost model charges each link the chunks this
mapping puts on it (cost/comm.py `lean_transfer_time`), so both follow `chunk_route`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def chunk_route(senders: int, receivers: int) -> list[tuple[int, int]]:
    """(sending TP rank, receiving TP rank) of chunk k = 0 .. lcm(t, t') - 1: k % t to k % t'."""
    return [(k % senders, k % receivers) for k in range(math.lcm(senders, receivers))]


@dataclass(frozen=True)
class ChunkPlan:
    """The chunks of one boundary transfer: `senders` (t) ranks hold the tensor of `numel` elements, each of
    the `receivers` (t') ranks must end with all of it."""

    senders: int
    receivers: int
    numel: int

    def __post_init__(self) -> None:
        if self.senders < 1 or self.receivers < 1 or self.numel < 1:
            raise ValueError(f"chunk plan needs t >= 1, t' >= 1 and numel >= 1, got {self}")

    @property
    def chunks(self) -> int:
        """n = lcm(t, t')."""
        return math.lcm(self.senders, self.receivers)

    @property
    def chunk_numel(self) -> int:
        """c = ceil(numel / n) elements per chunk (the last ones padded)."""
        return -(-self.numel // self.chunks)

    @property
    def per_receiver(self) -> int:
        """Chunks each receiver receives (and contributes to the all-gather): n / t'."""
        return self.chunks // self.receivers

    @property
    def per_sender(self) -> int:
        """Chunks each sender sends: n / t."""
        return self.chunks // self.senders

    def sent_by(self, sender: int) -> list[tuple[int, int]]:
        """(chunk k, receiver k % t') for every chunk that TP rank `sender` of the sending stage sends."""
        return [(k, r) for k, (s, r) in enumerate(chunk_route(self.senders, self.receivers)) if s == sender]

    def received_by(self, receiver: int) -> list[tuple[int, int]]:
        """(chunk k, sender k % t) for every chunk that TP rank `receiver` of the receiving stage receives, in
        the order of its slots in the all-gather (slot m holds chunk receiver + m t')."""
        return [(k, s) for k, (s, r) in enumerate(chunk_route(self.senders, self.receivers)) if r == receiver]

    def span(self, chunk: int) -> tuple[int, int]:
        """Elements [start, stop) of the flattened tensor that chunk k holds (stop <= numel; the rest of the
        chunk is padding, possibly all of it)."""
        c = self.chunk_numel
        return min(chunk * c, self.numel), min((chunk + 1) * c, self.numel)

    def sent_numel(self, sender: int) -> int:
        """Elements (padding included) that `sender` puts on the wire: n / t chunks of c."""
        return len(self.sent_by(sender)) * self.chunk_numel
