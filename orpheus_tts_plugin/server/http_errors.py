"""Every HTTP error of `orpheus-tts serve` in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from starlette.responses import JSONResponse

from ..errors import EngineFailedError, EngineOverloadedError
from ..wire import protocol
from .policy import LimitError, StreamLimitError

KINDS = {  # status → OpenAI's error type
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded",
}
CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def error_body(
    status: int, message: str, *, code: str | None = None, param: str | None = None, kind: str | None = None
) -> dict[str, str | None]:
    """OpenAI's error object: {"message", "type", "param", "code"}."""
    return {
        "message": message,
        "type": kind or KINDS.get(status, "server_error"),
        "param": param,
        "code": code or CODES.get(status),
    }


def error_json(
    status: int, message: str, *, code: str | None = None, param: str | None = None, kind: str | None = None
) -> JSONResponse:
    """A JSON error response; 429 and 503 say when to retry, 401 which scheme to use."""
    body = error_body(status, message, code=code, param=param, kind=kind)
    headers = {"Retry-After": "1"} if status in (429, 503) else {}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse({"error": body}, status_code=status, headers=headers or None)


def error_response(exc: BaseException, param: str | None = None) -> JSONResponse:
    """413 over a limit, 400 bad input, 429 at a client's share of streams, 503 overloaded or draining (and
    failed), else 500; `code` names the
    exception class a client raises for it (`protocol.ERRORS`)."""
    status, kind = status_of(exc)
    return error_json(status, str(exc), code=protocol.error_name(exc), param=param, kind=kind)


def error_object(exc: BaseException) -> dict[str, str | None]:
    """OpenAI's error object for `exc` (what `error_response`'s body holds under "error"): for an error that comes
    after the response began, e.g. an SSE `error` event."""
    status, kind = status_of(exc)
    return error_body(status, str(exc), code=protocol.error_name(exc), kind=kind)


def status_of(exc: BaseException) -> tuple[int, str | None]:
    """The HTTP status of `exc` and, where it is not the status's own, OpenAI's error type."""
    kind = None
    if isinstance(exc, LimitError):
        status = 413
    elif isinstance(exc, (ValueError, TypeError)):
        status = 400
    elif isinstance(exc, StreamLimitError):
        status = 429
    elif isinstance(exc, (EngineOverloadedError, EngineFailedError)):
        status, kind = 503, "overloaded" if isinstance(exc, EngineOverloadedError) else "server_error"
    else:
        status = 500
    return status, kind
