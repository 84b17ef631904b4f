"""A user's script that starts tensor-parallel ranks, run as a script file: without a main
guard each spawned rank re-runs it, which is named in one line; with the guard it runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

START = """\
from asyncinfer.api import LLM
from asyncinfer.params import SamplingParams

def main():
    llm = LLM({model!r}, skip_tokenizer_init=True, tensor_parallel_size=2, dtype="float32",
              page_size=4, max_running_requests=2, num_pages=64, max_seq_len=64)
    [out] = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True),
                         use_tqdm=False)
    print("tokens", len(out.token_ids))
    llm.close()
"""


def run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "start.py"
    script.write_text(body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("guarded", [False, True], ids=["no-guard", "guard"])
def test_a_script_starting_ranks_at_import_is_told_to_add_a_main_guard(
        tmp_path: Path, tiny_llama_dir: Path, guarded: bool) -> None:
    """Unguarded: exit status 1 and the last stderr line names the script and the fix (no
    "rank 1 exited"); guarded: the same code generates its tokens."""
    start = START.format(model=str(tiny_llama_dir))
    ending = 'if __name__ == "__main__":\n    main()\n' if guarded else "main()\n"
    done = run_script(tmp_path, start + ending)
    if guarded:
        assert done.returncode == 0, done.stderr
        assert "tokens 3" in done.stdout
        return
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert 'if __name__ == "__main__":' in last
    assert str(tmp_path / "start.py") in last
    assert "exited with code" not in done.stderr
    assert "bootstrapping" not in done.stderr
