"""The docs' figures come from the JSON records in docs/benchmarks/: every record named exists,
every README figure names its record and the record's commit with that commit's date, and the
figures of docs/benchmarks.md's summary are numbers their records hold."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "docs" / "benchmarks"
RECORD_NAME = re.compile(r"docs/benchmarks/([\w./-]+\.(?:json|png))")
# A figure: a number (or a range of two) followed by a unit of throughput or a ratio.
NUMBER = r"\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(rf"(?<![\w.])({NUMBER})(?:–({NUMBER}))?\s?(tok/s|×|%|ms|s\b)")
HEX = re.compile(r"\b[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")


def _blocks(markdown: str) -> list[str]:
    """Paragraphs and tables outside code fences, each table joined to the paragraph before
    it (its caption)."""
    blocks: list[str] = []
    for raw in re.split(r"\n\s*\n", re.sub(r"```.*?```", "", markdown, flags=re.S)):
        text = raw.strip()
        if text.startswith("|") and blocks:
            blocks[-1] += "\n" + text
        elif text:
            blocks.append(text)
    return blocks


def _section(markdown: str, title: str) -> str:
    start = markdown.index(f"\n## {title}\n")
    end = markdown.find("\n## ", start + 1)
    return markdown[start:end if end != -1 else None]


@cache
def _record_text(name: str) -> str:
    return (RECORDS / name).read_text()


def _commits(name: str) -> set[str]:
    """The commits a record names: every hexadecimal value under a key that says commit."""
    found: set[str] = set()

    def walk(node: object, under_commit: bool) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, under_commit or "commit" in key)
        elif isinstance(node, list):
            for value in node:
                walk(value, under_commit)
        elif isinstance(node, str) and under_commit:
            found.update(HEX.findall(node))

    walk(json.loads(_record_text(name)), False)
    return found


def _numbers(name: str) -> list[float]:
    return [float(token.replace(",", "")) for token in re.findall(NUMBER, _record_text(name))]


@cache
def _commit_date(commit: str) -> str | None:
    """The author date of a commit, or None where git or the commit is not at hand."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "show", "-s", "--format=%as", commit],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _in_records(token: str, unit: str, names: list[str]) -> bool:
    """Whether a number, as written (rounded to its decimals), is a number of those records;
    a percentage may also be a recorded fraction."""
    value = float(token.replace(",", ""))
    decimals = len(token.partition(".")[2])
    tolerance = 0.5 * 10 ** -decimals + 1e-9
    return any(abs(number * scale - value) <= tolerance
               for name in names for number in _numbers(name)
               for scale in ((1, 100) if unit == "%" else (1,)))


def _figures(text: str) -> list[tuple[str, str]]:
    """The figures of a text, (number, unit): those written with a unit, and the cells that
    hold only a number in a table whose header names tok/s."""
    found = [(token, match.group(3)) for match in FIGURE.finditer(text)
             for token in match.group(1, 2) if token is not None]
    header = ""
    for line in text.splitlines():
        if not line.startswith("|"):
            header = ""
        elif not header:
            header = line
        elif "tok/s" in header:
            found += [(cell, "tok/s") for cell in (c.strip().strip("*") for c in line.split("|"))
                      if re.fullmatch(NUMBER, cell)]
    return found


def _check_figures(text: str, names: list[str]) -> list[str]:
    return [f"{token} {unit} is in none of {names}" for token, unit in _figures(text)
            if not _in_records(token, unit, names)]


def _check_commits(text: str, names: list[str]) -> list[str]:
    """Each record that names a commit has one of them in the text, each with its date."""
    problems = []
    for name in names:
        commits = _commits(name)
        named = {commit for commit in HEX.findall(text) if commit in commits}
        if commits and not named:
            problems.append(f"{name} ran at {sorted(commits)}: none is named")
        for commit in named:
            date = _commit_date(commit)
            if date is not None and date not in text:
                problems.append(f"{commit} is of {date}, a date not given beside it")
    return problems


def test_every_record_the_docs_name_exists() -> None:
    for doc in ("README.md", "DEVELOPERS.md", "docs/benchmarks.md"):
        for name in RECORD_NAME.findall((ROOT / doc).read_text()):
            assert (RECORDS / name).is_file(), f"{doc} names docs/benchmarks/{name}"


def test_every_readme_figure_names_its_record_commit_and_date() -> None:
    problems = []
    for block in _blocks((ROOT / "README.md").read_text()):
        if not any(unit in ("tok/s", "×") for _token, unit in _figures(block)):
            continue
        names = [name for name in RECORD_NAME.findall(block) if name.endswith(".json")]
        if not names:
            problems.append(f"names no record: {block[:120]!r}")
            continue
        assert all((RECORDS / name).is_file() for name in names), names
        problems += [f"{block[:60]!r}: {problem}" for problem in
                     _check_figures(block, names) + _check_commits(block, names)]
    assert not problems, "\n".join(problems)


def test_the_summary_rows_are_their_records_figures() -> None:
    summary = _section((ROOT / "docs" / "benchmarks.md").read_text(), "Current summary")
    rows = [line for line in summary.splitlines() if line.startswith("| ")][1:]
    assert len(rows) >= 10
    problems = []
    for row in rows:
        what, figure, _machine, commits, dates, record = (
            cell.strip() for cell in row.strip("|").split(" | "))
        name = record.strip("`")
        assert (RECORDS / name).is_file(), f"no record {name} for {what!r}"
        named = set(HEX.findall(commits))
        if _commits(name):
            assert named and named <= _commits(name), f"{what!r}: {named} not in {name}"
        wanted = {date for date in map(_commit_date, named) if date is not None}
        assert wanted <= set(DATE.findall(dates)), f"{what!r}: dates {wanted}, given {dates}"
        problems += _check_figures(figure, [name])
    assert not problems, "\n".join(problems)


def test_not_slow_leaves_out_the_tests_that_need_the_embedded_model() -> None:
    """README's `-m "not slow"`: a test taking the embedded SmolLM2 is left out, one on a
    tiny model stays."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", "not slow", "tests/test_llm.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "test_naive_cache_recomputes_the_whole_prompt" in out.stdout
    assert "test_text_prompts_and_stop_strings" not in out.stdout
    assert "deselected" in out.stdout


def test_a_test_path_after_the_double_dash_replaces_the_default_paths() -> None:
    """README's `nox -s tests -- tests/test_x.py -k name` runs that file alone, and options
    alone keep the whole suite."""
    pytest.importorskip("nox")
    spec = importlib.util.spec_from_file_location("asyncinfer_noxfile", ROOT / "noxfile.py")
    assert spec is not None and spec.loader is not None
    noxfile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(noxfile)
    suite = ["tests", "policies/vtc/tests"]
    assert noxfile._pytest_args(suite, ["tests/test_llm.py", "-k", "stop"]) == [
        "tests/test_llm.py", "-k", "stop"]
    assert noxfile._pytest_args(suite, ["tests/test_llm.py::test_text_prompts_and_stop_strings"]
                                ) == ["tests/test_llm.py::test_text_prompts_and_stop_strings"]
    assert noxfile._pytest_args(suite, ["-m", "not slow"]) == [*suite, "-m", "not slow"]
