"""What training data must satisfy for a model and sequence length, checked without torch: by `flashflex launch`
before any worker starts (launch/preflight.py) and by each worker as it opens its data (runtime/training/data.py).

`data` is "synthetic" (seeded random tokens, always valid) or the path of a token file (data/token_file.py)."""

from __future__ import annotations

from ..errors import InputError
from .token_file import TokenFile, vocabulary_advice

SYNTHETIC = "synthetic"


def check_vocabulary(file: TokenFile, vocab_size: int) -> None:
    """The file's declared vocabulary fits the model's `vocab_size` (InputError naming both)."""
    if file.vocab_size > vocab_size:
        raise InputError(f"{file.path}: token vocabulary {file.vocab_size} exceeds the model's vocab_size "
                         f"{vocab_size}; {vocabulary_advice(file.vocab_size)}")


def sequence_windows(file: TokenFile, seq_len: int) -> int:
    """How many windows of `seq_len` inputs (plus the shifted target) the file holds; InputError when none."""
    windows = (len(file) - 1) // seq_len
    if windows < 1:
        raise InputError(f"{file.path}: {len(file)} tokens, fewer than one sequence of {seq_len + 1}")
    return windows


def check_training_data(data: str, vocab_size: int, seq_len: int) -> None:
    """`data` can train a model of `vocab_size` at `seq_len`: declared vocabulary, length, and every token id
    below `vocab_size` (a chunked scan of the memory map)."""
    if data == SYNTHETIC:
        return
    file = TokenFile(data)
    check_vocabulary(file, vocab_size)
    sequence_windows(file, seq_len)
    largest = file.max_token()
    if largest >= vocab_size:
        raise InputError(f"{file.path}: largest token id {largest} is not below the model's vocab_size "
                         f"{vocab_size}; {vocabulary_advice(file.vocab_size)}")
