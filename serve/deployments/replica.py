"""EngineReplica: one Engine serving one base and its variants, as a Ray Serve deployment."""

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve.config import parse_config
from serve.deployments.board import Reporter
from serve.engine import faults
from serve.engine.types import SamplingParams, Tenant
from serve.errors import ManyfoldError
from serve.store.catalog import key_of
from serve.store.manifest import BaseEntry, VariantEntry
from serve.store.progress import log as fetch_log

log = logging.getLogger("ray.serve")

BOARD_FORGET_TIMEOUT_S = 2.0
"""How long a stopping replica waits to tell the residency board it is gone."""

MAX_MULTIPLEXED_IDS = 64
"""Variant ids a replica reports to Ray's router as held (affinity only: memory is the cache's budget)."""


def show_fetches() -> None:
    """A fetch's progress lines (serve/store/progress.py) on this replica's stderr, which Ray forwards to the
    terminal of `manyfold serve`: Serve's own logger stops at WARNING there (serve/app.py)."""
    if not fetch_log.handlers:
        fetch_log.addHandler(logging.StreamHandler())
        fetch_log.setLevel(logging.INFO)
        fetch_log.propagate = False


@serve.deployment
class EngineReplica:
    def __init__(self, config: dict, base: str, board: DeploymentHandle, threads: int = 1):
        """threads: torch's intra-op threads, the replica's CPU share (serve/app.py): Ray would leave it one. The
        engine (and torch) is imported here, in the replica's process: `manyfold serve` imports this module only to
        bind the deployment, and would spend seconds importing what it never runs."""
        import torch

        from serve.engine.engine import Engine

        torch.set_num_threads(threads)
        memory = ray.get_runtime_context().get_assigned_resources().get("memory")  # bytes, when Ray reserved some
        parsed = parse_config(config)
        d = parsed.deployments.get(base, parsed.deployment)
        if d.device is not None:  # this base's own device (serve/config.py DeploymentConfig.device)
            parsed = parsed.model_copy(update={"device": d.device})
        self.board = board
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        show_fetches()
        try:
            self.engine = Engine(parsed, bases=[base], memory_target=int(memory) if memory else None,
                                 on_fetch=self._fetching, aliases=False)  # the router resolves them
        except BaseException:
            self._tell_board(self.board.forget)  # no "loading" left behind for /readyz
            raise
        self.stall_timeout_s = d.stall_timeout_s
        self.reporter = Reporter(self._report,
                                 before=lambda: faults.hit("report", [base]))

    def _fetching(self, entry: BaseEntry | VariantEntry, done: int, total: int) -> None:
        """How far a fetch from object storage has come, at the pace of its log lines (serve/store/progress.py):
        the base's goes on the board, where /readyz reads it while the base loads."""
        if entry.kind == "base":
            self._tell_board(self.board.loading, entry.name, done, total)

    def _tell_board(self, method, *args) -> None:
        """A call to the board not waited for (the constructor runs on the replica's event loop, blocking it;
        Serve's router sends the call from its own); one the handle refuses costs one warning line."""
        try:
            method.remote(self.replica_id, *args)
        except Exception as e:  # noqa: BLE001
            log.warning("residency board not told: %s", (str(e).splitlines() or [type(e).__name__])[0])

    async def _report(self, held: dict[str, str]) -> None:
        await self.board.report.remote(self.replica_id, held, await self.engine.snapshot())

    async def check_health(self) -> None:
        """Serve calls this every health_check_period_s: it fails when the engine is stuck (requests waiting, no
        step for stall_timeout_s), so Serve replaces the replica; otherwise it is the board's heartbeat (bounded;
        a board away never fails the check)."""
        self.engine.check_progress(self.stall_timeout_s)
        await self.reporter.report(self.engine.cache.resident())

    @serve.multiplexed(max_num_models_per_replica=MAX_MULTIPLEXED_IDS)
    async def _hold(self, model_id: str) -> str:
        """Tells Ray's router this replica holds `model_id`, so later requests for it come here."""
        return model_id

    @asynccontextmanager
    async def _serving(self) -> AsyncIterator[None]:
        """Around every request: affinity for its variant and the revision the router resolved (serve/store/
        catalog.py: a revision new here is looked for before the request is answered) first, a residency report
        after."""
        model_id = serve.get_multiplexed_model_id()
        if model_id:
            await self._hold(model_id)
            await self.engine.catalog.notice(key_of(model_id))
        try:
            yield
        finally:
            self.reporter.changed(self.engine.cache.resident())  # in the background: the answer goes now

    async def _answer(self, call: Awaitable):
        """A client's error (4xx) comes back as a value: raised here, Ray would log it with a traceback as
        a failure of the replica. The router raises it again in the ingress."""
        async with self._serving():
            try:
                return await call
            except ManyfoldError as e:
                if e.http_status >= 500:
                    raise
                return e

    async def classify(self, model: str, texts: list[str], truncate: bool = True, tenant: Tenant | None = None):
        return await self._answer(self.engine.classify(model, texts, truncate, tenant))

    async def embed(self, model: str, texts: list[str], truncate: bool = True, tenant: Tenant | None = None):
        return await self._answer(self.engine.embed(model, texts, truncate, tenant))

    async def complete(self, model: str, params: SamplingParams, prompt: str | list[int] | None = None,
                       messages: list[dict] | None = None, tools: list[dict] | None = None,
                       tenant: Tenant | None = None):
        return await self._answer(self.engine.complete(model, params, prompt=prompt, messages=messages, tools=tools,
                                                       tenant=tenant))

    async def complete_stream(self, model: str, params: SamplingParams, prompt: str | list[int] | None = None,
                              messages: list[dict] | None = None, tools: list[dict] | None = None,
                              tenant: Tenant | None = None):
        """Called with handle.options(stream=True): each TextDelta goes to the ingress as it comes."""
        async with self._serving():
            try:
                async for delta in self.engine.complete_stream(model, params, prompt=prompt, messages=messages,
                                                               tools=tools, tenant=tenant):
                    yield delta
            except ManyfoldError as e:
                if e.http_status >= 500:
                    raise
                yield e  # as _answer: the router raises it

    async def add_variant(self, name: str, base: str, path: str, kind: str):
        return await self._answer(self.engine.add_variant(name, base, path, kind))

    async def add_variants(self, items: list[tuple[str, str, str, str]]):
        return await self._answer(self.engine.add_variants(items))

    async def models(self):
        return await self.engine.models()

    async def snapshot(self) -> dict:
        return await self.engine.snapshot()

    async def __del__(self):
        """Serve calls this when the replica stops: finish what is queued, then release the compute thread."""
        await self.engine.drain(timeout_s=25.0)
        try:  # bounded: a board already deleted with the app never answers, and Serve would force-kill us
            await asyncio.wait_for(self.board.forget.remote(self.replica_id), BOARD_FORGET_TIMEOUT_S)
        except Exception:  # noqa: BLE001  (the board may be stopping too)
            pass
