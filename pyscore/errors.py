"""Errors the engine raises for bad requests. Each names the offending field, so the server can answer with
a precise gRPC status (the mapping lives in the server, which is the only place that knows gRPC). A message that
quotes the client's input quotes it through `quoted`, so no input can make a message long."""

from __future__ import annotations

QUOTE_LIMIT = 200  # characters of client input a message quotes at most
QUOTE_ENDS = 8  # elements quoted from each end of a long list


def elide(text: str, limit: int) -> str:
    """text, or its head and tail around a note of how much was cut from the middle: at most ~limit + 30
    characters whatever the length of text."""
    if len(text) <= limit:
        return text
    keep = limit // 2
    return f"{text[:keep]}…({len(text) - 2 * keep} characters elided)…{text[len(text) - keep:]}"


def quoted(value: object, limit: int = QUOTE_LIMIT) -> str:
    """repr(value) for an error message, elided in the middle past about `limit` characters. Every message that
    quotes client input (a label, a model name, a list of token ids) quotes it with this: a status message
    travels in gRPC metadata twice (grpc-message, and the BadRequest in grpc-status-details-bin), and gRPC
    clients refuse metadata over 16 KiB by default — with RESOURCE_EXHAUSTED instead of the status the server
    meant. Only the quoted ends are ever repr'd, so quoting a huge input costs no more than a short one."""
    if isinstance(value, str):
        return repr(elide(value, limit))
    if isinstance(value, (list, tuple)) and len(value) > 2 * QUOTE_ENDS:
        ends = [quoted(v, limit) for v in (*value[:QUOTE_ENDS], *value[-QUOTE_ENDS:])]
        middle = f"…({len(value) - 2 * QUOTE_ENDS} more)…"
        return elide(f"[{', '.join([*ends[:QUOTE_ENDS], middle, *ends[QUOTE_ENDS:]])}]", limit)
    return elide(repr(value), limit)


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


class PassInterrupted(Exception):
    """A forward pass stopped at a layer boundary because its owner's decision there said STOP (every caller of the pass
    gave up, or the server is shutting down). Nothing of the pass is committed — no prefix-cache block, no KV-cache
    length, no token — so the requests can be run again from where they were; it is never one request's error."""
