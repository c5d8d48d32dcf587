"""The running generations, one per base: generate rows join their base's running generation between decode steps,
the fairness policy picks which join and which are parked, and each step's outcome answers the rows it ended.
Plain asyncio, no torch: the scheduler (serve/engine/scheduling/scheduler.py) feeds it rows and resolves them; the batch
itself (serve/engine/generation/decode_batch.py) runs on the compute thread.
"""

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from serve.config import BatchConfig
from serve.engine.scheduling.fairness import Fairness
from serve.engine.scheduling.rows import Forwards, GenerationBatch, Row, Step
from serve.engine.stats import Distribution, Latencies, Seconds, TenantWaits

log = logging.getLogger("manyfold.engine")


@dataclass
class Generating:
    """A base's running generation: its batch, the rows in it, and rows waiting to join."""

    batch: GenerationBatch
    pending: list[Row] = field(default_factory=list)
    running: list[Row] = field(default_factory=list)
    short: bool = False
    """The last step found the batch full (Step.full) though it runs fewer than max_batch_size rows."""
    budget: bool = False
    """The last step left a new row waiting for its token budget (Step.budget): rows that wait here hold permits."""


class Generations:
    """The running generation of each base and the loop that steps it. The scheduler builds one for each event loop
    it serves, and hands it what the loop asks of the scheduler:
    - let_in(): before a step's rows are chosen, let the rows that permits given back let out of the queue reach
      the generation first;
    - pull(base, g, holding): with g's batch crowded (holding: its running rows by tenant), take rows out of the
      queue past the permits that would take a parked row's slot; they come back through `join`;
    - spawn(coro): keep and supervise a task (each base's generation runs in one);
    - finish(row, result=None, error=None), fail(row, stage, e), shut_out(rows): resolve rows, each exactly once;
    - stepped(): a generation stepped, which is progress (Scheduler.stalled_s).
    The counters it adds to (latencies, tenant_waits, batch_sizes, seconds, preemptions) are the scheduler's, kept
    across loops.
    """

    def __init__(self, config: BatchConfig, forwards: Forwards, compute: Executor, fairness: Fairness, *,
                 latencies: dict[str, Latencies], tenant_waits: dict[str, TenantWaits], batch_sizes: Distribution,
                 seconds: Seconds,
                 preemptions: Counter[str], let_in: Callable[[], Awaitable[None]],
                 pull: Callable[[str, Generating, Counter[str]], None], spawn: Callable[[Coroutine], None],
                 finish: Callable[..., None], fail: Callable[[Row, str, BaseException], None],
                 shut_out: Callable[[list[Row]], None], stepped: Callable[[], None]):
        self.config = config
        self.forwards = forwards
        self.compute = compute
        self.fairness = fairness
        self.latencies = latencies
        self.tenant_waits = tenant_waits
        self.batch_sizes = batch_sizes
        self.seconds = seconds
        self.preemptions = preemptions
        self.let_in, self.pull, self.spawn, self.stepped = let_in, pull, spawn, stepped
        self.finish, self.fail, self.shut_out = finish, fail, shut_out
        self._generating: dict[str, Generating] = {}
        """By base: its running generation, which rows dispatched now join."""

    def __len__(self) -> int:
        """Bases with a running generation."""
        return len(self._generating)

    def join(self, row: Row) -> None:
        """A generate row joins its base's running generation, started if there is none."""
        running = self._generating.get(row.base)
        if running is None:
            try:
                batch = self.forwards.generation(row.base)
            except Exception as e:
                log.exception("starting a generation on base '%s' failed", row.base)
                self.fail(row, "starting a generation", e)
                return
            running = self._generating[row.base] = Generating(batch)
            self.spawn(self._run(row.base, running))
        running.pending.append(row)

    def load(self, open_rows: Counter[str]) -> dict[str, dict]:
        """By base (open_rows: rows submitted and not yet answered): requests running (in a generation batch) and
        waiting (every other one not yet answered), and the variants running and waiting to join the batch."""
        out: dict[str, dict] = {}
        for base, n in open_rows.items():
            g = self._generating.get(base)
            running, pending = (g.running, g.pending) if g is not None else ([], [])
            out[base] = {"running": len(running), "waiting": max(0, n - len(running)),
                         "running_variants": sorted({r.variant for r in running if r.variant}),
                         "waiting_variants": sorted({r.variant for r in pending if r.variant})}
        return out

    async def _on_compute(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.compute, fn, *args)

    async def _run(self, base: str, g: Generating) -> None:
        """The base's running generation: admits waiting rows (of any variant), steps, until none are left. A
        step that raises fails the rows in the batch and those it was admitting; rows still waiting to join
        start a fresh generation."""
        new: list[Row] = []
        ended: float | None = None
        try:
            while g.pending or len(g.batch):
                await self.let_in()
                gone = self._gone(g)
                holding = self._crowded(g, len(g.pending), budget=True)
                if holding is not None:
                    self.pull(base, g, holding)
                new = self._next_rows(g)
                park, parked_for = self._preempt(g, new)
                new += parked_for
                share = self._share(g, new)
                if ended is not None:
                    self.seconds.add("scheduling", time.perf_counter() - ended)
                joining = time.monotonic()
                step = await self._on_compute(g.batch.run, new, gone, park, self.fairness.victims(g.running),
                                              self.fairness.key, share)
                ended = time.perf_counter()
                self.stepped()
                self._after_step(g, new, step, park, joining)
                new = []
            self._retire(base, g)
            await self._on_compute(g.batch.close)
        except Exception as e:
            log.exception("a generation step on base '%s' failed", base)
            await self._abandon(base, g, new, e)
        finally:
            self._retire(base, g)
            self.shut_out(g.running + new + g.pending)

    def _retire(self, base: str, g: Generating) -> None:
        """g stops taking rows: those dispatched from now on start a new batch."""
        if self._generating.get(base) is g:
            del self._generating[base]

    def _gone(self, g: Generating) -> list[Row]:
        """Rows whose callers have gone: answered now, dropped from the batch at this step."""
        gone = [r for r in g.running if r.cancelled] + [r for r in g.pending if r.cancelled and r.parked]
        for r in gone + [r for r in g.pending if r.cancelled and not r.parked]:
            self.finish(r)
        g.running = [r for r in g.running if not r.cancelled]
        g.pending = [r for r in g.pending if not r.cancelled]
        return gone

    def _crowded(self, g: Generating, joining: int = 0, budget: bool = False) -> Counter[str] | None:
        """VTC with every slot spoken for: the batch's rows and `joining` more take every row it may hold (or the
        batch holds all its KV cache or variant pool holds), or with `budget` rows left waiting for the token budget
        (they hold permits, so another tenant's rows would stay in the queue): the running rows by tenant (None: no
        row is to be parked or pulled)."""
        if self.fairness.policy != "vtc" or (len(g.batch) + joining < self.config.max_batch_size and not g.short
                                             and not (budget and g.budget)):
            return None
        return Counter(r.tenant for r in g.running)

    def _preempt(self, g: Generating, joining: list[Row]) -> tuple[list[Row], list[Row]]:
        """VTC, with every slot of the batch taken once `joining` (the rows taking its free slots) join: running rows
        parked (DecodeBatch.run) for rows still waiting of tenants holding fewer (Fairness.preempt); those rows join
        in their place. Counted once the free slots are given: parking only with no slot free, a step with one
        free slot gave it to one light row and left the tenant's next rows waiting for a free slot while a flood
        kept the rest (the fairness scenario's worst light waits). At most max_batch_size rows are parked at once,
        so the host memory their keys and values take stays within one KV store's. -> (rows to park, rows to
        join)."""
        holding = self._crowded(g, len(joining))
        if holding is None or not g.pending:
            return [], []
        holding.update(r.tenant for r in joining)
        park, new = self.fairness.preempt(g.running, g.pending, holding, joining)
        room = max(0, self.config.max_batch_size - sum(r.parked for r in g.pending))
        park, new = park[:room], new[:room]
        for row in new:
            g.pending.remove(row)
        return park, new

    def _share(self, g: Generating, new: Sequence[Row] = ()) -> Callable[[Row], tuple[str, int]]:
        """Each row's group and prompt-token allowance at this step (Fairness.prompt_share), given the rows joining
        it (new; none before they are chosen), whose prompts it writes, and the batch's rows still writing
        theirs."""
        writing = [r for r in [*g.running, *new] if not r.tokens_seen]  # a parked row resuming mid-prompt too
        return self.fairness.prompt_share([*g.running, *new, *g.pending], self.config.max_step_tokens,
                                          self.config.vtc_far_prompt_tokens, writing)

    def _next_rows(self, g: Generating) -> list[Row]:
        """The rows that join the batch at this step, in the fairness policy's order, passing over those whose
        prompts would wait for the prompts being written (their group's allowance spent, or the step's budget
        filled by the prompts ranked before them): given a free slot, such a row leaves it empty for the step,
        and a row ranked after it waits. A flood of long prompts, its next rows ranked first, took every free slot
        step after step while its prompt was written, and a light tenant's short one waited for it."""
        free = max(0, self.config.max_batch_size - len(g.batch))
        if not free:  # a full batch, the common case under load: no row's prompt need be checked
            return []
        share = self._share(g)
        ready = [r for r in g.pending if not g.batch.prompt_waits(r, self.fairness.key, share)]
        new = self.fairness.take(ready, free)[0]
        taken = {id(r) for r in new}
        g.pending = [r for r in g.pending if id(r) not in taken]
        return new

    def _after_step(self, g: Generating, new: list[Row], step: Step, park: list[Row], joining: float) -> None:
        """joining: time.monotonic() as the step began, when the rows that joined it left the wait (their queue
        time ends there, as vLLM's ends when a request is scheduled)."""
        g.short, g.budget = step.full, step.budget
        for r, e in step.failed:
            if r in g.running:
                g.running.remove(r)
            self.fail(r, "its generation", e)
        waiting = {id(w) for w in step.waiting}
        joined = [r for r in new if id(r) not in waiting and not r.done]
        g.running += joined
        for r in step.parked:
            g.running.remove(r)
            r.parked = True
            self.preemptions[r.base] += 1
        g.pending = list(step.parked) + list(step.waiting) + g.pending
        now = time.monotonic()
        for r in joined:
            self.fairness.admit(r)  # its prompt charged now it runs (once: a resumed row's was when it first joined)
            if r.parked:  # resumed: its wait and its prompt were counted when it first joined
                r.parked = False
                continue
            lat = self.latencies.setdefault(r.base, Latencies())
            lat.queue.observe(joining - r.submitted_at)
            lat.prompt_tokens += len(r.payload[0])
            if r.scope:
                self.tenant_waits.setdefault(r.scope, TenantWaits()).queue.observe(joining - r.submitted_at)
        if len(g.batch) or step.finished:
            self.batch_sizes.observe(len(g.batch) + len(step.finished))
        for row, gen in [*g.batch.rows(), *step.finished]:
            self._tokens(row, len(gen.token_ids), now)
        for row, gen in g.batch.rows():
            if row.stream is not None:
                row.stream.put_nowait((gen.text, len(gen.token_ids)))
                row.generation = gen
        for row, gen in step.finished:
            if row in g.running:
                g.running.remove(row)
            if gen.end_token is not None:  # sampled, so generated, though in neither its tokens nor its text
                self.latencies.setdefault(row.base, Latencies()).generation_tokens += 1
            self.finish(row, gen)

    def _tokens(self, row: Row, count: int, now: float) -> None:
        """A generation row's latencies as its tokens arrive (Latencies.arrived)."""
        if count > row.tokens_seen:
            self.fairness.served(row, count - row.tokens_seen)
            lat = self.latencies.setdefault(row.base, Latencies())
            lat.arrived(row.tokens_seen, count - row.tokens_seen, now - row.submitted_at, now - row.token_at)
            if row.tokens_seen == 0 and row.scope:
                self.tenant_waits.setdefault(row.scope, TenantWaits()).first_token.observe(now - row.submitted_at)
            lat.generation_tokens += count - row.tokens_seen
            row.tokens_seen, row.token_at = count, now

    async def _abandon(self, base: str, g: Generating, new: list[Row], e: Exception) -> None:
        """A step raised: the batch's state is not to be trusted. Its rows fail; rows that only waited to join
        go to a fresh generation."""
        self._retire(base, g)
        try:
            await self._on_compute(g.batch.close)
        except Exception:
            log.exception("closing the failed generation of base '%s' failed too", base)
        for r in g.running + new + [r for r in g.pending if r.parked]:  # a parked row's keys went with the batch
            self.fail(r, "its generation", e)
        waiting, g.pending = [r for r in g.pending if not r.parked], []
        for r in waiting:
            self.join(r)
