"""A client that leaves before its answer, over real HTTP (uvicorn on 127.0.0.1): its row leaves the engine, the
request is one INFO line with its id and a 499 in the metrics, and nothing is logged as an error."""

import asyncio
import gc
import json
import logging
import queue
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from serve.config import ServeConfig
from serve.engine.engine import Engine
from serve.engine.types import SamplingParams
from serve.http.app import build_http_app

MESSAGES = [{"role": "user", "content": "hello"}]
CHAT = {"model": "tiny-lm-top", "messages": MESSAGES, "max_tokens": 64, "temperature": 0}
"""A chat of 64 tokens, on a variant: while its row runs, it holds the variant in the cache."""


class Watched:
    """The engine as the app's backend, telling the test when a generation starts and how its call ended."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.started = threading.Event()
        self.ended: queue.Queue[str] = queue.Queue()
        self.on_first_piece: Callable[[], None] = lambda: None

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    async def complete(self, *args, **kwargs):
        self.started.set()
        try:
            gen = await self.engine.complete(*args, **kwargs)
        except asyncio.CancelledError:
            self.ended.put("cancelled")
            raise
        self.ended.put("answered")
        return gen

    async def complete_stream(self, *args, **kwargs):
        pieces, finished = self.engine.complete_stream(*args, **kwargs), False
        try:
            async for piece in pieces:
                if not self.started.is_set():
                    self.started.set()
                    self.on_first_piece()
                finished = piece.final is not None
                yield piece
        finally:
            await pieces.aclose()
            self.ended.put("finished" if finished else "closed")


@pytest.fixture(scope="module")
def engine(serving_store) -> Engine:
    eng = Engine(ServeConfig(store=serving_store[0]))
    gen = asyncio.run(eng.complete("tiny-lm-top", SamplingParams(max_tokens=64), messages=MESSAGES))
    assert gen.finish_reason == "length"  # left alone, the row would run all 64 tokens
    return eng


@contextmanager
def served(backend) -> Iterator[tuple[str, object]]:
    """The app on a uvicorn server of its own, on a socket bound before it starts (so no wait for it to listen);
    -> (url, app). On exit the server stops after every request it took has finished."""
    config = ServeConfig(store=backend.engine.config.store)
    app = build_http_app(backend, config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="off"))  # logs reach caplog
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


class ComputeGate:
    """Holds the engine's compute thread from hold() until open() (or the end of the block): rows cannot step."""

    def __init__(self, engine: Engine):
        self.engine, self.gate = engine, threading.Event()

    def hold(self) -> None:
        self.engine._compute.submit(self.gate.wait)

    def open(self) -> None:
        self.gate.set()

    def __enter__(self) -> "ComputeGate":
        return self

    def __exit__(self, *exc) -> None:
        self.open()


def raw_post(url: str, path: str, body: dict, rid: str) -> socket.socket:
    """A POST written on a socket of its own, so that the test closes the connection when it chooses."""
    data = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\nx-request-id: {rid}\r\n\r\n".encode() + data)
    return sock


def requests_counted(app, status: str) -> float:
    text = app.state.http.metrics.render([], []).decode()
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "manyfold_requests"
               for s in f.samples if s.name == "manyfold_requests_total" and s.labels["status"] == status
               and s.labels["model"] == "tiny-lm-top")


def check_log(caplog, rid: str, message: str) -> None:
    gc.collect()  # an exception nobody retrieved is logged ("... was never retrieved") when its future is freed
    mine = [r for r in caplog.records if rid in r.getMessage()]
    assert [(r.levelname, r.getMessage(), r.exc_info) for r in mine] == [("INFO", message, None)]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []


def test_a_client_gone_before_its_answer_frees_its_row_and_is_one_info_line_and_a_499(engine, caplog):
    caplog.set_level(logging.INFO)
    backend = Watched(engine)
    with served(backend) as (url, app), ComputeGate(engine) as gate:
        gate.hold()  # the row is queued in the engine and cannot finish before the client leaves
        client = raw_post(url, "/v1/chat/completions", CHAT, rid="gone-1")
        assert backend.started.wait(60)
        client.close()
        assert backend.ended.get(timeout=60) == "cancelled"  # the server stopped working for it
        gate.open()
        other = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "model": "tiny-lm", "max_tokens": 2},
                           timeout=60)
        assert other.status_code == 200  # answered after the row that left: it ran in the same batch
        assert engine.holds() == {}  # the row gone has left the batch, with its hold on tiny-lm-top
    assert requests_counted(app, "499") == 1 and requests_counted(app, "500") == 0
    check_log(caplog, "gone-1", "POST /v1/chat/completions -> 499 the client closed the request (request gone-1)")


def test_a_client_gone_mid_stream_frees_its_row_and_is_one_info_line_and_a_499(engine, caplog):
    caplog.set_level(logging.INFO)
    backend = Watched(engine)
    with served(backend) as (url, app), ComputeGate(engine) as gate:
        backend.on_first_piece = gate.hold  # the row cannot run its 64 tokens
        client = raw_post(url, "/v1/chat/completions", {**CHAT, "stream": True}, rid="gone-2")
        received = b""
        while b"data: " not in received:
            received += client.recv(4096)
        assert received.startswith(b"HTTP/1.1 200")
        client.close()
        assert backend.ended.get(timeout=60) == "closed"
        gate.open()
        other = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "model": "tiny-lm", "max_tokens": 2},
                           timeout=60)
        assert other.status_code == 200
        assert engine.holds() == {}
    assert requests_counted(app, "499") == 1 and requests_counted(app, "200") == 0
    check_log(caplog, "gone-2",
              "POST /v1/chat/completions -> 499 the client closed the request mid-response (request gone-2)")
