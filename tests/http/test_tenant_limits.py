"""Per-tenant limits (serve/http/tenant_limits.py) through the HTTP app: past each limit the request is a 429 with
Retry-After and a message naming the limit and its value, counted by tenant in the metrics; nothing else is
refused (the same tenant's other limits, other tenants). Time is the gate's clock, set by the test."""

import asyncio

import httpx
import pytest
from prometheus_client import generate_latest

from serve.config import ServeConfig, key_digest
from serve.engine.types import Classifications
from serve.http.app import build_http_app

TOKENS = 40
"""Prompt tokens each classified text costs here."""


class Backend:
    """Classifies at once, or, while `hold` is set, waits for it to be released (a request in flight)."""

    def __init__(self):
        self.hold: asyncio.Event | None = None
        self.entered = asyncio.Event()

    async def classify(self, model: str, texts: list[str], truncate: bool = True, tenant=None) -> Classifications:
        self.entered.set()
        if self.hold is not None:
            await self.hold.wait()
        return Classifications(labels=["neg", "pos"], probs=[[0.5, 0.5]] * len(texts),
                               prompt_tokens=TOKENS * len(texts))


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _app(tmp_path, limits: dict) -> tuple:
    config = ServeConfig(store=tmp_path, tenants=[
        {"name": "limited", "key_sha256": [key_digest("sk-limited")], "limits": limits},
        {"name": "free", "key_sha256": [key_digest("sk-free")]}])
    backend = Backend()
    app = build_http_app(backend, config)
    clock = app.state.http.tenant_gate.clock = Clock()
    return app, backend, clock


async def _classify(client: httpx.AsyncClient, who: str, texts: int = 1) -> httpx.Response:
    return await client.post("/v1/classify", json={"model": "clf", "input": ["good"] * texts},
                             headers={"Authorization": f"Bearer sk-{who}"})


def _limited(app, limit: str) -> float:
    text = generate_latest(app.state.http.metrics.registry).decode()
    line = f'manyfold_tenant_limited_total{{limit="{limit}",tenant="limited"}}'
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)


def _refused(r: httpx.Response, limit: str, value: str) -> None:
    assert r.status_code == 429, r.text
    message = r.json()["error"]["message"]
    assert f"{limit} = {value}" in message and "'limited'" in message
    assert int(r.headers["retry-after"]) >= 1


def run(test) -> None:
    async def main():
        await test()

    asyncio.run(main())


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


def test_requests_per_second(tmp_path):
    app, _, clock = _app(tmp_path, {"requests_per_s": 2})

    async def test():
        async with _client(app) as c:
            assert [(await _classify(c, "limited")).status_code for _ in range(2)] == [200, 200]
            _refused(await _classify(c, "limited"), "requests_per_s", "2")
            assert (await _classify(c, "free")).status_code == 200
            clock.now += 0.5  # one request's worth refilled
            assert (await _classify(c, "limited")).status_code == 200
            _refused(await _classify(c, "limited"), "requests_per_s", "2")
        assert _limited(app, "requests_per_s") == 2

    run(test)


def test_tokens_per_minute(tmp_path):
    """Tokens are taken when a request is answered: the one that overdraws the bucket is served, the next one is
    refused until the minute's rate has refilled it."""
    app, _, clock = _app(tmp_path, {"tokens_per_min": 60})

    async def test():
        async with _client(app) as c:
            assert (await _classify(c, "limited", texts=2)).status_code == 200  # 80 tokens of 60: overdrawn
            r = await _classify(c, "limited")
            _refused(r, "tokens_per_min", "60")
            assert int(r.headers["retry-after"]) == 21  # 20 tokens owed, then one more, at a token a second
            assert (await _classify(c, "free", texts=4)).status_code == 200
            clock.now += 21
            assert (await _classify(c, "limited")).status_code == 200
        assert _limited(app, "tokens_per_min") == 1

    run(test)


def test_concurrent_requests(tmp_path):
    app, backend, _ = _app(tmp_path, {"max_concurrent": 1})

    async def test():
        backend.hold = asyncio.Event()
        async with _client(app) as c:
            first = asyncio.create_task(_classify(c, "limited"))
            await backend.entered.wait()  # the first request is in flight
            _refused(await _classify(c, "limited"), "max_concurrent", "1")
            backend.hold.set()
            assert (await first).status_code == 200
            assert (await _classify(c, "limited")).status_code == 200  # its place was given back
            assert (await _classify(c, "free")).status_code == 200
        assert _limited(app, "max_concurrent") == 1

    run(test)


@pytest.mark.parametrize("limits", [{}, {"requests_per_s": 1000, "tokens_per_min": 10**6, "max_concurrent": 100}])
def test_within_the_limits_nothing_is_refused(tmp_path, limits):
    app, _, _ = _app(tmp_path, limits)

    async def test():
        async with _client(app) as c:
            assert {(await _classify(c, who)).status_code for who in ["limited", "free"] * 20} == {200}

    run(test)
