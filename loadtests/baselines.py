"""The two baselines, as Ray Serve apps speaking the same /v1/classify as Manyfold:

- `lru`: one full model per variant, loaded from its uncompressed safetensors on a miss, kept in an LRU
  bounded by bytes (the budget Manyfold gets for its base plus its variant cache), one decode per miss.
- `multiplex`: Ray Serve's own model multiplexing (`serve.multiplexed`), full models loaded from the same
  uncompressed safetensors, at most as many per replica as fit the same budget.
"""

import asyncio
import threading
from collections import OrderedDict
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from ray import serve


def load_classifier(model_dir: Path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@torch.no_grad()
def classify(loaded, texts: list[str]) -> list[dict]:
    model, tok = loaded
    probs = model(**tok(texts, truncation=True, max_length=512, padding=True, return_tensors="pt")).logits.softmax(-1)
    labels = [model.config.id2label[i] for i in range(probs.shape[-1])]
    return [{"index": i, "label": labels[int(p.argmax())], "probs": dict(zip(labels, p.tolist()))}
            for i, p in enumerate(probs)]


def model_bytes(loaded) -> int:
    return sum(p.numel() * p.element_size() for p in loaded[0].parameters())


lru_app = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 1})
@serve.ingress(lru_app)
class LruServer:
    def __init__(self, models_dir: str, budget_bytes: int):
        self.dir = Path(models_dir)
        self.budget = budget_bytes
        self.models: OrderedDict[str, tuple] = OrderedDict()
        self.loading: dict[str, asyncio.Future] = {}
        self.hits = self.misses = 0
        self.compute = threading.Lock()

    async def _get(self, name: str):
        if name in self.models:
            self.hits += 1
            self.models.move_to_end(name)
            return self.models[name]
        if name in self.loading:
            self.hits += 1
            return await self.loading[name]
        self.misses += 1
        fut = asyncio.get_running_loop().create_future()
        self.loading[name] = fut
        try:
            loaded = await asyncio.to_thread(load_classifier, self.dir / name)
            self.models[name] = loaded
            while sum(model_bytes(m) for m in self.models.values()) > self.budget and len(self.models) > 1:
                self.models.popitem(last=False)
            fut.set_result(loaded)
            return loaded
        finally:
            del self.loading[name]

    @lru_app.post("/v1/classify")
    async def classify_route(self, body: dict):
        loaded = await self._get(body["model"])
        texts = [body["input"]] if isinstance(body["input"], str) else body["input"]

        def run():
            with self.compute:
                return classify(loaded, texts)

        return {"object": "list", "model": body["model"], "data": await asyncio.to_thread(run)}

    @lru_app.get("/stats")
    async def stats(self):
        return {"hits": self.hits, "misses": self.misses}


multiplex_app = FastAPI()


def multiplex_server(models_dir: str, max_models: int):
    @serve.deployment(ray_actor_options={"num_cpus": 1})
    @serve.ingress(multiplex_app)
    class MultiplexServer:
        def __init__(self):
            self.dir = Path(models_dir)
            self.loads = self.calls = 0

        @serve.multiplexed(max_num_models_per_replica=max_models)
        async def get_model(self, model_id: str):
            self.loads += 1
            return await asyncio.to_thread(load_classifier, self.dir / model_id)

        @multiplex_app.post("/v1/classify")
        async def classify_route(self, request: Request):
            body = await request.json()
            self.calls += 1
            loaded = await self.get_model(serve.get_multiplexed_model_id())
            texts = [body["input"]] if isinstance(body["input"], str) else body["input"]
            return {"object": "list", "model": body["model"], "data": await asyncio.to_thread(classify, loaded, texts)}

        @multiplex_app.get("/stats")
        async def stats(self):
            return {"hits": self.calls - self.loads, "misses": self.loads}

    return MultiplexServer
