"""Around every request, as pure ASGI middleware: its id, its metrics and the x-request-id header (Measured);
the body-size limit (BodyLimit), checked before any route reads the body."""

import time
import uuid
from collections import deque

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.config import LimitsConfig
from serve.errors import TooLarge
from serve.http.errors import error_response
from serve.metrics import Metrics


class Measured:
    """Gives the request an id (the client's x-request-id, cut to 64 characters, or a fresh one) and a model
    (None until a route names it), observes its status and latency when the response starts, and returns the
    id in x-request-id. Pure ASGI rather than BaseHTTPMiddleware, whose call_next turned a handler cut short
    (a CancelledError when the client left) into "RuntimeError: No response returned.", an internal error."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        rid = Headers(scope=scope).get("x-request-id", "")[:64] or uuid.uuid4().hex[:16]
        request_state = scope.setdefault("state", {})  # what handlers see as request.state
        request_state.update(model=None, request_id=rid)

        async def send_measured(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")
                self.metrics.observe(request_state["model"], getattr(route, "path", "unmatched"), message["status"],
                                     started)
                MutableHeaders(scope=message)["x-request-id"] = rid
            await send(message)

        await self.app(scope, receive, send_measured)


class BodyLimit:
    """413 for a body over limits.max_request_bytes: by its Content-Length, before reading anything; a POST
    without one (a chunked body) is read here first, refused as soon as its bytes pass the limit (the rest
    is never read), and handed on unchanged if it fits. Buffering here holds no more than the route would:
    it reads a JSON body whole."""

    def __init__(self, app: ASGIApp, limits: LimitsConfig) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limits.max_request_bytes
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            response = error_response(413, TooLarge.code, f"request body of {length} bytes exceeds {limit}")
            return await response(scope, receive, send)
        if scope["method"] == "POST" and length is None:
            messages, fits = await _read_body(receive, limit)
            if not fits:
                response = error_response(413, TooLarge.code, f"request body exceeds {limit} bytes")
                return await response(scope, receive, send)
            receive = _replay(messages, receive)
        await self.app(scope, receive, send)


async def _read_body(receive: Receive, limit: int) -> tuple[list[Message], bool]:
    """The request's messages up to the end of its body (or the client leaving), and True; or those read
    until their bytes passed limit, and False."""
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages, True
        size += len(message.get("body", b""))
        if size > limit:
            return messages, False
        if not message.get("more_body", False):
            return messages, True


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that gives the messages already read, in order, then reads on."""
    pending = deque(messages)

    async def replayed() -> Message:
        return pending.popleft() if pending else await receive()

    return replayed
