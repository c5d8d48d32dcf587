"""Engine: the bases of a store in memory, a variant cache, and the scheduler that batches their rows. No Ray, no
HTTP.

Requests are checked and turned into rows here (prompts tokenised on the event loop with its own tokenizer,
serve/engine/prompts.py), then queued on the scheduler (serve/engine/scheduling/scheduler.py), which holds each row's
variant in the cache and runs the forwards (serve/engine/forwards.py) on one compute thread. Model ids resolve against
the catalog's snapshot (serve/store/catalog.py), and a row runs the revision of its entry it resolved to: the
cache and slots know variants by their entries' keys, so a replace is another variant. A snapshot that no longer
has a key frees its memory when the engine follows it.
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial

import torch

from serve.config import ServeConfig
from serve.engine import faults
from serve.engine.cache import VariantCache
from serve.engine.forwards import Forwards
from serve.engine.generation.grammars import Grammars
from serve.engine.memory import MIB, PROFILE_ROWS, MemoryPlan, reserved_bytes, resident_bytes, working_bytes
from serve.engine.model import BaseModelRuntime
from serve.engine.scheduling.rows import Op
from serve.engine.scheduling.scheduler import Scheduler
from serve.engine.types import (Classifications, Embeddings, Generation, ModelInfo, SamplingParams, Tenant,
                                TextDelta)
from serve.errors import ArtifactError, BadRequest, ConfigError, Unavailable, VariantIncompatible, VariantNotFound
from serve.store.objects import fetched
from serve.store.catalog import Catalog, Snapshot
from serve.store.manifest import REVISION_SEP, BaseEntry, VariantEntry
from serve.store.tensors import Alloc
from serve.variants import variant_kind
from serve.variants.base import LoadedVariant

log = logging.getLogger("manyfold.engine")


class Engine:
    """Results are plain Python values (lists, dataclasses), so they cross process boundaries as they are."""

    def __init__(self, config: ServeConfig, bases: list[str] | None = None, memory_target: int | None = None,
                 on_fetch: Callable[[BaseEntry | VariantEntry, int, int], None] | None = None,
                 aliases: bool = True):
        """memory_target: bytes the engine may hold in all (a replica's Ray memory); None: the memory_target_mib of
        its bases' deployments. Only `neuzip_decoded_mib: auto` reads it. on_fetch: told how far a fetch of an
        entry from object storage has come (StoreView.on_fetch), the bases' included. aliases=False: model ids
        name stored entries, as a router sends them, its aliases resolved (a replica runs the entry a name
        pointed to when the router resolved it, even if an upgrade has switched the name since)."""
        self.config = config
        self.aliases = aliases
        self.catalog = Catalog(config.store, config.store_refresh_s)
        self.catalog.files.on_fetch = on_fetch
        self._followed = self.catalog.snapshot
        """The snapshot whose keys the cache and slots hold (older keys have been retired)."""
        self.bases: dict[str, BaseModelRuntime] = {}
        self._only = set(bases) if bases is not None else None
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="manyfold-compute")
        """The one thread that runs forwards and touches slots and families."""
        self._compiling = ThreadPoolExecutor(max_workers=1, thread_name_prefix="manyfold-grammar")
        """The thread that compiles structured outputs' grammars, off the step and the event loop."""
        self.grammars: dict[str, Grammars] = {}
        """By causal base: its compiled grammars (serve/engine/generation/grammars.py)."""
        c = config.cache
        self.cache = VariantCache(self._load_variant, c.device_mib << 20, c.cpu_mib << 20, config.device,
                                  tuple(c.pinned), copier=self._compute)
        for name in self._followed.manifest.bases:
            if self._only is None or name in self._only:
                self._load_base(name)
        self.memory_plan = self._keep_decoded(memory_target) if config.neuzip_decoded_mib == "auto" else None
        self.scheduler = Scheduler(config.batch, self.cache, Forwards(self.bases), self._compute)

    # ---- bases and variants
    def _load_base(self, name: str) -> None:
        files, entry = self.catalog.files, self._followed.base(name)
        files.verify(entry)  # every file against its manifest sha256 (on object storage: once per node)
        decoded_mib = self.config.neuzip_decoded_mib
        self.bases[name] = BaseModelRuntime(name, files.base_dir(entry), self.config.device, self.config.slots,
                                            0 if decoded_mib == "auto" else decoded_mib << 20, self.config.batch,
                                            self.config.engine)
        self.cache.buffers.reserve(self._reserve_layout(name))
        self.cache.buffers.refill()
        rt = self.bases[name]
        if rt.kv is not None:
            self.grammars[name] = Grammars(partial(rt.prompts.tokenizer.from_pretrained, files.base_dir(entry)),
                                           rt.model.config.vocab_size, rt.eos_ids, self.config.structured_outputs,
                                           self._compiling)

    def _keep_decoded(self, target: int | None) -> MemoryPlan:
        """neuzip_decoded_mib: auto: the memory plan (serve/engine/memory.py), its free bytes kept decoded by the
        NeuZip bases in turn."""
        if target is None:
            targets = [self.config.deployments.get(b, self.config.deployment).memory_target_mib for b in self.bases]
            if None in targets:
                raise ConfigError("neuzip_decoded_mib is auto, yet no memory target: set the deployment's "
                                  "memory_target_mib (or give the replica Ray memory)")
            target = sum(targets) * MIB
        device = torch.device(self.config.device)
        rows = min(self.config.batch.max_batch_size, PROFILE_ROWS)
        working = max((working_bytes(rt, rows) for rt in self.bases.values()), default=0)  # one at a time
        groups = sum(v.kind == "emr" and v.base in self.bases for v in self._followed.manifest.variants.values())
        plan = MemoryPlan(target, resident_bytes(device), working, reserved_bytes(self.config, groups))
        left = plan.free
        for rt in self.bases.values():
            if rt.coded is not None:
                left -= rt.coded.keep(left)
        plan = replace(plan, decoded=plan.free - left)
        log.info("%s", plan.describe())
        return plan

    def _reserve_layout(self, base: str) -> list:
        """(shape, dtype) of the buffers a load of the base's largest weight-set variant (by stored bytes)
        writes; nothing when it has none, or when that file is unreadable (its requests will say so)."""
        variants = [v for v in self._followed.manifest.variants.values()
                    if v.base == base and variant_kind(v.kind).family == "weights"]
        if not variants:
            return []
        largest = max(variants, key=lambda v: sum(f.bytes for f in v.files))  # the most changed, roughly
        try:
            return variant_kind(largest.kind).reserve_layout(self.catalog.files, largest)
        except ArtifactError as e:
            log.warning("no decode buffers reserved for base '%s': %s", base, e)
            return []

    def _load_variant(self, key: str, alloc: Alloc) -> LoadedVariant:
        """Runs in a worker thread: one revision of a stored variant -> its kind's in-memory form, checked against
        its slots."""
        entry = self.catalog.snapshot.entry(key)
        faults.hit("load", [entry.name])
        rt = self.bases[entry.base]
        variant = variant_kind(entry.kind).load(self.catalog.files, entry, rt.view, alloc)
        rt.check(variant)
        return variant

    async def resolve(self, model: str) -> tuple[str, str | None, str | None]:
        """model id -> (base, the model id again or None for the base itself, its entry's key or None)."""
        snapshot, base, variant = await self.catalog.resolve(model, self.aliases)
        self._follow()
        if base not in self.bases:
            raise VariantNotFound(f"model '{model}' is not served here (its base '{base}' is another replica's)")
        return base, variant, snapshot.model_key(variant) if variant else None

    def _follow(self) -> Snapshot:
        """Take the catalog's newest snapshot as the engine's: the keys it no longer has leave the cache and (on
        the compute thread) their slots, and bases new to it are loaded."""
        now, before = self.catalog.snapshot, self._followed
        if now is before:
            return now
        self._followed = now
        for name, entry in before.manifest.variants.items():
            if now.manifest.variants.get(name) != entry:  # removed, or replaced under the same name
                key = before.key(name)
                self.cache.drop(key)
                rt = self.bases.get(entry.base)
                if rt is not None:
                    self._compute.submit(rt.retire, key)  # slots are touched on the compute thread only
        for name in set(now.manifest.bases) - set(self.bases):
            if self._only is None or name in self._only:
                self._load_base(name)
        return now

    def model_infos(self) -> list[ModelInfo]:
        snapshot = self._follow()
        out = [ModelInfo(n, "base", None, "hot", None) for n in self.bases]
        out += [ModelInfo(model, v.kind, v.base, self.cache.residency(snapshot.key(v.name)), v.models()[own],
                          form=v.form_of(own), alias_of=own if own != model else None)
                for model, v, own in snapshot.served() if v.base in self.bases]
        return out

    async def models(self) -> list[ModelInfo]:
        return self.model_infos()

    def check_progress(self, stall_timeout_s: float) -> None:
        """Raise Unavailable when requests have waited stall_timeout_s without an answer or a step: a stuck
        engine, which a replica's health check reports so that Serve replaces it."""
        stalled = self.scheduler.stalled_s()
        if stalled > stall_timeout_s:
            raise Unavailable(f"the engine has had requests for {stalled:.0f} s without answering one or taking a "
                              f"step (stall_timeout_s {stall_timeout_s:g})")

    async def readiness(self) -> tuple[bool, dict[str, str]]:
        """In one process every base is loaded before the engine answers: ready, each base running."""
        return True, {b: "running" for b in self.bases}

    async def snapshots(self) -> list[dict]:
        return [await self.snapshot()]

    async def snapshot(self) -> dict:
        """Counters for metrics: cache events and bytes, queue depth, batch sizes, load times."""
        st = self.cache.stats
        slots = sum(f.nbytes for rt in self.bases.values() for f in tuple(rt.families.values()))
        return {"cache_hits": st.hits, "cache_misses": st.misses, "cache_evictions": st.evictions,
                "cache_bytes": {"hot": self.cache.used_bytes("device"), "warm": self.cache.used_bytes("cpu"),
                                "recycled": self.cache.buffers.free_bytes, "slots": slots},
                "queue_depth": self.scheduler.queue_depth, "batch_sizes": self.scheduler.batch_sizes.to_dict(),
                "load_seconds": st.load_seconds.to_dict(), "seconds": self.seconds(),
                "memory_plan": self.memory_plan.to_dict() if self.memory_plan else None,
                "base_bytes": {name: rt.nbytes for name, rt in self.bases.items()},
                "kv_bytes": {name: rt.kv.nbytes for name, rt in self.bases.items() if rt.kv is not None},
                "kv_blocks": {name: {"used": rt.kv.pool.used, "blocks": rt.kv.blocks}
                              for name, rt in self.bases.items() if rt.kv is not None},
                "steps": {name: dict(rt.step_counts) for name, rt in self.bases.items() if rt.step_counts},
                "step_tokens": {name: dict(rt.token_counts) for name, rt in self.bases.items() if rt.token_counts},
                "latencies": {b: lat.to_dict() for b, lat in self.scheduler.latencies.items()},
                "tenant_waits": {t: w.to_dict() for t, w in self.scheduler.tenant_waits.items()},
                "preemptions": dict(self.scheduler.preemptions),
                "prefix_tokens": {name: dict(rt.prefix_tokens) for name, rt in self.bases.items() if rt.prefix_tokens},
                "grammars": {name: g.counters() for name, g in self.grammars.items()},
                "load": self._load(), "max_batch_size": self.config.batch.max_batch_size,
                "node_cache": self._node_cache()}

    def _node_cache(self) -> dict[str, int]:
        """This replica's lookups in its node's cache of the store's objects (object storage only)."""
        cache = self.catalog.files.cache
        return {} if cache is None else {"hits": cache.stats.hits, "fetches": cache.stats.fetches}

    def _load(self) -> dict[str, dict]:
        """Scheduler.load by base, its variants narrowed to LoRA and PiSSA adapters (vllm:lora_requests_info)."""
        variants = self._followed.manifest.variants
        out = self.scheduler.load()
        for by in out.values():
            for field in ("running_variants", "waiting_variants"):
                names = sorted({key.partition(REVISION_SEP)[0] for key in by[field]})
                by[field] = [n for n in names if n in variants and variants[n].kind in ("lora", "pissa")]
        return out

    def seconds(self) -> dict[str, float]:
        """Seconds of work by part (compute thread and scheduler), summed over the bases (see Seconds)."""
        out = dict(self.scheduler.seconds.parts)
        for rt in self.bases.values():
            for part, s in dict(rt.seconds.parts).items():  # a copy: the compute thread adds parts
                out[part] = out.get(part, 0.0) + s
        return out

    def info(self, name: str) -> ModelInfo:
        """A model, or a group entry (an EMR group: its card, without labels; its tasks are the models)."""
        for m in self.model_infos():
            if m.name == name:
                return m
        v = self._followed.manifest.variants.get(name)
        if v is not None and v.base in self.bases:
            return ModelInfo(v.name, v.kind, v.base, self.cache.residency(self._followed.key(name)), None)
        raise VariantNotFound(f"model '{name}' does not exist")

    @property
    def _max_add_bytes(self) -> int:
        """The most one add may copy (admin.max_add_mib): a larger source is refused before it is copied."""
        return int(self.config.admin.max_add_mib * MIB)

    async def add_variant(self, name: str, base: str, path: str, kind: str = "full") -> ModelInfo:
        """Validate and store a variant of any registered kind, atomically, through the catalog; served at once,
        without restart (a replaced one is a new key: its old revision leaves the cache and slots).
        A file of the caller's that is missing or unreadable is the caller's error here (422), not the store's."""
        try:
            with fetched([path], self._max_add_bytes) as (local,):
                await self.catalog.write(
                    lambda store: variant_kind(kind).add(store, name, base, local, slots=self.config.slots))
        except ArtifactError as e:
            raise VariantIncompatible(str(e)) from e
        return self.info(name)

    async def add_variants(self, items: list[tuple[str, str, str, str]]) -> list[ModelInfo | Exception]:
        """add_variant for many (name, base, path, kind) at once: each kind's add_many validates its items and the
        manifest is written once per kind and base, so thousands register in one call. -> per item, in order, its
        card or the error that kept it out (a caller's file missing or unreadable: 422, as in add_variant)."""
        from serve.variants.base import add_batch

        try:
            with fetched([p for _, _, p, _ in items], self._max_add_bytes) as paths:
                local = [(n, b, str(p), k) for (n, b, _, k), p in zip(items, paths)]
                outcomes = await self.catalog.write(lambda store: add_batch(store, local, self.config.slots))
        except ArtifactError as e:
            raise VariantIncompatible(str(e)) from e
        infos = {m.name: m for m in self.model_infos()}  # once: info() per item would list every model each time
        return [VariantIncompatible(str(o)) if isinstance(o, ArtifactError) else o if isinstance(o, Exception)
                else infos.get(o.name) or self.info(o.name) for o in outcomes]

    async def remove_variant(self, name: str) -> None:
        self._follow().variant(name)  # 404 for an unknown name; bases are not removed over HTTP
        await self.catalog.write(lambda store: store.remove(name))
        self._follow()

    # ---- requests
    async def classify(self, model: str, texts: list[str], truncate: bool = True,
                       tenant: Tenant | None = None) -> Classifications:
        """Texts longer than the model reads are cut (and counted), or refused when truncate is False."""
        base, variant, key = await self.resolve(model)
        labels = self._followed.labels(variant) if variant else None
        if not labels:
            raise BadRequest(f"model '{model}' is not a classifier")
        if not truncate:
            self.bases[base].prompts.check_inputs_fit(texts)
        probs, tokens, truncated = await self._submit("classify", base, variant, key, texts, tenant)
        return Classifications(labels, probs, tokens, truncated)

    async def embed(self, model: str, texts: list[str], truncate: bool = True,
                    tenant: Tenant | None = None) -> Embeddings:
        """One unit vector per text, and the tokens read; long texts as classify() treats them."""
        base, variant, key = await self.resolve(model)
        self.bases[base].require(model, encoder=True)
        if not truncate:
            self.bases[base].prompts.check_inputs_fit(texts)
        return await self._submit("embed", base, variant, key, texts, tenant)

    async def complete(self, model: str, params: SamplingParams, prompt: str | list[int] | None = None,
                       messages: list[dict] | None = None, tools: list[dict] | None = None,
                       tenant: Tenant | None = None) -> Generation:
        """A text completion of `prompt`, or a chat completion of `messages` (and the tools the model may call, in
        OpenAI's form) under the base's chat template."""
        return await self._submit(*await self._generation_row(model, params, prompt, messages, tools, tenant), tenant)

    async def complete_stream(self, model: str, params: SamplingParams, prompt: str | list[int] | None = None,
                              messages: list[dict] | None = None, tools: list[dict] | None = None,
                              tenant: Tenant | None = None) -> AsyncIterator[TextDelta]:
        """complete(), as text pieces while the tokens come. Text that may yet turn out to be the start of a
        stop string is held back until it cannot (half characters never reach the text: it is decoded
        incrementally)."""
        updates: asyncio.Queue[tuple[str, int] | None] = asyncio.Queue()  # one per decode step: <= max_tokens + 1
        row = self.scheduler.submit(*await self._generation_row(model, params, prompt, messages, tools, tenant),
                                    stream=updates, tenant=tenant)
        held = max((len(s) for s in params.stop), default=1) - 1
        sent = sent_tokens = 0
        with_prompt = params.echo or params.logprobs is not None  # the first piece carries the prompt
        try:
            while (update := await updates.get()) is not None:
                text, tokens = update
                end = len(text) - held
                if end > sent:
                    yield TextDelta(text[sent:end], completion_tokens=tokens, prompt_tokens=len(row.payload[0]),
                                    cached_tokens=row.generation.cached_tokens if row.generation else 0,
                                    logprobs=row.logprobs(sent_tokens, tokens),
                                    **_prompt_of(row.generation, with_prompt))
                    sent, sent_tokens, with_prompt = end, tokens, False
            gen = row.future.result()
            yield TextDelta(gen.text[sent:], gen, completion_tokens=gen.completion_tokens,
                            prompt_tokens=gen.prompt_tokens, cached_tokens=gen.cached_tokens,
                            logprobs=None if gen.logprobs is None else gen.logprobs[sent_tokens:],
                            **_prompt_of(gen, with_prompt))
        finally:
            row.cancelled = not row.future.done()

    async def _generation_row(self, model: str, params: SamplingParams, prompt: str | list[int] | None,
                              messages: list[dict] | None, tools: list[dict] | None, tenant: Tenant | None
                              ) -> tuple[Op, str, str | None, str | None, tuple]:
        """Without max_tokens a row may run to the end of the context, within the server's max_tokens. A row with a
        constraint waits here for its grammar (compiled on a worker thread, or from the cache): a constraint the
        grammar library refuses is the request's error before anything runs."""
        base, variant, key = await self.resolve(model)
        rt = self.bases[base]
        rt.require(model, encoder=False)
        if messages is not None:
            ids = rt.prompts.chat(messages, tools)
        elif isinstance(prompt, list):
            ids = rt.prompts.check_token_ids(prompt)
        else:
            ids = rt.prompts.encode(prompt or "")
        rt.prompts.check_fits(ids, params.max_tokens)
        rt.prompts.check_sampling(params)
        if params.max_tokens is None:
            params = replace(params, max_tokens=min(self.config.limits.max_tokens, rt.max_length - len(ids)))
        grammar = None
        if params.constraint is not None:
            who = tenant.name if tenant is not None else model
            grammar = await self.grammars[base].compile(params.constraint, who)
        return "generate", base, variant, key, (ids, params, grammar)

    async def _submit(self, op: Op, base: str, variant: str | None, key: str | None, payload,
                      tenant: Tenant | None = None):
        return await self.scheduler.result(self.scheduler.submit(op, base, variant, key, payload, tenant=tenant))

    @property
    def batch_sizes(self):
        """Rows per forward, as a histogram (benchmarks read it)."""
        return self.scheduler.batch_sizes

    def holds(self) -> dict[str, int]:
        """Rows holding cache entries and slots now, by name (empty once every row has been answered)."""
        out = {f"cache:{n}": e.in_use for n, e in self.cache.entries() if e.in_use}
        for rt in self.bases.values():
            out.update({f"slots:{rt.name}:{f}": n for f, n in rt.slot_refs().items()})
        return out

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Stop taking requests and wait (bounded) for those already queued or running."""
        await self.scheduler.drain(timeout_s)
        self._compute.shutdown(wait=True)
        self._compiling.shutdown(wait=False, cancel_futures=True)
        self.catalog.close()


def _prompt_of(gen: Generation | None, wanted: bool) -> dict:
    if not wanted or gen is None:
        return {}
    return {"prompt_text": gen.prompt_text, "prompt_logprobs": gen.prompt_logprobs}
