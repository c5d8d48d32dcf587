"""Baseline "multiplex": Ray Serve's model multiplexing of merged models behind the same `POST /v1/completions`.

Each tenant's adapter is merged into a full copy of the base (PEFT `merge_and_unload`) on a miss; a replica holds
at most max_models of them (`serve.multiplexed`, LRU, as many as fit the memory budget). Requests of one model are
batched by `serve.batch` (which splits batches by multiplexed model id); two batches may be in flight, so that
one model's load overlaps another's generation, which holds a lock.
"""

from __future__ import annotations

import asyncio
import threading

import torch
from fastapi import FastAPI, HTTPException
from ray import serve

from loadtests.peft_server import completion_body, eos_of, generate_rows, load_base


def load_merged(base_dir: str, adapter_dir: str, threads: int):
    """A fresh base from disk with the adapter merged into its weights: a plain transformers model."""
    from peft import PeftModel

    base, _ = load_base(base_dir, threads)
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


def merged_server(base_dir: str, paths: dict[str, str], max_models: int, max_batch: int, wait_s: float,
                  num_cpus: float, threads: int):
    app = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": num_cpus}, max_ongoing_requests=100_000)
    @serve.ingress(app)
    class MergedServer:
        def __init__(self):
            from transformers import AutoTokenizer

            torch.set_num_threads(threads)
            self.tok = AutoTokenizer.from_pretrained(base_dir)
            self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
            self.eos = None
            self.compute = threading.Lock()
            self.loads = self.batches = self.rows = 0

        @serve.multiplexed(max_num_models_per_replica=max_models)
        async def get_model(self, model_id: str):
            self.loads += 1
            return await asyncio.to_thread(load_merged, base_dir, paths[model_id], threads)

        def _generate(self, model, reqs: list[dict]) -> list[list[int]]:
            with self.compute:
                self.eos = self.eos or eos_of(model, self.tok)
                return generate_rows(model, [r["ids"] for r in reqs], [r["max_tokens"] for r in reqs], self.pad,
                                     self.eos)

        @serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=wait_s, max_concurrent_batches=2)
        async def generate(self, reqs: list[dict]) -> list[list[int]]:
            outs: dict[int, list[int]] = {}
            self.batches, self.rows = self.batches + 1, self.rows + len(reqs)
            for model_id in dict.fromkeys(r["model"] for r in reqs):  # one model per batch; grouped to be sure
                group = [i for i, r in enumerate(reqs) if r["model"] == model_id]
                model = await self.get_model(model_id)
                for i, out in zip(group, await asyncio.to_thread(self._generate, model, [reqs[i] for i in group])):
                    outs[i] = out
            return [outs[i] for i in range(len(reqs))]

        @app.post("/v1/completions")
        async def completions(self, body: dict):
            model = body.get("model")
            if model not in paths or serve.get_multiplexed_model_id() != model:
                raise HTTPException(404, f"no model '{model}' (the serve_multiplexed_model_id header must name it)")
            ids = self.tok(body["prompt"], add_special_tokens=True)["input_ids"]
            max_tokens = int(body.get("max_tokens", 16))
            out = await self.generate({"model": model, "ids": ids, "max_tokens": max_tokens})
            return completion_body(model, self.tok.decode(out, skip_special_tokens=True), len(ids), len(out),
                                   max_tokens)

        @app.get("/stats")
        async def stats(self):
            return {"loads": self.loads, "batches": self.batches,
                    "rows_per_batch": self.rows / self.batches if self.batches else 0.0}

    return MergedServer
