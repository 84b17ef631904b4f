"""The examples run and show what they claim."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))


def test_scheduling_trace_matches_the_chapter(smollm2_dir: Path) -> None:
    from scheduling_trace import run_trace

    rounds, same = run_trace(verbose=False)
    assert [(phase, size) for phase, size, _ in rounds] == [
        ("prefill", 5), ("decode", 4), ("decode", 3), ("decode", 3), ("decode", 2),
        ("decode", 1)]
    assert all(same)
