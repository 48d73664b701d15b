"""Range checks for numbers from options and files, in one place: each returns the value or raises
InputError with one line naming the option (or field), the allowed range and the value given.

The limits keep memory and arithmetic sane (a seed numpy accepts, a TCP port, batch sizes whose token
tensors fit in memory); they are far above any real run.
"""

from __future__ import annotations

import math

from .errors import InputError

MAX_SEED = 2**32 - 1
MAX_PORT = 65535
MAX_GLOBAL_BATCH = 2**24
MAX_SEQ_LEN = 2**24
MAX_NODES = 65536
MAX_DEVICES_PER_NODE = 1024
MAX_DEVICES = 2**17  # in one cluster
MAX_TIMEOUT_S = 10**6
MAX_STEPS = 10**9


def finite(value: float | str, what: str) -> float:
    """`value` (a number or its text) as a float, refused when it is NaN or infinite."""
    number = float(value)
    if not math.isfinite(number):
        raise InputError(f"{what} must be a finite number, got {value!r}")
    return number


def positive(value: float | str, what: str, maximum: float | None = None) -> float:
    """A finite number > 0 (and <= maximum when given)."""
    number = finite(value, what)
    if number <= 0:
        raise InputError(f"{what} must be positive, got {value!r}")
    if maximum is not None and number > maximum:
        raise InputError(f"{what} must be at most {maximum:g}, got {value!r}")
    return number


def non_negative(value: float | str, what: str) -> float:
    """A finite number >= 0."""
    number = finite(value, what)
    if number < 0:
        raise InputError(f"{what} must be 0 or more, got {value!r}")
    return number


def int_in_range(value: int, what: str, low: int, high: int) -> int:
    """An integer in [low, high]; bools and floats with a fraction are refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{what} must be an integer in [{low}, {high}], got {value!r}")
    if not low <= value <= high:
        raise InputError(f"{what} must be an integer in [{low}, {high}], got {value}")
    return value


def int_text_in_range(text: str, what: str, low: int, high: int) -> int:
    """A decimal integer string in [low, high]; thousands of digits are refused without converting them."""
    digits = text.strip()
    if not digits.isdecimal():
        raise InputError(f"{what} must be an integer in [{low}, {high}], got {text!r}")
    if len(digits.lstrip("0")) > len(str(high)):
        raise InputError(f"{what} must be an integer in [{low}, {high}], got {digits[:20]}{'...' if len(digits) > 20 else ''}")
    return int_in_range(int(digits), what, low, high)


def gpu_list(text: str, what: str = "--gpus") -> tuple[int, ...]:
    """A comma-separated list of distinct CUDA device indices as this host numbers them ("2,3")."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() for part in parts):
        raise InputError(f"{what} must be comma-separated GPU indices like 0,2, got {text!r}")
    values = tuple(int(part) for part in parts)
    if len(set(values)) != len(values):
        raise InputError(f"{what} names a GPU twice: {text!r}")
    if max(values) >= MAX_DEVICES_PER_NODE:
        raise InputError(f"{what} {max(values)} is not a GPU index below {MAX_DEVICES_PER_NODE}")
    return values


def seed(value: int, what: str = "--seed") -> int:
    """A random seed: 0 .. 2**32 - 1."""
    return int_in_range(value, what, 0, MAX_SEED)


def port(value: int, what: str = "--port") -> int:
    """A TCP port: 1 .. 65535."""
    return int_in_range(value, what, 1, MAX_PORT)


def timeout_s(value: float, what: str = "--timeout") -> float:
    """A timeout in seconds: finite, > 0, at most MAX_TIMEOUT_S."""
    return positive(value, what, MAX_TIMEOUT_S)


def learning_rate(value: float, what: str = "--lr") -> float:
    """A learning rate: finite and > 0."""
    return positive(value, what)


def steps(value: int, what: str = "--steps") -> int:
    """A step count: 1 .. MAX_STEPS."""
    return int_in_range(value, what, 1, MAX_STEPS)


def batch_shape(global_batch: int, seq_len: int, micro_batch: int) -> tuple[int, int, int]:
    """--global-batch, --seq-len and --micro-batch within bounds that keep a batch's tensors in memory."""
    return (int_in_range(global_batch, "--global-batch", 1, MAX_GLOBAL_BATCH),
            int_in_range(seq_len, "--seq-len", 1, MAX_SEQ_LEN),
            int_in_range(micro_batch, "--micro-batch", 1, MAX_GLOBAL_BATCH))


def cluster_shape(nodes: str, devices_per_node: str, what: str) -> tuple[int, int]:
    """A node count and devices per node (decimal text) within MAX_NODES and MAX_DEVICES_PER_NODE."""
    return (int_text_in_range(nodes, f"{what}: node count", 1, MAX_NODES),
            int_text_in_range(devices_per_node, f"{what}: devices per node", 1, MAX_DEVICES_PER_NODE))
