"""Router: the ingress's backend. Sends each request to its base's deployment, with the variant as Ray's
multiplexed model id so that replicas already holding a full variant get its requests."""

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from ray.serve.exceptions import BackPressureError, RequestCancelledError
from ray.serve.handle import DeploymentHandle

from serve.deployments.board import best_tier
from serve.engine.types import ModelInfo, SamplingParams, TextDelta
from serve.errors import ClientGone, ManyfoldError, Overloaded
from serve.store.store import Store


class Router:
    def __init__(self, store_root: str | Path, handles: dict[str, DeploymentHandle], board: DeploymentHandle):
        self.store = Store(store_root)
        self.handles = handles
        self.board = board

    def _handle(self, model: str) -> DeploymentHandle:
        self.store.refresh()
        base, variant = self.store.resolve(model)
        handle = self.handles[base]
        return handle.options(multiplexed_model_id=variant) if variant else handle

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

    async def _call(self, response):
        with self._replica_errors():
            result = await response
        if isinstance(result, ManyfoldError):  # a client's error, returned by the replica (see EngineReplica)
            raise result
        return result

    async def classify(self, model: str, texts: list[str], truncate: bool = True):
        return await self._call(self._handle(model).classify.remote(model, texts, truncate))

    async def embed(self, model: str, texts: list[str], truncate: bool = True):
        return await self._call(self._handle(model).embed.remote(model, texts, truncate))

    async def complete(self, model: str, params: SamplingParams, prompt: str | list[int] | None = None,
                       messages: list[dict] | None = None):
        return await self._call(self._handle(model).complete.remote(model, params, prompt=prompt,
                                                                     messages=messages))

    async def complete_stream(self, model: str, params: SamplingParams, prompt: str | list[int] | None = None,
                              messages: list[dict] | None = None) -> AsyncIterator[TextDelta]:
        handle = self._handle(model).options(stream=True)
        deltas = handle.complete_stream.remote(model, params, prompt=prompt, messages=messages)
        try:
            with self._replica_errors():
                async for delta in deltas:
                    if isinstance(delta, ManyfoldError):
                        raise delta
                    yield delta
        finally:
            deltas.cancel()  # a no-op once it has ended; else the replica stops generating for a client gone

    async def models(self) -> list[ModelInfo]:
        """Every model; a variant's residency is the best over all replicas of its base (the ResidencyBoard),
        or the answering replica's own if that is better (it may not have reported yet)."""
        per_base = await asyncio.gather(*(self._call(h.models.remote()) for h in self.handles.values()))
        held = await self._call(self.board.residency.remote())
        return [replace(m, residency=best_tier(m.residency, held.get(m.name, "disk")))
                for infos in per_base for m in infos]

    async def snapshots(self) -> list[dict]:
        return list(await asyncio.gather(*(self._call(h.snapshot.remote()) for h in self.handles.values())))

    async def add_variant(self, name: str, base: str, path: str, kind: str = "full") -> ModelInfo:
        """Validated and stored by one of the base's replicas (the ingress runs no model code); the others see
        the new manifest on their next request."""
        self.store.refresh()
        self.store.base(base)  # VariantNotFound for an unknown base
        return await self._call(self.handles[base].add_variant.remote(name, base, path, kind))

    async def remove_variant(self, name: str) -> None:
        self.store.refresh()
        self.store.variant(name)
        await asyncio.to_thread(self.store.remove, name)
