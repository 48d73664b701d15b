"""Training data: token files (memory-mapped; training reads with pread) and a deterministic synthetic source.

Both answer `global_batch(step) -> int64 [global_batch, seq_len + 1]`, a function of the step, the seed
and the data only, never of the plan: runs under different plans see the same global batch at step k and
can be compared loss for loss. Each pipeline takes its own rows (`pipeline_rows`); `rows(step, rows)` gives
exactly `global_batch(step)[rows]` while reading and building only those rows (first and last stages call it;
middle stages read no tokens).

Token files: data/token_file.py (the format), `flashflex data prepare` (data/prepare.py) writes them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from ...data.checks import SYNTHETIC, check_vocabulary, sequence_windows
from ...data.token_file import TokenFile


class BatchSource:
    """The global batch of every step: int64 [global_batch, seq_len + 1] (inputs and shifted targets)."""

    vocab_size: int

    global_batch_size: int
    seq_len: int

    def rows(self, step: int, rows: slice) -> torch.Tensor:  # pragma: no cover - interface
        """`global_batch(step)[rows]` (rows: a slice with step 1), int64 [len, seq_len + 1], built alone."""
        raise NotImplementedError

    def global_batch(self, step: int) -> torch.Tensor:
        """Rows of step `step`: int64 [global_batch, seq_len + 1]."""
        return self.rows(step, slice(0, self.global_batch_size))

    def describe(self) -> str:  # pragma: no cover - interface
        raise NotImplementedError


class TokenFileSource(BatchSource):
    """Windows of seq_len + 1 tokens from a token file, visited in a seeded permutation per epoch.

    Window w covers tokens [w * seq_len, w * seq_len + seq_len + 1); sample j of the run is window
    perm_e[j mod W] of epoch e = j div W, where W is the number of windows and perm_e depends only on
    (seed, e). Sample j belongs to step j div global_batch.
    """

    def __init__(self, path: str | os.PathLike[str], global_batch: int, seq_len: int, seed: int = 0) -> None:
        self.file = TokenFile(path)
        self.vocab_size = self.file.vocab_size
        self.global_batch_size = global_batch
        self.seq_len = seq_len
        self.seed = seed
        self.windows = sequence_windows(self.file, seq_len)
        self._perm_cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            rng = np.random.default_rng([self.seed, epoch, 0x70CE])
            self._perm_cache = {epoch: rng.permutation(self.windows)}
        return self._perm_cache[epoch]

    def rows(self, step: int, rows: slice) -> torch.Tensor:
        """Rows `rows` of step `step`: int64 [len, seq_len + 1]; reads only their windows."""
        picked = range(self.global_batch_size)[rows]
        out = np.empty((len(picked), self.seq_len + 1), dtype=np.int64)
        for row, i in enumerate(picked):
            j = step * self.global_batch_size + i
            window = int(self._perm(j // self.windows)[j % self.windows])
            start = window * self.seq_len
            out[row] = self.file.read(start, self.seq_len + 1)
        return torch.from_numpy(out)

    def describe(self) -> str:
        return f"{self.file.path} ({len(self.file):,} tokens, vocab {self.vocab_size})"


class SyntheticSource(BatchSource):
    """Deterministic learnable sequences: row r of step k is x_t = (a + d * t) mod vocab, with (a, d)
    drawn from a generator seeded by (seed, k) and d in [1, 8]; a model can learn to continue them."""

    def __init__(self, vocab_size: int, global_batch: int, seq_len: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.global_batch_size = global_batch
        self.seq_len = seq_len
        self.seed = seed

    def rows(self, step: int, rows: slice) -> torch.Tensor:
        """Rows `rows` of step `step`: int64 [len, seq_len + 1]. Every row's (a, d) is drawn (2 numbers a row, the
        same generator stream as the whole batch), only the chosen rows' tokens are built."""
        rng = np.random.default_rng([self.seed, step, 0x5EED])
        start = rng.integers(0, self.vocab_size, size=(self.global_batch_size, 1))[rows]
        stride = rng.integers(1, 9, size=(self.global_batch_size, 1))[rows]
        t = np.arange(self.seq_len + 1)[None, :]
        return torch.from_numpy(((start + stride * t) % self.vocab_size).astype(np.int64))

    def describe(self) -> str:
        return f"synthetic (seed {self.seed}, vocab {self.vocab_size})"


def open_source(data: str, vocab_size: int, global_batch: int, seq_len: int, seed: int = 0) -> BatchSource:
    """`data` is "synthetic" or a token file path; a token file's vocabulary must fit the model's."""
    if data == SYNTHETIC:
        return SyntheticSource(vocab_size, global_batch, seq_len, seed)
    source = TokenFileSource(data, global_batch, seq_len, seed)
    check_vocabulary(source.file, vocab_size)
    return source


def pipeline_rows(sequences: Sequence[int], pipeline: int) -> slice:
    """Rows of the global batch for `pipeline`, given every pipeline's sequence count, in plan order."""
    start = sum(sequences[:pipeline])
    return slice(start, start + sequences[pipeline])


def stage_tokens(source: BatchSource, step: int, rows: slice, reads: bool) -> torch.Tensor:
    """What a stage passes to train_step at `step`: int64 [rows, seq_len + 1]. A stage that `reads` (the first
    stage takes the inputs, the last the targets) gets its pipeline's rows; a middle stage reads nothing and
    gets zeros of the same shape (train_step only slices them; its activations come from the stage before)."""
    if reads:
        return source.rows(step, rows)
    count = len(range(source.global_batch_size)[rows])
    return torch.zeros((count, source.seq_len + 1), dtype=torch.int64)
