"""CUDA graphs of a base's generation steps: one per row bucket, prompt-token bucket and set of families, captured
once and replayed.

A step of B decode rows and P prompt tokens (buckets, serve/engine/step/layout.py) is the same launches whatever its
rows hold: the KV cache is written and read through block tables of a fixed width (rewritten in place), every family's
per-token maps sit in buffers allocated once (serve/engine/families/token_maps.py), the attention reads each decode
row's length and the chunk table on the device, and a NeuZip base's decode launches write buffers allocated once. So the
step is captured whole, reading its inputs from static buffers, and each later step copies its inputs there (one copy),
lets the families refill their maps, and replays. A graph is keyed by its families' `version`s too (and a NeuZip
base's): when a stack, a map buffer, an EMR group's tensors or a decoded weight move, the next step captures again.
Graphs of base rows alone (no family, no prompt) are captured for every row bucket at start-up (`warm_up`), which says
what capture cost and held; the others when first needed.
"""

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from serve.engine.step.batch import BASE_ROW, BatchPlan

log = logging.getLogger("manyfold.engine")
MAX_GRAPHS = 256
"""Graphs kept at most, the least recently replayed dropped first (row buckets x token buckets x the sets of
families steps hold: a few dozen in practice; the bound keeps an unusual mix of families from growing them)."""


@dataclass
class _Graph:
    replay: Callable[[], None]
    """Runs the captured step again (CUDAGraph.replay)."""
    inputs: torch.Tensor
    """int64 on the device, StepInputs.packed's layout: a decode-only step's is [4 * B], ids, positions, write
    lanes and lengths."""
    logits: torch.Tensor
    """[kept, vocab] fp32: what a replay writes."""
    key: tuple
    """StepGraphs._key at capture: its buckets, its families and the versions of their tensors' addresses."""


class StepGraphs:
    def __init__(self, rt):
        self.rt = rt
        self.pool = None
        """The memory pool every capture shares (made at the first)."""
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.captures = 0
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        """Device memory the captures took (their pool and static buffers)."""

    def _key(self, inputs, plan: BatchPlan) -> tuple:
        families = tuple(sorted(plan.families))
        return (inputs.decode_rows, inputs.prompt_tokens, families, *self._versions(families))

    def _versions(self, families: tuple[str, ...]) -> tuple:
        """The families' versions and the NeuZip base's: each changes when a tensor a graph reads moves (None: a
        family gone)."""
        coded = self.rt.coded.version if self.rt.coded is not None else 0
        return tuple(getattr(self.rt.families.get(f), "version", None) for f in families), coded

    def current(self, g: _Graph) -> bool:
        """Whether g still reads where its families' tensors are: kept under its key, and no stack, map buffer,
        EMR group or decoded weight moved since (an admission's attach or a store change between two steps
        can, while the rows running stay the same)."""
        return self.graphs.get(g.key) is g and g.key[3:] == self._versions(g.key[2])

    def run(self, inputs, plan: BatchPlan) -> _Graph:
        """Replay the step's graph (captured now if need be); its logits [kept, vocab] fp32 are in the graph's
        `logits` until the next replay."""
        for family in plan.families:  # host copies into the maps' buffers (a new buffer is a new version)
            self.rt.families[family].prepare(plan)
        key = self._key(inputs, plan)
        g = self.graphs.get(key)
        packed = inputs.packed()
        if g is None:
            g = self._capture(key, plan, inputs, packed)
        else:
            self.graphs.move_to_end(key)
            g.inputs.copy_(packed, non_blocking=True)
        with self.rt.seconds.timing("forward"):
            g.replay()
        return g

    def continue_(self, g: _Graph, tokens: torch.Tensor) -> None:
        """Replay `g` (a decode-only step's) again as the next decode step of the same rows, all on the device: each
        row feeds the token sampled from the last replay (tokens [B]) one position further; padding rows stay
        padding."""
        bucket = g.logits.shape[0]
        if g.inputs.numel() != 4 * bucket:
            raise RuntimeError("only a decode-only step's graph is launched from its last tokens")
        if not self.current(g):
            raise RuntimeError("a graph whose families' tensors moved is captured again, not continued")
        ids, positions, _, lengths = g.inputs.split([bucket] * 4)
        live = lengths > 0
        ids.copy_(tokens[:bucket])
        positions.add_(live)
        lengths.add_(live)
        with self.rt.seconds.timing("forward"):
            g.replay()

    def forget(self, family: str) -> None:
        """A family gone (an EMR group the store replaced or removed): the graphs that ran it go too."""
        for key in [k for k in self.graphs if family in k[2]]:
            del self.graphs[key]

    def warm_up(self) -> None:
        """Capture the base-rows graph of every bucket, so that the first requests pay no capture, and log what
        capture cost."""
        from serve.engine.step.layout import lay_out, row_bucket

        buckets = sorted({row_bucket(n, self.rt.kv.lanes) for n in range(1, self.rt.kv.lanes + 1)})
        for bucket in buckets:
            inputs = lay_out({}, [], bucket, self.rt.kv.scratch, self.rt.tokenizer.pad_token_id)
            plan = BatchPlan([BASE_ROW] * bucket, self.rt.device, tokens=[1] * bucket)
            self._capture(self._key(inputs, plan), plan, inputs, inputs.packed())
        log.info("base '%s': %d decode-step CUDA graphs (rows %s) captured in %.2f s, holding %.0f MiB",
                 self.rt.name, len(buckets), ",".join(map(str, buckets)), self.capture_seconds,
                 self.capture_bytes / (1 << 20))

    def _capture(self, key: tuple, plan: BatchPlan, inputs, packed: torch.Tensor) -> _Graph:
        """Warm up on a side stream (Triton compiles, the allocator settles), capture, and replay once (capture
        runs nothing). Warming up writes the step's own keys and values where the step writes them: the same.
        The plan's families have prepared their maps (no host copy may run inside a capture). The capture errs only
        on this thread's unsafe calls ("thread_local"): under the default, "global", the cache's copier moving a
        variant onto the device (an allocation, a copy) while a step captures invalidated the capture and failed the
        step (seen on an H200; vLLM captures so too)."""
        rt = self.rt
        for stale in [k for k in self.graphs if k[:3] == key[:3]]:  # the same buckets and families, old addresses
            del self.graphs[stale]
        while len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        torch.cuda.synchronize(rt.device)
        before, started = torch.cuda.memory_allocated(rt.device), time.perf_counter()
        static = packed.to(rt.device)
        ids, positions, kept, layout = inputs.layout(static, rt.kv.positions)

        def forward() -> torch.Tensor:
            out = rt.model(input_ids=ids, position_ids=positions, past_key_values=rt.kv.stepping(layout),
                           use_cache=True, kv_layout=layout, logits_to_keep=0 if kept is None else kept)
            return out.logits[0].float()

        side = torch.cuda.Stream(rt.device)
        side.wait_stream(torch.cuda.current_stream(rt.device))
        with rt.corrections.planned(plan), torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(rt.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        self.pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
        with rt.corrections.planned(plan), torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = forward()
        graph.replay()
        torch.cuda.synchronize(rt.device)
        self.captures += 1
        self.capture_seconds += time.perf_counter() - started
        self.capture_bytes += torch.cuda.memory_allocated(rt.device) - before
        g = self.graphs[key] = _Graph(graph.replay, static, logits, key)
        return g
