"""A graceful drain for the HTTP app: requests are counted from arrival to the last byte of their response
(a stream until its [DONE]); once the gate closes, new requests get 503 with Retry-After while those in
flight finish. The server closes every ingress's gate and waits for them before it stops the HTTP proxy."""

import asyncio

from serve.http.schemas import ErrorBody, ErrorDetail

RETRY_AFTER_S = 5


class DrainGate:
    def __init__(self) -> None:
        self.open = True
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def close(self, timeout_s: float) -> int:
        """Refuse new requests, wait up to timeout_s for those in flight; -> how many were still running."""
        self.open = False
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            pass
        return self.in_flight

    def refusal(self) -> bytes:
        message = f"server is shutting down (finishing {self.in_flight} requests in flight); retry later"
        return ErrorBody(error=ErrorDetail(message=message, type="unavailable", code="unavailable")
                         ).model_dump_json().encode()


class Gated:
    """ASGI middleware: `app.add_middleware(Gated, gate=gate)`, outermost, so it counts whole responses."""

    def __init__(self, app, gate: DrainGate):
        self.app, self.gate = app, gate

    async def __call__(self, scope, receive, send) -> None:
        gate = self.gate
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not gate.open:
            body = gate.refusal()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"retry-after", str(RETRY_AFTER_S).encode()),
                                    (b"content-length", str(len(body)).encode())]})
            return await send({"type": "http.response.body", "body": body})
        gate.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            gate.leave()
