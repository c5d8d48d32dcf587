"""CUDA graphs of a base's decode steps: one per row bucket and set of families, captured once and replayed.

A decode step of B rows (a bucket, serve/engine/steps.py) is the same launches whatever its rows hold: the KV
store is written and read by slot, the adapter pool's per-token maps sit in buffers allocated once
(serve/engine/adapter_pool.py: prepare), and the attention reads each row's length on the device. So the step is
captured once, reading its inputs from static buffers, and each later step copies its inputs there (one copy),
lets the families refill their maps, and replays. A graph with the adapter pool's ops is keyed by the pool's
`version` too: when its stacks or maps are reallocated, the next step captures again. Graphs of base rows alone
(no family) are captured for every bucket at start-up (`warm_up`), which says what capture cost and held.
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from serve.engine.batch import BASE_ROW, BatchPlan
from serve.engine.kv_store import StepLayout

log = logging.getLogger("manyfold.engine")


@dataclass
class _Graph:
    replay: Callable[[], None]
    """Runs the captured step again (CUDAGraph.replay)."""
    inputs: torch.Tensor
    """[4 * B] int64 on the device: ids, positions, write slots, lengths (StepInputs.packed's order)."""
    logits: torch.Tensor
    """[B, vocab] fp32: what a replay writes."""


class StepGraphs:
    def __init__(self, rt):
        self.rt = rt
        self.pool = None
        """The memory pool every capture shares (made at the first)."""
        self.graphs: dict[tuple, _Graph] = {}
        self.captures = 0
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        """Device memory the captures took (their pool and static buffers)."""

    def _key(self, bucket: int, plan: BatchPlan) -> tuple:
        families = tuple(sorted(plan.families))
        return bucket, families, tuple(getattr(self.rt.families[f], "version", 0) for f in families)

    def run(self, inputs, plan: BatchPlan) -> _Graph:
        """Replay the decode step's bucket graph (captured now if need be); its logits [B, vocab] fp32 are in the
        graph's `logits` until the next replay."""
        for family in plan.families:  # host copies into the maps' buffers (a new buffer is a new version)
            self.rt.families[family].prepare(plan)
        key = self._key(inputs.decode_rows, plan)
        g = self.graphs.get(key)
        packed = inputs.packed()
        if g is None:
            g = self._capture(key, plan, packed)
        else:
            g.inputs.copy_(packed, non_blocking=True)
        with self.rt.seconds.timing("forward"):
            g.replay()
        return g

    def continue_(self, g: _Graph, tokens: torch.Tensor) -> None:
        """Replay `g` again as the next decode step of the same rows, all on the device: each row feeds the token
        sampled from the last replay (tokens [B]) one position further; padding rows stay padding."""
        bucket = g.logits.shape[0]
        ids, positions, _, lengths = g.inputs.split([bucket] * 4)
        live = lengths > 0
        ids.copy_(tokens[:bucket])
        positions.add_(live)
        lengths.add_(live)
        with self.rt.seconds.timing("forward"):
            g.replay()

    def warm_up(self) -> None:
        """Capture the base-rows graph of every bucket, so that the first requests pay no capture, and log what
        capture cost."""
        from serve.engine.steps import lay_out, row_bucket

        buckets = sorted({row_bucket(n, self.rt.kv.slots) for n in range(1, self.rt.kv.slots + 1)})
        for bucket in buckets:
            inputs = lay_out({}, [], bucket, self.rt.kv.scratch, self.rt.tokenizer.pad_token_id)
            plan = BatchPlan([BASE_ROW] * bucket, self.rt.device, tokens=[1] * bucket)
            self._capture(self._key(bucket, plan), plan, inputs.packed())
        log.info("base '%s': %d decode-step CUDA graphs (rows %s) captured in %.2f s, holding %.0f MiB",
                 self.rt.name, len(buckets), ",".join(map(str, buckets)), self.capture_seconds,
                 self.capture_bytes / (1 << 20))

    def _capture(self, key: tuple, plan: BatchPlan, packed: torch.Tensor) -> _Graph:
        """Warm up on a side stream (Triton compiles, the allocator settles), capture, and replay once (capture
        runs nothing). Warming up writes the step's own keys and values where the step writes them: the same.
        The plan's families have prepared their maps (no host copy may run inside a capture)."""
        rt = self.rt
        bucket = key[0]
        for stale in [k for k in self.graphs if k[:2] == key[:2]]:  # the same bucket and families, old addresses
            del self.graphs[stale]
        torch.cuda.synchronize(rt.device)
        before, started = torch.cuda.memory_allocated(rt.device), time.perf_counter()
        inputs = packed.to(rt.device)
        ids, positions, slots, lengths = inputs.split([bucket] * 4)
        layout = StepLayout(slots, positions, lengths, rt.kv.positions, bucket)

        def forward() -> torch.Tensor:
            out = rt.model(input_ids=ids[None], position_ids=positions[None], past_key_values=rt.kv.stepping(layout),
                           use_cache=True, kv_layout=layout, logits_to_keep=0)
            return out.logits[0].float()

        side = torch.cuda.Stream(rt.device)
        side.wait_stream(torch.cuda.current_stream(rt.device))
        with rt.corrections.planned(plan), torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(rt.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        self.pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
        with rt.corrections.planned(plan), torch.cuda.graph(graph, pool=self.pool):
            logits = forward()
        graph.replay()
        torch.cuda.synchronize(rt.device)
        self.captures += 1
        self.capture_seconds += time.perf_counter() - started
        self.capture_bytes += torch.cuda.memory_allocated(rt.device) - before
        g = self.graphs[key] = _Graph(graph.replay, inputs, logits)
        return g
