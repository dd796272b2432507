"""Errors the engine raises for bad requests. Each names the offending field, so the server can answer with
a precise gRPC status (the mapping lives in the server, which is the only place that knows gRPC)."""

from __future__ import annotations


class RequestError(Exception):
    """Base class of every request the engine refuses (Score, Generate, Tokenize alike): `field` is the request
    field at fault ('' when none applies)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


class InvalidArgument(RequestError):
    """The request is malformed or out of range (gRPC INVALID_ARGUMENT)."""


class FailedPrecondition(RequestError):
    """Well-formed, but this model or configuration cannot serve it (gRPC FAILED_PRECONDITION)."""


class NotFound(RequestError):
    """A named resource (the model) does not exist here (gRPC NOT_FOUND)."""


class ResourceExhausted(RequestError):
    """The request exceeds a configured limit of this server (gRPC RESOURCE_EXHAUSTED)."""
