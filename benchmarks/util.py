"""Small helpers the benchmarks share."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any


def git_commit() -> str:
    """The short commit of the checkout the benchmark runs from ("unknown" outside git).

    ``ASYNCINFER_COMMIT`` wins: a copy of the tree on another machine can carry a stale
    ``.git``.
    """
    if os.environ.get("ASYNCINFER_COMMIT"):
        return os.environ["ASYNCINFER_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=False, cwd=Path(__file__).parent)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def write_report(path: str | None, report: Any) -> None:
    """Write ``report`` as indented JSON to ``path`` (its folder made), if a path is given."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
