"""The aiohttp application: :func:`create_app` puts routes, operations and router API together."""

from __future__ import annotations

from aiohttp import web

from asyncinfer.server.backend import GenerateBackend
from asyncinfer.server.errors import error_middleware
from asyncinfer.server.metrics import ServerMetrics
from asyncinfer.server.operations import (
    BACKEND,
    METRICS,
    STATE,
    Operations,
    ServerState,
    auth_middleware,
)
from asyncinfer.server.options import ServerOptions
from asyncinfer.server.router_api import RouterAPI, WorkerInfo
from asyncinfer.server.routes import Routes

MAX_BODY_BYTES = 16 * 2**20


def create_app(backend: GenerateBackend, *, api_key: str | None = None,
               served_model_name: str | None = None, options: ServerOptions | None = None,
               worker: WorkerInfo | None = None) -> web.Application:
    """An app serving ``backend``; the caller starts and closes it.

    With ``api_key``, /v1/*, /generate, /flush_cache and /health_generate need
    ``Authorization: Bearer <api_key>``; /health, metrics, OpenAPI and the router's worker
    routes stay open. ``served_model_name``
    defaults to ``backend.model_name``; ``worker`` describes the model to routers.
    """
    options = options or ServerOptions()
    served_name = served_model_name or backend.model_name
    worker = worker or WorkerInfo()
    metrics = ServerMetrics(backend.stats, served_name, worker.page_size)
    middlewares = [error_middleware] + ([auth_middleware(api_key)] if api_key else [])
    # Bodies are inflated by .body, bounded and off the event loop, not by aiohttp.
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES,
                          handler_args={"auto_decompress": False})
    state = ServerState()
    app[METRICS], app[STATE], app[BACKEND] = metrics, state, backend
    operations = Operations(backend, options, state, metrics)
    routes = Routes(backend, served_name, metrics, options, operations)
    routes.add_routes(app)
    app.router.add_get("/health", operations.health)
    app.router.add_get("/health_generate", operations.health_generate)
    app.router.add_post("/flush_cache", operations.flush_cache)
    RouterAPI(backend, served_name, options, worker).add_routes(app)

    async def stop_tokenizing(app: web.Application) -> None:
        routes.encoder.pool.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(stop_tokenizing)
    return app
