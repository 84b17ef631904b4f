"""CPU kernels of our own, compiled for this CPU at first use: decode attention over the
paged KV cache (``cpu_attention.c``, for the torch attention backend), the elementwise work
between a layer's matrix products (``cpu_layer_ops.c``, for layers.fused), the sampler's
token choice (``cpu_sample.c``: the argmax and the Gumbel race, for engine.sampler),
structured output's token-bitmask mask (``cpu_mask.c``, for engine.grammar), and, where the
CPU has AMX tile units or AVX-512, bfloat16 matrix products (``cpu_gemm.c``, for
layers.linear), and with AMX prefill attention (``cpu_prefill.c``, for the torch attention
backend).

The sources are compiled once per CPU kind with the system's C compiler (``$CC``, else
``cc``) and ``-march=native``, so an AVX2-only CPU and an AVX-512 one each get code for
their own vector units from the same sources, and cached under asyncinfer's cache
directory, keyed by the sources, the flags, the compiler and the CPU's flags. The kernels
run on torch's own OpenMP runtime (the same ``libgomp.so.1``) with torch's thread count,
and are called through ctypes, which releases the GIL while they run.

Without a working compiler :func:`load` returns None and the callers keep their torch code.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from asyncinfer.cachedir import cache_dir
from asyncinfer.memory import Slab

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name)
           for name in ("cpu_attention.c", "cpu_layer_ops.c", "cpu_sample.c", "cpu_gemm.c",
                        "cpu_prefill.c", "cpu_mask.c")]
HEADERS = [Path(__file__).with_name("cpu_common.h")]
FLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
         "-std=c11", "-ffp-contract=fast", "-Wno-psabi"]
if platform.machine() in ("x86_64", "AMD64"):
    # GCC vectorizes loops for AVX-512 CPUs in 256-bit registers unless told otherwise; the
    # loops it vectorizes itself (the norms', SiLU's, softmax's) then do half a register's
    # work per instruction. No effect on an AVX2 build.
    FLAGS.append("-mprefer-vector-width=512")

_I64, _F32, _INT, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
_DECODE_ARGS = [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _F32,
                _I64, _I64, _INT, _INT]
_GEMM_ARGS = [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _INT]
_NORM_ARGS = [_PTR, _I64, _PTR, _PTR, _I64, _I64, _F32, _PTR, _PTR, _INT]
_SILU_ARGS = [_PTR, _I64, _I64, _PTR, _INT]
_ARGMAX_ARGS = [_PTR, _I64, _I64, _PTR, _INT]
_PREFILL_ARGS = [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64,
                 _I64, _F32, _I64, _PTR, _INT]
_ROPE_ARGS = [_PTR, _PTR, _PTR, _PTR, _PTR, _F32, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR,
              _PTR, _PTR, _INT, _INT]


def cpu_flags() -> str:
    """This CPU's feature flags, the ``flags`` line of /proc/cpuinfo ("" where there is
    none): what the compiled kernels are keyed by."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def cpu_vendor() -> str:
    """This CPU's ``vendor_id`` from /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


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
        self._norm = self._bind("add_rms_norm_bf16", _NORM_ARGS)
        self._silu = self._bind("silu_mul_bf16", _SILU_ARGS)
        self._rope = self._bind("qk_norm_rope_store_bf16", _ROPE_ARGS)
        self._argmax = self._bind("argmax_rows_f32", _ARGMAX_ARGS)
        self._race = self._bind("race_rows_f32", [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _INT])
        self._noise = self._bind("gumbel_rows_f32", [_PTR, _I64, _I64, _PTR, _INT])
        self._mask = self._bind("mask_rows", [_PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, _INT,
                                              _INT])
        self._pack = self._bind("pack_bf16", [_PTR, _I64, _I64, _PTR])
        self._amx_linear = self._bind("amx_linear_bf16", _GEMM_ARGS)
        self._wide_linear = self._bind("wide_linear_bf16", _GEMM_ARGS)
        self._wide_linear.restype = _INT  # -1: its scratch could not be allocated
        self._dot_linear = self._bind("dot_linear_bf16", _GEMM_ARGS)
        self._dot_linear.restype = _INT
        ready = self._lib.amx_linear_ready
        ready.argtypes, ready.restype = [], _INT
        self.amx = bool(ready())
        """Whether this build multiplies on AMX tiles (the CPU has them, the compiler
        targets them and the kernel lets the process use them)."""
        wide = self._lib.wide_linear_built
        wide.argtypes, wide.restype = [], _INT
        built = wide()
        self.products: str | None = "amx" if self.amx else ("avx512" if built == 1 else None)
        """Which of our kernels multiplies packed bf16 weights by default: "amx" (tile
        products), "avx512" (bf16 weights widened to float32 in registers, float32 FMAs: an
        AVX-512 CPU without AMX), or None (torch's products)."""
        dot = self._lib.dot_linear_built
        dot.argtypes, dot.restype = [], _INT
        self.dot_built = bool(dot())
        """Whether this build has the AVX512-BF16 form of the AVX-512 product."""
        self.dot = self.products == "avx512" and self.dot_built and cpu_vendor() == "AuthenticAMD"
        """Whether the AVX-512 product multiplies on ``vdpbf16ps`` (two bf16 products a lane
        an instruction) rather than float32 FMAs over widened weights: on AMD's CPUs with
        AVX512-BF16 (Zen 4 on), where it issues at the FMAs' rate; Intel's CPUs without AMX
        were measured issuing it at a quarter of that (docs/benchmarks.md)."""
        self.fixed_products: str | None = self.products or ("avx2" if built == 2 else None)
        """Which of our kernels the batch-invariant mode multiplies with: ``products``, or on
        an AVX2 CPU with FMA "avx2" (the AVX-512 kernel's arithmetic on 8-float vectors,
        which also does that CPU's float32 products: ``use_fp32_products``)."""
        self._prefill = self._bind("prefill_attention_bf16", _PREFILL_ARGS)
        built = self._lib.prefill_attention_built
        built.argtypes, built.restype = [], _INT
        self._prefill_built = self.amx and bool(built())

    def _bind(self, name: str, args: list[Any]) -> Any:
        fn = getattr(self._lib, name)
        fn.argtypes, fn.restype = args, None
        return fn

    def supports(self, kv_dtype: torch.dtype) -> bool:
        """Whether decode attention over a pool of ``kv_dtype`` runs here."""
        return kv_dtype in self._decode

    def decode_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                         scale: float, max_len: int, window: int | None = None
                         ) -> torch.Tensor:
        """Each request's one query [batch, heads, dim] against keys 0 .. lens[i] of its
        row ``rows[i]`` of ``table`` (the KV slot of each position) in one layer's pools
        [slots, kv_heads, dim]: the attention output [batch, heads, dim], in bfloat16 for a
        bfloat16 ``q`` (computed in float32, rounded once), else in float32. ``max_len``
        bounds ``lens``; every tensor is on the CPU and contiguous. With a ``window`` only
        the last ``window`` keys of each request are read. Consecutive queries of one row
        at consecutive lengths (a prefill chunk's tokens) are attended together, each with
        the bits it has alone."""
        if q.dtype != torch.bfloat16:
            q = q.to(torch.float32)
        q = q.contiguous()
        batch, heads, dim = q.shape
        kv_heads = k_pool.shape[1]
        out = torch.empty_like(q)
        assert k_pool.is_contiguous() and v_pool.is_contiguous() and table.is_contiguous()
        assert table.dtype == rows.dtype == lens.dtype == torch.int64
        self._decode[k_pool.dtype](
            q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), table.data_ptr(),
            table.shape[1], rows.data_ptr(), lens.data_ptr(), out.data_ptr(), batch, heads,
            kv_heads, dim, scale, max_len, window or 0, int(q.dtype == torch.bfloat16),
            torch.get_num_threads())
        return out

    # Prefill attention on AMX tiles (cpu_prefill.c says how).

    def runs_prefill(self, dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> bool:
        """Whether :meth:`prefill_attention` takes a bf16 pool of these shapes: built with
        AMX and AVX512-BF16, head sizes a multiple of 32 up to 128."""
        return (self._prefill_built and dtype == torch.bfloat16 and heads % kv_heads == 0
                and dim % 32 == 0 and dim <= 128)

    def prefill_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                          slots: torch.Tensor, slot_at: torch.Tensor, q_at: torch.Tensor,
                          starts: torch.Tensor, news: torch.Tensor,
                          scale: float, window: int | None = None) -> torch.Tensor:
        """Causal attention of each request's new tokens over its whole prefix: request
        ``r``'s queries are rows ``q_at[r] .. q_at[r] + news[r]`` of ``q`` [tokens, heads,
        dim] (bf16, rows may have a stride), at positions ``starts[r]`` on; its keys and
        values are at ``slots[slot_at[r] .. slot_at[r] + starts[r] + news[r]]`` of one
        layer's pools [slots, kv_heads, dim] (bf16, holding the new tokens' too); with a
        ``window``, position p sees keys p - window + 1 .. p only. The output has q's
        shape, contiguous; rows of no request are left unwritten."""
        tokens, heads, dim = q.shape
        kv_heads = k_pool.shape[1]
        assert self.runs_prefill(k_pool.dtype, heads, kv_heads, dim)
        assert q.dtype == torch.bfloat16 and q.stride(2) == 1 and q.stride(1) == dim
        assert k_pool.is_contiguous() and v_pool.is_contiguous() and v_pool.dtype == k_pool.dtype
        index = (slots, slot_at, q_at, starts, news)
        assert all(t.dtype == torch.int64 and t.is_contiguous() for t in index)
        out = torch.empty(tokens, heads, dim, dtype=torch.bfloat16)
        self._prefill(q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(),
                      k_pool.shape[0], slots.data_ptr(), slot_at.data_ptr(), q_at.data_ptr(),
                      starts.data_ptr(), news.data_ptr(), starts.numel(), heads, kv_heads, dim,
                      scale, window or 0, out.data_ptr(), torch.get_num_threads())
        return out

    # bfloat16 matrix products over packed weights (cpu_gemm.c says how).

    def packs(self, weight: torch.Tensor) -> bool:
        """Whether :meth:`pack` takes ``weight`` [out, in]: bf16, ``out`` a multiple of 16
        and ``in`` of 32 (whole tiles), on a build with one of our product kernels."""
        return (self.fixed_products is not None and weight.dtype == torch.bfloat16
                and weight.dim() == 2 and weight.shape[0] % 16 == 0
                and weight.shape[1] % 32 == 0)

    def pack(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``weight`` [out, in] in the AMX tile layout (which the AVX-512 kernel reads too),
        flat: into ``out`` (as many bf16 elements, contiguous, 64-byte aligned) where
        given."""
        assert self.packs(weight)
        weight = weight.detach().contiguous()
        # The kernels load whole vectors and tiles: a slab's slices start on 64 bytes.
        packed = (Slab([(weight.numel(), torch.bfloat16)]).take(weight.numel(), torch.bfloat16)
                  if out is None else out)
        assert packed.dtype == torch.bfloat16 and packed.numel() == weight.numel()
        assert packed.is_contiguous() and packed.data_ptr() % 64 == 0
        self._pack(weight.data_ptr(), weight.shape[0], weight.shape[1], packed.data_ptr())
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x Wᵀ + b`` for bf16 ``x`` [rows, in] (rows may have a stride) and W packed by
        :meth:`pack`: float32 sums, rounded once to bf16."""
        rows, k = x.shape
        assert self.fixed_products is not None
        assert x.dtype == torch.bfloat16 and x.stride(1) == 1
        assert packed.numel() == out_features * k
        assert bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())
        out = torch.empty(rows, out_features, dtype=torch.bfloat16)
        if rows:
            product = (self._amx_linear if self.products == "amx"
                       else self._dot_linear if self.dot else self._wide_linear)
            failed = product(x.data_ptr(), x.stride(0), packed.data_ptr(),
                             None if bias is None else bias.data_ptr(), rows, out_features, k,
                             out.data_ptr(), torch.get_num_threads())
            if failed:
                raise MemoryError(f"no memory for a float32 copy of {rows} x {k} inputs")
        return out

    # The elementwise work of a layer, bfloat16 activations only (layers.fused says what
    # each computes; the C source, how it rounds).

    @staticmethod
    def runs_layer_ops(dtype: torch.dtype, hidden: int, head_dim: int) -> bool:
        """Whether the layer ops below run for activations of ``dtype`` and these sizes
        (the norms sum squares sixteen lanes at a time)."""
        return dtype == torch.bfloat16 and hidden % 16 == 0 and head_dim % 16 == 0

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                     weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``r = residual + x`` (``x`` itself when ``residual`` is None); ``(norm(r), r)``.
        ``x`` [rows, n] may be a view with a row stride; the rest are contiguous."""
        rows, n = x.shape
        assert x.dtype == weight.dtype == torch.bfloat16
        assert x.stride(1) == 1 and weight.is_contiguous()
        out = torch.empty(rows, n, dtype=x.dtype)
        if residual is None:
            res, res_ptr, res_out = x, None, None
        else:
            assert residual.is_contiguous() and residual.dtype == torch.bfloat16
            res = torch.empty_like(out)
            res_ptr, res_out = residual.data_ptr(), res.data_ptr()
        self._norm(x.data_ptr(), x.stride(0), res_ptr, weight.data_ptr(), rows, n, eps,
                   out.data_ptr(), res_out, torch.get_num_threads())
        return out, res

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the contiguous fused [rows, 2 n] product."""
        rows, width = gate_up.shape
        assert gate_up.is_contiguous() and gate_up.dtype == torch.bfloat16
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self._silu(gate_up.data_ptr(), rows, width // 2, out.data_ptr(),
                   torch.get_num_threads())
        return out

    def qk_norm_rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                           eps: float, heads: int, kv_heads: int, head_dim: int,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:
        """layers.fused.qk_norm_rope_store in one pass: q, k rotated (normed first when
        the weights are given), and k, v written to their slots of the caches."""
        rows = qkv.shape[0]
        assert qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and slots.is_contiguous()
        assert k_cache.dtype in (torch.bfloat16, torch.float32) and k_cache.dtype == v_cache.dtype
        assert qkv.dtype == cos.dtype == sin.dtype == torch.bfloat16
        assert all(w is None or w.dtype == torch.bfloat16 for w in (q_weight, k_weight))
        q = torch.empty(rows, heads, head_dim, dtype=qkv.dtype)
        k = torch.empty(rows, kv_heads, head_dim, dtype=qkv.dtype)
        self._rope(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                   None if q_weight is None else q_weight.data_ptr(),
                   None if k_weight is None else k_weight.data_ptr(), eps, rows, heads,
                   kv_heads, head_dim, q.data_ptr(), k.data_ptr(), k_cache.data_ptr(),
                   v_cache.data_ptr(), slots.data_ptr(), int(k_cache.dtype == torch.float32),
                   torch.get_num_threads())
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        v = qkv[:, q_size + kv_size:].view(rows, kv_heads, head_dim)
        return q, k, v

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax, as ``logits.float().argmax(-1)`` (the first of equal values,
        the first NaN), with the rows split over the threads."""
        logits = logits.float().contiguous()
        rows, n = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        self._argmax(logits.data_ptr(), rows, n, out.data_ptr(), torch.get_num_threads())
        return out

    def race(self, logits: torch.Tensor, inv_temperature: torch.Tensor,
             keys: torch.Tensor) -> torch.Tensor:
        """engine.sampler's ``race`` in one pass per row: ``argmax(logits / T + Gumbel)``
        of each row's key, its argmax where ``inv_temperature`` is 0; the noise's
        logarithms are our own, within an ulp or two of torch's."""
        logits = logits.float().contiguous()
        rows, n = logits.shape
        inv_t = inv_temperature.to(torch.float32).contiguous()
        keys = keys.to(torch.int64).contiguous()
        assert inv_t.shape == keys.shape == (rows,)
        out = torch.empty(rows, dtype=torch.int64)
        self._race(logits.data_ptr(), rows, n, inv_t.data_ptr(), keys.data_ptr(),
                   out.data_ptr(), torch.get_num_threads())
        return out

    def gumbel_noise(self, keys: torch.Tensor, vocab: int) -> torch.Tensor:
        """engine.sampler's ``gumbel_noise`` [rows, vocab] float32 of int64 ``keys``."""
        keys = keys.to(torch.int64).contiguous()
        out = torch.empty(keys.shape[0], vocab, dtype=torch.float32)
        self._noise(keys.data_ptr(), keys.shape[0], vocab, out.data_ptr(),
                    torch.get_num_threads())
        return out

    @staticmethod
    def masks(logits: torch.Tensor) -> bool:
        """Whether :meth:`mask_rows` takes ``logits``: float32 or bf16 [rows, vocab], on the
        CPU, each row contiguous."""
        return (logits.device.type == "cpu" and logits.dim() == 2
                and logits.dtype in (torch.float32, torch.bfloat16) and logits.stride(1) == 1)

    def mask_rows(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                  vocab: int) -> None:
        """In place, as xgrammar's ``apply_token_bitmask_inplace``: each row ``r`` of
        ``rows`` of ``logits`` set to -inf at the first ``vocab`` tokens whose bit in
        ``bitmask[r]`` (int32 words, bit j of word w for token 32 w + j) is clear."""
        assert self.masks(logits) and bitmask.dtype == torch.int32 and bitmask.is_contiguous()
        assert bitmask.shape[0] >= logits.shape[0] and bitmask.shape[1] * 32 >= vocab
        assert vocab <= logits.shape[1] and all(0 <= r < logits.shape[0] for r in rows)
        index = torch.tensor(rows, dtype=torch.int64)
        self._mask(logits.data_ptr(), logits.stride(0), vocab, bitmask.data_ptr(),
                   bitmask.shape[1], index.data_ptr(), len(rows),
                   int(logits.dtype == torch.bfloat16), torch.get_num_threads())


@functools.cache
def load(march: str = "native") -> NativeKernels | None:
    """The kernels compiled with ``-march=<march>`` (cached on disk), or None, with a warning,
    where they cannot be built (no C compiler, or one that does not know ``march``)."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        logger.warning("no C compiler (%s) found: CPU attention and layer ops stay on torch "
                       "(slower); install gcc to get the native kernels", compiler)
        return None
    flags = [*FLAGS, f"-march={march}"]
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    texts = [source.read_text() for source in [*SOURCES, *HEADERS]]
    key = hashlib.sha256("\0".join([*texts, *flags, version, cpu_flags()])
                         .encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"cpu_kernels-{march}-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            result = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(built),
                                     "-lm"],
                                    capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                logger.warning("the CPU kernels did not compile (-march=%s); CPU attention "
                               "and layer ops stay on torch: %s", march,
                               result.stderr.strip()[-500:])
                return None
            os.replace(built, path)  # atomic: a concurrent build writes the same bytes
    return NativeKernels(path, march)
