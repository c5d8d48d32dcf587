"""Engine: the bases of a store in memory, a variant cache, and a batching scheduler. No Ray, no HTTP.

Requests become rows in a bounded queue (full -> Overloaded, HTTP 429). The scheduler takes the first waiting
row, gathers more for up to `batch_wait_timeout_s` or `max_batch_size` rows, and groups them by (operation,
base, variant). Base rows share one forward; each full variant's rows run with its weights swapped in (see
model.py). A classify or embed group is one forward. Generation is continuous: a generate group becomes its
variant's running DecodeBatch, which later rows for that variant join between decode steps, up to
`max_batch_size` rows. Every forward runs on one compute thread, so the event loop keeps answering, and the
running groups take turns step by step: a long generation does not hold up a classification.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from serve.codecs.fmdelta_file import FmdFile
from serve.config import ServeConfig
from serve.engine.cache import Residency, VariantCache
from serve.engine.generation import DecodeBatch
from serve.engine.model import BaseModelRuntime, Generation, SamplingParams
from serve.engine.stats import BATCH_BUCKETS, Distribution
from serve.errors import ArtifactError, BadRequest, Overloaded, VariantNotFound
from serve.store.store import Store
from serve.store.tensors import DTYPES, Alloc, tensor_digest
from serve.variants.full import DELTA_FILE, add_full_variant

log = logging.getLogger("manyfold.engine")

Op = Literal["classify", "embed", "generate"]


@dataclass(eq=False)
class Row:
    op: Op
    base: str
    variant: str | None
    payload: Any
    future: asyncio.Future
    stream: asyncio.Queue | None = None
    """Generation only: the row's text after every step, then None once the future is resolved."""
    cancelled: bool = False
    """Its caller has gone: a running generation drops the row at the next step."""
    enqueued_s: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class TextDelta:
    """A piece of a streamed completion; the last one carries the whole Generation (finish reason, counts)."""

    text: str
    final: Generation | None = None


@dataclass(frozen=True)
class Embeddings:
    vectors: list[list[float]]
    prompt_tokens: int


@dataclass
class _Generating:
    """A variant's running generation: its DecodeBatch, the rows in it, and rows waiting to join."""

    pending: list[Row]
    capacity: int
    running: list[Row] = field(default_factory=list)
    batch: DecodeBatch | None = None

    def room(self) -> int:
        return self.capacity - len(self.running) - len(self.pending)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    kind: str
    base: str | None
    residency: Residency
    labels: list[str] | None


class Engine:
    """Results are plain Python values (lists, dataclasses), so they cross process boundaries as they are."""

    def __init__(self, config: ServeConfig, bases: list[str] | None = None):
        self.config = config
        self.store = Store(config.store)
        self.bases: dict[str, BaseModelRuntime] = {}
        self._base_digests: dict[str, dict[str, str]] = {}
        self._base_tensors: dict[str, dict[str, torch.Tensor]] = {}
        self._only = set(bases) if bases is not None else None
        c = config.cache
        self.cache = VariantCache(self._decode_variant, c.device_mib << 20, c.cpu_mib << 20, config.device,
                                  tuple(c.pinned))
        for name in self.store.manifest.bases:
            if self._only is None or name in self._only:
                self._load_base(name)
        self._queue: asyncio.Queue[Row] | None = None
        self._worker: asyncio.Task | None = None
        self._generating: dict[tuple[str, str | None], _Generating] = {}
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="manyfold-compute")
        self._accepting = True
        self.batch_sizes = Distribution(BATCH_BUCKETS)

    # ---- bases and variants
    def _load_base(self, name: str) -> None:
        self.store.verify(self.store.base(name))  # every file against its manifest sha256
        rt = BaseModelRuntime(name, self.store.base_dir(name), self.config.device)
        # Taken once, before any call swaps variant weights into the module: decodes run in other threads
        # while a batch runs, and must always read the base's own tensors.
        tensors = {n: t.detach() for n, t in rt.model.state_dict().items()}
        self._base_tensors[name] = tensors
        self._base_digests[name] = {n: tensor_digest(t) for n, t in tensors.items()}
        self.bases[name] = rt
        self.cache.buffers.reserve(self._decode_layout(name))
        self.cache.buffers.refill()

    def _decode_layout(self, base: str) -> list[tuple[list[int], torch.dtype]]:
        """(shape, dtype) of every tensor a decode of the base's largest full variant (by stored bytes) writes,
        from its header; nothing when it has none, or when that file is unreadable (its requests will say so)."""
        variants = [v for v in self.store.manifest.variants.values() if v.base == base and v.kind == "full"]
        if not variants:
            return []
        largest = max(variants, key=lambda v: sum(f.bytes for f in v.files))  # the most changed, roughly
        try:
            fmd = FmdFile(self.store.variant_dir(largest.name) / DELTA_FILE)
        except ArtifactError as e:
            log.warning("no decode buffers reserved for base '%s': %s", base, e)
            return []
        return [(r.shape, DTYPES[r.dtype]) for r in fmd.records.values() if r.codec != "same"]

    def _decode_variant(self, name: str, alloc: Alloc) -> tuple[dict[str, torch.Tensor], dict]:
        """Runs in a worker thread: FM-Delta file -> the tensors that differ from the base, plus the head."""
        entry = self.store.variant(name)
        fmd = FmdFile(self.store.variant_dir(name) / DELTA_FILE)
        tensors = fmd.decode_all(self._base_tensors[entry.base], base_digests=self._base_digests[entry.base],
                                 share_unchanged=True, alloc=alloc)
        weights, head = self.bases[entry.base].split_variant(tensors)
        return weights, {"head": head, "labels": entry.labels}

    def refresh(self) -> None:
        """Follow the store: another process (the ingress, on an admin call) may have changed it."""
        before = set(self.store.manifest.variants)
        if self.store.refresh():
            self._apply_store_change(before)

    def resolve(self, model: str) -> tuple[str, str | None]:
        """model name -> (base, variant or None for the base itself)."""
        self.refresh()
        base, variant = self.store.resolve(model)
        if base not in self.bases:
            raise VariantNotFound(f"model '{model}' is not served here (its base '{base}' is another replica's)")
        return base, variant

    def model_infos(self) -> list[ModelInfo]:
        out = [ModelInfo(n, "base", None, "device", None) for n in self.bases]
        out += [ModelInfo(v.name, v.kind, v.base, self.cache.residency(v.name), v.labels)
                for v in self.store.manifest.variants.values() if v.base in self.bases]
        return out

    async def models(self) -> list[ModelInfo]:
        self.refresh()
        return self.model_infos()

    async def snapshots(self) -> list[dict]:
        return [await self.snapshot()]

    async def snapshot(self) -> dict:
        """Counters for metrics: cache events and bytes, queue depth, batch sizes, decode times."""
        st = self.cache.stats
        return {"cache_hits": st.hits, "cache_misses": st.misses, "cache_evictions": st.evictions,
                "cache_bytes": {"device": self.cache.used_bytes("device"), "cpu": self.cache.used_bytes("cpu"),
                                "recycled": self.cache.buffers.free_bytes},
                "queue_depth": self.queue_depth, "batch_sizes": self.batch_sizes.to_dict(),
                "load_seconds": st.load_seconds.to_dict()}

    def reload_store(self) -> None:
        """Pick up variants added or removed in the store; cached weights of removed ones are dropped."""
        before = set(self.store.manifest.variants)
        self.store.reload()
        self._apply_store_change(before)

    def _apply_store_change(self, before: set[str]) -> None:
        for name in before - set(self.store.manifest.variants):
            self.cache.drop(name)
        for name in set(self.store.manifest.bases) - set(self.bases):
            if self._only is None or name in self._only:
                self._load_base(name)

    def info(self, name: str) -> ModelInfo:
        for m in self.model_infos():
            if m.name == name:
                return m
        raise VariantNotFound(f"model '{name}' does not exist")

    async def add_variant(self, name: str, base: str, path: str) -> ModelInfo:
        """Store a full fine-tune (HF directory) as an FM-Delta variant, atomically; served at once."""
        await asyncio.to_thread(add_full_variant, self.store, name, base, path)
        self.reload_store()
        return self.info(name)

    async def remove_variant(self, name: str) -> None:
        self.store.variant(name)  # 404 for an unknown name; bases are not removed over HTTP
        await asyncio.to_thread(self.store.remove, name)
        self.reload_store()

    # ---- requests
    async def classify(self, model: str, texts: list[str]) -> tuple[list[str], list[list[float]]]:
        """-> (labels, one probability row per text)."""
        base, variant = self.resolve(model)
        entry = self.store.manifest.variants.get(variant) if variant else None
        if entry is None or not entry.labels:
            raise BadRequest(f"model '{model}' is not a classifier")
        return entry.labels, (await self._submit("classify", base, variant, texts)).tolist()

    async def embed(self, model: str, texts: list[str]) -> Embeddings:
        """One unit vector per text, and the tokens read."""
        base, variant = self.resolve(model)
        return await self._submit("embed", base, variant, texts)

    async def complete(self, model: str, params: SamplingParams, prompt: str | None = None,
                       messages: list[dict] | None = None) -> Generation:
        """A text completion of `prompt`, or a chat completion of `messages` under the base's chat template."""
        return await self._submit(*self._generation_row(model, params, prompt, messages))

    async def complete_stream(self, model: str, params: SamplingParams, prompt: str | None = None,
                              messages: list[dict] | None = None) -> AsyncIterator[TextDelta]:
        """complete(), as text pieces while the tokens come. Text that may yet turn out to be the start of a
        stop string, or half of a multi-byte character, is held back until it cannot."""
        updates: asyncio.Queue[str | None] = asyncio.Queue()  # one item per decode step: <= max_tokens + 1
        row = self._enqueue(*self._generation_row(model, params, prompt, messages), stream=updates)
        held = max((len(s) for s in params.stop), default=1) - 1
        sent = 0
        try:
            while (text := await updates.get()) is not None:
                end = len(text) - held - text.endswith("\ufffd")
                if end > sent:
                    yield TextDelta(text[sent:end])
                    sent = end
            gen = row.future.result()
            yield TextDelta(gen.text[sent:], gen)
        finally:
            row.cancelled = not row.future.done()

    def _generation_row(self, model: str, params: SamplingParams, prompt: str | None,
                        messages: list[dict] | None) -> tuple[Op, str, str | None, tuple]:
        base, variant = self.resolve(model)
        rt = self.bases[base]
        rt.require_causal()
        ids = rt.chat_prompt(messages) if messages is not None else rt.encode_prompt(prompt or "")
        rt.check_fits(ids, params)
        return "generate", base, variant, (ids, params)

    def _enqueue(self, op: Op, base: str, variant: str | None, payload: Any,
                 stream: asyncio.Queue | None = None) -> Row:
        if not self._accepting:
            raise Overloaded("server is shutting down")
        self._ensure_started()
        row = Row(op, base, variant, payload, asyncio.get_running_loop().create_future(), stream)
        try:
            self._queue.put_nowait(row)
        except asyncio.QueueFull:
            raise Overloaded(f"{self._queue.maxsize} requests already waiting; retry later") from None
        return row

    async def _submit(self, op: Op, base: str, variant: str | None, payload: Any):
        row = self._enqueue(op, base, variant, payload)
        try:
            return await row.future
        except asyncio.CancelledError:  # the caller has gone (and cancelling it cancelled the future)
            row.cancelled = True
            raise

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize() if self._queue else 0

    # ---- scheduling
    def _ensure_started(self) -> None:
        """The queue and the scheduler live on the event loop that serves requests (one per replica)."""
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done() or self._worker.get_loop() is not loop:
            self._queue = asyncio.Queue(maxsize=self.config.batch.max_queue)
            self._group_slots = asyncio.Semaphore(self.config.batch.max_concurrent_groups)
            self._worker = loop.create_task(self._schedule())

    async def _schedule(self) -> None:
        b = self.config.batch
        while True:
            rows = [await self._queue.get()]
            deadline = time.perf_counter() + b.batch_wait_timeout_s
            while len(rows) < b.max_batch_size:
                try:
                    rows.append(await asyncio.wait_for(self._queue.get(), max(0.0, deadline - time.perf_counter())))
                except TimeoutError:
                    break
            groups: dict[tuple, list[Row]] = {}
            for r in rows:
                running = self._generating.get((r.base, r.variant)) if r.op == "generate" else None
                if running is not None and running.room() > 0:
                    running.pending.append(r)
                    if r.variant is not None:
                        self.cache.stats.hits += 1  # the running batch holds its variant
                else:
                    groups.setdefault((r.op, r.base, r.variant), []).append(r)
            # Groups run side by side (bounded): a cold variant decoding in its worker thread does not hold up
            # the groups behind it, whose variants are resident. Compute itself stays on one thread.
            for (op, _, _), group in groups.items():
                await self._group_slots.acquire()
                run = self._run_generation if op == "generate" else self._run_group
                asyncio.get_running_loop().create_task(run(group))

    @asynccontextmanager
    async def _weights(self, variant: str | None, requests: int) -> AsyncIterator[tuple[dict | None, dict]]:
        """(weights, extra) of a variant, held in the cache for the block; (None, {}) for the base itself."""
        if variant is None:
            yield None, {}
            return
        async with self.cache.use(variant, requests=requests) as entry:
            yield entry.weights, entry.extra

    def _resolve(self, row: Row, result: Any = None, error: BaseException | None = None) -> None:
        if row.cancelled:
            row.future.cancel()
        elif not row.future.done():
            if error is None:
                row.future.set_result(result)
            else:
                row.future.set_exception(error)
        if row.stream is not None:
            row.stream.put_nowait(None)
        self._queue.task_done()

    async def _run_group(self, rows: list[Row]) -> None:
        """One classify or embed forward for rows of one (base, variant)."""
        loop = asyncio.get_running_loop()
        try:
            async with self._weights(rows[0].variant, len(rows)) as (weights, extra):
                results = await loop.run_in_executor(self._compute, self._compute_group, rows, weights, extra)
            self.batch_sizes.observe(len(rows))
        except Exception as e:  # every row of the group fails the same way; other groups go on
            for r in rows:
                self._resolve(r, error=e)
        else:
            for r, res in zip(rows, results):
                self._resolve(r, res)
        finally:
            self._group_slots.release()

    async def _run_generation(self, rows: list[Row]) -> None:
        """The running DecodeBatch of one (base, variant): admits waiting rows, steps, until none are left."""
        base, variant = rows[0].base, rows[0].variant
        key, loop = (base, variant), asyncio.get_running_loop()
        group = _Generating(list(rows), self.config.batch.max_batch_size)
        self._generating[key] = group
        try:
            async with self._weights(variant, len(rows)) as (weights, _):
                group.batch = DecodeBatch(self.bases[base], weights)
                while group.pending or len(group.batch):
                    new, group.pending = group.pending, []
                    gone = [r for r in group.running + new if r.cancelled]
                    for row in gone:
                        self._resolve(row)  # its caller has gone: it leaves the batch at this step
                    new = [r for r in new if not r.cancelled]
                    group.running = [r for r in group.running if not r.cancelled] + new
                    finished = await loop.run_in_executor(
                        self._compute, group.batch.run, [r.payload[0] for r in new], [r.payload[1] for r in new],
                        new, gone)
                    if len(group.batch) or finished:
                        self.batch_sizes.observe(len(group.batch) + len(finished))
                    for row, gen in group.batch.rows():
                        if row.stream is not None:
                            row.stream.put_nowait(gen.text)
                    for row, gen in finished:
                        group.running.remove(row)
                        self._resolve(row, gen)
        except Exception as e:  # the batch's rows fail together; other batches go on
            for r in group.running + group.pending:
                self._resolve(r, error=e)
        finally:
            if self._generating.get(key) is group:
                del self._generating[key]
            self._group_slots.release()

    def _compute_group(self, rows: list[Row], weights: dict | None, extra: dict) -> list:
        op, rt = rows[0].op, self.bases[rows[0].base]
        texts = [t for r in rows for t in r.payload]
        if op == "embed":
            out, tokens = rt.embed(texts, weights)
        else:
            out = rt.classify(texts, weights, extra.get("head", {}))
        results, at = [], 0
        for r in rows:
            span = slice(at, at + len(r.payload))
            results.append(Embeddings(out[span].tolist(), int(tokens[span].sum())) if op == "embed" else out[span])
            at += len(r.payload)
        return results

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Stop taking requests and wait for those already queued or running."""
        self._accepting = False
        if self._queue is not None:
            try:
                await asyncio.wait_for(self._queue.join(), timeout_s)
            except TimeoutError:
                pass
        if self._worker is not None:
            self._worker.cancel()
        self._compute.shutdown(wait=True)

