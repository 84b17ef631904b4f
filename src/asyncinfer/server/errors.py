"""The one mapping from an exception (ours, aiohttp's, or unexpected: 500, logged) to an
HTTP error response, ``{"error": {"message", "type", "param", "code"}}`` as OpenAI's."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from asyncinfer.errors import AsyncInferError

logger = logging.getLogger(__name__)

_TYPES = {401: "authentication_error", 404: "not_found_error"}


CLIENT_CLOSED = 499  # nginx's status for a client that left before its answer; never sent


class APIError(AsyncInferError):
    """An HTTP-level error the server raises itself: a status, and the request field at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.http_status = status
        self.param = param
        self.code = code
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 naming the request field at fault."""
    return APIError(400, message, param=param, code=code)


def error_type(status: int) -> str:
    """OpenAI's ``type`` for a status: ``invalid_request_error`` for 4xx, ``server_error`` else."""
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The JSON body of an error response."""
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": code}}


def http_status(exc: BaseException) -> int:
    """The status ``exc`` is answered with."""
    if isinstance(exc, AsyncInferError):
        return int(exc.http_status)
    if isinstance(exc, web.HTTPException):
        return exc.status
    return 500


def error_payload(exc: BaseException, request: web.Request | None = None
                  ) -> tuple[int, dict[str, Any], dict[str, str]]:
    """Status, body and extra headers for ``exc``; anything not raised on purpose is logged."""
    status = http_status(exc)
    headers: dict[str, str] = {}
    if isinstance(exc, AsyncInferError):
        body = error_body(status, str(exc), getattr(exc, "param", None),
                          getattr(exc, "code", None))
        headers.update(getattr(exc, "headers", {}))
        if status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if status >= 500 and status != 503:
            logger.error("%s: %s", type(exc).__name__, exc)
    elif isinstance(exc, web.HTTPException):
        where = f" ({request.method} {request.path})" if request is not None else ""
        body = error_body(status, f"{exc.reason}{where}")
        if isinstance(exc, web.HTTPMethodNotAllowed):
            headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
    else:
        where = f"{request.method} {request.path}" if request is not None else "a request"
        logger.exception("unexpected error while handling %s", where)
        body = error_body(status, f"internal server error ({type(exc).__name__}); "
                                  "see the server log")
    return status, body, headers


def error_response(exc: BaseException, request: web.Request | None = None) -> web.Response:
    """The JSON response for ``exc``."""
    status, body, headers = error_payload(exc, request)
    response = web.json_response(body, status=status, headers=headers)
    if headers.get("Connection") == "close":
        response.force_close()
    return response


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                           ) -> web.StreamResponse:
    """Answer every error a handler raises through :func:`error_response`."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise  # a redirect is not an error
        return error_response(exc, request)
    except Exception as exc:
        return error_response(exc, request)


def from_validation(exc: Any) -> APIError:
    """A pydantic ``ValidationError`` as a 400 naming the first field at fault."""
    error = exc.errors(include_url=False)[0]
    param = _param(error["loc"])
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = "unknown field"
    elif error["type"] == "missing":
        message = "is required"
    got = "" if error["type"] in ("missing", "value_error") else f", got {_short(error)}"
    return bad_request(f"{param or 'body'}: {message}{got}", param)


def _param(loc: tuple[int | str, ...]) -> str | None:
    """``('messages', 0, 'content')`` as ``messages[0].content``."""
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else part)
    return param or None


def _short(error: Mapping[str, Any]) -> str:
    text = repr(error.get("input"))
    return text if len(text) <= 80 else text[:77] + "..."
