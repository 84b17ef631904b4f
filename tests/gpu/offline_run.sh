#!/usr/bin/env bash
# Run a command on a CUDA machine without a network (DEVELOPERS.md, "GPU tests").
#
#   bash tests/gpu/offline_run.sh python3 -m nox -s gpu-tests
#
# It installs the wheels of a local wheelhouse (.whl/: flashinfer-python, apache-tvm-ffi and
# what the tests need beyond the machine's torch) into /tmp/site, restores flashinfer's
# compiled kernels from .fi-cache/kernels.tar.gz as its AOT kernels (no JIT for those) and
# torch.compile's caches from .fi-cache/inductor.tar.*, runs the command, and packs both
# caches again into $KERNEL_CACHE_OUT (default .fi-cache/) for the next run.
set -uo pipefail
cache_out=${KERNEL_CACHE_OUT:-.fi-cache}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
aot=/tmp/site/flashinfer/data/aot
mkdir -p "$aot"
[ -f .fi-cache/kernels.tar.gz ] && tar xzf .fi-cache/kernels.tar.gz -C "$aot"
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws PYTHONUNBUFFERED=1
# torch.compile's FX graphs and Triton kernels, kept between runs the same way.
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor TRITON_CACHE_DIR=/tmp/inductor/triton
mkdir -p "$TORCHINDUCTOR_CACHE_DIR"
for cache in .fi-cache/inductor.tar.*; do
    [ -f "$cache" ] && tar xaf "$cache" -C "$TORCHINDUCTOR_CACHE_DIR"
done
[ -d .gpu-assets/tokenizer ] && export ASYNCINFER_TOKENIZER_DIR=$PWD/.gpu-assets/tokenizer
# A copied work tree may carry a stale .git: the commit can be written here instead.
[ -f .gpu-assets/COMMIT ] && export ASYNCINFER_COMMIT=$(cat .gpu-assets/COMMIT)
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null || exit 1
"$@"
rc=$?
save=/tmp/kernels
mkdir -p "$save" "$cache_out"
cp -r "$aot"/. "$save"/ 2>/dev/null
for so in /tmp/fiws/.cache/flashinfer/*/*/cached_ops/*/*.so; do
    [ -f "$so" ] || continue
    name=$(basename "$(dirname "$so")")
    mkdir -p "$save/$name" && cp "$so" "$save/$name/"
done
tar czf "$cache_out/kernels.tar.gz" -C "$save" . && ls -la "$cache_out/kernels.tar.gz"
# xz keeps torch.compile's cache small (about 3 MB against gzip's 14 MB).
if command -v xz >/dev/null; then
    tar cf - -C "$TORCHINDUCTOR_CACHE_DIR" . | xz -T0 -6 > "$cache_out/inductor.tar.xz"
else
    tar czf "$cache_out/inductor.tar.gz" -C "$TORCHINDUCTOR_CACHE_DIR" .
fi
ls -la "$cache_out"/inductor.tar.*
exit $rc
