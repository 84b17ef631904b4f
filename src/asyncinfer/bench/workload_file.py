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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncinfer.bench.plan import RequestSpec
from asyncinfer.errors import AsyncInferError
from asyncinfer.params import BOUNDS, MAX_INT32

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


_REQUIRED = object()


def _field(item: dict[str, Any], name: str, where: str, default: Any = _REQUIRED) -> Any:
    """``item[name]`` within the engine's bound for it; ``default`` where it is absent (or,
    for a default of None, null)."""
    if name not in item or (item[name] is None and default is None):
        if default is _REQUIRED:
            raise AsyncInferError(f"{where}: {name} is missing")
        return default
    value, bound = item[name], BOUNDS[name]
    try:
        holds = bound.holds(value)
    except (OverflowError, TypeError):  # an integer past a float's range, say
        holds = False
    if not holds:
        raise AsyncInferError(f"{where}: {name} must be {bound.describe()}, got "
                              f"{str(value)[:40]}")
    return value


def _request(item: Any, where: str) -> RequestSpec:
    if not isinstance(item, dict):
        raise AsyncInferError(f"{where}: expected an object, got {type(item).__name__}")
    if unknown := sorted(set(item) - set(FIELDS)):
        raise AsyncInferError(f"{where}: unknown field(s) {', '.join(unknown)}; a request "
                              f"has {', '.join(FIELDS)}")
    prompt = item.get("prompt")
    if (not isinstance(prompt, list) or not prompt
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT32
                       for t in prompt)):
        raise AsyncInferError(f"{where}: prompt must be a non-empty list of token ids "
                              f"(integers >= 0)")
    return RequestSpec(tuple(prompt), _field(item, "max_tokens", where),
                       temperature=float(_field(item, "temperature", where, 0.0)),
                       top_p=float(_field(item, "top_p", where, 1.0)),
                       seed=_field(item, "seed", where, None))


def read_workload_file(path: str | Path) -> list[RequestSpec]:
    """The requests of a workload file; AsyncInferError naming the file and the request
    where it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise AsyncInferError(f"cannot read the workload file {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise AsyncInferError(f"the workload file {path} is not JSON: {exc}") from None
    if (not isinstance(data, dict) or set(data) != {"requests"}
            or not isinstance(data["requests"], list)):
        raise AsyncInferError(f"the workload file {path} must hold {{\"requests\": [...]}} "
                              f"and nothing else")
    if not data["requests"]:
        raise AsyncInferError(f"the workload file {path} holds no request")
    return [_request(item, f"{path}, request {i}") for i, item in enumerate(data["requests"])]
