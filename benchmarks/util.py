"""Small helpers the benchmarks share."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_commit() -> str:
    """The short commit of the checkout the benchmark runs from ("unknown" outside git).

    ``ASYNCINFER_COMMIT`` wins: a copy of the tree on another machine (the device machine's)
    can carry a stale ``.git``.
    """
    if os.environ.get("ASYNCINFER_COMMIT"):
        return os.environ["ASYNCINFER_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=False, cwd=Path(__file__).parent)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"
