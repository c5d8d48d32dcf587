"""Around every request, as pure ASGI middleware: its id, its metrics and the x-request-id header (Measured);
the body-size limit (BodyLimit), checked before any route reads the body."""

import asyncio
import time
import uuid
from collections import deque
from dataclasses import dataclass

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.config import LimitsConfig
from serve.errors import ClientGone, TooLarge
from serve.http.disconnect import GONE
from serve.http.errors import error_response, log_refused
from serve.metrics import Metrics


class Measured:
    """Gives the request an id (the client's x-request-id, cut to 64 characters, or a fresh one), a model and a
    tenant (None until a route names them), times it to the start of its response, counts it by status once it ends,
    and returns the id in x-request-id. A request whose client left before its response ended (its handler
    cancelled, as Ray Serve's proxy does, or a stream cut short) counts as 499, with one INFO line. Pure ASGI
    rather than BaseHTTPMiddleware, whose call_next turned a handler cut short into "RuntimeError: No response
    returned.", an internal error."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        rid = Headers(scope=scope).get("x-request-id", "")[:64] or uuid.uuid4().hex[:16]
        request_state = scope.setdefault("state", {})  # what handlers see as request.state
        request_state.update(model=None, tenant=None, request_id=rid)
        response = _Response()

        async def send_measured(message: Message) -> None:
            if message["type"] == "http.response.start":
                response.status = message["status"]
                self.metrics.time(request_state["model"], _route(scope), response.status, started)
                MutableHeaders(scope=message)["x-request-id"] = rid
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                response.ended = True
            await send(message)

        try:
            await self.app(scope, _heard(receive), send_measured)
        except asyncio.CancelledError:  # Ray Serve's proxy cancels the handler of a client gone
            self._end(scope, response)
            raise
        except ClientDisconnect:  # a server that says so by raising: nothing is left to send, and no error
            self._end(scope, response)
        except BaseException:  # the error handler answers 500, unless the response had ended
            self.metrics.count(request_state["model"], _route(scope), response.status if response.ended else 500,
                               request_state["tenant"])
            raise
        else:
            self._end(scope, response)

    def _end(self, scope: Scope, response: "_Response") -> None:
        """Counts the request under its status, or as 499 with one INFO line when its client left before the
        response ended."""
        status = response.status if response.ended else ClientGone.http_status
        if not response.ended:
            log_refused(Request(scope), status, GONE + (" mid-response" if response.status else ""))
        self.metrics.count(scope["state"]["model"], _route(scope), status, scope["state"]["tenant"])


@dataclass
class _Response:
    status: int | None = None
    """Set when the response starts."""
    ended: bool = False
    """Its last body message was sent."""


def _heard(receive: Receive) -> Receive:
    """receive, where a failure to hear from the client says it has gone: Ray Serve's raises TaskCancelledError
    once its proxy has dropped the request, which would reach the app as an internal error, with a traceback."""

    async def heard() -> Message:
        try:
            return await receive()
        except Exception:  # noqa: BLE001  (whatever the server raises, there is no client left to answer)
            return {"type": "http.disconnect"}

    return heard


def _route(scope: Scope) -> str:
    return getattr(scope.get("route"), "path", "unmatched")


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
