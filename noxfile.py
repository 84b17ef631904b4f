"""Sessions: tests, core (the scheduler's fast tests), lint, typecheck, package, bench (CPU),
evaluation (lm-evaluation-harness) and gpu-tests (a CUDA machine).

tests, core, typecheck and bench run in one venv they share, `.nox/_shared`: torch and the
extras are installed into it once (by the first of them to run), and again
only when pyproject.toml, a plugin's pyproject.toml or the torch pin changes. Remove the
folder to rebuild it. lint installs only ruff and import-linter; package builds a clean venv of
its own on purpose (the wheel alone, with torch)."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).resolve().parent
# A CPU build of torch lies on these machines' disk; an unpinned torch would pull CUDA.
CPU_TORCH = "torch==2.13.0"
PLUGINS = ["policies/shortest-prompt-first", "policies/vtc"]
PLUGIN_TESTS = [f"{plugin}/tests" for plugin in PLUGINS]
# What `nox -s package` asks of the installed wheel.
PACKAGE_PROMPT = "The capital of France is"
# No test data goes into the sdist; it is about 0.2 MB.
MAX_SDIST_BYTES = 2 * 1024 * 1024
# The venv of every session that imports asyncinfer, and what goes into it.
SHARED_VENV = ROOT / ".nox" / "_shared"
SHARED_PYTHON = "python3.11"
SHARED_EXTRAS = "test,bench,dev,eval"


def _shared_env(session: nox.Session) -> dict[str, str | None]:
    """The environment of a command in the shared venv, built (or brought up to date) first.

    Invariant: the venv holds `CPU_TORCH`, asyncinfer editable with `SHARED_EXTRAS` and the
    plugins editable, as of the pyproject files whose digest its stamp records."""
    bin_dir = SHARED_VENV / "bin"
    env: dict[str, str | None] = {
        "VIRTUAL_ENV": str(SHARED_VENV),
        "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])}
    stamp = SHARED_VENV / "asyncinfer-installed.txt"
    wanted = hashlib.sha256("\n".join(
        [CPU_TORCH, SHARED_EXTRAS, (ROOT / "pyproject.toml").read_text()]
        + [(ROOT / plugin / "pyproject.toml").read_text() for plugin in PLUGINS]
    ).encode()).hexdigest()
    if (bin_dir / "python").exists() and stamp.exists() and stamp.read_text() == wanted:
        session.log(f"reusing {SHARED_VENV.relative_to(ROOT)} (remove it to rebuild)")
        return env
    if not (bin_dir / "python").exists():
        interpreter = shutil.which(SHARED_PYTHON)
        if interpreter is None:
            session.error(f"{SHARED_PYTHON} is not on PATH: the shared venv is made with it")
        session.run(interpreter, "-m", "venv", str(SHARED_VENV), external=True)
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "--progress-bar", "off"]
    session.run(*pip, CPU_TORCH, "-e", f"{ROOT}[{SHARED_EXTRAS}]", env=env, external=True)
    # The out-of-tree policy plugins, so their entry points are found like any third party's.
    editable_plugins = [arg for plugin in PLUGINS for arg in ("-e", str(ROOT / plugin))]
    session.run(*pip, "--no-deps", *editable_plugins, env=env, external=True)
    stamp.write_text(wanted)
    return env


def _in_shared(session: nox.Session, *args: str) -> None:
    """Run `python -m ARGS` in the shared venv."""
    env = _shared_env(session)
    session.run(str(SHARED_VENV / "bin" / "python"), "-m", *args, env=env, external=True)


def _pytest_args(default_paths: list[str], posargs: list[str]) -> list[str]:
    """The default paths and the arguments after `--`, or those arguments alone when they
    name a test file or folder of their own (`tests/test_x.py`, `tests/test_x.py::name`)."""
    names_a_path = any(
        not arg.startswith("-") and ("/" in arg or arg.endswith(".py"))
        and (ROOT / arg.split("::")[0]).exists() for arg in posargs)
    return list(posargs) if names_a_path else [*default_paths, *posargs]


@nox.session(python=False)
def tests(session: nox.Session) -> None:
    """The CPU test suite (GPU tests skip themselves).

    A part: `nox -s tests -- tests/test_x.py -k name`, or `nox -s tests -- -m "not slow"`."""
    # The slowest tests are listed at the end: the whole CI run should stay under 25 minutes
    # on 2 cores.
    _in_shared(session, "pytest", "-q", "-p", "no:cacheprovider", "--durations=25",
               *_pytest_args(["tests", *PLUGIN_TESTS], session.posargs))


@nox.session(python=False)
def evaluation(session: nox.Session) -> None:
    """lm-evaluation-harness against `asyncinfer serve` and against its own transformers
    model on the same weights (docs/evaluation.md), printing the comparison."""
    _in_shared(session, "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/test_lm_eval.py",
               *session.posargs)


# The scheduler's core in under a minute on two cores: no model is loaded.
CORE_TESTS = ["tests/test_scheduler.py", "tests/test_scheduler_view.py", "tests/test_policies.py",
              "tests/test_kvcache.py", "tests/test_radix_cache.py",
              "tests/test_rank_determinism.py"]


@nox.session(python=False)
def core(session: nox.Session) -> None:
    """Scheduler, policies (the plugins' too), KV cache, radix cache and rank determinism."""
    _in_shared(session, "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow and not gpu",
               *_pytest_args([*CORE_TESTS, *PLUGIN_TESTS], session.posargs))


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff over the package, tests, examples, benchmarks and plugins; the layers contract
    (docs/architecture.md) over the package's imports."""
    session.install("ruff>=0.6", "import-linter>=2.0")
    session.run("ruff", "check", "src", "tests", "examples", "benchmarks", "policies",
                "noxfile.py")
    session.run("lint-imports", env={"PYTHONPATH": "src"})


@nox.session(python=False)
def typecheck(session: nox.Session) -> None:
    """mypy over src/ and benchmarks/, against the dependencies' own hints (torch's too)."""
    _in_shared(session, "mypy")


@nox.session(python="3.11")
def package(session: nox.Session) -> None:
    """Build the sdist and the wheel and check them; install the wheel alone into a clean venv
    and generate with it; then install the policy plugins after it, in the order their
    READMEs give (asyncinfer first: no package index has it), and list them.

    The venv is made by ``python -m venv`` (no editable install, nothing of the tests'
    venv) and every command runs from an empty temporary folder, so only the installed wheel
    can be imported. The environment is passed on, so the embedded model comes from the cache
    that ``nox -s tests`` filled (``$ASYNCINFER_CACHE``, else the default location): after the
    tests nothing is downloaded again.
    """
    session.install("build>=1.2.1", "twine>=6.1")
    root = ROOT
    with tempfile.TemporaryDirectory(prefix="asyncinfer-package-") as tmp:
        dist, venv, cwd = Path(tmp) / "dist", Path(tmp) / "venv", Path(tmp) / "cwd"
        cwd.mkdir()
        # The wheel is built from the sdist, so a file the sdist lacks is missing from both.
        session.run("python", "-m", "build", "--quiet", "--outdir", str(dist), str(root))
        sdists, wheels = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
        if len(sdists) != 1 or len(wheels) != 1:
            session.error(f"expected one sdist and one wheel, got {sdists + wheels}")
        session.run("twine", "check", "--strict", str(sdists[0]), str(wheels[0]))
        _check_dists(session, root, sdists[0], wheels[0])

        session.run("python", "-m", "venv", str(venv))
        python, bin_dir = str(venv / "bin" / "python"), str(venv / "bin")
        env = {"PYTHONPATH": None, "VIRTUAL_ENV": str(venv),
               "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")])}
        with session.chdir(cwd):
            pip = [python, "-m", "pip", "install", "--quiet", "--progress-bar", "off"]
            session.run(*pip, CPU_TORCH, env=env, external=True)
            session.run(*pip, str(wheels[0]), env=env, external=True)
            where = session.run(python, "-c", "import asyncinfer; print(asyncinfer.__file__)",
                                env=env, external=True, silent=True, stderr=None)
            if not str(where).strip().startswith(str(venv)):
                session.error(f"asyncinfer was imported from {where!r}, not from the venv")
            # stdout alone: the start-up lines go to stderr, the prompt and its completion here.
            out = session.run(str(venv / "bin" / "asyncinfer"), "generate", PACKAGE_PROMPT,
                              "--max-tokens", "4", "--temperature", "0", env=env,
                              external=True, silent=True, stderr=None)
            text = str(out).strip()
            if not (text.startswith(PACKAGE_PROMPT) and text[len(PACKAGE_PROMPT):].strip()):
                session.error(f"asyncinfer generate printed no completion: {out!r}")
            session.log(f"the installed wheel generated: {text!r}")
            # The plugins' README instructions: asyncinfer installed first, then the plugin.
            # pip builds a local project in place, so from copies: no build/ in the tree.
            plugins = [shutil.copytree(root / plugin, Path(tmp) / Path(plugin).name,
                                       ignore=shutil.ignore_patterns(
                                           "build", "*.egg-info", "__pycache__"))
                       for plugin in PLUGINS]
            session.run(*pip, *map(str, plugins), env=env, external=True)
            listed = str(session.run(str(venv / "bin" / "asyncinfer"), "policies", env=env,
                                     external=True, silent=True, stderr=None))
            if "failed to load" in listed or not all(
                    f"\n{name}  (" in f"\n{listed}" for name in ("shortest_prompt_first", "vtc")):
                session.error(f"the installed plugins do not load: {listed}")


def _check_dists(session: nox.Session, root: Path, sdist: Path, wheel: Path) -> None:
    """The wheel carries every file of the package's source folder (Python or not: data the
    package reads at run time, such as C sources it compiles, must be listed in MANIFEST.in);
    the sdist carries the README, any license file and no tests, within its size bound."""
    package = root / "src" / "asyncinfer"
    wanted = {f"asyncinfer/{path.relative_to(package).as_posix()}"
              for path in package.rglob("*") if path.is_file()
              and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".so")}
    with zipfile.ZipFile(wheel) as whl:
        missing = sorted(wanted - set(whl.namelist()))
    if missing:
        session.error(f"the wheel lacks {missing}: add them to MANIFEST.in")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    expected = {"README.md", "pyproject.toml", *(path.name for path in root.glob("LICEN[CS]E*"))}
    if not expected <= names:
        session.error(f"the sdist lacks {sorted(expected - names)}")
    if any(name.startswith("tests/") for name in names):
        session.error("the sdist carries tests/ (MANIFEST.in prunes it)")
    if sdist.stat().st_size > MAX_SDIST_BYTES:
        session.error(f"the sdist is {sdist.stat().st_size} bytes, over {MAX_SDIST_BYTES}")


@nox.session(python=False)
def bench(session: nox.Session) -> None:
    """CPU benchmarks; results land in docs/benchmarks/ (see docs/benchmarks.md).

    vLLM's CPU build runs as a peer when VLLM_PYTHON names the python of a venv made by
    benchmarks/setup_vllm_cpu.sh.
    """
    _in_shared(session, "benchmarks.decode", "--json", "docs/benchmarks/cpu-decode.json")
    peers = ["--peers", "transformers,vllm", "--vllm-python", os.environ["VLLM_PYTHON"]] if (
        os.environ.get("VLLM_PYTHON")) else ["--peers", "transformers"]
    _in_shared(session, "benchmarks.offline", *peers,
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
