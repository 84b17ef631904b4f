#!/usr/bin/env bash
# Run a command on the device machine (an H200 lent through the device tool; DEVELOPERS.md).
#
#   bash tests/gpu/device_run.sh python3 -m nox -s gpu-tests
#
# It installs the wheels carried in .whl/ (flashinfer-python, apache-tvm-ffi and what the
# tests need beyond the machine's image) into /tmp/site, restores flashinfer's compiled
# kernels from .fi-cache/kernels.tar.gz as its AOT kernels (no JIT for those), runs the
# command, and packs every kernel it has into $OUT/kernels.tar.gz for the next call;
# torch.compile's cache travels the same way in .fi-cache/inductor.tar.xz.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
aot=/tmp/site/flashinfer/data/aot
mkdir -p "$aot"
[ -f .fi-cache/kernels.tar.gz ] && tar xzf .fi-cache/kernels.tar.gz -C "$aot"
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws PYTHONUNBUFFERED=1
# torch.compile's FX graphs and Triton kernels, kept between calls the same way.
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor TRITON_CACHE_DIR=/tmp/inductor/triton
mkdir -p "$TORCHINDUCTOR_CACHE_DIR"
for cache in .fi-cache/inductor.tar.*; do
    [ -f "$cache" ] && tar xaf "$cache" -C "$TORCHINDUCTOR_CACHE_DIR"
done
[ -d .gpu-assets/tokenizer ] && export ASYNCINFER_TOKENIZER_DIR=$PWD/.gpu-assets/tokenizer
# The .git that travels can be stale; the caller writes the commit it sends here.
[ -f .gpu-assets/COMMIT ] && export ASYNCINFER_COMMIT=$(cat .gpu-assets/COMMIT)
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null || exit 1
"$@"
rc=$?
save=/tmp/kernels
mkdir -p "$save"
cp -r "$aot"/. "$save"/ 2>/dev/null
for so in /tmp/fiws/.cache/flashinfer/*/*/cached_ops/*/*.so; do
    [ -f "$so" ] || continue
    name=$(basename "$(dirname "$so")")
    mkdir -p "$save/$name" && cp "$so" "$save/$name/"
done
if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/kernels.tar.gz" -C "$save" . && ls -la "$OUT/kernels.tar.gz"
    # xz: gzip's 14 MB grew past the 16 MiB a file may have coming back; xz makes it 3 MB.
    if command -v xz >/dev/null; then
        tar cf - -C "$TORCHINDUCTOR_CACHE_DIR" . | xz -T0 -6 > "$OUT/inductor.tar.xz"
    else
        tar czf "$OUT/inductor.tar.gz" -C "$TORCHINDUCTOR_CACHE_DIR" .
    fi
    ls -la "$OUT"/inductor.tar.*
fi
exit $rc
