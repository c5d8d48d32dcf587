"""Engine: the bases of a store in memory, a variant cache, and a batching scheduler. No Ray, no HTTP.

Requests become rows in a bounded queue (full -> Overloaded, HTTP 429). The scheduler takes the first waiting
row and gathers more for up to `batch_wait_timeout_s` or `max_batch_size` rows. A row whose variant is in
memory is held in the cache and dispatched at once; a cold one is loaded first (one load per variant, in a
worker thread), so it never holds up the others. Dispatched rows of one base share forwards whatever their
variants: classify and embed rows of a gather are one forward; generate rows join their base's one running
DecodeBatch between decode steps, up to `max_batch_size` rows. Every forward runs on one compute thread, so
the event loop keeps answering, and the base's batches take turns step by step: a long generation does not
hold up a classification. A row holds its variant in the cache until it is answered.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from serve.config import ServeConfig
from serve.engine.cache import CachedVariant, VariantCache
from serve.engine.generation import DecodeBatch, NewRow
from serve.engine.model import BaseModelRuntime
from serve.engine.stats import BATCH_BUCKETS, Distribution
from serve.engine.types import Classifications, Embeddings, Generation, ModelInfo, SamplingParams, TextDelta
from serve.errors import (ArtifactError, BadRequest, CapacityExceeded, Overloaded, VariantIncompatible,
                          VariantNotFound)
from serve.store.manifest import MEMBER_SEP
from serve.store.store import Store
from serve.store.tensors import Alloc
from serve.variants import variant_kind
from serve.variants.base import LoadedVariant

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
    held: CachedVariant | None = None
    """Its variant's store entry in memory, held in the cache from dispatch until the row is answered."""
    model: str | None = None
    """The model id it asked for: the entry itself, or one of a group's members ("<group>/<task>")."""
    enqueued_s: float = field(default_factory=time.perf_counter)
    generation: Generation | None = None
    """Streamed generation only: the row's Generation as far as it has gone."""

    def logprobs(self, start: int, stop: int) -> list | None:
        """Log probabilities of the generated tokens start..stop (appended to on the compute thread: a slice
        of what is already there is safe to read)."""
        gen = self.generation
        return None if gen is None or gen.logprobs is None else gen.logprobs[start:stop]

    @property
    def loaded(self) -> LoadedVariant | None:
        return self.held.variant.member(self.model) if self.held is not None else None


@dataclass
class _Generating:
    """A base's running generation: its DecodeBatch, the rows in it, and rows waiting to join."""

    batch: DecodeBatch
    pending: list[Row] = field(default_factory=list)
    running: list[Row] = field(default_factory=list)


class Engine:
    """Results are plain Python values (lists, dataclasses), so they cross process boundaries as they are."""

    def __init__(self, config: ServeConfig, bases: list[str] | None = None):
        self.config = config
        self.store = Store(config.store)
        self.bases: dict[str, BaseModelRuntime] = {}
        self._only = set(bases) if bases is not None else None
        c = config.cache
        self.cache = VariantCache(self._load_variant, c.device_mib << 20, c.cpu_mib << 20, config.device,
                                  tuple(c.pinned))
        for name in self.store.manifest.bases:
            if self._only is None or name in self._only:
                self._load_base(name)
        self._queue: asyncio.Queue[Row] | None = None
        self._worker: asyncio.Task | None = None
        self._generating: dict[str, _Generating] = {}
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="manyfold-compute")
        self._accepting = True
        self.batch_sizes = Distribution(BATCH_BUCKETS)

    # ---- bases and variants
    def _load_base(self, name: str) -> None:
        self.store.verify(self.store.base(name))  # every file against its manifest sha256
        self.bases[name] = BaseModelRuntime(name, self.store.base_dir(name), self.config.device, self.config.slots,
                                            self.config.neuzip_decoded_mib << 20)
        self.cache.buffers.reserve(self._reserve_layout(name))
        self.cache.buffers.refill()

    def _reserve_layout(self, base: str) -> list:
        """(shape, dtype) of the buffers a load of the base's largest weight-set variant (by stored bytes)
        writes; nothing when it has none, or when that file is unreadable (its requests will say so)."""
        variants = [v for v in self.store.manifest.variants.values()
                    if v.base == base and variant_kind(v.kind).family == "weights"]
        if not variants:
            return []
        largest = max(variants, key=lambda v: sum(f.bytes for f in v.files))  # the most changed, roughly
        try:
            return variant_kind(largest.kind).reserve_layout(self.store, largest)
        except ArtifactError as e:
            log.warning("no decode buffers reserved for base '%s': %s", base, e)
            return []

    def _load_variant(self, name: str, alloc: Alloc) -> LoadedVariant:
        """Runs in a worker thread: a stored variant -> its kind's in-memory form, checked against its slots."""
        entry = self.store.variant(name)
        rt = self.bases[entry.base]
        variant = variant_kind(entry.kind).load(self.store, entry, rt.view, alloc)
        rt.slots(variant.family).check(variant)
        return variant

    def refresh(self) -> None:
        """Follow the store: another process (the ingress, on an admin call) may have changed it."""
        before = dict(self.store.manifest.variants)
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
        out += [ModelInfo(model, v.kind, v.base, self.cache.residency(v.name), labels)
                for v in self.store.manifest.variants.values() if v.base in self.bases
                for model, labels in v.models().items()]
        return out

    async def models(self) -> list[ModelInfo]:
        self.refresh()
        return self.model_infos()

    async def snapshots(self) -> list[dict]:
        return [await self.snapshot()]

    async def snapshot(self) -> dict:
        """Counters for metrics: cache events and bytes, queue depth, batch sizes, load times."""
        st = self.cache.stats
        slots = sum(f.nbytes for rt in self.bases.values() for f in rt.families.values())
        return {"cache_hits": st.hits, "cache_misses": st.misses, "cache_evictions": st.evictions,
                "cache_bytes": {"device": self.cache.used_bytes("device"), "cpu": self.cache.used_bytes("cpu"),
                                "recycled": self.cache.buffers.free_bytes, "slots": slots},
                "queue_depth": self.queue_depth, "batch_sizes": self.batch_sizes.to_dict(),
                "load_seconds": st.load_seconds.to_dict()}

    def reload_store(self) -> None:
        """Pick up variants added or removed in the store; cached weights of removed ones are dropped."""
        before = dict(self.store.manifest.variants)
        self.store.reload()
        self._apply_store_change(before)

    def _apply_store_change(self, before: dict) -> None:
        now = self.store.manifest.variants
        for name, entry in before.items():
            if now.get(name) != entry:  # removed, or replaced under the same name
                self.cache.drop(name)
                rt = self.bases.get(entry.base)
                if rt is not None:
                    self._compute.submit(rt.forget, name)  # slots are touched on the compute thread only
        for name in set(self.store.manifest.bases) - set(self.bases):
            if self._only is None or name in self._only:
                self._load_base(name)

    def info(self, name: str) -> ModelInfo:
        """A model, or a group entry (an EMR group: its card, without labels; its tasks are the models)."""
        for m in self.model_infos():
            if m.name == name:
                return m
        v = self.store.manifest.variants.get(name)
        if v is not None and v.base in self.bases:
            return ModelInfo(v.name, v.kind, v.base, self.cache.residency(v.name), None)
        raise VariantNotFound(f"model '{name}' does not exist")

    async def add_variant(self, name: str, base: str, path: str, kind: str = "full") -> ModelInfo:
        """Validate and store a variant of any registered kind, atomically; served at once, without restart.
        A file of the caller's that is missing or unreadable is the caller's error here (422), not the store's."""
        before = dict(self.store.manifest.variants)  # the add updates self.store's manifest itself
        try:
            await asyncio.to_thread(variant_kind(kind).add, self.store, name, base, Path(path),
                                    slots=self.config.slots)
        except ArtifactError as e:
            raise VariantIncompatible(str(e)) from e
        self.store.reload()
        self._apply_store_change(before)  # a replaced group leaves the cache and its slots
        return self.info(name)

    async def remove_variant(self, name: str) -> None:
        self.store.variant(name)  # 404 for an unknown name; bases are not removed over HTTP
        await asyncio.to_thread(self.store.remove, name)
        self.reload_store()

    # ---- requests
    async def classify(self, model: str, texts: list[str], truncate: bool = True) -> Classifications:
        """Texts longer than the model reads are cut (and counted), or refused when truncate is False."""
        base, variant = self.resolve(model)
        labels = self.store.labels(variant) if variant else None
        if not labels:
            raise BadRequest(f"model '{model}' is not a classifier")
        if not truncate:
            self.bases[base].check_inputs_fit(texts)
        probs, tokens, truncated = await self._submit("classify", base, variant, texts)
        return Classifications(labels, probs, tokens, truncated)

    async def embed(self, model: str, texts: list[str], truncate: bool = True) -> Embeddings:
        """One unit vector per text, and the tokens read; long texts as classify() treats them."""
        base, variant = self.resolve(model)
        if not truncate:
            self.bases[base].check_inputs_fit(texts)
        return await self._submit("embed", base, variant, texts)

    async def complete(self, model: str, params: SamplingParams, prompt: str | list[int] | None = None,
                       messages: list[dict] | None = None) -> Generation:
        """A text completion of `prompt`, or a chat completion of `messages` under the base's chat template."""
        return await self._submit(*self._generation_row(model, params, prompt, messages))

    async def complete_stream(self, model: str, params: SamplingParams, prompt: str | list[int] | None = None,
                              messages: list[dict] | None = None) -> AsyncIterator[TextDelta]:
        """complete(), as text pieces while the tokens come. Text that may yet turn out to be the start of a
        stop string is held back until it cannot (half characters never reach the text: it is decoded
        incrementally)."""
        updates: asyncio.Queue[tuple[str, int] | None] = asyncio.Queue()  # one per decode step: <= max_tokens + 1
        row = self._enqueue(*self._generation_row(model, params, prompt, messages), stream=updates)
        held = max((len(s) for s in params.stop), default=1) - 1
        sent = sent_tokens = 0
        with_prompt = params.echo or params.logprobs is not None  # the first piece carries the prompt
        try:
            while (update := await updates.get()) is not None:
                text, tokens = update
                end = len(text) - held
                if end > sent:
                    yield TextDelta(text[sent:end], logprobs=row.logprobs(sent_tokens, tokens),
                                    **_prompt_of(row.generation, with_prompt))
                    sent, sent_tokens, with_prompt = end, tokens, False
            gen = row.future.result()
            yield TextDelta(gen.text[sent:], gen, logprobs=None if gen.logprobs is None else gen.logprobs[sent_tokens:],
                            **_prompt_of(gen, with_prompt))
        finally:
            row.cancelled = not row.future.done()

    def _generation_row(self, model: str, params: SamplingParams, prompt: str | list[int] | None,
                        messages: list[dict] | None) -> tuple[Op, str, str | None, tuple]:
        """Without max_tokens a row may run to the end of the context, within the server's max_tokens."""
        base, variant = self.resolve(model)
        rt = self.bases[base]
        rt.require_causal()
        if messages is not None:
            ids = rt.chat_prompt(messages)
        elif isinstance(prompt, list):
            ids = rt.check_token_ids(prompt)
        else:
            ids = rt.encode_prompt(prompt or "")
        if params.max_tokens is None:
            params = replace(params, max_tokens=max(1, min(self.config.limits.max_tokens, rt.max_length - len(ids))))
        rt.check_fits(ids, params)
        return "generate", base, variant, (ids, params)

    def _enqueue(self, op: Op, base: str, variant: str | None, payload: Any,
                 stream: asyncio.Queue | None = None) -> Row:
        if not self._accepting:
            raise Overloaded("server is shutting down")
        self._ensure_started()
        entry = variant.split(MEMBER_SEP, 1)[0] if variant is not None else None  # what the cache holds
        row = Row(op, base, entry, payload, asyncio.get_running_loop().create_future(), stream, model=variant)
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
            b = self.config.batch
            self._queue = asyncio.Queue(maxsize=b.max_queue)
            self._in_flight = asyncio.Semaphore(b.max_batch_size * b.max_concurrent_groups)
            self._worker = loop.create_task(self._schedule())

    async def _schedule(self) -> None:
        """Bounded: at most max_batch_size * max_concurrent_groups rows are taken from the queue at once; the
        rest wait there (and beyond max_queue are refused)."""
        b = self.config.batch
        while True:
            await self._in_flight.acquire()
            rows = [await self._queue.get()]
            deadline = time.perf_counter() + b.batch_wait_timeout_s
            while len(rows) < b.max_batch_size and not self._in_flight.locked():
                await self._in_flight.acquire()
                try:
                    rows.append(await asyncio.wait_for(self._queue.get(), max(0.0, deadline - time.perf_counter())))
                except TimeoutError:
                    self._in_flight.release()
                    break
            ready = []
            for r in rows:
                r.held = self.cache.try_acquire(r.variant) if r.variant is not None else None
                if r.variant is None or r.held is not None:
                    ready.append(r)
                else:  # cold: loads in the background, and the rows in memory go on without it
                    asyncio.get_running_loop().create_task(self._load_then_dispatch(r))
            self._dispatch(ready)

    async def _load_then_dispatch(self, row: Row) -> None:
        try:
            row.held = await self.cache.acquire(row.variant)
        except Exception as e:  # this row's variant fails alone
            self._resolve(row, error=e)
            return
        self._dispatch([row])

    def _dispatch(self, rows: list[Row]) -> None:
        """Rows whose variants are held: generate rows join their base's running batch, classify and embed rows
        of one base become one forward."""
        loop = asyncio.get_running_loop()
        groups: dict[tuple[str, str], list[Row]] = {}
        for r in rows:
            if r.cancelled:
                self._resolve(r)
            elif r.op == "generate":
                running = self._generating.get(r.base)
                if running is None:
                    running = self._generating[r.base] = _Generating(DecodeBatch(self.bases[r.base]))
                    loop.create_task(self._run_generation(r.base, running))
                running.pending.append(r)
            else:
                groups.setdefault((r.op, r.base), []).append(r)
        for group in groups.values():
            loop.create_task(self._run_group(group))

    def _resolve(self, row: Row, result: Any = None, error: BaseException | None = None) -> None:
        if row.held is not None:
            self.cache.release(row.held)
            row.held = None
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
        self._in_flight.release()

    async def _run_group(self, rows: list[Row]) -> None:
        """Classify or embed rows of one base, whatever their variants, in as few forwards as slots allow."""
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._compute, self._compute_group, rows)
            self.batch_sizes.observe(len(rows))
        except Exception as e:  # every row of the group fails the same way; other groups go on
            for r in rows:
                self._resolve(r, error=e)
        else:
            for r, res in zip(rows, results):
                self._resolve(r, res)

    async def _run_generation(self, base: str, group: _Generating) -> None:
        """The base's running DecodeBatch: admits waiting rows (of any variant), steps, until none are left."""
        loop = asyncio.get_running_loop()
        cap = self.config.batch.max_batch_size
        new: list[Row] = []
        try:
            while group.pending or len(group.batch):
                gone = [r for r in group.running + group.pending if r.cancelled]
                for row in gone:
                    self._resolve(row)  # its caller has gone: it leaves the batch at this step
                group.running = [r for r in group.running if not r.cancelled]
                pending = [r for r in group.pending if not r.cancelled]
                room = max(0, cap - len(group.batch))
                new, group.pending = pending[:room], pending[room:]
                finished, waiting = await loop.run_in_executor(
                    self._compute, group.batch.run,
                    [NewRow(r, r.payload[0], r.payload[1], r.loaded) for r in new], gone)
                waited = {id(w.tag) for w in waiting}
                group.running += [r for r in new if id(r) not in waited]
                group.pending = [w.tag for w in waiting] + group.pending
                if len(group.batch) or finished:
                    self.batch_sizes.observe(len(group.batch) + len(finished))
                for row, gen in group.batch.rows():
                    if row.stream is not None:
                        row.stream.put_nowait((gen.text, len(gen.token_ids)))
                        row.generation = gen
                for row, gen in finished:
                    group.running.remove(row)
                    self._resolve(row, gen)
        except Exception as e:  # the batch's rows fail together, those it was admitting too; other batches go on
            await loop.run_in_executor(self._compute, group.batch.close)
            failed = {id(r): r for r in group.running + new + group.pending if not r.future.done()}
            for r in failed.values():
                self._resolve(r, error=e)
        finally:
            if self._generating.get(base) is group:
                del self._generating[base]

    def _compute_group(self, rows: list[Row]) -> list:
        """On the compute thread: as many rows as get slots go in one forward, then the next, so rows of more
        adapters than slots still run (in more forwards)."""
        rt, results = self.bases[rows[0].base], []
        while len(results) < len(rows):
            chunk, slots = [], []
            for r in rows[len(results):]:
                slot = rt.attach(r.loaded)
                if slot is None:
                    break
                chunk.append(r)
                slots.append(slot)
            if not chunk:
                raise CapacityExceeded(f"every adapter slot of base '{rt.name}' is in use; retry later")
            try:
                results += self._forward_rows(rt, chunk, slots)
            finally:
                for slot in slots:
                    rt.detach(slot)
        return results

    def _forward_rows(self, rt: BaseModelRuntime, rows: list[Row], slots: list) -> list:
        op = rows[0].op
        texts = [t for r in rows for t in r.payload]
        per_text = [s for r, s in zip(rows, slots) for _ in r.payload]
        if op == "embed":
            out, tokens = rt.embed(texts, per_text)
        else:
            out, tokens = rt.classify(texts, per_text, [r.loaded.head for r in rows for _ in r.payload])
        at_limit = [i for i, n in enumerate(tokens.tolist()) if n == rt.max_input_tokens]
        cut = set(i for i, n in zip(at_limit, rt.input_lengths([texts[i] for i in at_limit]))
                  if n > rt.max_input_tokens)
        results, at = [], 0
        for r in rows:
            span = range(at, at + len(r.payload))
            read, truncated = int(tokens[at:span.stop].sum()), sum(i in cut for i in span)
            if op == "embed":
                results.append(Embeddings(out[at:span.stop].tolist(), read, truncated))
            else:
                results.append(([out[i].tolist() for i in span], read, truncated))
            at = span.stop
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


def _prompt_of(gen: Generation | None, wanted: bool) -> dict:
    if not wanted or gen is None:
        return {}
    return {"prompt_text": gen.prompt_text, "prompt_logprobs": gen.prompt_logprobs}
