"""The flashflex token file: a 64-byte header and the token ids, memory-mapped for scans and read with pread
while training (runtime/training/data.py's TokenFileSource).

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
from pathlib import Path

import numpy as np

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


def vocabulary_advice(data_vocab: int) -> str:
    """What to do when a token file's ids do not fit the model's vocabulary: the end of a one-line error."""
    return ("prepare the data with the model's tokenizer, or plan a model whose vocabulary holds the data's "
            f"({data_vocab:,} ids): a config.json with \"vocab_size\": {data_vocab} as --model (docs/models.md; the "
            "small presets have 256)")


def token_file_vocab(path: str | os.PathLike[str]) -> int | None:
    """The vocab_size a token file's header records (BYTE_VOCAB for byte-level data); None when `path` is no
    readable token file."""
    try:
        return _read_header(Path(path))[1]
    except InputError:
        return None


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
