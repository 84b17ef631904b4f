"""The house rules of docs/architecture.md that a test can hold: the torch-free leaves, the
layers contract, and no measuring switch read from the environment."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "asyncinfer"
ALLOWED_VARIABLES = {"ASYNCINFER_CACHE", "ASYNCINFER_API_KEY"}


@pytest.mark.parametrize("module", ["asyncinfer.policies", "asyncinfer.core",
                                    "asyncinfer.params", "asyncinfer.config",
                                    "asyncinfer.options", "asyncinfer.server.protocol"])
def test_leaves_and_policies_import_without_torch(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}, sys; assert 'torch' not in sys.modules"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_only_the_cache_directory_and_api_key_are_read_from_the_environment() -> None:
    read = set()
    for path in SRC.rglob("*.py"):
        read |= set(re.findall(r"environ(?:\.get)?[\[(]\s*[\"'](ASYNCINFER_\w+)",
                               path.read_text()))
    assert read and read <= ALLOWED_VARIABLES, read


def test_the_layers_contract_holds() -> None:
    linter = pytest.importorskip("importlinter")
    del linter
    done = subprocess.run(["lint-imports"], capture_output=True, text=True, timeout=300,
                          cwd=SRC.parent.parent, env={"PYTHONPATH": str(SRC.parent),
                                                      "PATH": str(Path(sys.executable).parent)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 kept, 0 broken" in done.stdout
