"""Every error asyncinfer raises on purpose, one hierarchy; each class has its HTTP status."""

from __future__ import annotations


class AsyncInferError(Exception):
    http_status = 500


class InvalidRequestError(AsyncInferError, ValueError):
    """A request or option the user can fix; ``param`` names the request field at fault."""

    http_status = 400

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFoundError(AsyncInferError):
    http_status = 404


class UnsupportedModelError(AsyncInferError):
    http_status = 400


class EngineError(AsyncInferError):
    http_status = 500


class ConfigError(AsyncInferError, ValueError):
    """An engine option out of range or inconsistent with the model or the machine."""

    http_status = 400
