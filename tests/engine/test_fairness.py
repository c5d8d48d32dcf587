"""Fair scheduling across tenants (serve/engine/scheduling/fairness.py) on the real Scheduler, over a generation that
gives every running row one token a step: which rows join the batch, and what each tenant is served, step by step."""

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from serve.config import BatchConfig
from serve.engine.scheduling.fairness import OUTPUT_WEIGHT, PROMPT_WEIGHT, Fairness, FairQueue
from serve.engine.scheduling.rows import Row, Step
from serve.engine.scheduling.scheduler import Scheduler
from serve.engine.types import Generation, SamplingParams, Tenant
from serve.errors import Overloaded

PROMPT = 8
MAX_TOKENS = 6
SLOTS = 4


class Batch:
    """A running generation of SLOTS rows: every step gives each running row one token; a row ends at its
    max_tokens. It records what each tenant was served (prompt tokens on joining, then each token, weighted as
    VTC weighs them) and who was waiting after each step."""

    def __init__(self, trace: "Trace"):
        self.running: dict[Row, Generation] = {}
        self.parked: dict[Row, Generation] = {}
        self.trace = trace

    def __len__(self) -> int:
        return len(self.running)

    def prompt_waits(self, row: Row, rank, share) -> bool:
        return False  # a step here writes every prompt at once

    def run(self, new: list[Row], gone: list[Row], park: list[Row] = (), victims: list[Row] = (),
            rank=None, share=None) -> Step:
        step = Step()
        for r in park:
            self.parked[r] = self.running.pop(r)
            step.parked.append(r)
            self.trace.parked.append(r.tenant)
        for r in new:
            if len(self.running) < SLOTS and r in self.parked:
                self.running[r] = self.parked.pop(r)
            elif len(self.running) < SLOTS:
                self.running[r] = Generation(prompt_tokens=len(r.payload[0]))
                self.trace.serve(r.tenant, PROMPT_WEIGHT * len(r.payload[0]))
                self.trace.admitted.append(r.tenant)
                self.trace.joined[r.tenant] = len(self.trace.steps)
            else:
                step.waiting.append(r)
        for r, gen in list(self.running.items()):
            gen.token_ids.append(1)
            self.trace.serve(r.tenant, OUTPUT_WEIGHT)
            if len(gen.token_ids) >= r.payload[1].max_tokens:
                step.finished.append((r, gen))
                del self.running[r]
        self.trace.step(self.running)
        return step

    def rows(self) -> list[tuple[Row, Generation]]:
        return list(self.running.items())

    def close(self) -> None:
        pass


class Trace:
    def __init__(self):
        self.served: dict[str, float] = {}
        self.admitted: list[str] = []
        self.joined: dict[str, int] = {}
        """Tenant -> the step its latest row joined at."""
        self.steps: list[dict[str, float]] = []
        self.submitted: dict[str, int] = {}
        self.parked: list[str] = []
        """The tenant of each row parked, in turn."""
        self.hold: Hold | None = None
        """Where the compute thread stops, at the end of a step, until the test has done what it does there."""

    def serve(self, tenant: str, cost: float) -> None:
        self.served[tenant] = self.served.get(tenant, 0.0) + cost

    def step(self, running: dict) -> None:
        """After each step: each tenant's service so far, and whether it still had rows not yet in the batch."""
        joined = {t: self.admitted.count(t) for t in self.submitted}
        self.steps.append({"served": dict(self.served),
                           "backlogged": {t for t, n in self.submitted.items() if joined[t] < n}})
        hold = self.hold
        if hold is not None and hold.reached(self):
            self.hold = None
            hold.loop.call_soon_threadsafe(hold.here.set)
            assert hold.go.wait(HANG_S), "the test never let the step go"


HANG_S = 60
"""What a wait of these tests gives up after: a hang, not a timing (no step takes a noticeable time)."""


class Hold:
    """The end of the step after which `until` holds of the trace and n more steps have run."""

    def __init__(self, trace: Trace, n: int, until: Callable[[Trace], bool]):
        self.n, self.until = n, until
        self.since = len(trace.steps) if until(trace) else None
        self.loop = asyncio.get_running_loop()
        self.here = asyncio.Event()
        self.go = threading.Event()

    def reached(self, trace: Trace) -> bool:
        if self.since is None and self.until(trace):
            self.since = len(trace.steps)
        return self.since is not None and len(trace.steps) >= self.since + self.n


class Forwards:
    def __init__(self, trace: Trace):
        self.trace = trace

    def generation(self, base: str) -> Batch:
        return Batch(self.trace)

    def encode(self, rows):
        raise AssertionError("no encoder rows here")


def serve(policy: str, waves: list[list[tuple[str, int]]], max_queue: int = 1024, burst_rows: int = 8,
          until: Callable[[Trace], bool] = lambda t: True, then: int = 3) -> Trace:
    """Submit each wave's (tenant, rows) at once, the next wave at the end of the step after which `until` holds
    of the trace and `then` more steps have run (_held). Returns the trace of the run."""
    trace = Trace()
    config = BatchConfig(max_batch_size=SLOTS, max_queue=max_queue, fairness=policy, batch_wait_timeout_s=0,
                         vtc_burst_rows=burst_rows)
    with ThreadPoolExecutor(1) as compute:
        scheduler = Scheduler(config, holds=None, forwards=Forwards(trace), compute=compute)

        async def run() -> None:
            pending = []

            def submit(wave: list[tuple[str, int]]) -> None:
                for tenant, n in wave:
                    trace.submitted[tenant] = trace.submitted.get(tenant, 0) + n
                    for _ in range(n):
                        payload = ([0] * PROMPT, SamplingParams(max_tokens=MAX_TOKENS))
                        row = scheduler.submit("generate", "base", None, None, payload, tenant=Tenant(tenant))
                        pending.append(scheduler.result(row))

            submit(waves[0])
            for wave in waves[1:]:
                async with _held(trace, then, until):
                    submit(wave)
            await asyncio.gather(*pending)

        asyncio.run(run())
    return trace


@contextlib.asynccontextmanager
async def _held(trace: Trace, n: int, until: Callable[[Trace], bool] = lambda t: True) -> AsyncIterator[None]:
    """The body runs with the compute thread stopped at the end of the step after which `until` holds and n more
    steps have run (the scheduler has not seen that step's outcome yet): what it submits lands at that step
    exactly, however loaded the machine."""
    trace.hold = hold = Hold(trace, n, until)
    try:
        try:
            await asyncio.wait_for(hold.here.wait(), HANG_S)
        except TimeoutError:
            raise AssertionError("the scheduler made no progress") from None
        yield
    finally:
        hold.go.set()


ROW_COST = PROMPT_WEIGHT * PROMPT + OUTPUT_WEIGHT * MAX_TOKENS
BOUND = 2 * (PROMPT_WEIGHT * PROMPT + OUTPUT_WEIGHT * SLOTS * MAX_TOKENS)
"""S-LoRA's Theorem 4.4: 2U, U = w_p * L_input + w_q * M, M the tokens a batch holds."""


def _largest_gap(trace: Trace, a: str, b: str) -> float:
    """The largest difference of service between a and b after any step at which both were backlogged."""
    gaps = [abs(s["served"].get(a, 0) - s["served"].get(b, 0)) for s in trace.steps if {a, b} <= s["backlogged"]]
    assert gaps, "the two tenants were never backlogged together"
    return max(gaps)


def test_two_backlogged_tenants_are_served_within_vtcs_bound():
    """A sends 60 rows before B sends 60: first come, first served gives A the engine until its rows run out;
    VTC keeps the two within 2U of each other for as long as both wait."""
    waves = [[("a", 60), ("b", 60)]]
    vtc = serve("vtc", waves)
    assert _largest_gap(vtc, "a", "b") <= BOUND
    fcfs = serve("fcfs", waves)
    assert _largest_gap(fcfs, "a", "b") > BOUND  # what the bound guards against, on the same rows
    assert vtc.admitted[:SLOTS * 4].count("b") >= SLOTS * 2 - 1
    assert fcfs.admitted[:60] == ["a"] * 60


@pytest.mark.parametrize("burst_rows", [0, 8])
def test_a_tenant_back_from_idle_does_not_take_the_engine_over(burst_rows):
    """A and B are served for a while; C, idle until then, sends 60 rows. Lifted to the smallest counter of those
    waiting (less its credit of burst_rows rows), C competes from where they stand: it is not given the engine until
    it has caught up on the service it missed while idle, and stays within 2U of A and B, plus its credit."""
    trace = serve("vtc", [[("a", 60), ("b", 60)], [], [], [], [("c", 60)]], burst_rows=burst_rows)
    first_c = trace.admitted.index("c")
    after = trace.admitted[first_c:first_c + 12 * SLOTS]
    assert after.count("c") <= len(after) // 3 + SLOTS + burst_rows  # a third, give or take a batch, and its credit
    for other in ("a", "b"):
        assert _largest_gap(_since(trace, first_c), "c", other) <= BOUND + burst_rows * ROW_COST


@pytest.mark.parametrize("phase", range(MAX_TOKENS))
def test_a_tenant_back_from_idle_has_its_burst_served_before_a_flood(phase):
    """A flood holds every slot and keeps sending; an idle tenant sends five rows at once, once the flood has been
    served more than its credit and the burst cost (so the credit is all its own), at each step of the flood's
    rows' lives (they finish together every MAX_TOKENS steps). With credit for eight rows, its five join before any
    more of the flood's, taking freed slots or parking the flood's rows, never its own."""
    trace = serve("vtc", [[("heavy", 60)], [("light", 5)]], burst_rows=8,
                  until=lambda t: t.served.get("heavy", 0) >= 2 * (8 + 5) * ROW_COST, then=phase)
    first = trace.admitted.index("light")
    assert trace.admitted[first:first + 5] == ["light"] * 5
    assert set(trace.parked) <= {"heavy"}


@pytest.mark.parametrize("burst_rows", [8, 0])
def test_a_tenant_back_from_idle_is_lifted_to_the_floor_less_its_credit(burst_rows):
    """S-LoRA lifts a tenant back from idle to the smallest counter of those waiting (burst_rows 0), banking
    nothing; with credit, burst_rows of its row's cost below it, but never below what it was served."""
    fairness = Fairness("vtc", burst_rows)
    fairness.counters.update({"heavy": 1000.0, "light": 10.0, "regular": 990.0})
    for tenant in ("heavy", "light", "heavy", "regular"):
        fairness.arrive(Row("generate", "base", None, ([0] * PROMPT, SamplingParams(max_tokens=MAX_TOKENS)), None,
                            tenant=tenant))
    assert fairness.counters == {"heavy": 1000.0, "light": 1000.0 - burst_rows * ROW_COST,
                                 "regular": 990.0 if burst_rows else 1000.0}


def test_a_tenant_back_from_idle_is_not_lifted_above_a_tenant_whose_rows_are_running():
    """The floor is the least served of the tenants with rows waiting or running: with a flood the only tenant
    waiting, a light tenant back from idle is lifted no higher than the credit below a light tenant whose row runs
    (lifted to the flood's counter, its rows would rank after every running light tenant's)."""
    fairness = Fairness("vtc", burst_rows=2)
    rows = {t: Row("generate", "base", None, ([0] * PROMPT, SamplingParams(max_tokens=MAX_TOKENS)), None, tenant=t)
            for t in ("heavy", "running", "back")}
    fairness.arrive(rows["heavy"])
    fairness.arrive(rows["running"])
    fairness.admit(rows["running"])  # it runs: nothing of its tenant waits
    fairness.counters.update({"heavy": 2000.0, "running": 100.0, "back": 10.0})
    fairness.arrive(rows["back"])
    assert fairness.counters["back"] == 100.0 - 2 * ROW_COST
    fairness.leave(rows["running"])
    fairness.leave(rows["back"])
    later = Row("generate", "base", None, ([0] * PROMPT, SamplingParams(max_tokens=MAX_TOKENS)), None, tenant="back")
    fairness.arrive(later)  # the flood is the only other tenant left: lifted to it
    assert fairness.counters["back"] == 2000.0 - 2 * ROW_COST


@pytest.mark.parametrize("recent_s", [0.0, 60.0])
def test_a_tenant_answered_within_recent_s_still_sets_the_floor(recent_s):
    """A light tenant arriving in a moment with no other light row open: the one answered within recent_s still
    sets the floor (lifted to the flood's counter, it would put the flood within the credit, and the flood's next
    prompt would take whole steps); past recent_s, as with recent_s 0, the flood alone is the floor."""
    fairness = Fairness("vtc", burst_rows=2, recent_s=recent_s)
    rows = {t: Row("generate", "base", None, ([0] * PROMPT, SamplingParams(max_tokens=MAX_TOKENS)), None, tenant=t)
            for t in ("heavy", "light1", "light2")}
    for r in rows.values():
        fairness.arrive(r)
        fairness.admit(r)
    fairness.counters.update({"heavy": 2000.0, "light1": 100.0, "light2": 10.0})
    fairness.leave(rows["light1"])
    fairness.leave(rows["light2"])
    fairness.arrive(Row("generate", "base", None, ([0] * PROMPT, SamplingParams(max_tokens=MAX_TOKENS)), None,
                        tenant="light2"))
    assert fairness.counters["light2"] == (100.0 if recent_s else 2000.0) - 2 * ROW_COST


def test_a_row_whose_prompt_would_wait_leaves_its_free_slot_to_the_next():
    """One slot free; the flood's rows rank first, but their prompts would wait for the one it is writing (its share
    of the step spent): the slot goes to the light tenant's row ranked after them, not to a flood row that would
    leave it empty for the step."""
    from serve.engine.scheduling.generating import Generating, Generations

    class Writing(Batch):
        def prompt_waits(self, row: Row, rank, share) -> bool:
            return share(row)[0] == "heavy"

    fairness = Fairness("vtc")
    fairness.counters.update({"heavy": 0.0, "light": 500.0})
    generations = Generations(BatchConfig(max_batch_size=SLOTS, fairness="vtc"), Forwards(Trace()), None, fairness,
                              latencies={}, tenant_waits={}, batch_sizes=None, seconds=None, preemptions=Counter(),
                              let_in=None, pull=None, spawn=None, finish=None, fail=None, shut_out=None, stepped=None)
    batch = Writing(Trace())
    for _ in range(SLOTS - 1):
        batch.running[Row("generate", "base", None, ([0], SamplingParams(max_tokens=MAX_TOKENS)), None,
                          tenant="other")] = Generation()
    pending = [Row("generate", "base", None, ([0] * PROMPT, SamplingParams(max_tokens=MAX_TOKENS)), None, tenant=t)
               for t in ("heavy", "heavy", "light")]
    for r in pending:
        fairness.arrive(r)
    g = Generating(batch, pending=list(pending))
    assert generations._next_rows(g) == pending[2:]
    assert g.pending == pending[:2]
    batch.prompt_waits = lambda row, rank, share: False  # the flood's prompt written: its rows go first again
    g.pending.append(Row("generate", "base", None, ([0] * PROMPT, SamplingParams(max_tokens=MAX_TOKENS)), None,
                         tenant="light"))
    fairness.arrive(g.pending[-1])
    assert generations._next_rows(g) == pending[:1]


@pytest.mark.parametrize("ahead", [2 * ROW_COST, 1.0])
def test_a_flood_far_ahead_gives_up_a_slot_even_holding_only_its_share(ahead):
    """Every slot taken, two by a light tenant's rows, two by a flood's; the light tenant's third row waits. Served
    less than the flood by more than that row's cost, it parks one of the flood's rows although the flood holds no
    more slots than it (the slots' max-min share would keep them); served about as much, it waits for a slot to
    come free."""
    fairness = Fairness("vtc")
    fairness.counters.update({"heavy": 500.0 + ahead, "light": 500.0})
    rows = []
    for tenant in ["light", "light", "heavy", "heavy", "light"]:
        r = Row("generate", "base", None, ([0] * PROMPT, SamplingParams(max_tokens=MAX_TOKENS)), None, tenant=tenant)
        r.tokens_seen, r.seq = 1, len(rows)
        rows.append(r)
    running, waiting = rows[:4], rows[4:]
    park, new = fairness.preempt(running, waiting, Counter(r.tenant for r in running))
    if ahead > ROW_COST:
        assert park == [rows[3]] and new == waiting  # the flood's latest row
    else:
        assert (park, new) == ([], [])


def test_a_floods_row_still_writing_its_prompt_is_parked_for_a_light_row():
    """Every slot held by a flood far ahead, its latest row still writing a long prompt (no token yet): that row is
    parked for the light tenant's, as a decoding row would be. Only decoding rows were, so a flood of long prompts
    kept a slot through every step of each prompt (the fairness scenario's long-prompts shape)."""
    fairness = Fairness("vtc")
    fairness.counters.update({"heavy": 500.0 + 2 * ROW_COST, "light": 500.0})
    rows = []
    for tenant, seen in [("heavy", 3), ("heavy", 2), ("heavy", 1), ("heavy", 0), ("light", 0)]:
        r = Row("generate", "base", None, ([0] * PROMPT, SamplingParams(max_tokens=MAX_TOKENS)), None, tenant=tenant)
        r.tokens_seen, r.seq = seen, len(rows)
        rows.append(r)
    running, waiting = rows[:4], rows[4:]
    assert fairness.preempt(running, waiting, Counter(r.tenant for r in running)) == ([rows[3]], waiting)


def _since(trace: Trace, first_admission: int) -> Trace:
    """The trace of the steps after admission number `first_admission`, service counted from there."""
    out = Trace()
    out.submitted = trace.submitted
    start = next(s for s in trace.steps if sum(s["served"].values()) > 0 and s["served"].get("c"))
    base = start["served"]
    out.steps = [{"served": {t: v - base.get(t, 0) for t, v in s["served"].items()}, "backlogged": s["backlogged"]}
                 for s in trace.steps[trace.steps.index(start):]]
    return out


def test_a_tenant_alone_gets_the_whole_engine():
    """Work-conserving: one tenant's rows fill every slot at every step while it has rows waiting."""
    trace = serve("vtc", [[("solo", 40)]])
    full = [s for s in trace.steps if "solo" in s["backlogged"]]
    assert full and len(trace.admitted) == 40


def test_a_full_queue_pushes_out_the_flooding_tenants_newest_row():
    """vtc: a light tenant's request still gets in when a flooding tenant has filled the queue (the flooder's
    newest row is refused instead); fcfs refuses the light tenant's."""

    async def fill(policy: str) -> tuple[list, BaseException | None]:
        fairness = Fairness(policy)
        queue = FairQueue(fairness, maxsize=4)
        loop = asyncio.get_running_loop()
        rows = [Row("generate", "base", None, ([0], SamplingParams()), loop.create_future(), tenant="heavy")
                for _ in range(4)]
        for r in rows:
            fairness.arrive(r)
            assert queue.put_nowait(r) is None
        light = Row("generate", "base", None, ([0], SamplingParams()), loop.create_future(), tenant="light")
        fairness.arrive(light)
        try:
            pushed = queue.put_nowait(light)
        except asyncio.QueueFull as e:
            return rows, e
        assert pushed is rows[-1] and queue.qsize() == 4
        assert light in [await queue.get() for _ in range(4)]
        return rows, None

    assert asyncio.run(fill("vtc"))[1] is None
    assert isinstance(asyncio.run(fill("fcfs"))[1], asyncio.QueueFull)


def test_the_scheduler_answers_a_pushed_out_row_with_429():
    trace = Trace()
    config = BatchConfig(max_batch_size=SLOTS, max_queue=2, fairness="vtc", batch_wait_timeout_s=0,
                         max_concurrent_groups=1)
    with ThreadPoolExecutor(1) as compute:
        scheduler = Scheduler(config, holds=None, forwards=Forwards(trace), compute=compute)

        async def run() -> list:
            def submit(tenant: str) -> Row:
                payload = ([0] * PROMPT, SamplingParams(max_tokens=MAX_TOKENS))
                return scheduler.submit("generate", "base", None, None, payload, tenant=Tenant(tenant))

            trace.submitted["heavy"] = trace.submitted["light"] = 0
            heavy = [submit("heavy") for _ in range(2)]  # the queue is full before the loop takes any
            light = submit("light")
            return await asyncio.gather(*(scheduler.result(r) for r in heavy + [light]), return_exceptions=True)

        results = asyncio.run(run())
    assert isinstance(results[1], Overloaded) and "'heavy'" in str(results[1])
    assert not isinstance(results[0], BaseException) and not isinstance(results[2], BaseException)
    assert scheduler.queue_depth == 0 and not scheduler.fairness.waiting


@pytest.mark.parametrize("weights", [(1.0, 3.0)])
def test_weights_share_the_engine_in_proportion(weights):
    """A tenant of weight 3 beside one of weight 1, both backlogged: about three of its rows join for each of the
    other's."""
    trace = Trace()
    config = BatchConfig(max_batch_size=SLOTS, fairness="vtc", batch_wait_timeout_s=0)
    with ThreadPoolExecutor(1) as compute:
        scheduler = Scheduler(config, holds=None, forwards=Forwards(trace), compute=compute)

        async def run() -> None:
            rows = []
            for name, w in zip(("one", "three"), weights):
                trace.submitted[name] = 80
                for _ in range(80):
                    payload = ([0] * PROMPT, SamplingParams(max_tokens=MAX_TOKENS))
                    rows.append(scheduler.submit("generate", "base", None, None, payload, tenant=Tenant(name, w)))
            await asyncio.gather(*(scheduler.result(r) for r in rows))

        asyncio.run(run())
    first = trace.admitted[:60]
    assert 2.0 <= first.count("three") / first.count("one") <= 4.5


def test_the_slot_a_finished_row_frees_goes_to_the_row_the_policy_picks_from_all_that_wait():
    """A flood holds every permit (its rows run and wait to join); another tenant's row waits in the queue. The
    first heavy row to finish gives back a permit and a slot at once: the waiting row is let out of the queue and
    takes that slot, rather than waiting for a second row to finish (here eight steps later)."""
    trace = Trace()
    config = BatchConfig(max_batch_size=SLOTS, max_concurrent_groups=2, fairness="vtc", batch_wait_timeout_s=0)
    with ThreadPoolExecutor(1) as compute:
        scheduler = Scheduler(config, holds=None, forwards=Forwards(trace), compute=compute)

        async def run() -> int:
            def submit(tenant: str, max_tokens: int) -> Row:
                trace.submitted[tenant] = trace.submitted.get(tenant, 0) + 1
                payload = ([0] * PROMPT, SamplingParams(max_tokens=max_tokens))
                return scheduler.submit("generate", "base", None, None, payload, tenant=Tenant(tenant))

            rows = [submit("heavy", n) for n in (8, 16, 24, 32)] + [submit("heavy", 60) for _ in range(12)]
            async with _held(trace, 1):
                asked = len(trace.steps)
                rows.append(submit("light", 2))
            await asyncio.gather(*(scheduler.result(r) for r in rows))
            return asked

        asked = asyncio.run(run())
    assert asked < 8 and trace.admitted[:SLOTS] == ["heavy"] * SLOTS  # the batch was full when it came
    assert trace.joined["light"] <= 9  # the first heavy row finishes at step 8, the second at 16


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_a_flood_holding_every_slot_and_permit_gives_a_slot_to_another_tenant_at_the_next_step(policy):
    """A flood's rows hold every slot and every permit (their next rows wait to join, the rest in the queue) and
    finish all at once, far off; a light tenant's row comes. VTC takes it out of the queue past the permits and
    parks the flood's latest row for it: it joins at the next step, and the parked row resumes later and ends
    with every token it asked for. FCFS leaves it waiting until the flood's rows finish."""
    trace = Trace()
    config = BatchConfig(max_batch_size=SLOTS, max_concurrent_groups=2, fairness=policy, batch_wait_timeout_s=0)
    with ThreadPoolExecutor(1) as compute:
        scheduler = Scheduler(config, holds=None, forwards=Forwards(trace), compute=compute)

        async def run() -> tuple[int, list]:
            def submit(tenant: str, max_tokens: int) -> Row:
                trace.submitted[tenant] = trace.submitted.get(tenant, 0) + 1
                payload = ([0] * PROMPT, SamplingParams(max_tokens=max_tokens))
                return scheduler.submit("generate", "base", None, None, payload, tenant=Tenant(tenant))

            heavy = [submit("heavy", 40) for _ in range(16)]
            async with _held(trace, 2):
                asked = len(trace.steps)
                light = submit("light", 2)
            results = await asyncio.gather(*(scheduler.result(r) for r in heavy + [light]))
            return asked, results

        asked, results = asyncio.run(run())
    assert [len(g.token_ids) for g in results] == [40] * 16 + [2]
    assert scheduler.queue_depth == 0 and scheduler._out == scheduler._borrowed == 0
    if policy == "vtc":
        assert trace.joined["light"] <= asked + 2 and trace.parked == ["heavy"]
        assert scheduler.preemptions["base"] == 1
    else:
        assert trace.joined["light"] >= 40 and not trace.parked and not scheduler.preemptions


def test_rows_taken_and_left_waiting_are_not_charged_until_they_join():
    """Two of a flood's rows are taken to join; the batch runs one and leaves the other waiting (its prompt found no
    room in the step's token budget): the flood is charged the prompt of the row that joined alone, and only once
    it joined, and the other waits as before, uncharged. Charged for rows it was not served (or while the step
    runs), the flood would lift every tenant arriving meanwhile to a counter it never earned, and its rows would
    then rank before theirs."""
    from serve.engine.scheduling.generating import Generating, Generations

    fairness = Fairness("vtc")
    generations = Generations(BatchConfig(max_batch_size=SLOTS, fairness="vtc"), Forwards(Trace()), None, fairness,
                              latencies={}, tenant_waits={}, batch_sizes=None, seconds=None, preemptions=Counter(),
                              let_in=None, pull=None, spawn=None, finish=None, fail=None, shut_out=None, stepped=None)
    heavy = [Row("generate", "base", None, ([0] * PROMPT, SamplingParams(max_tokens=MAX_TOKENS)), None,
                 tenant="heavy") for _ in range(2)]
    for r in heavy:
        fairness.arrive(r)
    g = Generating(Batch(Trace()), pending=list(heavy))
    new = generations._next_rows(g)
    assert new == heavy and not fairness.counters.get("heavy") and fairness.waiting == Counter({"heavy": 2})
    generations._after_step(g, new, Step(waiting=[heavy[1]]), [], joining=0.0)
    assert g.running == heavy[:1] and g.pending == heavy[1:]
    assert fairness.counters["heavy"] == PROMPT_WEIGHT * PROMPT and fairness.waiting == Counter({"heavy": 1})
    assert not heavy[1].charged


def test_no_more_rows_are_parked_than_a_batch_holds():
    """Parked rows keep their keys and values in host memory: with a batch's worth parked already, no row is
    parked for another tenant's, however far ahead the tenant holding the most is."""
    from serve.engine.scheduling.generating import Generating, Generations

    made = []

    def row(tenant: str, parked: bool = False) -> Row:
        r = Row("generate", "base", None, ([0] * PROMPT, SamplingParams(max_tokens=MAX_TOKENS)), None, tenant=tenant)
        r.tokens_seen, r.parked, r.seq = 1, parked, len(made)  # decoding; arrived in turn
        made.append(r)
        return r

    config = BatchConfig(max_batch_size=SLOTS, fairness="vtc")
    generations = Generations(config, Forwards(Trace()), None, Fairness("vtc"), latencies={}, tenant_waits={},
                              batch_sizes=None, seconds=None, preemptions=Counter(), let_in=None, pull=None,
                              spawn=None, finish=None, fail=None, shut_out=None, stepped=None)
    batch = Batch(Trace())
    heavy = [row("heavy") for _ in range(SLOTS)]
    batch.running = {r: Generation(prompt_tokens=PROMPT) for r in heavy}
    light = row("light")
    g = Generating(batch, pending=[light], running=list(heavy))
    park, new = generations._preempt(g, [])
    assert park == [heavy[-1]] and new == [light]  # below the bound: the light row takes a heavy one's slot
    other = row("other")
    g = Generating(batch, pending=[row("heavy", parked=True) for _ in range(SLOTS)] + [other], running=list(heavy))
    assert generations._preempt(g, []) == ([], []) and g.pending[-1] is other


@pytest.mark.parametrize("served", [{"heavy": 5000.0, "light": 0.0, "other": 0.0},
                                    {"heavy": 100.0, "light": 100.0, "other": 100.0}])
def test_rows_waiting_beyond_the_free_slots_park_a_floods_rows(served):
    """A flood holds three of four slots and one is free; a light tenant's row and another tenant's wait. The free
    slot goes to the first in VTC's order, and with the flood far ahead of the second its latest row is parked for
    it at the same step: parking only once every slot was taken, the second row waited for a flood's row to end
    while the flood kept three slots (the fairness scenario's worst light waits). Level with them, the flood keeps
    its slots at a step that gave one free (max-min there too churned two floods' rows in the scenario)."""
    from serve.engine.scheduling.generating import Generating, Generations

    made = []

    def row(tenant: str, decoding: bool) -> Row:
        r = Row("generate", "base", None, ([0] * PROMPT, SamplingParams(max_tokens=MAX_TOKENS)), None, tenant=tenant)
        r.tokens_seen, r.seq = int(decoding), len(made)
        made.append(r)
        return r

    fairness = Fairness("vtc")
    fairness.counters.update(served)
    generations = Generations(BatchConfig(max_batch_size=SLOTS, fairness="vtc"), Forwards(Trace()), None, fairness,
                              latencies={}, tenant_waits={}, batch_sizes=None, seconds=None, preemptions=Counter(),
                              let_in=None, pull=None, spawn=None, finish=None, fail=None, shut_out=None, stepped=None)
    batch = Batch(Trace())
    heavy = [row("heavy", decoding=True) for _ in range(SLOTS - 1)]
    batch.running = {r: Generation(prompt_tokens=PROMPT) for r in heavy}
    light, other = row("light", decoding=False), row("other", decoding=False)
    g = Generating(batch, pending=[light, other, row("heavy", decoding=False)], running=list(heavy))
    joining = generations._next_rows(g)
    assert joining == [light]
    if served["heavy"] > served["other"]:
        assert generations._preempt(g, joining) == ([heavy[-1]], [other])
        assert [r.tenant for r in g.pending] == ["heavy"]
    else:
        assert generations._preempt(g, joining) == ([], [])
        assert [r.tenant for r in g.pending] == ["other", "heavy"]


@pytest.mark.parametrize("served", [{"heavy": 5000.0, "light": 100.0}, {"heavy": 100.0, "light": 100.0},
                                    {"heavy": 50.0, "light": 100.0}])
def test_a_row_takes_a_slot_only_from_a_tenant_served_at_least_as_much(served):
    """Every slot taken, three by a light tenant's decoding rows, one by a flood's: the flood's waiting row parks a
    light row only if the light tenant has been served at least as much (VTC would take the flood's row first);
    served more than it, the flood waits for a slot to come free, however few it holds."""
    fairness = Fairness("vtc")
    fairness.counters.update(served)
    rows = []
    for tenant in ["light"] * 3 + ["heavy"] * 2:
        r = Row("generate", "base", None, ([0] * PROMPT, SamplingParams(max_tokens=MAX_TOKENS)), None, tenant=tenant)
        r.tokens_seen, r.seq = 1, len(rows)
        rows.append(r)
    running, waiting = rows[:4], rows[4:]
    park, new = fairness.preempt(running, waiting, Counter(r.tenant for r in running))
    if served["heavy"] > served["light"]:
        assert (park, new) == ([], [])
    else:
        assert park == [rows[2]] and new == waiting


def test_a_light_rows_prompt_is_written_before_a_floods_long_one_in_the_policys_order(bases):
    """Steps of 8 prompt tokens; a heavy row's 40-token prompt is being written when a light row of 3 tokens
    arrives: ranked first, it is admitted past the heavy prompt's backlog and written in the next step, which
    samples its first token while the heavy prompt has 24 tokens to go. In admission order it waits for them."""
    from serve.config import BatchConfig
    from serve.engine.generation.decode_batch import DecodeBatch
    from serve.engine.generation.row import NewRow
    from serve.engine.model import BaseModelRuntime
    from serve.engine.types import SamplingParams

    rt = BaseModelRuntime("lm", bases["plain"], batch=BatchConfig(max_batch_size=4, max_step_tokens=8,
                                                                  max_model_len=96))
    params = SamplingParams(max_tokens=4)
    for rank, light_waits in (({"light": 0, "heavy": 1}.get, False), (None, True)):
        batch = DecodeBatch(rt)
        heavy, light = NewRow("heavy", [j % 40 + 3 for j in range(40)], params), NewRow("light", [5, 6, 7], params)
        batch.run([heavy], rank=rank)
        step = batch.run([light], rank=rank)
        assert ("light" in step.waiting) == light_waits
        decoding = {tag: len(gen.token_ids) for tag, gen in batch.rows()}
        assert decoding == ({} if light_waits else {"light": 1})
        batch.close()


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_a_tenant_far_ahead_writes_its_share_of_a_steps_prompt_tokens(policy):
    """Under vtc, a flood served more than a light tenant by more than the credit (burst_rows + 1 of the light
    tenant's rows) has its prompts written far_tokens a step while the light tenant has a row in the batch or
    waiting, and none at a step that writes the light tenant's prompt (its own prompt does not count); within the
    credit of it, as light tenants lie of each other, or alone, it gets the whole budget. fcfs caps nothing."""
    fairness = Fairness(policy, burst_rows=2)

    def row(tenant: str) -> Row:
        return Row("generate", "base", None, ([0] * PROMPT, SamplingParams(max_tokens=MAX_TOKENS)), None,
                   tenant=tenant)

    heavy, light = row("heavy"), row("light")
    for ahead, shares in ((3 * ROW_COST, (4, 512)), (3 * ROW_COST - 1, (512, 512))):
        fairness.counters.update({"heavy": 100.0 + ahead, "light": 100.0})
        share = fairness.prompt_share([heavy, light, row("light")], 512, 4)
        assert (share(heavy), share(light)) == (("heavy", shares[0] if policy == "vtc" else 512),
                                                ("light", shares[1] if policy == "vtc" else 512))
        writes_light = fairness.prompt_share([heavy, light, row("light")], 512, 4, writing=[heavy, light])
        far = policy == "vtc" and shares[0] == 4
        assert writes_light(heavy) == ("heavy", 0 if far else share(heavy)[1])  # a step writing a light prompt
        assert writes_light(light) == share(light)
    assert fairness.prompt_share([heavy, row("heavy")], 512, 4, writing=[heavy])(heavy) == ("heavy", 512)


def test_a_tenant_answered_within_recent_s_still_holds_a_flood_to_its_share_of_prompt_tokens():
    """No light row open, the light tenant's last answered a second ago: the flood far ahead of it is still
    written far_tokens a step (given the whole budget in such moments, its 500-token chunks made the steps a light
    row arriving next waited for three times longer); recent_s later, alone, it gets the whole budget."""
    fairness = Fairness("vtc", burst_rows=2, recent_s=2.0)
    heavy, light = (Row("generate", "base", None, ([0] * PROMPT, SamplingParams(max_tokens=MAX_TOKENS)), None,
                        tenant=t) for t in ("heavy", "light"))
    for r in (heavy, light):
        fairness.arrive(r)
        fairness.admit(r)
    fairness.counters.update({"heavy": 100.0 + 3 * ROW_COST, "light": 100.0})
    fairness.leave(light)
    left = time.monotonic()
    assert fairness.prompt_share([heavy], 512, 4, now=left + 1.0)(heavy) == ("heavy", 4)
    assert fairness.prompt_share([heavy], 512, 4, now=left + 3.0)(heavy) == ("heavy", 512)


def test_a_flood_far_ahead_writes_no_prompt_at_a_step_writing_a_light_rows_prompt():
    """The step a light row joins writes its prompt, and its first token comes from that step: a flood far ahead
    writes none of its own prompt there, nor at a step writing the prompt of a light row already in the batch, and
    goes on at the next step, when the light rows only decode."""
    from serve.engine.scheduling.generating import Generating, Generations

    fairness = Fairness("vtc", burst_rows=2)
    config = BatchConfig(max_batch_size=SLOTS, fairness="vtc", max_step_tokens=64, vtc_far_prompt_tokens=4)
    generations = Generations(config, Forwards(Trace()), None, fairness, latencies={}, tenant_waits={},
                              batch_sizes=None, seconds=None, preemptions=Counter(), let_in=None, pull=None,
                              spawn=None, finish=None, fail=None, shut_out=None, stepped=None)
    rows = {name: Row("generate", "base", None, ([0] * PROMPT, SamplingParams(max_tokens=MAX_TOKENS)), None,
                      tenant=name.rstrip("0123456789")) for name in ("heavy", "light1", "light2")}
    fairness.counters.update({"heavy": 100.0 + 3 * ROW_COST, "light": 100.0})
    g = Generating(Batch(Trace()), running=[rows["heavy"], rows["light1"]], pending=[rows["light2"]])
    rows["light1"].tokens_seen = 3  # decoding; the flood's row is still writing its prompt
    assert generations._share(g, [])(rows["heavy"]) == ("heavy", 4)
    g.pending = []
    assert generations._share(g, [rows["light2"]])(rows["heavy"]) == ("heavy", 0)  # light2 joins
    assert generations._share(g, [rows["light2"]])(rows["light2"]) == ("light", 64)
    rows["light1"].tokens_seen = 0  # in the batch, its prompt still being written
    assert generations._share(g, [])(rows["heavy"]) == ("heavy", 0)
    rows["light1"].parked, rows["light1"].tokens_seen = True, 3  # parked and resuming: its prompt is written
    assert generations._share(g, [rows["light1"]])(rows["heavy"]) == ("heavy", 4)
    rows["light1"].tokens_seen = 0  # parked mid-prompt and resuming: the rest of its prompt is written
    assert generations._share(g, [rows["light1"]])(rows["heavy"]) == ("heavy", 0)


def test_a_group_allowed_no_prompt_tokens_writes_none_and_its_new_rows_wait():
    """An allowance of 0 (a flood at a step writing a light row's prompt) writes nothing of that group, and a new
    row of it would wait; the other group's prompt is written whole."""
    from types import SimpleNamespace

    from serve.engine.step.layout import prompt_chunks, prompt_waits

    def prefilling(tag: str, length: int):
        return SimpleNamespace(tag=tag, prompt=[1] * length, written=0, kv=0, params=SamplingParams(max_tokens=1))

    rows = [prefilling("heavy", 100), prefilling("light", 10)]
    share = {"heavy": ("heavy", 0), "light": ("light", 64)}.get
    chunks = prompt_chunks(rows, 64, None, {"light": 0, "heavy": 1}.get, share)
    assert [(c.row.tag, c.length) for c in chunks] == [("light", 10)]
    assert prompt_waits(rows[1:], "heavy", 64, {"light": 0, "heavy": 1}.get, share)
    assert not prompt_waits(rows[:1], "light", 64, {"light": 0, "heavy": 1}.get, share)


def test_a_prompt_is_written_at_most_its_share_a_step(bases):
    """A 40-token prompt in steps of 16 tokens beside a 10-token one ranked first: given a share of 4 tokens a step,
    it samples its first token at the tenth step, not the fourth (6 tokens, then 15 a step beside the other row's
    decode token); the row ranked first is written whole in the first step either way."""
    from serve.config import BatchConfig
    from serve.engine.generation.decode_batch import DecodeBatch
    from serve.engine.generation.row import NewRow
    from serve.engine.model import BaseModelRuntime
    from serve.engine.types import SamplingParams

    rt = BaseModelRuntime("lm", bases["plain"], batch=BatchConfig(max_batch_size=4, max_step_tokens=16,
                                                                  max_model_len=96, prefix_caching=False))
    params = SamplingParams(max_tokens=4)
    for share, heavy_first, light_first in (({"heavy": 4}.get, 10, 1), (None, 4, 1)):
        batch = DecodeBatch(rt)
        new = [NewRow("light", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], params),
               NewRow("heavy", [j % 40 + 3 for j in range(40)], params)]
        first: dict[str, int] = {}
        for step in range(1, 12):
            out = batch.run(new, share=(lambda tag: (tag, share(tag) or 16)) if share else None,
                            rank={"light": 0, "heavy": 1}.get)
            new = []
            for tag, gen in [*batch.rows(), *out.finished]:  # a row may end at its first token
                if gen.token_ids or gen.end_token is not None:
                    first.setdefault(tag, step)
        assert (first.get("heavy"), first.get("light")) == (heavy_first, light_first)
        batch.close()


def test_a_tenants_prompts_share_its_allowance_and_a_row_past_it_waits_to_join(bases):
    """A tenant allowed 4 prompt tokens a step: its first 40-token prompt is written 4 a step and samples at the tenth
    step; its second, sent with it, is left waiting to join while the first fills the allowance (not admitted to
    hold a lane unwritten), then written once the first is done. Two of its prompts written at once would each have
    taken the allowance, and the step twice it."""
    from serve.config import BatchConfig
    from serve.engine.generation.decode_batch import DecodeBatch
    from serve.engine.generation.row import NewRow
    from serve.engine.model import BaseModelRuntime
    from serve.engine.types import SamplingParams

    rt = BaseModelRuntime("lm", bases["plain"], batch=BatchConfig(max_batch_size=4, max_step_tokens=64,
                                                                  max_model_len=96, prefix_caching=False))
    params = SamplingParams(max_tokens=4)
    batch = DecodeBatch(rt)
    rows = {("heavy", i): NewRow(("heavy", i), [(j + i) % 40 + 3 for j in range(40)], params) for i in range(2)}
    new, first, writing = list(rows.values()), {}, {}
    for step in range(1, 14):
        out = batch.run(new, share=lambda tag: (tag[0], 4), rank=lambda tag: tag[1])
        new = [rows[tag] for tag in out.waiting]
        writing[step] = [(s.tag[1], s.written) for s in batch.prefilling]
        for tag, gen in [*batch.rows(), *out.finished]:
            if gen.token_ids or gen.end_token is not None:
                first.setdefault(tag, step)
    assert first == {("heavy", 0): 10}
    assert [writing[k] for k in (1, 9, 10, 11, 13)] == [[(0, 4)], [(0, 36)], [], [(1, 4)], [(1, 12)]]
    batch.close()


def test_rows_left_waiting_for_the_token_budget_let_another_tenant_out_of_the_queue_but_park_nothing():
    """A flood's rows waiting to join for the prompt budget hold permits while its batch has free lanes: the next
    step pulls a light tenant's row out of the queue past them (crowded for the pull), and parks no running row for
    it (not crowded for parking: a lane is free)."""
    from serve.engine.scheduling.generating import Generating, Generations

    config = BatchConfig(max_batch_size=SLOTS, fairness="vtc")
    generations = Generations(config, Forwards(Trace()), None, Fairness("vtc"), latencies={}, tenant_waits={},
                              batch_sizes=None, seconds=None, preemptions=Counter(), let_in=None, pull=None,
                              spawn=None, finish=None, fail=None, shut_out=None, stepped=None)
    batch = Batch(Trace())
    heavy = [Row("generate", "base", None, ([0] * PROMPT, SamplingParams(max_tokens=MAX_TOKENS)), None,
                 tenant="heavy") for _ in range(2)]
    batch.running = {heavy[0]: Generation(prompt_tokens=PROMPT)}
    g = Generating(batch, pending=[heavy[1]], running=[heavy[0]])
    assert generations._crowded(g, budget=True) is None  # no row waited for the budget yet
    g.budget = True
    assert generations._crowded(g, budget=True) == Counter({"heavy": 1})
    assert generations._crowded(g) is None and generations._preempt(g, []) == ([], [])


def test_a_replica_takes_every_request_its_engine_holds_so_none_waits_first_come_first_served_before_it(tmp_path):
    """By default a base's replica takes as many requests at once as its engine holds (BatchConfig.rows_held): a
    flood fills the engine's queue and is refused there (429) before the replica stops taking requests, so a light
    tenant's request still reaches the fair queue (pushing out the flood's newest) and joins the batch, rather than
    waiting in Ray's queue, first come, first served, behind the flood."""
    from serve.app import replica_options
    from serve.config import ServeConfig

    trace = Trace()
    config = ServeConfig(store=tmp_path, batch={"max_batch_size": SLOTS, "max_queue": 300, "max_concurrent_groups": 2,
                                                "fairness": "vtc", "batch_wait_timeout_s": 0})  # 300: above 256
    ongoing = replica_options(config, "base", 1.0)[0]["max_ongoing_requests"]
    set_to_3 = ServeConfig(store=tmp_path, deployment={"max_ongoing_requests": 3})
    assert replica_options(set_to_3, "base", 1.0)[0]["max_ongoing_requests"] == 3
    with ThreadPoolExecutor(1) as compute:
        scheduler = Scheduler(config.batch, holds=None, forwards=Forwards(trace), compute=compute)

        async def run() -> tuple[int, list, BaseException | None]:
            def submit(tenant: str, max_tokens: int) -> Row:
                trace.submitted[tenant] = trace.submitted.get(tenant, 0) + 1
                payload = ([0] * PROMPT, SamplingParams(max_tokens=max_tokens))
                return scheduler.submit("generate", "base", None, None, payload, tenant=Tenant(tenant))

            held, refused = [], None
            while refused is None and len(held) < ongoing:  # the flood's rows outlast the test
                try:
                    held.append(submit("heavy", 10**6))
                except Overloaded as e:
                    refused = e
                async with _held(trace, 1):  # the scheduler takes what its permits let out of the queue
                    pass
            results = []
            if refused is not None:  # else the replica would have stopped taking requests first: failed below
                light = submit("light", 2)
                results = await asyncio.gather(scheduler.result(light), scheduler.result(held[-1]),
                                               return_exceptions=True)
            for r in held:  # the flood's callers go, as an HTTP client's disconnect marks them: each is answered
                r.cancelled = True
            await asyncio.gather(*(r.future for r in held), return_exceptions=True)
            return len(held), results, refused

        held, results, refused = asyncio.run(run())
    assert refused is not None and held < ongoing  # the engine refused the flood before Ray would have queued
    light, newest = results
    assert not isinstance(light, BaseException) and len(light.token_ids) == 2
    assert isinstance(newest, Overloaded) and "'heavy'" in str(newest)  # pushed out for the light row
