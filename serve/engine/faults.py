"""Fault injection for tests: a stage of serving raises when a test has armed it, and costs one falsy check
when nothing is armed (always, in a server). No torch, no Ray: every room may call `hit`.

Stages, in the order a row meets them: "load" (a variant read into memory), "promote" (a cache entry moved
to the fast tier), "attach" (a row given its variant's slot), "prefill", "decode" (one step of a running
generation), "encode" (a classify or embed forward), "detokenize" (generated tokens to text), "close" (a
generation batch torn down), "report" (a replica's residency report).
"""

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

STAGES = ("load", "promote", "attach", "prefill", "decode", "encode", "detokenize", "close", "report")


class InjectedFault(RuntimeError):
    """What an armed stage raises: an error the server did not expect, as a device or a bug would raise."""


_armed: dict[str, Callable[[frozenset[str]], bool]] = {}
hits: dict[str, int] = {}
"""Faults raised so far, by stage (a test reads it to prove its fault fired)."""


def hit(stage: str, variants: Iterable[str | None] = ()) -> None:
    """Raise InjectedFault if `stage` is armed for any of `variants` (the entries the step touches)."""
    if _armed and stage in _armed and _armed[stage](frozenset(v for v in variants if v is not None)):
        hits[stage] = hits.get(stage, 0) + 1
        raise InjectedFault(f"injected fault at {stage}")


@contextmanager
def injected(stage: str, *names: str) -> Iterator[None]:
    """Arm `stage` inside the block: for steps touching any of `names` (variants, or a base for its own rows),
    or for every step when none are given."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage '{stage}' (known: {', '.join(STAGES)})")
    targets = frozenset(names)
    _armed[stage] = (lambda touched: True) if not targets else (lambda touched: not targets.isdisjoint(touched))
    try:
        yield
    finally:
        _armed.pop(stage, None)
