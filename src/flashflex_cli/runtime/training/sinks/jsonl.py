"""The JSONL sink: `RUN/metrics.jsonl`, one JSON object per step, only ever appended to (always written: what
`show --run`, `calibrate`, the timeline and the next launch read)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class JsonlSink:
    """Appends each row to `path` as one JSON line, flushed at once (a crash loses no finished step)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, row: dict[str, Any]) -> None:
        """Append `row`."""
        self._handle.write(json.dumps(row) + "\n")
        self._handle.flush()

    def close(self) -> None:
        """Close the file."""
        self._handle.close()
