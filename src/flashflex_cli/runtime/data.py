"""Training data: token files (memory-mapped; training reads with pread) and a deterministic synthetic source.

Both answer `global_batch(step) -> int64 [global_batch, seq_len + 1]`, a function of the step, the seed
and the data only, never of the plan: runs under different plans see the same global batch at step k and
can be compared loss for loss. Each pipeline takes its own rows (`pipeline_rows`); `rows(step, rows)` gives
exactly `global_batch(step)[rows]` while reading and building only those rows (first and last stages call it;
middle stages read no tokens).

Token file layout (little-endian): a 64-byte header, then `num_tokens` tokens of `dtype`.

    offset  size  field
    0       8     magic b"FLXTOKEN"
    8       4     version (uint32) = 1
    12      4     bytes per token (uint32): 2 (uint16) or 4 (uint32)
    16      8     vocab_size (uint64)
    24      8     num_tokens (uint64)
    32      32    zero padding
"""

from __future__ import annotations

import os
import struct
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from ..errors import InputError
from ..fileio import atomic_open

MAGIC = b"FLXTOKEN"
VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sIIQQ")
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
BYTE_VOCAB = 256
MAX_VOCAB = 2**32  # ids must fit uint32
SCAN_CHUNK = 1 << 24  # tokens per step of a vocabulary scan (32-64 MiB of the memory map)
SYNTHETIC = "synthetic"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest token dtype that holds ids below `vocab_size`."""
    return _DTYPES[2] if vocab_size <= 2**16 else _DTYPES[4]


def header_bytes(itemsize: int, vocab_size: int, num_tokens: int) -> bytes:
    """The 64-byte header of a token file of `num_tokens` tokens of `itemsize` bytes (streaming writers)."""
    return _HEADER.pack(MAGIC, VERSION, itemsize, vocab_size, num_tokens).ljust(HEADER_BYTES, b"\0")


def write_token_file(path: str | os.PathLike[str], tokens: np.ndarray, vocab_size: int) -> Path:
    """Write `tokens` (1-D ids < vocab_size) as a token file, atomically (temp file, then rename)."""
    target = Path(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise InputError("tokens must be one-dimensional")
    if not 1 <= vocab_size <= MAX_VOCAB:
        raise InputError(f"vocab_size must lie in [1, {MAX_VOCAB}], got {vocab_size}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise InputError(f"token ids must lie in [0, {vocab_size})")
    dtype = token_dtype(vocab_size)
    header = _HEADER.pack(MAGIC, VERSION, dtype.itemsize, vocab_size, tokens.size).ljust(HEADER_BYTES, b"\0")
    with atomic_open(target, binary=True) as handle:
        handle.write(header)
        handle.write(tokens.astype(dtype).tobytes())
    return target


def _read_header(path: Path) -> tuple[int, int, int]:
    """(bytes per token, vocab_size, num_tokens) of a token file, every field checked."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(HEADER_BYTES)
        size = path.stat().st_size
    except OSError as exc:
        raise InputError(f"{path}: cannot read token file: {exc.strerror or exc}") from None
    if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
        raise InputError(f"{path}: not a flashflex token file (bad magic); make one with "
                         "`flashflex data prepare`")
    _, version, itemsize, vocab, count = _HEADER.unpack(raw[: _HEADER.size])
    if version != VERSION:
        raise InputError(f"{path}: token file version {version}, this flashflex reads {VERSION}")
    if itemsize not in _DTYPES:
        raise InputError(f"{path}: unsupported token width {itemsize} bytes")
    if not 1 <= vocab <= MAX_VOCAB:
        raise InputError(f"{path}: header vocab_size {vocab} outside [1, {MAX_VOCAB}]")
    expected = HEADER_BYTES + itemsize * count
    if size != expected:
        raise InputError(f"{path}: truncated or padded: {size} bytes, header says {expected}")
    return itemsize, int(vocab), int(count)


class TokenFile:
    """A memory-mapped token file: `.tokens` (numpy view), `.vocab_size`, `len()` tokens; `read` for training.

    A file truncated while it is mapped kills a process touching the lost pages with SIGBUS, naming nothing;
    `read` uses pread on a descriptor opened once, so a shrunken file is one InputError naming it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not os.path.isfile(self.path):
            raise InputError(f"{self.path}: no such token file")
        itemsize, self.vocab_size, count = _read_header(self.path)
        self.tokens: np.ndarray = (np.memmap(self.path, dtype=_DTYPES[itemsize], mode="r", offset=HEADER_BYTES,
                                             shape=(count,)) if count else np.zeros(0, _DTYPES[itemsize]))
        self._fd: int | None = None

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count), read from the file itself (not the memory map)."""
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise InputError(f"token file {self.path} changed while training: {exc.strerror or exc}") from None
            weakref.finalize(self, os.close, self._fd)
        dtype = self.tokens.dtype
        want = count * dtype.itemsize
        try:
            raw = os.pread(self._fd, want, HEADER_BYTES + start * dtype.itemsize)
        except OSError as exc:
            raise InputError(f"token file {self.path}: read error while training: {exc.strerror or exc}") from None
        if len(raw) != want:
            raise InputError(f"token file {self.path} changed while training (truncated?): {len(raw)} of {want} "
                             f"bytes at token {start}")
        return np.frombuffer(raw, dtype=dtype)

    def max_token(self, chunk: int = SCAN_CHUNK) -> int:
        """The largest token id in the file (-1 when empty), scanned chunk by chunk over the memory map."""
        largest = -1
        for start in range(0, len(self), chunk):
            largest = max(largest, int(self.tokens[start : start + chunk].max()))
        return largest

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


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
        self.windows = (len(self.file) - 1) // seq_len
        if self.windows < 1:
            raise InputError(f"{self.file.path}: {len(self.file)} tokens, fewer than one sequence of "
                             f"{seq_len + 1}")
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
    if source.vocab_size > vocab_size:
        raise InputError(f"{data}: token vocabulary {source.vocab_size} exceeds the model's vocab_size "
                         f"{vocab_size}")
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


# ---- tokenizers ---------------------------------------------------------------------------------------


def encode_bytes(texts: Iterable[str]) -> np.ndarray:
    """Byte-level tokenizer: the UTF-8 bytes of each text (vocab 256), texts joined by a newline."""
    data = b"\n".join(text.encode("utf-8") for text in texts)
    return np.frombuffer(data, dtype=np.uint8).astype(np.int64)


def encode_hf(texts: Iterable[str], tokenizer_path: str | os.PathLike[str]) -> tuple[np.ndarray, int]:
    """Encode with a Hugging Face `tokenizer.json` (the `tokenizers` package); returns (ids, vocab size)."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    except Exception as exc:  # the tokenizers package raises plain Exceptions
        raise InputError(f"{tokenizer_path}: cannot load tokenizer: {str(exc).splitlines()[0]}") from None
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text).ids)
    return np.asarray(ids, dtype=np.int64), tokenizer.get_vocab_size(with_added_tokens=True)


def prepare(text_files: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str],
            tokenizer: str | os.PathLike[str] | None = None) -> tuple[int, int]:
    """Tokenize text files into one token file; returns (tokens written, vocab size)."""
    if not text_files:
        raise InputError("no text files given")
    texts = []
    for name in text_files:
        path = Path(name)
        if not os.path.isfile(path):
            raise InputError(f"{path}: no such file")
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise InputError(f"{path}: not a UTF-8 text file") from None
        except OSError as exc:
            raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if tokenizer is None:
        ids, vocab = encode_bytes(texts), BYTE_VOCAB
    else:
        if not os.path.isfile(tokenizer):
            raise InputError(f"{tokenizer}: no such tokenizer file")
        ids, vocab = encode_hf(texts, tokenizer)
    if ids.size < 2:
        raise InputError("the text files hold fewer than two tokens")
    write_token_file(out, ids, vocab)
    return int(ids.size), vocab
