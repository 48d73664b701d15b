"""A cluster file as a command reads it: loaded and validated (hardware/cluster.py), and a warning on stderr for
each device type whose figures are the file's own (a type the catalog does not know)."""

from __future__ import annotations

import os

from ..hardware.cluster import Cluster, file_figures_warnings, load_cluster
from .consoles import diagnostics


def load_cluster_warned(path: str | os.PathLike[str]) -> Cluster:
    """Load the cluster file at `path`; print one warning line per device type with figures from the file alone."""
    cluster = load_cluster(path)
    console = diagnostics()
    for line in file_figures_warnings(cluster, path):
        console.print(f"[yellow]warning[/yellow]: {line}", soft_wrap=True, markup=True, highlight=False)
    return cluster
