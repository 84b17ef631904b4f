"""The torch backend's CPU kernels (``cpu_kernels.c``), compiled for this CPU at first use.

The source is compiled once per CPU kind with the system's C compiler (``$CC``, else
``cc``) and ``-march=native``, so an AVX2-only CPU and an AVX-512 one each get code for
their own vector units from the same source, and cached under asyncinfer's cache directory,
keyed by the source, the flags, the compiler and the CPU's flags. The kernels run on
torch's own OpenMP runtime (the same ``libgomp.so.1``) with torch's thread count, and are
called through ctypes, which releases the GIL while they run.

Without a working compiler :func:`load` returns None and the backend keeps its torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from asyncinfer.cache import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
         "-std=c11"]

_I64, _F32, _INT, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
_DECODE_ARGS = [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _F32,
                _I64, _INT]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


class NativeKernels:
    """The compiled kernels of one library (one ``-march``)."""

    def __init__(self, path: Path, march: str) -> None:
        self.path, self.march = path, march
        self._lib = ctypes.CDLL(str(path))
        self._decode = {}
        for dtype, name in ((torch.float32, "decode_attention_f32"),
                            (torch.bfloat16, "decode_attention_bf16")):
            fn = getattr(self._lib, name)
            fn.argtypes, fn.restype = _DECODE_ARGS, None
            self._decode[dtype] = fn

    def supports(self, kv_dtype: torch.dtype) -> bool:
        """Whether decode attention over a pool of ``kv_dtype`` runs here."""
        return kv_dtype in self._decode

    def decode_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                         scale: float, max_len: int) -> torch.Tensor:
        """Each request's one query [batch, heads, dim] against keys 0 .. lens[i] of its
        row ``rows[i]`` of ``table`` (the KV slot of each position) in one layer's pools
        [slots, kv_heads, dim]: the attention output [batch, heads, dim] in float32.
        ``max_len`` bounds ``lens``; every tensor is on the CPU and contiguous."""
        q = q.to(torch.float32).contiguous()
        batch, heads, dim = q.shape
        kv_heads = k_pool.shape[1]
        out = torch.empty_like(q)
        assert k_pool.is_contiguous() and v_pool.is_contiguous() and table.is_contiguous()
        assert table.dtype == rows.dtype == lens.dtype == torch.int64
        self._decode[k_pool.dtype](
            q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), table.data_ptr(),
            table.shape[1], rows.data_ptr(), lens.data_ptr(), out.data_ptr(), batch, heads,
            kv_heads, dim, scale, max_len, torch.get_num_threads())
        return out


@functools.cache
def load(march: str = "native") -> NativeKernels | None:
    """The kernels compiled with ``-march=<march>`` (cached on disk), or None, with a warning,
    where they cannot be built (no C compiler, or one that does not know ``march``)."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        logger.warning("no C compiler (%s) found: CPU attention stays on torch's gather and "
                       "SDPA (slower); install gcc to get the native kernels", compiler)
        return None
    flags = [*FLAGS, f"-march={march}"]
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *flags, version, _cpu_flags()])
                         .encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"cpu_kernels-{march}-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            result = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built), "-lm"],
                                    capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                logger.warning("the CPU attention kernels did not compile (-march=%s); "
                               "CPU attention stays on torch's gather and SDPA: %s", march,
                               result.stderr.strip()[-500:])
                return None
            os.replace(built, path)  # atomic: a concurrent build writes the same bytes
    return NativeKernels(path, march)
