"""A rank's memory counters: the peak and current bytes of its device (the CUDA caching allocator's counters on a
GPU; on an emulated CPU device this process's resident set from /proc/self/status), and the reset of the peak
before the first step, so a step's peak excludes what initialisation held (bytes throughout)."""

from __future__ import annotations


def rank_memory_bytes(device_type: str) -> int:
    """Peak memory of this process: CUDA max allocated on GPUs, max resident set size on CPU (bytes)."""
    if device_type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def held_memory_bytes(device_type: str) -> int:
    """Memory this process holds now: CUDA allocated on GPUs, resident set size on CPU (bytes); and the peak
    counter is reset (CUDA peak stats; Linux VmHWM through /proc/self/clear_refs), so that `peak_since_reset`
    sees only what comes after. Taken before the first step: the baseline of `memory_growth_bytes`."""
    if device_type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()
        return int(torch.cuda.memory_allocated())
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # resets the peak resident set size (Linux >= 4.0)
    except OSError:
        pass  # then the peak includes initialisation: an overstatement, never an understatement
    return _status_bytes("VmRSS")


def peak_since_reset(device_type: str) -> int:
    """Peak memory since `held_memory_bytes` reset the counter (bytes)."""
    if device_type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    return _status_bytes("VmHWM")


def resident_bytes() -> int:
    """Resident set size of this process now (bytes; 0 where unavailable)."""
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int:
    """A kB field of /proc/self/status in bytes (0 where unavailable)."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
