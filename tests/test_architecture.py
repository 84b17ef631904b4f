"""The house rules of docs/architecture.md that a test can hold: the torch-free leaves, the
layers contracts, no import circle, no file over 500 lines, every design note the code points
to, and no measuring switch read from the environment."""

from __future__ import annotations

import ast
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
    assert "2 kept, 0 broken" in done.stdout


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, modules: set[str]) -> set[str]:
    """Every module of the package ``path`` imports, lazy and type-checking imports too."""
    me = _module(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != me:
                found.add(name)
    return found


def test_no_module_reaches_itself_through_its_imports() -> None:
    files = {_module(path): path for path in SRC.rglob("*.py")}
    graph = {name: _imported(path, set(files)) for name, path in files.items()}
    circles = []
    for start in graph:
        # A path back to ``start``, depth first (the package has about a hundred modules).
        stack, seen = [(start, (start,))], set()
        while stack:
            name, path = stack.pop()
            for nxt in graph[name]:
                if nxt == start:
                    circles.append(path)
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, (*path, nxt)))
    assert graph["asyncinfer.server.main"], "the import graph was not read"
    assert not circles, circles[:3]


def test_no_source_file_is_over_500_lines() -> None:
    long = {str(path.relative_to(SRC)): n for path in SRC.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > 500}
    assert not long, long


def test_every_design_note_the_code_points_to_is_in_architecture_md() -> None:
    doc = (SRC.parent.parent / "docs" / "architecture.md").read_text()
    headings = {line.lstrip("#").strip() for line in doc.splitlines() if line.startswith("#")}
    pointed = set()
    for path in SRC.rglob("*.py"):
        text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text())
        pointed |= {title.strip() for _, title in re.findall(
            r"docs/architecture\.md[,:]? ([\"\'])(.+?)\1(?!\w)", text)}
    assert len(pointed) > 10
    assert not pointed - headings, sorted(pointed - headings)
