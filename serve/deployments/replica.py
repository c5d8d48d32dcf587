"""EngineReplica: one Engine serving one base and its variants, as a Ray Serve deployment."""

from ray import serve

from serve.config import parse_config
from serve.engine.engine import Engine
from serve.engine.model import SamplingParams

MAX_MULTIPLEXED_IDS = 64
"""Variant ids a replica reports to Ray's router as held (affinity only: memory is the cache's budget)."""


@serve.deployment
class EngineReplica:
    def __init__(self, config: dict, base: str):
        self.engine = Engine(parse_config(config), bases=[base])

    @serve.multiplexed(max_num_models_per_replica=MAX_MULTIPLEXED_IDS)
    async def _hold(self, model_id: str) -> str:
        """Tells Ray's router this replica holds `model_id`, so later requests for it come here."""
        return model_id

    async def _affinity(self) -> None:
        model_id = serve.get_multiplexed_model_id()
        if model_id:
            await self._hold(model_id)

    async def classify(self, model: str, texts: list[str]):
        await self._affinity()
        return await self.engine.classify(model, texts)

    async def embed(self, model: str, texts: list[str]):
        await self._affinity()
        return await self.engine.embed(model, texts)

    async def complete(self, model: str, params: SamplingParams, prompt: str | None = None,
                       messages: list[dict] | None = None):
        await self._affinity()
        return await self.engine.complete(model, params, prompt=prompt, messages=messages)

    async def complete_stream(self, model: str, params: SamplingParams, prompt: str | None = None,
                              messages: list[dict] | None = None):
        """Called with handle.options(stream=True): each TextDelta goes to the ingress as it comes."""
        await self._affinity()
        async for delta in self.engine.complete_stream(model, params, prompt=prompt, messages=messages):
            yield delta

    async def models(self):
        return await self.engine.models()

    async def snapshot(self) -> dict:
        return await self.engine.snapshot()

    async def __del__(self):
        """Serve calls this when the replica stops: finish what is queued, then release the compute thread."""
        await self.engine.drain(timeout_s=25.0)
