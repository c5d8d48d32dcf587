"""The edge of serve/errors.py: every error leaves as one JSON body and at most one log line.

A ManyfoldError keeps its status and code; request validation is a 422 naming the first `loc: msg`; anything
else is a 500 "internal error (request <id>)" with the traceback only in the logs."""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.errors import ManyfoldError, first_error
from serve.http import schemas as S

log = logging.getLogger("manyfold.http")


def error_response(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    body = S.ErrorBody(error=S.ErrorDetail(message=message, type=code, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def internal_error(rid: str) -> S.ErrorDetail:
    """Logs the exception being handled; the client gets an id to find it by, never the traceback."""
    log.exception("internal error (request %s)", rid)
    return S.ErrorDetail(message=f"internal error (request {rid})", type="internal_error", code="internal_error")


def request_id(request: Request) -> str:
    return getattr(request.state, "request_id", None) or "-"


def log_refused(request: Request, status: int, message: str) -> None:
    """One line per refused request, no traceback (that is for internal errors): INFO for a client's mistake,
    WARNING for the server's refusals (429, 5xx)."""
    level = logging.INFO if status in (400, 401, 403, 404, 413, 422, 499) else logging.WARNING
    log.log(level, "%s %s -> %d %s (request %s)", request.method, request.url.path, status, message,
            request_id(request))


def manyfold_message(request: Request, e: ManyfoldError) -> str:
    """The error's one line; a server's failure (5xx) also names the request, so an operator finds its log."""
    return f"{e} (request {request_id(request)})" if e.http_status >= 500 else str(e)


async def _manyfold_error(request: Request, e: ManyfoldError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after_s)} if hasattr(e, "retry_after_s") else None
    message = manyfold_message(request, e)
    log_refused(request, e.http_status, str(e))
    return error_response(e.http_status, e.code, message, headers)


def invalid_message(e: RequestValidationError) -> str:
    """A body that is not JSON says where it breaks, as json.loads does (FastAPI gives only the offset); any other
    problem is the first `loc: msg`."""
    err = e.errors()[0]
    if err["type"] != "json_invalid" or not isinstance(e.body, str):
        return first_error(e, skip=("body",))
    pos = err["loc"][-1]
    line, column = e.body.count("\n", 0, pos) + 1, pos - e.body.rfind("\n", 0, pos)
    return f"request body is not valid JSON: {err['ctx']['error']} at line {line}, column {column}"


async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
    message = invalid_message(e)
    log_refused(request, 422, message)
    return error_response(422, "invalid_request", message)


async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
    return error_response(e.status_code, "not_found" if e.status_code == 404 else "http_error", str(e.detail))


async def _internal(request: Request, e: Exception) -> JSONResponse:
    detail = internal_error(request_id(request))
    return error_response(500, detail.code, detail.message)


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ManyfoldError, _manyfold_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _internal)
