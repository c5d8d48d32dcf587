"""Around every request: its id, the body-size limit, its metrics and the x-request-id response header."""

import time
import uuid

from fastapi import Request, Response

from serve.errors import TooLarge
from serve.http.errors import error_response


async def measure(request: Request, call_next) -> Response:
    state = request.app.state.http
    limits = state.limits
    started = time.perf_counter()
    request.state.model = None
    request.state.request_id = request.headers.get("x-request-id", "")[:64] or uuid.uuid4().hex[:16]
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limits.max_request_bytes:
        response = error_response(413, TooLarge.code,
                                  f"request body of {length} bytes exceeds {limits.max_request_bytes}")
    elif request.method == "POST" and length is None and len(await request.body()) > limits.max_request_bytes:
        response = error_response(413, TooLarge.code, f"request body exceeds {limits.max_request_bytes} bytes")
    else:
        response = await call_next(request)
    route = request.scope.get("route")
    state.metrics.observe(request.state.model, getattr(route, "path", "unmatched"), response.status_code, started)
    response.headers["x-request-id"] = request.state.request_id
    return response
