"""Run a check script under Triton's interpreter, in a process of its own (the variable must
be set before triton loads): the CUDA kernels' logic on CPU tensors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_interpreted(script: str, what: str) -> str:
    """``script``'s stdout once it exits 0 under ``TRITON_INTERPRET=1``; the test is skipped
    where triton is not installed (``what`` names the kernel in the reason)."""
    pytest.importorskip("triton", reason=f"triton is not installed: {what} cannot run "
                                          f"under TRITON_INTERPRET=1")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, timeout=600,
                          capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
