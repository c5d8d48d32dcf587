"""Baseline "peft": PEFT's own mixed-batch inference behind the same `POST /v1/completions` as Manyfold.

One PeftModel over the base holds the tenants' adapters (`load_adapter` on a miss, `delete_adapter` of the least
recently used when their bytes pass the budget); concurrent requests are batched (up to max_batch, waiting
wait_s for more) and each batch is one `generate(..., adapter_names=[...])`: PEFT runs every row with its own
adapter. Batches are static: a batch runs until its longest row is done, and arrivals wait for the next one.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from fastapi import FastAPI, HTTPException
from ray import serve

ADAPTER_WEIGHTS = "adapter_model.safetensors"


@torch.no_grad()
def generate_rows(model, rows: list[list[int]], max_new: list[int], pad_id: int, eos_ids: list[int],
                  adapter_names: list[str] | None = None) -> list[list[int]]:
    """Greedy continuations of token-id rows in one left-padded batch, each cut to its own max_new and after
    its first eos (which counts as a completion token, as Manyfold and vLLM count it); adapter_names (one per
    row) is PEFT's mixed batch."""
    from transformers import GenerationConfig

    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [rows, width], left padded
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # [rows, width]
    for i, r in enumerate(rows):
        input_ids[i, width - len(r):] = torch.tensor(r)
        attention_mask[i, width - len(r):] = 1
    config = GenerationConfig(max_new_tokens=max(max_new), do_sample=False, pad_token_id=pad_id,
                              eos_token_id=eos_ids)
    extra = {} if adapter_names is None else {"adapter_names": adapter_names}
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config, **extra)
    result = []
    for i, n in enumerate(max_new):
        new = out[i, width:width + n].tolist()
        cut = next((j + 1 for j, t in enumerate(new) if t in eos_ids), len(new))
        result.append(new[:cut])
    return result


def eos_of(model, tokenizer) -> list[int]:
    eos = model.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    return list(eos) if isinstance(eos, list | tuple) else [eos]


def completion_body(model: str, text: str, prompt_tokens: int, completion_tokens: int, max_tokens: int) -> dict:
    """The OpenAI completion shape every system answers with."""
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "text": text, "logprobs": None,
                                         "finish_reason": "length" if completion_tokens >= max_tokens else "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def load_base(base_dir: str, threads: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(base_dir)


@dataclass
class Pending:
    model: str
    ids: list[int]
    max_tokens: int
    future: asyncio.Future


class AdapterLru:
    """Adapters held in one PeftModel, bounded by their weight bytes; the least recently used goes first."""

    def __init__(self, base, paths: dict[str, str], budget_bytes: int):
        self.base, self.paths, self.budget = base, paths, budget_bytes
        self.held: OrderedDict[str, int] = OrderedDict()
        self.model = None
        self.loads = self.evictions = 0

    def ensure(self, names: set[str]) -> None:
        """Every name loaded, then evict others until the bytes fit (the batch's own never go)."""
        from peft import PeftModel

        for name in sorted(names):
            if name in self.held:
                self.held.move_to_end(name)
                continue
            if self.model is None:
                self.model = PeftModel.from_pretrained(self.base, self.paths[name], adapter_name=name).eval()
            else:
                self.model.load_adapter(self.paths[name], adapter_name=name)
            self.held[name] = (Path(self.paths[name]) / ADAPTER_WEIGHTS).stat().st_size
            self.loads += 1
        for name in list(self.held):
            if sum(self.held.values()) <= self.budget:
                break
            if name not in names:
                self.model.delete_adapter(name)
                del self.held[name]
                self.evictions += 1


def peft_server(base_dir: str, paths: dict[str, str], budget_bytes: int, max_batch: int, wait_s: float,
                num_cpus: float, threads: int):
    app = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": num_cpus}, max_ongoing_requests=100_000)
    @serve.ingress(app)
    class PeftServer:
        def __init__(self):
            base, self.tok = load_base(base_dir, threads)
            self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
            self.eos = eos_of(base, self.tok)
            self.lru = AdapterLru(base, paths, budget_bytes)
            self.queue: asyncio.Queue[Pending] = asyncio.Queue()
            self.loop_task = None
            self.batches = self.rows = 0

        def _run(self, batch: list[Pending]) -> list[list[int]]:
            self.lru.ensure({p.model for p in batch})
            return generate_rows(self.lru.model, [p.ids for p in batch], [p.max_tokens for p in batch], self.pad,
                                 self.eos, [p.model for p in batch])

        async def _next_batch(self) -> list[Pending]:
            batch = [await self.queue.get()]
            deadline = time.perf_counter() + wait_s
            while len(batch) < max_batch:
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), max(0.0, deadline - time.perf_counter())))
                except TimeoutError:
                    break
            return [p for p in batch if not p.future.done()]  # a cancelled request is never run

        async def _batches(self) -> None:
            while True:
                batch = await self._next_batch()
                if not batch:
                    continue
                self.batches, self.rows = self.batches + 1, self.rows + len(batch)
                try:
                    outs = await asyncio.to_thread(self._run, batch)
                except Exception as e:  # every waiting request hears of it; the loop goes on
                    outs = [e] * len(batch)
                for p, out in zip(batch, outs):
                    if not p.future.done():
                        (p.future.set_exception if isinstance(out, Exception) else p.future.set_result)(out)

        @app.post("/v1/completions")
        async def completions(self, body: dict):
            if body.get("model") not in paths:
                raise HTTPException(404, f"no model '{body.get('model')}'")
            if self.loop_task is None or self.loop_task.done():
                self.loop_task = asyncio.create_task(self._batches())
            ids = self.tok(body["prompt"], add_special_tokens=True)["input_ids"]
            max_tokens = int(body.get("max_tokens", 16))
            future = asyncio.get_running_loop().create_future()
            await self.queue.put(Pending(body["model"], ids, max_tokens, future))
            out = await future
            return completion_body(body["model"], self.tok.decode(out, skip_special_tokens=True), len(ids), len(out),
                                   max_tokens)

        @app.get("/stats")
        async def stats(self):
            return {"loads": self.lru.loads, "evictions": self.lru.evictions, "held": len(self.lru.held),
                    "batches": self.batches, "rows_per_batch": self.rows / self.batches if self.batches else 0.0}

    return PeftServer
