"""One exception family; the CLI turns each into a one-line message and an exit code.

Exit codes (ARCHITECTURE.md): 0 success, 1 a check the user asked for failed, 2 bad input.
"""

from __future__ import annotations


class FlashflexError(Exception):
    """Base of every error the CLI reports as one line instead of a traceback."""

    exit_code: int = 2


class InputError(FlashflexError):
    """Unreadable, malformed or invalid input: a file, a spec, an option."""

    exit_code = 2


class InfeasibleError(FlashflexError):
    """A well-formed request that cannot be satisfied (the model does not fit, a batch cannot divide)."""

    exit_code = 2


class CheckFailed(FlashflexError):
    """A check the user asked for failed (a plan regression, a plan that does not match a machine)."""

    exit_code = 1


class RuntimeFailure(FlashflexError):
    """A distributed job failed (a rank died, a timeout)."""

    exit_code = 1
