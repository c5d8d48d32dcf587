"""The scheduler: requests become rows in one bounded queue, rows are gathered, their variants held in the cache,
and dispatched to the forwards. Plain asyncio, no torch: the forwards (serve/engine/forwards.py) run on the one
compute thread it is given, so the event loop keeps answering.

The scheduler takes the waiting row that goes next and gathers more for up to `batch_wait_timeout_s` or
`max_batch_size` rows (beyond max_queue, Overloaded: HTTP 429). Which row goes next, out of the queue and into a
running generation, is the fairness policy's (serve/engine/scheduling/fairness.py: by tenant, the least served first, or
first come, first served); each row carries its tenant. A row whose variant is on the fast tier is held and dispatched
at once; any other is acquired in its own task (a load, or a promotion from the cpu tier), so it never holds up
the rest. Classify and embed rows of one gather and base are one forward; generate rows join their base's one
running generation between decode steps (serve/engine/scheduling/generating.py).

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
from typing import Any

from serve.config import BatchConfig
from serve.engine.scheduling.fairness import Fairness, FairQueue
from serve.engine.scheduling.generating import Generating, Generations
from serve.engine.scheduling.rows import Forwards, Holds, Op, Row, row_error
from serve.engine.stats import BATCH_BUCKETS, Distribution, Latencies, Seconds, TenantWaits
from serve.engine.types import Tenant
from serve.errors import ManyfoldError, Overloaded

log = logging.getLogger("manyfold.engine")


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
        self.fairness = Fairness(config.fairness, config.vtc_burst_rows, config.vtc_far_recent_s)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: FairQueue | None = None
        self._in_flight: asyncio.Semaphore | None = None
        self._permits = config.permits()
        self._out = 0
        """Rows the gather has taken out of the queue (each with a permit) and not yet resolved."""
        self._borrowed = 0
        """Rows taken out of the queue past the permits, to take a parked row's slot (_pull): the next permits
        given back are not released, so the rows out stay bounded."""
        self._worker: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._open: Counter[str] = Counter()
        """Rows submitted and not yet answered, by base."""
        self.preemptions: Counter[str] = Counter()
        """Running rows parked for another tenant's (Generations._preempt), by base."""
        self.latencies: dict[str, Latencies] = {}
        """By base: each answered request's time to first token, between tokens, end to end."""
        self.tenant_waits: dict[str, TenantWaits] = {}
        """By authenticated tenant: its generation rows' waits to join a batch and to their first token."""
        self._progress_at = time.monotonic()
        """When a row was last answered or a generation last stepped (or work arrived at an idle scheduler)."""
        self._generations = self._new_generations()

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
                  scope=tenant.name if tenant else "",
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
            self._loop, self._worker, self._open = loop, None, Counter()
            self.fairness = Fairness(self.config.fairness, self.config.vtc_burst_rows,
                                     self.config.vtc_far_recent_s)
            self._generations = self._new_generations()
            self._queue = FairQueue(self.fairness, maxsize=self.config.max_queue)
            self._in_flight = asyncio.Semaphore(self._permits)
            self._out = self._borrowed = 0
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._gather_loop())
            self._worker.add_done_callback(self._supervise)

    def _new_generations(self) -> Generations:
        """The running generations of this loop, fed by this scheduler and answering their rows through it."""
        return Generations(self.config, self.forwards, self.compute, self.fairness, latencies=self.latencies,
                           tenant_waits=self.tenant_waits, batch_sizes=self.batch_sizes, seconds=self.seconds,
                           preemptions=self.preemptions, let_in=self._let_in, pull=self._pull, spawn=self._spawn,
                           finish=self._finish, fail=self._fail, shut_out=self._shut_out, stepped=self._stepped)

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
        """Bounded: at most config.permits() rows are out of the queue at once; the rest
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
                self._generations.join(r)
            else:
                self.fairness.admit(r)
                groups.setdefault((r.op, r.base), []).append(r)
        for group in groups.values():
            self._spawn(self._run_group(group))

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

    # ---- feeding the running generations (serve/engine/scheduling/generating.py)
    def _stepped(self) -> None:
        """A generation stepped: progress, as an answered row is (stalled_s)."""
        self._progress_at = time.monotonic()

    async def _let_in(self) -> None:
        """Before a step's rows are chosen: the rows that permits given back by the last step let out of the queue
        are gathered and waiting to join first (bounded), so that the slot a finished row frees goes to the row
        the fairness policy picks among all that wait, not only among those already out of the queue (a tenant's
        flood holds every permit, and another tenant's row would otherwise wait for a second finished row)."""
        for _ in range(4 * self.config.max_batch_size):
            if not self._queue.qsize() or self._out >= self._permits:
                return
            await asyncio.sleep(0)

    def _pull(self, base: str, g: Generating, holding: Counter[str]) -> None:
        """With every permit out (a flood's rows waiting to join hold them all), rows still in the queue are taken
        out of it past the permits, at most max_batch_size borrowed at once, when they go before what waits in
        g.pending: each row that would take one of this step's free slots ahead of the rows waiting to join
        (Fairness.take), and a tenant's next row that would take a parked row's slot (Generations._preempt;
        holding: g's running rows by tenant, with every slot spoken for). Pulling only for parking, a burst's rows
        came out one a step, and a slot its flood's finished rows freed went to the flood's rows already out: the
        permits they gave back repaid the borrowed ones first. The rows pulled reach g.pending through admission
        like any row."""
        if not self._in_flight.locked():
            return
        free = max(0, self.config.max_batch_size - len(g.batch))
        pulled, passed, weights = [], set(), {r.tenant: r.weight for r in g.running}
        while self._borrowed < self.config.max_batch_size:
            row = next((r for r in self._queue.heads() if r.tenant not in passed), None)
            if row is None:
                break
            waiting = [*g.pending, *pulled]
            joins = row in self.fairness.take([*waiting, row], free)[0]
            parks = all(r.tenant != row.tenant for r in waiting) and self.fairness.outranked(row, holding, weights)
            if row.op != "generate" or row.base != base or not (joins or parks):
                passed.add(row.tenant)  # its later rows go after this one
                continue
            self._queue.take(row)
            self._borrowed += 1
            self._out += 1
            pulled.append(row)
        if pulled:
            self._admit(pulled)

    def load(self) -> dict[str, dict]:
        """By base: requests running and waiting, and their variants (Generations.load)."""
        return self._generations.load(self._open)
