"""How a Trans-LoRA transfer writes its synthetic inputs (translora.py calls it): the temperature and the seeds
each prompt shows, batch by batch, and how many candidates to write, sized by the acceptance rate measured as
they are written, bounded by a cap, and checked against the fewest a student may be trained on.

One prompt at one temperature starved the headlines student (6 of 192 candidates kept, many of them repeats):
batches now take the temperatures in turn, each row shows its own shuffled subset of the seeds, and the first
round (one batch at each temperature) measures the filter's rate before the rest of the run is sized.
"""

import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from serve.errors import ConfigError

TEMPERATURES = (0.7, 1.0, 1.3)
"""Sampling temperatures, one per batch in turn: the low one stays near the seeds, the high one strays further."""
BATCH = 32
"""Candidates written per batch: one `generate` call at one temperature. On a CPU a call's decode steps cost
little more for more rows (SmolLM2 writing spam candidates in bf16 on the Intel VM's 2 cores: 0.61 s a candidate
in batches of 16 or 32, 0.89 in batches of 8; headline candidates in fp32 on the AMD VM's: 1.59 s in batches of
32, 2.06 in batches of 16)."""
FIRST_ROUND = BATCH * len(TEMPERATURES)
"""Candidates written before the run is sized by their acceptance rate: one batch at each temperature."""
MIN_SHOWN = 3
"""Seeds a prompt shows at least (all of them where there are fewer)."""
ATTEMPTS_PER_SAMPLE = 16
"""The default cap on candidates written, per input wanted: a filter that passes 1 in 16 still fills the quota."""
FLOOR_SHARE = 4
"""The default floor is the inputs wanted over this: fewer are learnt by heart, and the student overfits them."""
Write = Callable[[int, float, int], list[str]]
"""Called as (count, temperature, seed): that many candidate inputs, "" where the generator wrote nothing."""
Judge = Callable[[list[str]], list[bool]]
"""Whether each candidate passes the filter."""


def temperature(batch: int) -> float:
    """The sampling temperature of the batch-th batch (counted from 0): the schedule, in turn."""
    return TEMPERATURES[batch % len(TEMPERATURES)]


def shown_seeds(parts: list[str], rng: random.Random, group: list[int] | None = None) -> list[str]:
    """A random subset of the seeds (at least MIN_SHOWN, or of `group`'s seeds only where given) in random order:
    one prompt's examples. Different examples and orders per prompt steer the generator away from writing the
    same input again."""
    pool = [parts[i] for i in group] if group else parts
    k = rng.randint(min(MIN_SHOWN, len(pool)), len(pool))
    return rng.sample(pool, k)


MAX_LABEL_WORDS = 3
"""Outputs of at most this many words, few distinct ones among the seeds, are labels (spam's " yes" / " no")."""


def label_groups(outputs: list[str]) -> list[list[int]] | None:
    """The seeds' indices grouped by output, in order of first appearance, where their outputs are labels: at
    most half as many distinct outputs as seeds, none over MAX_LABEL_WORDS words. None where they are free text.
    Prompts then show one label's seeds at a time, the labels in turn, so that the inputs written span the labels
    as the seeds do: shown every seed, SmolLM2 wrote ordinary messages for 47 of 48 spam inputs kept on one seed,
    the teacher answered " no" to them, and the student learnt to answer " no" to everything."""
    distinct = list(dict.fromkeys(o.strip() for o in outputs))
    if len(distinct) > len(outputs) // 2 or any(len(o.split()) > MAX_LABEL_WORDS for o in distinct):
        return None
    return [[i for i, o in enumerate(outputs) if o.strip() == label] for label in distinct]


@dataclass(frozen=True)
class AttemptPlan:
    """How many inputs a transfer wants (samples), the fewest it may train a student on (floor), and the most
    candidates it may write (cap)."""

    samples: int
    floor: int
    cap: int

    @classmethod
    def build(cls, samples: int, max_attempts: int | None = None, min_accepted: int | None = None
              ) -> "AttemptPlan":
        """The plan with its defaults (cap ATTEMPTS_PER_SAMPLE x samples, floor samples / FLOOR_SHARE);
        ConfigError on values that cannot work."""
        if samples < 1:
            raise ConfigError(f"samples must be >= 1; got {samples}")
        floor = min_accepted if min_accepted is not None else max(1, samples // FLOOR_SHARE)
        cap = max_attempts if max_attempts is not None else ATTEMPTS_PER_SAMPLE * samples
        if not 1 <= floor <= samples:
            raise ConfigError(f"min_accepted must be between 1 and samples ({samples}); got {floor}")
        if cap < floor:
            raise ConfigError(f"max_attempts ({cap}) must be >= min_accepted ({floor})")
        return cls(samples, floor, cap)

    def projected(self, passed: int, attempts: int) -> int:
        """Candidates to write in all to fill the quota at the rate measured so far (as if one had passed where
        none has), within the cap."""
        if attempts == 0:
            return self.cap
        needed = self.samples - min(passed, self.samples)
        return min(self.cap, attempts + math.ceil(needed * attempts / max(passed, 1)))

    def reachable(self, passed: int, attempts: int) -> bool:
        """Whether the floor may still be reached within the cap at a generous rate, (passed + 3) / attempts (the
        rule of three where none has passed): a hopeless run ends early, a slow one goes on."""
        if passed >= self.floor or attempts == 0:
            return True
        return passed + (passed + 3) / attempts * (self.cap - attempts) >= self.floor

    def next_batch(self, passed: int, attempts: int) -> int:
        """Candidates to write next; 0 once the quota is full, the cap is reached, or (after the first round)
        the floor is out of reach."""
        if passed >= self.samples or attempts >= self.cap:
            return 0
        if attempts < FIRST_ROUND:
            return min(BATCH, self.cap - attempts)
        if not self.reachable(passed, attempts):
            return 0
        return max(1, min(BATCH, self.projected(passed, attempts) - attempts))


@dataclass(frozen=True)
class BatchRecord:
    """One batch's fates: attempts = accepted + rejected + dropped + surplus."""

    temperature: float
    attempts: int
    accepted: int
    rejected: int
    dropped: int
    surplus: int


@dataclass
class Sampling:
    """What a run of batches wrote and kept."""

    plan: AttemptPlan
    accepted: list[str] = field(default_factory=list)
    batches: list[BatchRecord] = field(default_factory=list)
    planned_attempts: int = 0
    """The attempts the first round's rate sized the run at (within the cap); later batches revise it."""
    out_of_time: bool = False
    """Writing stopped at the transfer's time budget (translora.Budget) before the quota was full."""
    written: list[str] = field(default_factory=list)
    """Every fresh candidate in the order written, whatever the judge said (accepted, rejected, surplus)."""

    @property
    def attempts(self) -> int:
        return sum(b.attempts for b in self.batches)

    @property
    def passed(self) -> int:
        return len(self.accepted) + self.count("surplus")

    @property
    def rate(self) -> float:
        """Candidates that passed the filter per candidate written."""
        return self.passed / self.attempts if self.attempts else 0.0

    def as_written(self) -> list[str]:
        """The first plan.samples fresh candidates, whatever the filter said: the other set a transfer measures a
        student on (students.input_sets)."""
        return self.written[:self.plan.samples]

    def count(self, fate: str) -> int:
        return sum(getattr(b, fate) for b in self.batches)

    def summary(self) -> dict:
        """The report's `generation` figures."""
        return {"min_accepted": self.plan.floor, "max_attempts": self.plan.cap,
                "planned_attempts": self.planned_attempts, "acceptance_rate": round(self.rate, 4),
                "temperatures": sorted({b.temperature for b in self.batches}), "out_of_time": self.out_of_time,
                "distinct_bigrams": round(distinct_ngrams(self.accepted, 2), 4),
                "batches": [asdict(b) for b in self.batches]}

    def to_dict(self) -> dict:
        """Everything it holds, as JSON can write it (a benchmark keeps inputs it shares between runs)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Sampling":
        """The Sampling to_dict wrote."""
        return cls(AttemptPlan(**d["plan"]), list(d["accepted"]), [BatchRecord(**b) for b in d["batches"]],
                   d["planned_attempts"], d.get("out_of_time", False), list(d.get("written", [])))

    def note(self) -> str:
        """The report's note where fewer inputs than wanted were kept ("" where the quota was filled)."""
        kept = len(self.accepted)
        return "" if kept == self.plan.samples else f"only {kept} of {self.plan.samples} inputs accepted"

    def shortfall(self) -> str:
        """The one line a transfer fails with when fewer than the floor were accepted: the figures, why it
        stopped, and what to change."""
        stop = ("when --budget-min ran out" if self.out_of_time else
                f"after --max-attempts {self.plan.cap}" if self.attempts >= self.plan.cap else
                f"and at that rate the other {self.plan.cap - self.attempts} of --max-attempts {self.plan.cap} "
                f"would not reach it")
        return (f"only {len(self.accepted)} of {self.attempts} generated inputs accepted ({self.rate:.1%}), short of "
                f"the {self.plan.floor} a student needs (--min-accepted), {stop}: add seed examples (adapter train "
                f"--discriminator --seeds), raise --max-attempts or lower --min-accepted")


def distinct_ngrams(texts: list[str], n: int) -> float:
    """Distinct word n-grams over all n-grams of `texts` (distinct-n): 1.0 where no n-gram repeats, lower as the
    inputs echo each other and the seeds' phrases."""
    grams = [tuple(words[i:i + n]) for words in (t.split() for t in texts) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def sample_inputs(write: Write, judge: Judge, plan: AttemptPlan, seen: set[str], seed: int,
                  tick: Callable[[int, int], None] = lambda done, total: None,
                  out_of_time: Callable[[], bool] = lambda: False) -> Sampling:
    """Write candidates batch by batch (plan.next_batch, each at the next temperature) and keep the fresh ones
    the judge passes, up to plan.samples, or until out_of_time() says so before a batch. Blank candidates and
    repeats (of `seen`, which grows) never reach the judge. Each batch writes at least one candidate, so the cap
    bounds the loop."""
    out = Sampling(plan)
    for b in range(plan.cap):
        n = plan.next_batch(out.passed, out.attempts)
        if n == 0:
            break
        if out_of_time():
            out.out_of_time = True
            break
        t = temperature(b)
        cands = write(n, t, seed + out.attempts)
        fresh = [c for c in dict.fromkeys(cands) if c and c not in seen]
        seen.update(fresh)
        out.written += fresh
        passed = [c for c, ok in zip(fresh, judge(fresh) if fresh else []) if ok]
        room = plan.samples - len(out.accepted)
        out.accepted += passed[:room]
        out.batches.append(BatchRecord(t, n, min(len(passed), room), len(fresh) - len(passed), n - len(fresh),
                                       max(0, len(passed) - room)))
        if not out.planned_attempts and (out.attempts >= FIRST_ROUND or len(out.accepted) >= plan.samples):
            out.planned_attempts = plan.projected(out.passed, out.attempts)
        tick(out.attempts, plan.projected(out.passed, out.attempts))
    out.planned_attempts = out.planned_attempts or out.attempts
    return out
