"""The size limit at the edge: a body over limits.max_request_bytes is one 413 line, a chunked one (no
Content-Length) as soon as its bytes pass the limit, so the rest is never read; a body within it is served.
A handler cancelled because its client left (as Ray Serve's proxy cancels it), or a stream whose server can no
longer hear from its client (Ray Serve's receive raises), is a 499 and one INFO line."""

import asyncio
import json
import logging

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from serve.config import ServeConfig
from serve.engine.types import Classifications, TextDelta
from serve.http.app import build_http_app

LIMIT = 1024
CHUNK = 256
JSON = {"content-type": "application/json"}


class FakeEngine:
    async def classify(self, model: str, texts: list[str], truncate: bool = True, tenant=None) -> Classifications:
        return Classifications(labels=["neg", "pos"], probs=[[0.25, 0.75]] * len(texts), prompt_tokens=len(texts))


@pytest.fixture
def app(tmp_path):
    config = ServeConfig(store=tmp_path, limits={"max_request_bytes": LIMIT})
    return build_http_app(FakeEngine(), config)


def padded(size: int) -> bytes:
    """A classify request of exactly `size` bytes."""
    body = json.dumps({"model": "clf", "input": "good"}).encode()
    return body + b" " * (size - len(body))


def pieces(body: bytes):
    for i in range(0, len(body), CHUNK):
        yield body[i:i + CHUNK]


class Counted:
    """An async request body, in CHUNK-byte chunks, that counts how many of them the server pulled."""

    def __init__(self, body: bytes):
        self.chunks, self.pulled = list(pieces(body)), 0

    async def __aiter__(self):
        for chunk in self.chunks:
            self.pulled += 1
            yield chunk


def post(app, body: Counted, headers: dict) -> httpx.Response:
    """Over httpx's ASGI transport, which pulls the request body only when the app receives."""
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
            return await c.post("/v1/classify", content=body, headers={**JSON, **headers})

    return asyncio.run(go())


def test_a_chunked_body_over_the_limit_is_one_413_line(app):
    with TestClient(app) as client:
        r = client.post("/v1/classify", content=pieces(padded(LIMIT + 1)), headers=JSON)
    assert "content-length" not in r.request.headers and r.request.headers["transfer-encoding"] == "chunked"
    assert r.status_code == 413 and r.headers["x-request-id"]
    assert r.json()["error"] == {"message": f"request body exceeds {LIMIT} bytes", "type": "request_too_large",
                                 "code": "request_too_large", "param": None}


def test_a_chunked_body_within_the_limit_is_served(app):
    with TestClient(app) as client:
        r = client.post("/v1/classify", content=pieces(padded(LIMIT)), headers=JSON)
    assert r.request.headers["transfer-encoding"] == "chunked"
    assert r.status_code == 200 and r.json()["data"][0]["label"] == "pos"


def test_a_chunked_body_is_read_no_further_than_the_limit(app):
    body = Counted(padded(100 * LIMIT))
    r = post(app, body, {})
    assert r.status_code == 413 and r.json()["error"]["message"] == f"request body exceeds {LIMIT} bytes"
    assert body.pulled == LIMIT // CHUNK + 1 < len(body.chunks)  # the chunk that passed the limit was the last


def test_a_chunked_body_that_fits_reaches_the_route_whole(app):
    body = Counted(padded(LIMIT))
    r = post(app, body, {})
    assert r.status_code == 200 and r.json()["data"][0]["label"] == "pos"
    assert body.pulled == len(body.chunks) > 1


def test_a_content_length_over_the_limit_is_refused_before_reading_anything(app):
    body = Counted(padded(100 * LIMIT))
    r = post(app, body, {"content-length": str(100 * LIMIT)})
    assert r.status_code == 413
    assert r.json()["error"]["message"] == f"request body of {100 * LIMIT} bytes exceeds {LIMIT}"
    assert body.pulled == 0


class Stalled(FakeEngine):
    """A classify that never ends: its request ends only when its client leaves."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def classify(self, model: str, texts: list[str], truncate: bool = True, tenant=None) -> Classifications:
        self.entered.set()
        await asyncio.Event().wait()


def test_a_handler_cancelled_when_its_client_left_is_a_499_and_one_info_line(tmp_path, caplog):
    backend = Stalled()
    app = build_http_app(backend, ServeConfig(store=tmp_path))

    async def leave() -> None:  # httpx's ASGI transport runs the app in the caller's task, which is cancelled
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
            call = asyncio.ensure_future(c.post("/v1/classify", json={"model": "clf", "input": "good"},
                                                headers={"x-request-id": "req-9"}))
            await backend.entered.wait()
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

    with caplog.at_level(logging.INFO):
        asyncio.run(leave())
    assert [(r.levelname, r.getMessage(), r.exc_info) for r in caplog.records] == [
        ("INFO", "POST /v1/classify -> 499 the client closed the request (request req-9)", None)]
    assert requests_counted(app) == {"499": 1.0}


class Endless(FakeEngine):
    """A stream that never ends by itself."""

    async def complete_stream(self, model: str, params, prompt=None, messages=None, tenant=None):
        while True:
            yield TextDelta("a")
            await asyncio.sleep(0)  # a turn of the event loop per piece


def requests_counted(app) -> dict[str, float]:
    text = app.state.http.metrics.render([], []).decode()
    return {s.labels["status"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "manyfold_requests" for s in f.samples if s.name == "manyfold_requests_total"}


def test_a_stream_whose_server_can_no_longer_hear_its_client_is_a_499_not_an_internal_error(tmp_path, caplog):
    app = build_http_app(Endless(), ServeConfig(store=tmp_path))
    body = json.dumps({"model": "lm", "prompt": "a", "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("testserver", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         (b"x-request-id", b"req-10")]}
    received = []

    async def receive():
        received.append(1)
        if len(received) == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        if len(received) == 2:  # heard while the first piece comes: the client is still there
            await asyncio.Event().wait()
        raise RuntimeError("Task was cancelled.")  # as Ray Serve's TaskCancelledError, once its proxy dropped it

    async def send(message) -> None:
        pass

    with caplog.at_level(logging.INFO):
        asyncio.run(app(scope, receive, send))
    lines = [(r.levelname, r.getMessage(), r.exc_info) for r in caplog.records]
    assert lines == [("INFO", "POST /v1/completions -> 499 the client closed the request mid-response "
                               "(request req-10)", None)]
    assert requests_counted(app) == {"499": 1.0} and len(received) == 3
