"""The scheduler: requests become rows in one bounded queue, rows are gathered, their variants held in the cache,
and dispatched to the forwards. Plain asyncio, no torch: the forwards (serve/engine/forwards.py) run on the one
compute thread it is given, so the event loop keeps answering.

The scheduler takes the waiting row that goes next and gathers more for up to `batch_wait_timeout_s` or
`max_batch_size` rows (beyond max_queue, Overloaded: HTTP 429). Which row goes next, out of the queue and into a
running generation, is the fairness policy's (serve/engine/fairness.py: by tenant, the least served first, or first
come, first served); each row carries its tenant. A row whose variant is on the fast tier is held and dispatched at
once; any other is acquired in its own task (a load, or a promotion from the cpu tier), so it never holds up
the rest. Classify and embed rows of one gather and base are one forward; generate rows join their base's one
running generation between decode steps.

Supervised: whatever raises (an acquisition, an attach, a prefill, a decode step, closing a batch, a forward),
only the rows that step touched fail, each with RowFailed naming its model and the stage, and the scheduler goes
on serving the same queue. Every row is resolved exactly once (`_finish`), which releases its cache hold, its
place in the queue and its permit, whatever happened.
"""

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Coroutine
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from serve.config import BatchConfig
from serve.engine.fairness import Fairness, FairQueue
from serve.engine.rows import Forwards, GenerationBatch, Holds, Op, Row, Step, row_error
from serve.engine.stats import BATCH_BUCKETS, Distribution, Latencies, Seconds
from serve.engine.types import Tenant
from serve.errors import ManyfoldError, Overloaded

log = logging.getLogger("manyfold.engine")

@dataclass
class _Generating:
    """A base's running generation: its batch, the rows in it, and rows waiting to join."""

    batch: GenerationBatch
    pending: list[Row] = field(default_factory=list)
    running: list[Row] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: BatchConfig, holds: Holds, forwards: Forwards, compute: Executor):
        self.config = config
        self.holds = holds
        self.forwards = forwards
        self.compute = compute
        self.accepting = True
        self.batch_sizes = Distribution(BATCH_BUCKETS)
        self.seconds = Seconds()
        """"scheduling": event-loop time from one generation step's end to the next one's start."""
        self.fairness = Fairness(config.fairness)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: FairQueue | None = None
        self._in_flight: asyncio.Semaphore | None = None
        self._permits = config.max_batch_size * config.max_concurrent_groups
        self._out = 0
        """Rows the gather has taken out of the queue (each with a permit) and not yet resolved."""
        self._borrowed = 0
        """Rows taken out of the queue past the permits, to take a parked row's slot (_pull): the next permits
        given back are not released, so the rows out stay bounded."""
        self._worker: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._generating: dict[str, _Generating] = {}
        self._open: Counter[str] = Counter()
        """Rows submitted and not yet answered, by base."""
        self.preemptions: Counter[str] = Counter()
        """Running rows parked for another tenant's (_preempt), by base."""
        self.latencies: dict[str, Latencies] = {}
        """By base: each answered request's time to first token, between tokens, end to end."""
        self._progress_at = time.monotonic()
        """When a row was last answered or a generation last stepped (or work arrived at an idle scheduler)."""

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize() if self._queue is not None else 0

    def stalled_s(self) -> float:
        """Seconds the scheduler has had rows to answer without answering one or stepping; 0 when idle."""
        return time.monotonic() - self._progress_at if self._open.total() else 0.0

    # ---- requests
    def submit(self, op: Op, base: str, model: str | None, key: str | None, payload: Any,
               stream: asyncio.Queue | None = None, tenant: Tenant | None = None) -> Row:
        """Queue a row of `model` (None: the base), whose entry has `key` in the cache (a group's for a member), for
        `tenant` (None: the model is the tenant); Overloaded when the queue is full or the server is stopping.
        Await its future."""
        if not self.accepting:
            raise Overloaded("server is shutting down")
        self._start()
        row = Row(op, base, key, payload, self._loop.create_future(), model=model, stream=stream,
                  submitted_at=time.monotonic(), tenant=tenant.name if tenant else model or base,
                  weight=tenant.weight if tenant else 1.0)
        self.fairness.arrive(row)
        try:
            pushed = self._queue.put_nowait(row)
        except asyncio.QueueFull:
            self.fairness.leave(row)
            raise Overloaded(f"{self._queue.maxsize} requests already waiting; retry later") from None
        if not self._open.total():
            self._progress_at = time.monotonic()  # the clock starts with the work
        self._open[base] += 1
        if pushed is not None:
            self._push_out(pushed)
        return row

    def _push_out(self, row: Row) -> None:
        """A row the full queue gave up for another tenant's (FairQueue): answered as if refused on arrival. It
        never held a permit, and its queue place is already given back."""
        row.done = True
        self._open[row.base] -= 1
        self.fairness.leave(row)
        if not row.future.done():
            row.future.set_exception(Overloaded(f"{self._queue.maxsize} requests already waiting, the most of "
                                                f"them yours ('{row.tenant}'); retry later"))
        if row.stream is not None:
            row.stream.put_nowait(None)

    async def result(self, row: Row) -> Any:
        try:
            return await row.future
        except asyncio.CancelledError:  # the caller has gone (and cancelling it cancelled the future)
            row.cancelled = True
            raise

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests and wait (bounded) for those already queued or running."""
        self.accepting = False
        if self._queue is not None:
            try:
                await asyncio.wait_for(self._queue.join(), timeout_s)
            except TimeoutError:
                pass
        if self._worker is not None:
            self._worker.cancel()

    # ---- the loop, supervised
    def _start(self) -> None:
        """The queue lives on the event loop that serves requests (one per replica; a test's asyncio.run makes
        another, whose rows the old loop could never serve). A loop that ended is restarted on the same queue."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._worker, self._generating, self._open = loop, None, {}, Counter()
            self.fairness = Fairness(self.config.fairness)
            self._queue = FairQueue(self.fairness, maxsize=self.config.max_queue)
            self._in_flight = asyncio.Semaphore(self._permits)
            self._out = self._borrowed = 0
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._gather_loop())
            self._worker.add_done_callback(self._supervise)

    def _supervise(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        log.error("the scheduler loop ended; restarting it on the same queue", exc_info=task.exception())
        if self.accepting and task.get_loop() is self._loop and not self._loop.is_closed():
            self._start_again()

    def _start_again(self) -> None:
        self._worker = self._loop.create_task(self._gather_loop())
        self._worker.add_done_callback(self._supervise)

    async def _gather_loop(self) -> None:
        while True:
            rows = await self._gather()
            try:
                self._admit(rows)
            except Exception as e:
                log.exception("admitting %d rows failed", len(rows))
                for r in rows:
                    self._fail(r, "admission", e)

    async def _gather(self) -> list[Row]:
        """Bounded: at most max_batch_size * max_concurrent_groups rows are out of the queue at once; the rest
        wait there (and beyond max_queue are refused). Each row taken holds one permit until it is resolved."""
        rows: list[Row] = []
        try:
            await self._permit()
            try:
                rows.append(await self._queue.get())
            except BaseException:
                self._give_back()
                raise
            deadline = time.perf_counter() + self.config.batch_wait_timeout_s
            while len(rows) < self.config.max_batch_size and not self._in_flight.locked():
                await self._permit()
                try:
                    rows.append(await asyncio.wait_for(self._queue.get(), max(0.0, deadline - time.perf_counter())))
                except BaseException:
                    self._give_back()
                    raise
        except TimeoutError:
            pass
        except BaseException:  # cancelled (drain): the rows taken get an answer too
            self._shut_out(rows)
            raise
        return rows

    async def _permit(self) -> None:
        await self._in_flight.acquire()
        self._out += 1

    def _give_back(self) -> None:
        self._out -= 1
        if self._borrowed:
            self._borrowed -= 1
        else:
            self._in_flight.release()

    def _spawn(self, coro: Coroutine) -> None:
        """Every task the scheduler starts is kept (not garbage-collected mid-flight) and its failure logged."""
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a scheduler task failed", exc_info=task.exception())

    # ---- admission and dispatch
    def _admit(self, rows: list[Row]) -> None:
        ready = []
        for r in rows:
            if r.variant is None:
                ready.append(r)
                continue
            try:
                r.held = self.holds.try_acquire(r.variant)
            except Exception as e:
                log.exception("acquiring '%s' failed", r.variant)
                self._fail(r, "acquiring its variant", e)
                continue
            if r.held is not None:
                ready.append(r)
            else:  # cold, or on the cpu tier: acquired in the background; the rows in memory go on without it
                self._spawn(self._acquire_then_dispatch(r))
        self._dispatch(ready)

    async def _acquire_then_dispatch(self, row: Row) -> None:
        try:
            row.held = await self.holds.acquire(row.variant)
        except Exception as e:  # this row's variant fails alone
            if not isinstance(e, ManyfoldError):
                log.exception("loading '%s' failed", row.variant)
            self._fail(row, "loading its variant", e)
            return
        finally:
            if row.held is None:  # cancelled mid-load
                self._shut_out([row])
        self._dispatch([row])

    def _dispatch(self, rows: list[Row]) -> None:
        """Generate rows join their base's running generation; classify and embed rows of one base become one
        forward."""
        groups: dict[tuple[str, str], list[Row]] = {}
        for r in rows:
            if r.cancelled:
                self._finish(r)
            elif r.op == "generate":
                self._join_generation(r)
            else:
                self.fairness.admit(r)
                groups.setdefault((r.op, r.base), []).append(r)
        for group in groups.values():
            self._spawn(self._run_group(group))

    def _join_generation(self, row: Row) -> None:
        running = self._generating.get(row.base)
        if running is None:
            try:
                batch = self.forwards.generation(row.base)
            except Exception as e:
                log.exception("starting a generation on base '%s' failed", row.base)
                self._fail(row, "starting a generation", e)
                return
            running = self._generating[row.base] = _Generating(batch)
            self._spawn(self._run_generation(row.base, running))
        running.pending.append(row)

    # ---- resolving rows
    def _finish(self, row: Row, result: Any = None, error: BaseException | None = None) -> None:
        """Resolve a row once: release its hold, answer its caller, give back its queue place and permit."""
        if row.done:
            return
        row.done = True
        self._open[row.base] -= 1
        self.fairness.leave(row)
        self._progress_at = now = time.monotonic()
        if error is None and not row.cancelled:
            self.latencies.setdefault(row.base, Latencies()).end_to_end.observe(now - row.submitted_at)
        held, row.held = row.held, None
        try:
            if held is not None:
                self.holds.release(held)
        except Exception:
            log.exception("releasing the cache hold of '%s' failed", row.variant)
        finally:
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
            self._give_back()

    def _fail(self, row: Row, stage: str, e: BaseException) -> None:
        self._finish(row, error=row_error(row, stage, e))

    def _shut_out(self, rows: list[Row]) -> None:
        """On the way out of a task that was cancelled (a drain): every row it had not answered gets an answer."""
        for r in rows:
            self._finish(r, error=Overloaded("server is shutting down"))  # a no-op for rows already answered

    # ---- running rows
    async def _run_group(self, rows: list[Row]) -> None:
        """Classify or embed rows of one base, whatever their variants, in one forward (or a few, if slots are
        short); a row that fails alone fails alone, a forward that fails fails its rows."""
        try:
            results = await self._loop.run_in_executor(self.compute, self.forwards.encode, rows)
            self.batch_sizes.observe(len(rows))
            for r, res in zip(rows, results):
                if isinstance(res, BaseException):
                    self._fail(r, "its forward", res)
                else:
                    self._finish(r, res)
        except Exception as e:
            if not isinstance(e, ManyfoldError):
                log.exception("a forward of %d %s rows failed", len(rows), rows[0].op)
            for r in rows:
                self._fail(r, "its forward", e)
        finally:
            self._shut_out(rows)

    async def _run_generation(self, base: str, g: _Generating) -> None:
        """The base's running generation: admits waiting rows (of any variant), steps, until none are left. A
        step that raises fails the rows in the batch and those it was admitting; rows still waiting to join
        start a fresh generation."""
        new: list[Row] = []
        ended: float | None = None
        try:
            while g.pending or len(g.batch):
                await self._let_in()
                gone = self._gone(g)
                self._pull(base, g)
                park, new = self._preempt(g)
                new += self._next_rows(g)
                if ended is not None:
                    self.seconds.add("scheduling", time.perf_counter() - ended)
                step = await self._loop.run_in_executor(self.compute, g.batch.run, new, gone, park)
                ended = time.perf_counter()
                self._progress_at = time.monotonic()
                self._after_step(g, new, step)
                new = []
            self._retire(base, g)
            await self._loop.run_in_executor(self.compute, g.batch.close)
        except Exception as e:
            log.exception("a generation step on base '%s' failed", base)
            await self._abandon(base, g, new, e)
        finally:
            self._retire(base, g)
            self._shut_out(g.running + new + g.pending)

    async def _let_in(self) -> None:
        """Before a step's rows are chosen: the rows that permits given back by the last step let out of the queue
        are gathered and waiting to join first (bounded), so that the slot a finished row frees goes to the row
        the fairness policy picks among all that wait, not only among those already out of the queue (a tenant's
        flood holds every permit, and another tenant's row would otherwise wait for a second finished row)."""
        for _ in range(4 * self.config.max_batch_size):
            if not self._queue.qsize() or self._out >= self._permits:
                return
            await asyncio.sleep(0)

    def _retire(self, base: str, g: _Generating) -> None:
        """g stops taking rows: those dispatched from now on start a new batch."""
        if self._generating.get(base) is g:
            del self._generating[base]

    def _gone(self, g: _Generating) -> list[Row]:
        """Rows whose callers have gone: answered now, dropped from the batch at this step."""
        gone = [r for r in g.running if r.cancelled] + [r for r in g.pending if r.cancelled and r.parked]
        for r in gone + [r for r in g.pending if r.cancelled and not r.parked]:
            self._finish(r)
        g.running = [r for r in g.running if not r.cancelled]
        g.pending = [r for r in g.pending if not r.cancelled]
        return gone

    def _crowded(self, g: _Generating) -> Counter[str] | None:
        """VTC with every slot of the batch taken: the running rows by tenant (None: no row is to be parked)."""
        if self.fairness.policy != "vtc" or len(g.batch) < self.config.max_batch_size:
            return None
        return Counter(r.tenant for r in g.running)

    def _pull(self, base: str, g: _Generating) -> None:
        """With every permit out (a flood's rows waiting to join hold them all), rows still in the queue that
        would take a parked row's slot (_preempt) are taken out of it past the permits, at most max_batch_size
        borrowed at once; they reach g.pending through admission like any row."""
        holding = self._crowded(g)
        if holding is None or not self._in_flight.locked():
            return
        pulled, weights = [], {r.tenant: r.weight for r in g.running}
        for row in self._queue.heads():
            if self._borrowed >= self.config.max_batch_size:
                break
            if row.op != "generate" or row.base != base or any(r.tenant == row.tenant for r in g.pending) \
                    or self.fairness.outranked(row, holding, weights | {row.tenant: row.weight}) is None:
                continue
            self._queue.take(row)
            self._borrowed += 1
            self._out += 1
            pulled.append(row)
        if pulled:
            self._admit(pulled)

    def _preempt(self, g: _Generating) -> tuple[list[Row], list[Row]]:
        """VTC, with every slot of the batch taken: running rows parked (DecodeBatch.run) for rows of tenants
        holding fewer (Fairness.preempt); those rows join in their place. -> (rows to park, rows to join)."""
        holding = self._crowded(g)
        if holding is None:
            return [], []
        park, new = self.fairness.preempt(g.running, g.pending, holding)
        for row in new:
            g.pending.remove(row)
            self.fairness.admit(row)
        return park, new

    def _next_rows(self, g: _Generating) -> list[Row]:
        """The rows that join the batch at this step, in the fairness policy's order."""
        new, g.pending = self.fairness.take(g.pending, max(0, self.config.max_batch_size - len(g.batch)))
        return new

    def _after_step(self, g: _Generating, new: list[Row], step: Step) -> None:
        for r, e in step.failed:
            if r in g.running:
                g.running.remove(r)
            self._fail(r, "its generation", e)
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
            if r.parked:  # resumed: its wait and its prompt were counted when it first joined
                r.parked = False
                continue
            lat = self.latencies.setdefault(r.base, Latencies())
            lat.queue.observe(now - r.submitted_at)
            lat.prompt_tokens += len(r.payload[0])
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
            self._finish(row, gen)

    def _tokens(self, row: Row, count: int, now: float) -> None:
        """A generation row's latencies as its tokens arrive (Latencies.arrived)."""
        if count > row.tokens_seen:
            self.fairness.served(row, count - row.tokens_seen)
            lat = self.latencies.setdefault(row.base, Latencies())
            lat.arrived(row.tokens_seen, count - row.tokens_seen, now - row.submitted_at, now - row.token_at)
            lat.generation_tokens += count - row.tokens_seen
            row.tokens_seen, row.token_at = count, now

    def load(self) -> dict[str, dict]:
        """By base: requests running (in a generation batch) and waiting (every other one not yet answered), and
        the variants running and waiting to join the batch."""
        out: dict[str, dict] = {}
        for base, n in self._open.items():
            g = self._generating.get(base)
            running, pending = (g.running, g.pending) if g is not None else ([], [])
            out[base] = {"running": len(running), "waiting": max(0, n - len(running)),
                         "running_variants": sorted({r.variant for r in running if r.variant}),
                         "waiting_variants": sorted({r.variant for r in pending if r.variant})}
        return out

    async def _abandon(self, base: str, g: _Generating, new: list[Row], e: Exception) -> None:
        """A step raised: the batch's state is not to be trusted. Its rows fail; rows that only waited to join
        go to a fresh generation."""
        self._retire(base, g)
        try:
            await self._loop.run_in_executor(self.compute, g.batch.close)
        except Exception:
            log.exception("closing the failed generation of base '%s' failed too", base)
        for r in g.running + new + [r for r in g.pending if r.parked]:  # a parked row's keys went with the batch
            self._fail(r, "its generation", e)
        waiting, g.pending = [r for r in g.pending if not r.parked], []
        for r in waiting:
            self._join_generation(r)
