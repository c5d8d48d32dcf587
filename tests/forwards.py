"""One forward of an engine's base for rows of the given models (the base itself, variants, group members), as
the scheduler would run them: each variant held in the cache and attached for the forward, then let go."""

import asyncio

import torch

from serve.engine.step.batch import BatchPlan
from serve.engine.engine import Engine
from serve.store.manifest import MEMBER_SEP


def forward_rows(engine: Engine, base: str, models: list[str], ids: torch.Tensor) -> torch.Tensor:
    """ids [rows, seq] (equal lengths: no padding), row i run as models[i] -> logits [rows, seq, vocab]."""
    rt = engine.bases[base]

    async def forward():
        snapshot = engine.catalog.snapshot
        held = [await engine.cache.acquire(snapshot.key(m.split(MEMBER_SEP)[0])) if m != base else None
                for m in models]
        slots = [rt.attach(h.variant.member(m) if h else None) for h, m in zip(held, models)]
        try:
            with torch.no_grad():
                return rt.call(BatchPlan(slots, rt.device), input_ids=ids).logits
        finally:
            for s in slots:
                rt.detach(s)
            for h in held:
                if h is not None:
                    engine.cache.release(h)

    return asyncio.run(forward())
