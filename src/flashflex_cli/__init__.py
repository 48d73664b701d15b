"""flashflex: plan and run asymmetric 3D-parallel LLM training on heterogeneous GPU fleets."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("flashflex")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"
