"""Watch a cluster file for changes during an elastic run (`flashflex launch --elastic --cluster-watch FILE`).

A change is a new (device, inode, size, modification time) stamp of the file: an editor's rename, a fleet
manager's atomic rewrite and an in-place write all give one. Rewriting the same content counts too: after a
device was lost, writing the original file back is how an operator says "it is back". A file that does not
load (half written by a non-atomic writer, invalid) is reported once and read again at its next change.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ..errors import FlashflexError
from ..hardware.cluster import Cluster, load_cluster

Stamp = tuple[int, int, int, int] | None  # (st_dev, st_ino, st_size, st_mtime_ns); None: the file is absent


def file_stamp(path: str | os.PathLike[str]) -> Stamp:
    """What changes when the file is rewritten (None when it cannot be stat'ed)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class ClusterWatch:
    """Polls one cluster file; `poll()` returns the newly loaded cluster once per change."""

    def __init__(self, path: str | os.PathLike[str], warn: Callable[[str], None]) -> None:
        """Changes count from now: the file as it is at construction is the starting point."""
        self.path = Path(path)
        self.warn = warn
        self.stamp = file_stamp(self.path)

    def poll(self) -> Cluster | None:
        """The cluster the file describes when it changed since the last poll; None otherwise, or when the
        changed file does not load (then one warning line)."""
        stamp = file_stamp(self.path)
        if stamp == self.stamp or stamp is None:
            return None
        self.stamp = stamp
        try:
            return load_cluster(self.path)
        except FlashflexError as exc:
            self.warn(f"--cluster-watch {self.path} changed but does not load, ignored: {exc}")
            return None
