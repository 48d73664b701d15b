"""`flashflex data prepare`: documents from many files -> one token file, tokenized and written as a stream.

Documents (data/readers.py) are separated by the tokenizer's end-of-text token (a Hugging Face tokenizer's
eos token from tokenizer_config.json beside it, else a well-known one such as <|endoftext|>, or --eot); the
byte-level tokenizer, which has none, separates them by a newline byte as before. Tokens go to the output
in chunks, so memory stays near one chunk whatever the data size; the file is written atomically (temp file,
header patched at the end, rename), and `append` extends an existing token file of the same vocabulary.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from ..fileio import atomic_open, read_json
from .readers import expand_inputs, read_documents
from .token_file import BYTE_VOCAB, HEADER_BYTES, TokenFile, header_bytes, token_dtype

NEWLINE = 10  # the byte-level tokenizer's document separator
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
ENCODE_BATCH = 256  # documents per tokenizer call
FLUSH_TOKENS = 1 << 20  # tokens buffered before a write
COPY_TOKENS = 1 << 22  # tokens per chunk when copying an existing file for append


@dataclass(frozen=True)
class PrepareSummary:
    """What a prepare wrote: tokens in the file (appended ones included), new tokens, vocabulary size,
    documents, input files, and the separator token id (None: none)."""

    tokens: int
    added: int
    vocab_size: int
    documents: int
    files: int
    separator: int | None


class _Encoder:
    """A tokenizer: `encode(texts) -> list of id lists`, `vocab_size`, `separator` (id or None)."""

    def __init__(self, tokenizer: str | os.PathLike[str] | None, eot: str | None) -> None:
        self._hf: Any = None
        if tokenizer is None:
            if eot is not None:
                raise InputError("--eot needs --tokenizer (the byte-level tokenizer separates by a newline)")
            self.vocab_size, self.separator = BYTE_VOCAB, NEWLINE
            return
        from tokenizers import Tokenizer

        if not os.path.isfile(tokenizer):
            raise InputError(f"{tokenizer}: no such tokenizer file")
        try:
            self._hf = Tokenizer.from_file(str(tokenizer))
        except Exception as exc:  # the tokenizers package raises plain Exceptions
            raise InputError(f"{tokenizer}: cannot load tokenizer: {str(exc).splitlines()[0]}") from None
        self.vocab_size = int(self._hf.get_vocab_size(with_added_tokens=True))
        self.separator = self._end_of_text(Path(tokenizer), eot)

    def _end_of_text(self, path: Path, eot: str | None) -> int | None:
        if eot is not None:
            found = self._hf.token_to_id(eot)
            if found is None:
                raise InputError(f"--eot {eot!r} is not a token of {path}")
            return int(found)
        config = path.with_name("tokenizer_config.json")
        if config.is_file():
            data = read_json(config)
            token = data.get("eos_token") if isinstance(data, dict) else None
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str) and self._hf.token_to_id(token) is not None:
                return int(self._hf.token_to_id(token))
        for token in EOT_CANDIDATES:
            if self._hf.token_to_id(token) is not None:
                return int(self._hf.token_to_id(token))
        return None

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self._hf is None:
            return [list(text.encode("utf-8")) for text in texts]
        return [item.ids for item in self._hf.encode_batch(texts)]


def _batches(files: Sequence[Path], field: str, column: str,
             advance: Callable[[int], None]) -> Iterator[list[str]]:
    """Documents of every file in order, ENCODE_BATCH at a time; `advance(bytes)` after each batch."""
    batch: list[str] = []
    consumed = 0
    for path in files:
        for text, size in read_documents(path, field, column):
            batch.append(text)
            consumed += size
            if len(batch) == ENCODE_BATCH:
                yield batch
                advance(consumed)
                batch, consumed = [], 0
    if batch:
        yield batch
    advance(consumed)


def _copy_existing(handle: Any, path: Path, vocab_size: int) -> int:
    """Copy the tokens of token file `path` (same vocabulary required) to `handle`; returns their count."""
    old = TokenFile(path)
    if old.vocab_size != vocab_size:
        raise InputError(f"--append {path}: the file has vocabulary {old.vocab_size}, this tokenizer "
                         f"{vocab_size}; append with the tokenizer that made it")
    for start in range(0, len(old), COPY_TOKENS):
        handle.write(old.read(start, min(COPY_TOKENS, len(old) - start)).tobytes())
    return len(old)


def prepare_files(inputs: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str],
                  tokenizer: str | os.PathLike[str] | None = None, field: str = "text", column: str = "text",
                  append: bool = False, eot: str | None = None,
                  progress: Callable[[int, int], None] | None = None) -> PrepareSummary:
    """Tokenize `inputs` (files or glob patterns) into token file `out`; `append`: after its existing tokens.

    progress(done_bytes, total_bytes) is called as input bytes are consumed (total: the input files' sizes).
    """
    files = expand_inputs(inputs)
    encoder = _Encoder(tokenizer, eot)
    dtype = token_dtype(encoder.vocab_size)
    total = sum(path.stat().st_size for path in files)
    done = 0

    def advance(size: int) -> None:
        nonlocal done
        done += size
        if progress is not None:
            progress(min(done, total), total)

    target = Path(out)
    existing = append and target.is_file()
    documents = added = 0
    with atomic_open(target, binary=True) as handle:
        handle.write(header_bytes(dtype.itemsize, encoder.vocab_size, 0))
        base = _copy_existing(handle, target, encoder.vocab_size) if existing else 0
        buffer: list[int] = []
        for batch in _batches(files, field, column, advance):
            for ids in encoder.encode(batch):
                if (base or documents) and encoder.separator is not None:
                    buffer.append(encoder.separator)
                buffer.extend(ids)
                documents += 1
            if len(buffer) >= FLUSH_TOKENS:
                added += _flush(handle, buffer, dtype, encoder.vocab_size)
        added += _flush(handle, buffer, dtype, encoder.vocab_size)
        if base + added < 2:
            raise InputError("the inputs hold fewer than two tokens")
        handle.seek(0)
        handle.write(header_bytes(dtype.itemsize, encoder.vocab_size, base + added))
        handle.seek(HEADER_BYTES + (base + added) * dtype.itemsize)
    return PrepareSummary(base + added, added, encoder.vocab_size, documents, len(files), encoder.separator)


def _flush(handle: Any, buffer: list[int], dtype: np.dtype, vocab_size: int) -> int:
    """Write and clear `buffer`; ids must lie below `vocab_size`. Returns the count written."""
    if not buffer:
        return 0
    ids = np.asarray(buffer, dtype=np.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise InputError(f"the tokenizer produced ids outside [0, {vocab_size})")
    handle.write(ids.astype(dtype).tobytes())
    buffer.clear()
    return int(ids.size)
