"""`manyfold store upgrade`: a base upgrade a platform runs under its tenants.

Every tenant's adapter on the old base moves to the new one (Trans-LoRA through translora_store.move_adapter:
each result registered as its own entry, `NAME.NEW`, one already there not redone, so an interrupted upgrade
resumes), and the name the tenant's clients call is switched to the new entry only where the guard kept the
transfer (the student, or the source adapter unchanged where it fits the new base and does better there). A name
is switched by an alias in the store's manifest (StoreManifest.aliases): one atomic manifest write, seen by every
process within store_refresh_s. Both bases serve throughout, and a request runs the entry its name pointed to when
it was resolved (the router resolves aliases; a replica runs the entry it was sent). `rollback` points every name
the upgrade switched back, in one write; `dry_run` says what would move and about how long it would take here.
Each tenant's progress is a line (stage, how far, minutes left) and the whole upgrade one JSON report: per tenant
the figures the guard compared, the decision, the minutes.
"""

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

from serve.adapters.budget import MINUTES_MEASURED, PARAMS_MEASURED, SECOND_STUDENT
from serve.adapters.translora import read_assets, trained_examples
from serve.adapters.translora_store import adapters_of, move_adapter, transferred_name
from serve.errors import ArtifactError, BadRequest
from serve.store.manifest import alias_problem
from serve.store.writer import atomic_write

SWITCHED = ("moved", "kept")
"""Decisions that switch a tenant's name: the guard kept a student, or the source adapter unchanged."""


@dataclass(frozen=True)
class Move:
    name: str
    """The model name the tenant's clients call."""
    entry: str
    """Its adapter on the old base."""
    new: str
    """Where the adapter lands on the new base (translora_store.transferred_name)."""


def plan(store, from_base: str, to_base: str) -> list[Move]:
    """Every tenant's adapter on from_base, with the name its clients call: an alias that points at it (or at
    where it lands), or its own name. An adapter whose own name an alias points elsewhere is no tenant's now."""
    store.base(from_base)
    store.base(to_base)
    aliases = store.manifest.aliases
    calling = {target: name for name, target in aliases.items()}
    moves = []
    for entry in adapters_of(store, from_base):
        new = transferred_name(entry, to_base)
        name = calling.get(entry) or calling.get(new) or entry
        if name == entry and aliases.get(entry, new) != new:
            continue
        moves.append(Move(name, entry, new))
    return moves


def point(store, changes: dict[str, str]) -> None:
    """One manifest write: each name pointed at the entry given (a name pointed at its own entry: its alias
    removed). Every process that follows the store switches these names together."""
    def change(m):
        aliases = dict(m.aliases)
        for name, target in changes.items():
            if target == name:
                aliases.pop(name, None)
            else:
                aliases[name] = target
        problem = alias_problem(aliases, m.variants, m.bases)
        if problem is not None:
            raise BadRequest(problem)
        return m.model_copy(update={"aliases": aliases})

    store.update(change)


def movable(store, entry: str) -> bool:
    """Whether Trans-LoRA can move the adapter: its discriminator and task were trained beside it."""
    try:
        read_assets(store.variant_dir(entry))
    except ArtifactError:
        return False
    return True


def to_transfer(store, m: Move) -> bool:
    """Whether the upgrade has a transfer to run for this tenant: not done before, and movable."""
    return m.new not in store.manifest.variants and movable(store, m.entry)


def decision(store, outcome: str, new: str) -> str:
    """What the guard decided for one tenant: "moved" (a student), "kept" (the source adapter unchanged),
    "failed" or "skipped"; a transfer done before is read back from its entry."""
    if outcome != "done":
        return outcome
    return "kept" if store.manifest.variants[new].translora == "unchanged" else "moved"


def minutes_each(store, from_base: str, to_base: str, moves: list[Move], samples: int, budget_min: float | None,
                 measured: list[float]) -> float:
    """About how long one transfer takes here: the mean of those this upgrade has measured, else the bench's
    measured transfer (budget.MINUTES_MEASURED) scaled by the larger base's parameters and the inputs wanted, at
    most the budget."""
    if measured:
        return sum(measured) / len(measured)
    params = max(store.base(from_base).params, store.base(to_base).params)
    examples = max([min(samples, trained_examples(store.variant_dir(m.entry)) or samples) for m in moves] or [0])
    guess = MINUTES_MEASURED * params / PARAMS_MEASURED * examples / 128
    return min(guess, budget_min) if budget_min else guess


def dry_run(store, from_base: str, to_base: str, samples: int = 64, budget_min: float | None = None,
            measure_inputs: bool = True) -> list[str]:
    """What an upgrade would do, a line a tenant, then the estimate: a range where a transfer may train a second
    student (measure_inputs: budget.SECOND_STUDENT), at most the budget."""
    moves = plan(store, from_base, to_base)
    todo = [m for m in moves if to_transfer(store, m)]
    each = minutes_each(store, from_base, to_base, todo, samples, budget_min, []) if todo else 0.0
    most = each * (1 + SECOND_STUDENT) if measure_inputs else each
    most = min(most, budget_min) if budget_min else most
    lines = [(f"upgrade {from_base} -> {to_base}: {len(moves)} tenant adapter{'s' * (len(moves) != 1)}, "
              f"{len(todo)} to transfer")]
    for m in moves:
        if m.new in store.manifest.variants:
            state = "switched" if store.manifest.aliases.get(m.name) == m.new else \
                f"transferred before ({decision(store, 'done', m.new)}), not switched"
        else:
            state = f"to transfer (~{_span(each, most)} min)" if m in todo else \
                "cannot move: no discriminator beside it (trained without --discriminator); its name stays"
        lines.append(f"  {m.name}: {m.entry} -> {m.new}: {state}")
    if not todo:
        lines.append("nothing to transfer: every tenant that can move has been transferred")
        return lines
    cap = f", at most --budget-min {budget_min:g}" if budget_min else ""
    why = "; the more where the filter refuses a quarter of the inputs and a second student trains" \
        if most > each else ""
    lines.append(f"about {_span(each * len(todo), most * len(todo))} minutes here in all (~{_span(each, most)} a "
                 f"transfer{cap}{why}; a name switches as its transfer is kept)")
    return lines


def _span(low: float, high: float) -> str:
    """Minutes as "12", or "12-17" where the two differ once rounded."""
    a, b = f"{low:.0f}", f"{high:.0f}"
    return a if a == b else f"{a}-{b}"


@dataclass
class Tenant:
    """One tenant's line of the upgrade's report."""

    name: str
    entry: str
    new: str
    decision: str
    """moved, kept, failed or skipped (SWITCHED decisions switch the name)."""
    switched: bool
    minutes: float
    """The transfer's minutes (this run's, or the report's from the run that did it)."""
    news: str
    compared: dict | None = None
    """The validation figures the guard compared (transfer_guard.Comparison)."""


def upgrade(store, from_base: str, to_base: str, report_path: Path, say: Callable[[str], None] = print,
            clock: Callable[[], float] = time.monotonic, **options) -> dict:
    """Move every tenant's adapter, switch each name the guard kept, and write the report after each tenant (an
    interrupted upgrade leaves what it did; run again, it redoes nothing done). -> the report."""
    moves = plan(store, from_base, to_base)
    before = _earlier(report_path, from_base, to_base)
    report = {"from": from_base, "to": to_base, "tenants": [],
              "options": {k: asdict(v) if is_dataclass(v) else v for k, v in options.items()}}
    measured = [t["minutes"] for t in before.values() if t["minutes"] > 0]
    to_move = [to_transfer(store, m) for m in moves]
    for i, m in enumerate(moves):
        each = minutes_each(store, from_base, to_base, moves, options.get("samples", 64), options.get("budget_min"),
                            measured)
        started = clock()
        tick = _ticker(f"[{i + 1}/{len(moves)}] {m.name}", say, clock, started, each, each * sum(to_move[i + 1:]))
        outcome, news, compared = move_adapter(store, m.entry, to_base, progress=tick, **options)
        earlier = before.get(m.name, {})
        ran = outcome not in ("done", "skipped")
        minutes = (clock() - started) / 60 if ran else earlier.get("minutes", 0.0)
        compared = compared if ran else earlier.get("compared")
        if ran:
            measured.append(minutes)
        chosen = decision(store, outcome, m.new)
        if chosen in SWITCHED and store.manifest.aliases.get(m.name, m.name) != m.new:
            point(store, {m.name: m.new})
        switched = store.manifest.aliases.get(m.name) == m.new
        say(f"[{i + 1}/{len(moves)}] {news}; {'switched' if switched else 'not switched'}: '{m.name}' answered by "
            f"'{m.new if switched else m.entry}'")
        report["tenants"].append(asdict(Tenant(m.name, m.entry, m.new, chosen, switched, round(minutes, 2), news,
                                               compared)))
        report["minutes"] = round(sum(t["minutes"] for t in report["tenants"]), 2)
        atomic_write(report_path, [json.dumps(report, indent=1).encode() + b"\n"])
    return report


def rollback(store, from_base: str, to_base: str) -> list[str]:
    """Every name an upgrade from from_base to to_base switched, pointed back at its adapter on from_base, in one
    write. -> the names."""
    changes = {m.name: m.entry for m in plan(store, from_base, to_base)
               if store.manifest.aliases.get(m.name) == m.new}
    if changes:
        point(store, changes)
    return sorted(changes)


def _earlier(path: Path, from_base: str, to_base: str) -> dict[str, dict]:
    """The tenants of an earlier run's report of the same upgrade, by name (its minutes are kept)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if data.get("from") != from_base or data.get("to") != to_base:
        return {}
    return {t["name"]: t for t in data.get("tenants", [])}


def _ticker(who: str, say: Callable[[str], None], clock: Callable[[], float], started: float, each: float,
            after: float) -> Callable[[str, int, int], None]:
    """A transfer's progress as lines: on each new stage and every tenth of it, with the minutes spent and the
    minutes left (this tenant's by the estimate, and the tenants after it)."""
    last: list = [None, -1]

    def tick(stage: str, done: int, total: int) -> None:
        tenth = 10 * done // total if total else 10
        if [stage, tenth] == last:
            return
        last[:] = [stage, tenth]
        spent = (clock() - started) / 60
        say(f"{who}: {stage} {done}/{total}, {spent:.1f} min; ~{max(each - spent, 0):.0f} min "
            f"left for it, ~{max(each - spent, 0) + after:.0f} for the upgrade")

    return tick
