"""Where asyncinfer keeps what it fetches or converts once: `ASYNCINFER_CACHE`, else XDG."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The root of asyncinfer's cache, created on first use."""
    root = os.environ.get("ASYNCINFER_CACHE")
    if root:
        path = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
        path = Path(xdg) / "asyncinfer"
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_dir() -> Path:
    path = cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path
