"""The one exception hierarchy of asyncinfer; the server maps each class to an HTTP status."""

from __future__ import annotations


class AsyncInferError(Exception):
    """Base of every error asyncinfer raises on purpose."""

    http_status = 500


class InvalidRequestError(AsyncInferError, ValueError):
    """A request or option the user can fix: bad sampling value, prompt too long, ...

    ``param`` names the request field at fault, when there is one (the server reports it).
    """

    http_status = 400

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFoundError(AsyncInferError):
    """A model name, path or hub id that cannot be resolved to weights on this machine."""

    http_status = 404


class UnsupportedModelError(AsyncInferError):
    """A model whose architecture asyncinfer has no implementation for."""

    http_status = 400


class EngineError(AsyncInferError):
    """The engine failed while running a batch."""

    http_status = 500


class ConfigError(AsyncInferError, ValueError):
    """An engine option out of range or inconsistent with the model or the machine."""

    http_status = 400
