"""A workload file: requests written out whole (prompt ids, output length, sampling), so the
same requests can go through ``LLM.generate`` and through `asyncinfer bench serve
--workload-file` and be compared like for like.

The file is JSON: ``{"requests": [{"prompt": [ids], "max_tokens": N, "temperature": T,
"top_p": P, "seed": S}, ...]}``; ``temperature`` (default 0), ``top_p`` (default 1) and
``seed`` (default none) may be left out. Every request ignores EOS, so each yields exactly
``max_tokens`` tokens on either side.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncinfer.bench.plan import RequestSpec
from asyncinfer.errors import AsyncInferError

FIELDS = ("prompt", "max_tokens", "temperature", "top_p", "seed")


def write_workload_file(path: str | Path, prompts: Sequence[Sequence[int]],
                        max_tokens: Sequence[int], temperature: float = 0.0,
                        top_p: float = 1.0) -> Path:
    """Write ``prompts`` with their ``max_tokens`` and one sampling setting for all."""
    if len(prompts) != len(max_tokens):
        raise ValueError("one max_tokens per prompt")
    requests = [{"prompt": list(p), "max_tokens": n, "temperature": temperature,
                 "top_p": top_p} for p, n in zip(prompts, max_tokens)]
    out = Path(path)
    out.write_text(json.dumps({"requests": requests}))
    return out


def _number(value: Any, where: str, name: str, lo: float, hi: float) -> float:
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value) or not lo <= value <= hi):
        raise AsyncInferError(f"{where}: {name} must be a number in [{lo:g}, {hi:g}], "
                              f"got {value!r}")
    return float(value)


def _request(item: Any, where: str) -> RequestSpec:
    if not isinstance(item, dict):
        raise AsyncInferError(f"{where}: expected an object, got {type(item).__name__}")
    if unknown := sorted(set(item) - set(FIELDS)):
        raise AsyncInferError(f"{where}: unknown field(s) {', '.join(unknown)}; a request "
                              f"has {', '.join(FIELDS)}")
    prompt = item.get("prompt")
    if (not isinstance(prompt, list) or not prompt
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                       for t in prompt)):
        raise AsyncInferError(f"{where}: prompt must be a non-empty list of token ids "
                              f"(integers >= 0)")
    max_tokens = item.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise AsyncInferError(f"{where}: max_tokens must be an integer >= 1, got "
                              f"{max_tokens!r}")
    seed = item.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise AsyncInferError(f"{where}: seed must be an integer, got {seed!r}")
    return RequestSpec(tuple(prompt), max_tokens,
                       temperature=_number(item.get("temperature", 0.0), where,
                                           "temperature", 0.0, 100.0),
                       top_p=_number(item.get("top_p", 1.0), where, "top_p", 1e-9, 1.0),
                       seed=seed)


def read_workload_file(path: str | Path) -> list[RequestSpec]:
    """The requests of a workload file; AsyncInferError naming the file and the request
    where it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise AsyncInferError(f"cannot read the workload file {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise AsyncInferError(f"the workload file {path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
        raise AsyncInferError(f"the workload file {path} must hold {{\"requests\": [...]}}")
    if not data["requests"]:
        raise AsyncInferError(f"the workload file {path} holds no request")
    return [_request(item, f"{path}, request {i}") for i, item in enumerate(data["requests"])]
