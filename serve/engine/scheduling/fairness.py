"""The order waiting rows are served in: by tenant with S-LoRA's Virtual Token Counter (arXiv 2401.00588), or first
come, first served. Plain Python, no torch: the scheduler (serve/engine/scheduling/scheduler.py) asks it which
row goes next, where rows wait (its bounded queue, and a base's rows waiting to join the running generation), and
tells it what each row was served.

VTC keeps one counter per tenant: the tokens it has been served, prompt tokens at PROMPT_WEIGHT and generated
tokens at OUTPUT_WEIGHT (S-LoRA's w_p = 1, w_q = 2: a generated token costs a decode step, a prompt token a share of
one), divided by the tenant's weight. The next row is the oldest one of the waiting tenant with the smallest
counter; its prompt is charged when it joins a batch, its tokens as they are generated. A tenant that starts
waiting again after a spell with nothing waiting is lifted to the smallest counter of the other tenants with rows
waiting or running (with none, to the counter of the last tenant whose wait ended) less `burst_rows` of its arriving
row's cost: S-LoRA lifts to the smallest counter of those waiting itself, which banks nothing, and then a light
tenant whose few requests arrive together, as Poisson arrivals do, competes with a flood at the flood's level and
waits for it row for row (the fairness scenario's light p99 was 4-5x its figure alone). Banked, but bounded: a
tenant back from idle goes at most burst_rows rows ahead of the others, it does not take the engine over.
Work-conserving: the policy only orders rows (and parks them); a tenant alone is given every row it sends.

S-LoRA's Theorem 4.4: two tenants backlogged over an interval are served within 2U weighted tokens of each other,
U = max(PROMPT_WEIGHT * L_input + OUTPUT_WEIGHT * M) over the interval's rows, M the tokens a batch holds; with
the credit, 2U + burst_rows row costs. The tests in tests/engine/test_fairness.py check it on the scheduler's own
counters.

Per replica: each replica orders its own rows (Ray Serve spreads a tenant's requests over replicas).
"""

import asyncio
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from itertools import count
from typing import Literal, Protocol

PROMPT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


class Waiting(Protocol):
    """What the policy reads of a row (serve/engine/scheduling/rows.py Row)."""

    tenant: str
    weight: float
    seq: int
    charged: bool

    def prompt_tokens(self) -> int: ...

    def tokens_asked(self) -> int: ...


def cost(row: Waiting) -> float:
    """What the row may cost its tenant in all (its prompt, and every token it may generate), weighted."""
    return (PROMPT_WEIGHT * row.prompt_tokens() + OUTPUT_WEIGHT * row.tokens_asked()) / row.weight


@dataclass
class Fairness:
    policy: Literal["vtc", "fcfs"] = "vtc"
    burst_rows: int = 8
    """A tenant back from idle is lifted this many of its rows' cost below the floor (BatchConfig.vtc_burst_rows)."""
    recent_s: float = 0.0
    """A tenant whose last row was answered this many seconds ago still counts as there: it sets the floor (arrive)
    and holds a far tenant's prompts to far_tokens a step (prompt_share; BatchConfig.vtc_far_recent_s)."""
    counters: dict[str, float] = field(default_factory=dict)
    """Each tenant's weighted tokens served (VTC's c_i); kept for fcfs too, for the same figures."""
    waiting: Counter[str] = field(default_factory=Counter)
    """Rows of each tenant not yet in a batch (nor answered)."""
    open: Counter[str] = field(default_factory=Counter)
    """Rows of each tenant not yet answered, waiting or running: the tenants a tenant back from idle is lifted
    against."""
    _last: float = 0.0
    """The counter of the last tenant whose rows all joined a batch (VTC's l)."""
    _left: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Tenants with no row open, by time.monotonic() when their last one was answered and its cost: those within
    recent_s of it count in arrive and prompt_share as if their rows were there."""
    _seq: Iterator[int] = field(default_factory=count)

    def arrive(self, row: Waiting) -> None:
        """A row starts waiting: numbered in arrival order; its tenant lifted if it had nothing waiting, to the
        floor less burst_rows of this row's cost. The floor is the least served of the other tenants with rows
        waiting or running, or answered within recent_s (none: the last whose wait ended). Not of those waiting
        alone: with a flood the only tenant waiting, a light tenant back from idle was lifted to the flood's
        counter less the credit, above the light tenants whose rows were running, and its rows then ranked after
        all of theirs and were parked for them (a flood's 1,000-token prompt, charged as its row joined, put it
        1,300 tokens above them: 14 s to join). Nor of those open alone: in a moment with no light row open, one
        arriving was lifted so too, and the flood, within the credit of it, was given whole steps of its prompt."""
        row.seq = next(self._seq)
        t = row.tenant
        if not self.waiting[t]:
            others = {u for u, n in self.open.items() if n} | set(self._recent(time.monotonic()))
            active = [self.counters.get(u, 0.0) for u in others if u != t]
            floor = min(active) if active else self._last
            self.counters[t] = max(self.counters.get(t, 0.0), floor - self.burst_rows * cost(row))
        self.waiting[t] += 1
        self.open[t] += 1

    def admit(self, row: Waiting) -> None:
        """The row joins a batch (or an encoder forward): its prompt is charged and it waits no more."""
        if row.charged:
            return
        row.charged = True
        self.charge(row, PROMPT_WEIGHT * row.prompt_tokens())
        self._stop_waiting(row)

    def leave(self, row: Waiting) -> None:
        """The row is answered (once), whether it ran or not: refused, failed or its caller gone before it joined a
        batch, it is charged nothing."""
        if not row.charged:
            row.charged = True
            self._stop_waiting(row)
        self.open[row.tenant] -= 1
        if not self.open[row.tenant]:
            del self.open[row.tenant]
            self._left[row.tenant] = (time.monotonic(), cost(row))

    def served(self, row: Waiting, tokens: int) -> None:
        """The row was given `tokens` more generated tokens."""
        self.charge(row, OUTPUT_WEIGHT * tokens)

    def charge(self, row: Waiting, cost: float) -> None:
        self.counters[row.tenant] = self.counters.get(row.tenant, 0.0) + cost / row.weight

    def _stop_waiting(self, row: Waiting) -> None:
        t = row.tenant
        self.waiting[t] -= 1
        if not self.waiting[t]:
            del self.waiting[t]
            self._last = self.counters.get(t, 0.0)

    def key(self, row: Waiting) -> tuple[float, int]:
        """Smaller goes first: arrival order (fcfs), or the tenant's counter, then arrival (vtc)."""
        return (0.0 if self.policy == "fcfs" else self.counters.get(row.tenant, 0.0), row.seq)

    def take(self, rows: list, n: int) -> tuple[list, list]:
        """The n rows of `rows` that go next, each taken row's prompt counted against its tenant for the rows
        after it (so that two rows of one tenant count against each other), and the rest in their order. ->
        (taken, rest). Nothing is charged here: a row is charged when it joins (admit), and a step may leave a
        row taken here waiting (its prompt finds no room in the step's token budget, no lane or blocks); charged
        for rows not run, a flood would lift every tenant arriving meanwhile to a counter it was never served,
        and its rows would then rank before theirs."""
        rest, taken, tally = list(rows), [], Counter()

        def key(row: Waiting) -> tuple[float, int]:
            counter, seq = self.key(row)
            return counter + tally[row.tenant], seq

        while rest and len(taken) < n:
            row = min(rest, key=key)
            rest.remove(row)
            if not row.charged and self.policy == "vtc":
                tally[row.tenant] += PROMPT_WEIGHT * row.prompt_tokens() / row.weight
            taken.append(row)
        return taken, rest

    def outranked(self, row: Waiting, holding: Counter[str], weights: dict[str, float],
                  far_only: bool = False) -> str | None:
        """The tenant a running row is to be parked from for `row` (holding: running rows by tenant; weights: by
        tenant). Of the tenants served more than row's by at least row's whole cost, the one holding the most for
        its weight, however few it holds: a flood holding its equal share of the slots still gives one up to a
        tenant it is that far ahead of, and the row it gets back once row has been served cannot move row's back
        (row's tenant is then at most level with it). Else, of the tenants served at least as much as row's
        (VTC's order: row would go before their rows), the one holding the most for its weight, if it would still
        hold at least as many for its weight as row's tenant once one row moved (so no row moves back: max-min
        over the slots, weighted). A tenant served more than the others takes no slot from them, however few it
        holds: a flood's long prompts wait for its turn, rather than parking the light rows that keep a step
        short. far_only: the first rule alone, at a step that gave slots free to the rows ranked first (max-min
        there too left the light tenants beside two floods 8x their p99 alone in the fairness scenario)."""
        served = self.counters.get(row.tenant, 0.0)
        far = [t for t in holding if t != row.tenant and holding[t] and self.ahead_by(t, row)]
        if far:
            return max(far, key=lambda t: (holding[t] / weights[t], self.counters.get(t, 0.0)))
        if far_only:
            return None
        ahead = [t for t in holding if t != row.tenant and self.counters.get(t, 0.0) >= served]
        most = max(ahead, key=lambda t: (holding[t] / weights[t], self.counters.get(t, 0.0)), default=None)
        if most is None or (holding[most] - 1) / weights[most] < (holding[row.tenant] + 1) / row.weight:
            return None
        return most

    def preempt(self, running: list, waiting: list, holding: Counter[str], joining: list = ()) -> tuple[list, list]:
        """With every slot taken (joining: rows taking the slots left free at this step, counted in holding, never
        parked; with any, only a tenant far ahead gives a slot up): for each waiting tenant, in the policy's order,
        whose next row outranks a running row (outranked), the latest running row of the tenant holding the most
        (decoding, or still writing its prompt: a flood's long prompt, written a few tokens a step, held its slot
        for all those steps) is to be parked and that row is to take its slot; holding is updated. Without it a
        flood holding every slot keeps a light tenant waiting until its rows finish, all at once if they started at
        once; and a light tenant's burst would be served no faster than the flood's counter advances. -> (rows to
        park, rows to join)."""
        weights = {r.tenant: r.weight for r in [*running, *waiting, *joining]}
        park, new, seen = [], [], set()
        for row in sorted(waiting, key=self.key):
            if row.tenant in seen:
                continue
            seen.add(row.tenant)
            most = self.outranked(row, holding, weights, far_only=bool(joining))
            victim = max((r for r in running if r.tenant == most and r not in park),
                         key=lambda r: r.seq, default=None)
            if victim is None:
                continue
            park.append(victim)
            new.append(row)
            holding[most] -= 1
            holding[row.tenant] += 1
        return park, new

    def prompt_share(self, rows: list, budget: int, far_tokens: int, writing: Collection = (),
                     now: float | None = None) -> Callable[[Waiting], tuple[str, int]]:
        """Each row's group (its tenant) and the most prompt tokens a step writes of that tenant's rows in all,
        given the rows in the batch and waiting to join it: under vtc, far_tokens for a flood (a tenant served more
        than another one's by more than the credit, burst_rows + 1 of that one's next rows) beside such a tenant's
        rows or one answered within recent_s (now: time.monotonic()), none in a step that writes the prompt of a
        row of a tenant it is that far ahead of (writing: the step's rows with a prompt to write), the step's
        budget for the others. The other tenants' rows wait on every step, and a step that writes a flood's
        500-token chunk takes three of their own (the fairness scenario's long-prompts shape: 801 ms steps beside
        the flood, 258 ms alone); a light row's first token comes from the step that writes its prompt, and a
        flood's 16 tokens beside it made that step a third longer on a CPU (184 ms alone), so the flood's prompt
        goes on at the next step without one. Recently answered tenants count too: light tenants' Poisson rows
        leave moments with none of theirs open, the flood was given the whole budget there (81-88 prompt tokens a
        step on average against the light rows' 11-14 alone, steps 518 ms against 188-244), and a light row
        arriving in such a step waited for it. By the tenant, not the row, or each of its prompts written at once
        takes the whole allowance; beyond the credit, since light tenants lie within it of each other (one back
        from idle is lifted to burst_rows below the floor), and one capped for another had its short prompts
        written over several steps. A tenant alone, or within the credit of the others, is given the whole budget:
        work-conserving where no one is waiting on it or has been for recent_s."""
        if self.policy != "vtc":
            return lambda row: (row.tenant, budget)
        recent = self._recent(time.monotonic() if now is None else now)
        allowed, writing_now = {}, {id(r) for r in writing}
        for t in {r.tenant for r in rows}:
            behind = [r for r in rows if r.tenant != t and self.ahead_by(t, r, self.burst_rows + 1)]
            gone = [u for u, c in recent.items() if u != t and self._ahead(t, u, c, self.burst_rows + 1)]
            allowed[t] = (budget if not behind and not gone else 0 if any(id(r) in writing_now for r in behind)
                          else far_tokens)
        return lambda row: (row.tenant, allowed.get(row.tenant, budget))

    def _recent(self, now: float) -> dict[str, float]:
        """The tenants with no row open whose last one was answered within recent_s of now, by that row's cost (the
        others forgotten)."""
        for t in [t for t, (at, _) in self._left.items() if now - at > self.recent_s or self.open[t]]:
            del self._left[t]
        return {t: c for t, (_, c) in self._left.items()}

    def ahead_by(self, tenant: str, row: Waiting, rows: float = 1) -> bool:
        """`tenant` is far ahead of row's: served more by at least `rows` times row's whole cost (outranked: one;
        prompt_share: beyond the credit)."""
        return self._ahead(tenant, row.tenant, cost(row), rows)

    def _ahead(self, tenant: str, other: str, other_cost: float, rows: float) -> bool:
        return self.counters.get(tenant, 0.0) >= self.counters.get(other, 0.0) + rows * other_cost

    def victims(self, running: list) -> list:
        """Running rows in the order they give up their KV blocks when the cache runs short: the most served tenant's
        (vtc; its latest row first), or the latest row (fcfs), as vLLM preempts the last of its running queue."""
        return sorted(running, key=self.key, reverse=True)


class FairQueue:
    """The scheduler's bounded queue of rows not yet taken, in the policy's order: asyncio.Queue's put_nowait / get /
    task_done / join / qsize, with get() giving the row that goes next rather than the oldest. One deque per
    tenant, so taking a row costs the number of waiting tenants, not of rows.

    Full, fcfs refuses the row arriving. Full, vtc refuses it only if its tenant already holds the most rows here;
    otherwise the newest row of the tenant holding the most is pushed out (longest-queue drop), so that a flooding
    tenant cannot fill the queue and have every other tenant's requests refused."""

    def __init__(self, fairness: Fairness, maxsize: int):
        self.fairness = fairness
        self.maxsize = maxsize
        self._by_tenant: dict[str, deque] = {}
        self._size = 0
        self._unfinished = 0
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def qsize(self) -> int:
        return self._size

    def put_nowait(self, row: Waiting) -> Waiting | None:
        """Queue `row`; -> a row pushed out to make room (the caller answers it), or None. QueueFull when `row`
        itself is refused."""
        pushed = None
        if self._size >= self.maxsize:
            longest = max(self._by_tenant, key=lambda t: len(self._by_tenant[t]))
            mine = len(self._by_tenant.get(row.tenant, ()))
            if self.fairness.policy == "fcfs" or mine + 1 >= len(self._by_tenant[longest]):
                raise asyncio.QueueFull
            pushed = self._pop(longest, newest=True)
            self._task_done()
        self._by_tenant.setdefault(row.tenant, deque()).append(row)
        self._size += 1
        self._unfinished += 1
        self._idle.clear()
        self._ready.set()
        return pushed

    async def get(self) -> Waiting:
        while not self._size:
            self._ready.clear()
            await self._ready.wait()
        head = min((q[0] for q in self._by_tenant.values()), key=self.fairness.key)
        return self._pop(head.tenant)

    def heads(self) -> list[Waiting]:
        """Each waiting tenant's next row, in the policy's order."""
        return sorted((q[0] for q in self._by_tenant.values()), key=self.fairness.key)

    def take(self, row: Waiting) -> None:
        """Take `row`, one of heads(), out of the queue now (what get() would give once it came first)."""
        assert self._by_tenant[row.tenant][0] is row
        self._pop(row.tenant)

    def _pop(self, tenant: str, newest: bool = False) -> Waiting:
        q = self._by_tenant[tenant]
        row = q.pop() if newest else q.popleft()
        if not q:
            del self._by_tenant[tenant]
        self._size -= 1
        return row

    def task_done(self) -> None:
        self._task_done()

    def _task_done(self) -> None:
        self._unfinished -= 1
        if not self._unfinished:
            self._idle.set()

    async def join(self) -> None:
        await self._idle.wait()
