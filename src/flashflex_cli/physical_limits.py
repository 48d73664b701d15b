"""Physical limits of the numbers that cluster, layer-profile, cost-parameter and price files hold, in one place
(and the size limits of the counts that plan files and model shapes hold).

A value outside its limit cannot describe real hardware (a device with 1e40 bytes of memory, a link of
1e-300 B/s, a slowdown of 1e308 that makes every stage time infinite): it is refused by name where the file
is loaded. Each limit lies far outside any device or link sold today or expected within the next decade, and
keeps the cost model's arithmetic finite; the reason for each figure is written next to it.

`limited(LIMIT)` is the pydantic field type that applies a limit in a schema (so every loader of the schema
gets it); `Limit.check` applies one to a value from elsewhere (a --synthetic spec, a cost-parameter file).
Numbers must be JSON numbers: a string, a boolean or a huge integer is refused before any conversion.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

from .errors import InputError
from .units import byte_size
from .validate_numbers import MAX_DEVICES, MAX_GLOBAL_BATCH, MAX_SEED, MAX_SEQ_LEN

KIB, MIB, GIB, TIB, PIB = 2**10, 2**20, 2**30, 2**40, 2**50


@dataclass(frozen=True)
class Limit:
    """The range [low, high] of one kind of quantity, in SI `unit` ([low, high) with `below_high`); `zero_ok`
    also admits 0 (a quantity that may be absent, such as an embedding's measured backward time)."""

    unit: str
    low: float
    high: float
    zero_ok: bool = False
    integer: bool = False
    below_high: bool = False

    def problem(self, value: Any) -> str | None:
        """Why `value` is not a number within this limit, as 'must be ..., got VALUE'; None when it is one."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"must be a number, got {shown(value)}"
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {shown(value)}"
        if self.integer and isinstance(value, float) and not value.is_integer():
            return f"must be a whole number of {self.unit}, got {shown(value)}"
        if value == 0 and self.zero_ok:
            return None
        # an int compares with a float exactly, without converting (a huge int cannot overflow here)
        if not self.low <= value <= self.high or (self.below_high and value == self.high):
            return f"must be {self.range_text()}, got {shown(value)}"
        return None

    def range_text(self) -> str:
        """'in [LOW, HIGH] UNIT' (']' is ')' with below_high; '0 or in ...' where zero is allowed)."""
        unit = f" {self.unit}" if self.unit else ""
        if self.unit == "bytes":
            low, high, unit = byte_size(self.low), byte_size(self.high), ""
        else:
            low, high = (f"{int(x)}" if self.integer and x < 1e16 else f"{x:g}" for x in (self.low, self.high))
        return f"{'0 or ' if self.zero_ok else ''}in [{low}, {high}{')' if self.below_high else ']'}{unit}"

    def value(self, value: Any) -> float | int:
        """`value` as an int (integer limits) or float; -0.0 becomes 0.0. Call after `problem` said None."""
        return int(value) if self.integer else float(value) + 0.0

    def check(self, value: Any, what: str) -> float | int:
        """`value` within this limit, or InputError '{what} must be ..., got VALUE'."""
        problem = self.problem(value)
        if problem is not None:
            raise InputError(f"{what} {problem}")
        return self.value(value)


def shown(value: Any) -> str:
    """A value as an error message shows it: a number in short form (a huge integer by its digit count),
    anything else by repr, cut at 60 characters."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**16:
        digits = len(str(abs(value))) if abs(value) < 10**4000 else None  # str() of longer ints is refused
        return f"an integer of {digits} digits" if digits else "an integer of more than 4000 digits"
    if isinstance(value, float):
        return f"{value:g}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def limited(limit: Limit) -> Any:
    """A pydantic field type holding a number within `limit` (a custom error names the value)."""

    def validate(value: Any) -> float | int:
        problem = limit.problem(value)
        if problem is not None:
            raise PydanticCustomError("physical_limit", problem)
        return limit.value(value)

    return Annotated[int if limit.integer else float, BeforeValidator(validate)]


# ---- devices ------------------------------------------------------------------------------------------------
# Memory of one device: from 1 MiB (no accelerator of the last 30 years has less, and no transformer layer of a
# model worth planning fits in it) to 1 PiB (20x the largest single-system memory sold today, 48 TB; today's
# largest accelerator holds 288 GB).
DEVICE_MEMORY_BYTES = Limit("bytes", MIB, PIB, integer=True)
# Memory bandwidth of one device: from 1 MB/s (slower than a 1990s PC's DRAM) to 100 PB/s (5x the on-chip
# SRAM bandwidth of a wafer-scale engine, 21 PB/s; HBM3e GPUs reach 8 TB/s).
MEMORY_BANDWIDTH = Limit("B/s", 1e6, 1e17)
# Dense FLOP/s of one device in any dtype: from 1 MFLOP/s (a 1990 PC) to 1 EFLOP/s (an exa-scale figure: 8x a
# wafer-scale engine's 125 PFLOP/s, 200x a B200's dense fp8 4.5 PFLOP/s).
DEVICE_FLOPS = Limit("FLOP/s", 1e6, 1e18)
# Emulation slowdown: from 1 (the runtime can only slow a device down) to 10,000 (a 1 ms layer takes 10 s;
# `profile --slowdown` allows up to 1000, and no emulated run with slower devices finishes).
SLOWDOWN = Limit("", 1.0, 1e4)

# ---- links --------------------------------------------------------------------------------------------------
# Bandwidth of a link, one direction: from 1 kB/s (slower than a 1990s dial-up modem) to 100 TB/s (100x NVLink
# 5's 900 GB/s per direction per GPU).
LINK_BANDWIDTH = Limit("B/s", 1e3, 1e14)
# Latency of a link or message: from 1 ns (light crosses 30 cm; a NIC or PCIe round trip takes hundreds) to
# 600 s (NCCL's and gloo's default collective timeout: a message slower than that fails the job).
LATENCY_S = Limit("s", 1e-9, 600.0)

# ---- layer profiles ----------------------------------------------------------------------------------------
# Seconds of one part (layer, embedding, head) for one micro-batch: 0 to 1e6 s (11.6 days for one layer's pass
# over one micro-batch: no measurement runs that long). No positive lower bound: a part may be below a timer's
# resolution, `flashflex calibrate` derives parts as differences of measured times, and a tiny time cannot
# overflow the cost model's arithmetic (every stage also pays its transfers and optimizer step).
PART_SECONDS = Limit("s", 0.0, 1e6)
# Bytes a device holds for one purpose (activations, fixed runtime memory, a reserve): 0 to the largest device
# memory above.
HELD_BYTES = Limit("bytes", 0.0, DEVICE_MEMORY_BYTES.high)

# ---- cost parameters ---------------------------------------------------------------------------------------
# An achieved fraction of a peak (compute, link or memory efficiency): from 1e-4 (a layer at 0.01% of its
# device's peak is a broken measurement, and smaller fractions make stage times overflow) to 1.
EFFICIENCY = Limit("", 1e-4, 1.0)
# Bytes per tensor element sent or kept: 0 to 16 (no dtype is wider than complex128's 16 bytes).
BYTES_PER_ELEMENT = Limit("bytes", 0.0, 16.0)
# Bytes per parameter of optimizer state or optimizer traffic: 0 to 1024 (Adam in fp64 with fp64 master
# weights moves 64; 1 KiB is 16x that).
BYTES_PER_PARAMETER = Limit("bytes", 0.0, 1024.0)
# A multiplier or pass count (loss passes, activation factor, DP buffer copies): 0 to 1000 (three orders above
# any measured figure, 1-4).
FACTOR = Limit("", 0.0, 1000.0)
# A layer's fixed time per micro-batch, in reads of its weights from device memory: 0 to 10,000 (the fitted
# reference figures lie within 70 of 0).
INTERCEPT = Limit("weight reads", 0.0, 1e4)
# A share of something (of memory the allocator cannot hand out, of a reduction hidden): 0 up to, not
# including, 1 (all of it).
SHARE = Limit("", 0.0, 1.0, below_high=True)
# per-operation host and device costs: at least a nanosecond, at most a second (no dispatch or kernel launch
# takes longer than that on any machine)
OP_SECONDS = Limit("s", 1e-9, 1.0)

# ---- prices -------------------------------------------------------------------------------------------------
# Price of one device-hour: from 1e-6 (a millionth of a currency unit: below any rental price, and a free
# device is not priced) to 1e6 (far above any real device; refuses typos such as a price in cents x 1e6).
PER_DEVICE_HOUR = Limit("per device-hour", 1e-6, 1e6)

# ---- sizes of runs and models ------------------------------------------------------------------------------
# Not physical quantities, but counts a file may hold (a plan, a layer profile, a model shape): each limit is
# far above any real run or model and keeps every product of them a finite float (validate_numbers.py holds
# the same limits for the command-line options).
SEQUENCES = Limit("sequences", 1, MAX_GLOBAL_BATCH, integer=True)  # a batch, micro-batch or micro-batch count
# inner steps an outer exchange overlaps (0: none); as many as a round of inner steps can hold
OVERLAP_STEPS = Limit("inner steps", 0, MAX_GLOBAL_BATCH, integer=True)
SEQ_LEN = Limit("tokens", 1, MAX_SEQ_LEN, integer=True)
# Micro-batches one pipeline accumulates into one optimizer step: 65,536. The runtime adds each micro-batch's
# gradients into fp32 gradients, one addition after another; the worst-case relative rounding error of such a sum
# of n terms is about n x 2**-24 (fp32's unit roundoff): 0.4% at 2**16 terms, 6% at 2**20, and from 2**24 on a
# term of the size of the sum so far no longer changes it. The 1F1B schedule (cost/schedule.py, runtime/parallel/pipeline.py)
# steps through every micro-batch, so a larger count is refused where the plan is read, before anything runs it.
MICRO_BATCHES = Limit("micro-batches", 1, 2**16, integer=True)
TP_DEGREE = Limit("devices", 1, MAX_DEVICES, integer=True)
SEED = Limit("", 0, MAX_SEED, integer=True)
# A model's width (hidden, MLP, head size): 4Mi, 80x the widest published MLP (Llama 3.1 405B's 53,248).
MODEL_WIDTH = Limit("", 1, 2**22, integer=True)
# Layers and attention heads: 16Ki, 130x the deepest published Llama (405B: 126 layers, 128 heads).
MODEL_DEPTH = Limit("", 1, 2**14, integer=True)
LAYER_INDEX = Limit("", 0, MODEL_DEPTH.high, integer=True)  # a layer boundary, 0 .. num_layers
# Vocabulary: 16Mi entries, 64x the largest published vocabulary (256k).
VOCAB = Limit("tokens", 1, 2**24, integer=True)
# Positions a model attends over (context length, sliding window): 2Gi tokens, 200x the longest published
# context (10M tokens).
POSITIONS = Limit("tokens", 1, 2**31, integer=True)
# Rotary base wavelength: 1 (no rotation) to 1e12 (published models use 1e4 to 1e7).
ROPE_THETA = Limit("", 1.0, 1e12)
# RMSNorm epsilon: 1e-30 to 1 (published models use 1e-6 to 1e-5; above 1 it swamps a normalised activation).
NORM_EPS = Limit("", 1e-30, 1.0)
# A rotary-scaling ratio (factor, low/high frequency factor): 1e-6 to 1e6 (Llama 3.1 uses 1 to 8).
RATIO = Limit("", 1e-6, 1e6)
