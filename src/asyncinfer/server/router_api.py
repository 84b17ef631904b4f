"""sglang-router's worker protocol: what a router registering this server reads of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aiohttp import web
from attrs import frozen

from asyncinfer.server.backend import GenerateBackend
from asyncinfer.server.options import ServerOptions


@frozen
class WorkerInfo:
    """The model a server runs, as routers and operators ask for it: where it was loaded
    from, its architecture, and the parallelism it runs with."""

    model_path: str | None = None
    model_type: str | None = None
    architectures: tuple[str, ...] = ()
    tp_size: int = 1
    policy: str | None = None
    page_size: int = 16
    device: str | None = None
    dtype: str | None = None

    @classmethod
    def from_model_dir(cls, model_dir: str, tp_size: int = 1, policy: str | None = None,
                       page_size: int = 16, *, device: str | None = None,
                       dtype: str | None = None) -> WorkerInfo:
        """Read from the model directory's config.json (what is missing stays None)."""
        try:
            config = json.loads((Path(model_dir) / "config.json").read_text())
        except (OSError, ValueError):
            config = {}
        return cls(model_dir, config.get("model_type"),
                   tuple(config.get("architectures") or ()), tp_size, policy, page_size,
                   device, dtype)

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path,
                "model_type": self.model_type, "architectures": list(self.architectures)}

    def server_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path,
                "tp_size": self.tp_size, "dp_size": 1, "policy": self.policy,
                "page_size": self.page_size, "device": self.device, "dtype": self.dtype,
                "engine": "asyncinfer"}


class RouterAPI:
    """The worker routes: /server_info, /model_info, /get_load (and older spellings)."""

    def __init__(self, backend: GenerateBackend, served_name: str, options: ServerOptions,
                 worker: WorkerInfo) -> None:
        self.backend, self.served_name = backend, served_name
        self.options, self.worker = options, worker

    def add_routes(self, app: web.Application) -> None:
        for path, handler in (("/server_info", self.server_info),
                              ("/get_server_info", self.server_info),
                              ("/model_info", self.model_info),
                              ("/get_model_info", self.model_info),
                              ("/get_load", self.load)):
            app.router.add_get(path, handler)

    async def server_info(self, request: web.Request) -> web.Response:
        """The served model, parallelism, limits, and the live counters."""
        stats = self.backend.stats()
        return web.json_response({
            **self.worker.server_info(), "served_model_name": self.served_name,
            "context_length": self.backend.context_len,
            "max_waiting_requests": self.options.max_waiting_requests,
            "num_running_reqs": stats.running, "num_waiting_reqs": stats.waiting,
            "kv_pages_used": stats.kv_pages_used, "kv_pages_total": stats.kv_pages_total,
            "version": _version()})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({**self.worker.model_info(),
                                  "served_model_name": self.served_name,
                                  "is_generation": True,
                                  "context_length": self.backend.context_len})

    async def load(self, request: web.Request) -> web.Response:
        """The load that load-aware router policies weigh, one entry per data-parallel rank
        (here one); ``num_tokens`` are those whose KV the running requests hold."""
        stats = self.backend.stats()
        return web.json_response([{
            "dp_rank": 0, "num_reqs": stats.running + stats.waiting,
            "num_running_reqs": stats.running, "num_waiting_reqs": stats.waiting,
            "num_tokens": stats.kv_pages_used * self.worker.page_size}])


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("asyncinfer")
    except PackageNotFoundError:
        return "unknown"
