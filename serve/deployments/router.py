"""Router: the ingress's backend. Sends each request to its base's deployment, with the variant as Ray's
multiplexed model id so that replicas already holding a full variant get its requests. A base that is not
running (DeploymentHealth) is refused with 503 within a bound; /v1/models and /metrics never wait on a replica
beyond a bound: models come from the catalog's snapshot (serve/store/catalog.py), residency from the board."""

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager

from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import BackPressureError, RequestCancelledError
from ray.serve.handle import DeploymentHandle

from serve.deployments.health import BaseState, DeploymentHealth
from serve.engine.types import ModelInfo, SamplingParams, Tenant, TextDelta
from serve.errors import ClientGone, ManyfoldError, Overloaded, ReplicaLost, VariantNotFound
from serve.store.catalog import Catalog, Snapshot

log = logging.getLogger("ray.serve")

PEEK_TIMEOUT_S = 2.0
"""How long /v1/models and /metrics wait for the board or a replica's counters before answering without them."""
RESENDS = 1
"""Times a request whose replica went away before answering anything is sent again. Serve's handle drops a replica
whose actor died from its choices at once, so the resend reaches a live replica of the base (or waits for the one
Serve starts in its place); a second loss in a row is a 503 to retry."""


class Router:
    def __init__(self, catalog: Catalog, handles: dict[str, DeploymentHandle], board: DeploymentHandle,
                 health: DeploymentHealth, ingress: str = "ingress",
                 lost: Callable[[str, str], None] = lambda model, outcome: None):
        """ingress: this ingress replica's id, under which it reports its request counters to the board; lost:
        called with (model, "resent" or "unavailable") for each request whose replica went away (Metrics.lost)."""
        self.ingress = ingress
        self.lost = lost
        self.catalog = catalog
        self.handles = handles
        self.board = board
        self.health = health
        self._writes_looked = 0
        """The board's count of store changes (ResidencyBoard.stored) as of this catalog's latest look for one."""
        self._listed: object = None
        self._by_base: dict[str, list[tuple[str, str, str, list[str] | None, str, str | None]]] = {}

    async def _handle(self, model: str) -> tuple[DeploymentHandle, str]:
        """-> (the handle of the base that answers `model`, the model id the replica is to run). The id is the
        entry's own, an alias resolved here: the replica runs the entry the name pointed to now, even if an
        upgrade switches the name before the request reaches it."""
        snapshot, base, variant = await self._resolve(model)
        await self.health.require(base, model)
        handle = self.handles[base]
        if not variant:
            return handle, model
        return handle.options(multiplexed_model_id=snapshot.routed(variant)), variant

    async def _resolve(self, model: str) -> tuple[Snapshot, str, str | None]:
        """Catalog.resolve, and on a miss within its negative window, once more after a look for the change if
        another ingress changed the store since this one last looked (_caught_up): a variant added through one
        ingress is served through every other at once, not after store_refresh_s; a name nobody added costs one
        call to the board, never a look at the store."""
        try:
            return await self.catalog.resolve(model)
        except VariantNotFound as miss:
            if not await self._caught_up():
                raise miss
            snapshot = self.catalog.snapshot
            return snapshot, *snapshot.resolve(model)

    async def _caught_up(self) -> bool:
        """Look for a change of the store now if another ingress changed it since this one last looked (the
        board's count, ResidencyBoard.stored); -> whether it looked. A board away: False (the catalog's own looks
        still find the change within store_refresh_s)."""
        try:
            writes = await asyncio.wait_for(self._call(self.board.writes.remote()), PEEK_TIMEOUT_S)
        except Exception:  # noqa: BLE001
            return False
        if writes == self._writes_looked:
            return False
        await self.catalog.refresh()
        self._writes_looked = writes
        return True

    async def _stored(self) -> None:
        """This ingress changed the store: counted on the board for the others (bounded; a board away costs
        them only the wait for their next look)."""
        try:
            await asyncio.wait_for(self._call(self.board.stored.remote()), PEEK_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001
            log.warning("the residency board did not count a change of the store (%s)", e)

    @staticmethod
    @contextmanager
    def _replica_errors() -> Iterator[None]:
        """A replica's ManyfoldErrors come back as themselves, one line, not Ray's wrapper."""
        try:
            yield
        except BackPressureError as e:
            raise Overloaded("every replica of this model is at capacity; retry later") from e
        except RequestCancelledError:
            raise ClientGone("the client closed the request") from None
        except ManyfoldError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, ManyfoldError):
                raise cause from None
            raise type(e)(str(e).splitlines()[0]) from None
        except RayTaskError:
            raise  # the replica's own code failed: an internal error, as it is
        except RayError as e:  # its actor, worker or node went away mid-request (killed, out of memory, a node
            # lost): Serve starts another replica, so the client is told to retry rather than handed a bare 500
            raise ReplicaLost("the model's replica stopped while answering; retry") from e

    async def _call(self, response):
        with self._replica_errors():
            result = await response
        if isinstance(result, ManyfoldError):  # a client's error, returned by the replica (see EngineReplica)
            raise result
        return result

    async def _answer(self, model: str, send: Callable[[DeploymentHandle, str], object]):
        """send(handle, model id)'s answer from a replica of the model's base; sent again (RESENDS) if the replica
        went away before answering."""
        for sent in range(RESENDS + 1):
            handle, routed = await self._handle(model)
            try:
                return await self._call(send(handle, routed))
            except ReplicaLost:
                self.lost(model, "resent" if sent < RESENDS else "unavailable")
                if sent == RESENDS:
                    raise

    async def classify(self, model: str, texts: list[str], truncate: bool = True, tenant: Tenant | None = None):
        return await self._answer(model, lambda handle, m: handle.classify.remote(m, texts, truncate, tenant))

    async def embed(self, model: str, texts: list[str], truncate: bool = True, tenant: Tenant | None = None):
        return await self._answer(model, lambda handle, m: handle.embed.remote(m, texts, truncate, tenant))

    async def complete(self, model: str, params: SamplingParams, prompt: str | list[int] | None = None,
                       messages: list[dict] | None = None, tools: list[dict] | None = None,
                       tenant: Tenant | None = None):
        return await self._answer(model, lambda handle, m: handle.complete.remote(
            m, params, prompt=prompt, messages=messages, tools=tools, tenant=tenant))

    async def complete_stream(self, model: str, params: SamplingParams, prompt: str | list[int] | None = None,
                              messages: list[dict] | None = None, tools: list[dict] | None = None,
                              tenant: Tenant | None = None) -> AsyncIterator[TextDelta]:
        """The replica's deltas; a stream whose replica went away before its first delta is sent again (RESENDS),
        one that had begun ends with ReplicaLost (the client's last event says so)."""
        for sent in range(RESENDS + 1):
            handle, routed = await self._handle(model)
            deltas = handle.options(stream=True).complete_stream.remote(routed, params, prompt=prompt,
                                                                        messages=messages, tools=tools, tenant=tenant)
            begun = False
            try:
                with self._replica_errors():
                    async for delta in deltas:
                        if isinstance(delta, ManyfoldError):
                            raise delta
                        begun = True
                        yield delta
                return
            except ReplicaLost:
                again = not begun and sent < RESENDS
                self.lost(model, "resent" if again else "unavailable")
                if not again:
                    raise
            finally:
                deltas.cancel()  # a no-op once it has ended; else the replica stops generating for a client gone

    async def models(self) -> list[ModelInfo]:
        """Every model of the store, at once: a variant's residency is the best over all replicas of its base
        (the ResidencyBoard, if it answers in time), and a base that is not running says so. A variant added or
        removed through another ingress is listed as it is now (_caught_up)."""
        await self._caught_up()
        states = await self.health.states()
        try:
            held = await asyncio.wait_for(self._call(self.board.residency.remote()), PEEK_TIMEOUT_S)
        except Exception:  # noqa: BLE001  (a board away costs residency, never the answer)
            held = {}
        out = []
        for base, variants in self._listing().items():
            state = states.get(base, BaseState(True))
            status = "ready" if state.running else "unavailable"
            out.append(ModelInfo(base, "base", None, "hot" if state.running else "cold", None, status))
            out += [ModelInfo(model, kind, base, held.get(key, "cold"), labels, status, form, alias_of)
                    for model, kind, key, labels, form, alias_of in variants]
        return out

    def _listing(self) -> dict[str, list[tuple[str, str, str, list[str] | None, str, str | None]]]:
        """(model, kind, entry key, labels, form, the entry's model an alias names) of every variant model, by the
        base that answers it: built once per snapshot, not per request, so that /v1/models and /metrics stay
        linear in the variants however many bases there are."""
        snapshot = self.catalog.snapshot
        if self._listed is not snapshot:
            by_base: dict[str, list] = {base: [] for base in self.handles}
            for model, v, own in snapshot.served():
                if v.base in by_base:
                    by_base[v.base].append((model, v.kind, snapshot.key(v.name), v.models()[own], v.form_of(own),
                                            own if own != model else None))
            self._listed, self._by_base = snapshot, by_base
        return self._by_base

    async def readiness(self) -> tuple[bool, dict[str, str]]:
        """Whether every base that can run has a running replica, and each base's state in words
        (serve/deployments/health.py); while not ready, a base whose replica is fetching it says how far (the
        board's, if it answers in time)."""
        ready, words = await self.health.readiness()
        if ready:
            return ready, words
        try:
            loading = await asyncio.wait_for(self._call(self.board.loads.remote()), PEEK_TIMEOUT_S)
        except Exception:  # noqa: BLE001  (a board away costs the words how far, never the answer)
            return ready, words
        return await self.health.readiness(loading)

    async def snapshots(self) -> list[dict]:
        """The counters of every replica of every base, as they last reported them to the board, and those of
        replicas gone (serve/deployments/board.py): summed, they never go backwards. A board that does not answer
        in time costs this scrape the engines' figures."""
        try:
            return await asyncio.wait_for(self._call(self.board.snapshots.remote()), PEEK_TIMEOUT_S)
        except Exception:  # noqa: BLE001
            return []

    async def ingress_counters(self, own: dict[str, float]) -> dict[str, float]:
        """Every ingress's request counters added up (the board's sum, this ingress's `own` reported first); a
        board that does not answer in time costs this scrape the other ingresses' counters."""
        try:
            return await asyncio.wait_for(self._call(self.board.ingress.remote(self.ingress, own)), PEEK_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001
            log.warning("the residency board did not add up the ingresses' counters (%s): this one's alone", e)
            return own

    async def add_variant(self, name: str, base: str, path: str, kind: str = "full") -> ModelInfo:
        """Validated and stored by one of the base's replicas (the ingress runs no model code). The router then
        looks for the change at once: its next request for the variant names the new revision, and a replica that
        does not hold it yet looks too (Catalog.notice)."""
        self.catalog.snapshot.base(base)  # VariantNotFound for an unknown base
        try:
            return await self._call(self.handles[base].add_variant.remote(name, base, path, kind))
        finally:
            await self.catalog.refresh()
            await self._stored()

    async def add_variants(self, items: list[tuple[str, str, str, str]]) -> list[ModelInfo | ManyfoldError]:
        """add_variant for many (name, base, path, kind): each base's items go to one of its replicas in one call
        (stored there with one manifest write per kind); an unknown base, or a replica that fails, fails its own
        items alone. -> per item, in order, its card or the error that kept it out."""
        out: list[ModelInfo | ManyfoldError | None] = [None] * len(items)
        groups: dict[str, list[int]] = {}
        for i, (_, base, _, _) in enumerate(items):
            if base in self.handles:
                groups.setdefault(base, []).append(i)
            else:
                out[i] = VariantNotFound(f"store {self.catalog.root} has no base '{base}' served here")
        calls = [self._call(self.handles[b].add_variants.remote([items[i] for i in group]))
                 for b, group in groups.items()]
        results = await asyncio.gather(*calls, return_exceptions=True)
        await self.catalog.refresh()
        await self._stored()
        for group, result in zip(groups.values(), results):
            if isinstance(result, BaseException) and not isinstance(result, ManyfoldError):
                raise result
            for j, i in enumerate(group):
                out[i] = result if isinstance(result, ManyfoldError) else result[j]
        return out  # type: ignore[return-value]  (every item has its outcome by now)

    async def remove_variant(self, name: str) -> None:
        """VariantNotFound for a name unknown here even after a look for another ingress's change (_caught_up, as
        _resolve looks): a variant added through one ingress is removed through any other at once."""
        try:
            self.catalog.snapshot.variant(name)
        except VariantNotFound:
            if not await self._caught_up():
                raise
            self.catalog.snapshot.variant(name)
        await self.catalog.write(lambda store: store.remove(name))
        await self._stored()
