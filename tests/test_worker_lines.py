"""Lines on the stderr that the launcher and its workers share: each goes out in one write call, so that another
rank's line cannot land inside it when stderr is unbuffered (PYTHONUNBUFFERED, as many CI images set)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

import pytest

from flashflex_cli.semantics import worker_protocol


class CountingRaw(io.RawIOBase):
    """A raw stream that keeps every write call's bytes apart."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.calls.append(bytes(data))
        return len(data)


def unbuffered_stderr(raw: CountingRaw) -> io.TextIOWrapper:
    """The stderr `python -u` gives: a text layer writing through to the descriptor on every call."""
    return io.TextIOWrapper(raw, encoding="utf-8", line_buffering=True, write_through=True)  # type: ignore[arg-type]


def test_say_is_one_write_with_its_newline_on_an_unbuffered_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = CountingRaw()
    monkeypatch.setattr(sys, "stderr", unbuffered_stderr(raw))
    worker_protocol.say("flashflex worker: out of memory on rank 2 (pipeline 1, stage 0)")
    assert raw.calls == [b"flashflex worker: out of memory on rank 2 (pipeline 1, stage 0)\n"]


def test_print_on_the_same_stderr_splits_the_line_and_its_newline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why `say` exists: print's two write calls leave a gap for another process's line."""
    raw = CountingRaw()
    monkeypatch.setattr(sys, "stderr", unbuffered_stderr(raw))
    print("flashflex worker: out of memory", file=sys.stderr, flush=True)
    assert raw.calls == [b"flashflex worker: out of memory", b"\n"]


@pytest.mark.slow
def test_lines_of_two_unbuffered_processes_never_interleave() -> None:
    """Two processes writing 2,000 long lines each to one pipe under PYTHONUNBUFFERED=1: every line arrives whole."""
    child = textwrap.dedent("""
        import sys
        from flashflex_cli.semantics.worker_protocol import say
        tag = sys.argv[1]
        for i in range(2000):
            say(f"{tag} {i:04d} " + tag * 300)
    """)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    read_end, write_end = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", child, tag], stderr=write_end, env=env) for tag in "ab"]
    os.close(write_end)
    with os.fdopen(read_end, "r", encoding="utf-8") as merged:
        lines = merged.read().splitlines()
    assert [proc.wait(timeout=120) for proc in procs] == [0, 0]
    assert len(lines) == 4000
    for line in lines:
        tag = line[0]
        assert line == f"{tag} {line[2:6]} " + tag * 300, line[:80]
