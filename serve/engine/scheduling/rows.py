"""The scheduler's rows, and the seams it drives: the cache it holds variants in (Holds), the forwards it runs on
the compute thread (Forwards, GenerationBatch) and what a generation step reports back (Step). Plain Python, no
torch: serve/engine/forwards.py and cache.py implement the seams.
"""

import asyncio
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from serve.engine.types import Generation
from serve.errors import ManyfoldError, RowFailed
from serve.store.manifest import REVISION_SEP

Op = Literal["classify", "embed", "generate"]


@dataclass(eq=False)
class Row:
    op: Op
    base: str
    variant: str | None
    """The key of the cache entry it runs ("<name>@<revision>", its group's for a group member); None for the
    base itself."""
    payload: Any
    """generate: (prompt ids, SamplingParams[, its compiled grammar]); classify and embed: the texts."""
    future: asyncio.Future
    model: str | None = None
    """The model id it asked for: the entry itself, or one of a group's members ("<group>/<task>")."""
    stream: asyncio.Queue | None = None
    """Generation only: the row's (text, tokens) after every step, then None once the future is resolved."""
    cancelled: bool = False
    """Its caller has gone: a running generation drops the row at the next step."""
    held: Any = None
    """Its variant's cache entry, held from dispatch until the row is resolved."""
    done: bool = False
    """Resolved: its hold, queue place and permit are back."""
    generation: Generation | None = None
    """Streamed generation only: the row's Generation as far as it has gone."""
    submitted_at: float = 0.0
    """time.monotonic() when it was queued."""
    tokens_seen: int = 0
    """Generation: tokens generated as of the last step (the scheduler's latency figures)."""
    token_at: float = 0.0
    """Generation: time.monotonic() of its latest token."""
    tenant: str = ""
    """Whose row it is, as rows are ordered (serve/engine/scheduling/fairness.py): the request's tenant, or else its
    model."""
    scope: str = ""
    """The authenticated tenant whose cached KV prefixes it may read ("": a server without tenants, one scope)."""
    weight: float = 1.0
    """Its tenant's share of the engine."""
    seq: int = 0
    """Its place in arrival order."""
    charged: bool = False
    """Its prompt has been charged to its tenant (it joined a batch), or it left without: it waits no more."""
    parked: bool = False
    """Generation: taken out of its batch for another tenant's row (preempted), its state kept there, waiting to
    rejoin."""

    def prompt_tokens(self) -> int:
        """What its prompt costs its tenant: a generation's prompt tokens; an encoder row's texts, at about four
        characters a token (counted before they are tokenised)."""
        if self.op == "generate":
            return len(self.payload[0])
        return sum(len(text) // 4 + 1 for text in self.payload)

    def tokens_asked(self) -> int:
        """The tokens a generation may write (its max_tokens; 0 where it set none, or for an encoder row)."""
        return (self.payload[1].max_tokens or 0) if self.op == "generate" else 0

    @property
    def entry(self) -> str:
        """The name of its variant's entry (a group's for a member), or its base's."""
        return self.variant.partition(REVISION_SEP)[0] if self.variant is not None else self.base

    @property
    def label(self) -> str:
        """The model the client asked for, as error messages name it."""
        return self.model or self.base

    @property
    def loaded(self) -> Any:
        """The row's variant in memory (a LoadedVariant), or None for the base."""
        return self.held.variant.member(self.model) if self.held is not None else None

    def logprobs(self, start: int, stop: int) -> list | None:
        """Log probabilities of the generated tokens start..stop (appended to on the compute thread: a slice of
        what is already there is safe to read)."""
        gen = self.generation
        return None if gen is None or gen.logprobs is None else gen.logprobs[start:stop]


class Holds(Protocol):
    """The variant cache, as the scheduler uses it (serve/engine/cache.py)."""

    def try_acquire(self, name: str) -> Any | None: ...

    async def acquire(self, name: str) -> Any: ...

    def release(self, held: Any) -> None: ...


@dataclass
class Step:
    """What one generation step did to its rows."""

    finished: list[tuple[Row, Generation]] = field(default_factory=list)
    waiting: list[Row] = field(default_factory=list)
    """New rows left for a later step (no room in the step's token budget, no free lane, KV blocks or slot)."""
    full: bool = False
    """Some new row waited for want of a lane, KV blocks or a variant slot, or a running row was parked for KV
    blocks: the batch holds what its memory holds (a row that waits for the token budget does not make it full)."""
    budget: bool = False
    """Some new row waited for the step's token budget (the prompts ranked before it fill it)."""
    parked: list[Row] = field(default_factory=list)
    """Running rows taken out of the batch for now (preempted), to resume when passed in again."""
    failed: list[tuple[Row, BaseException]] = field(default_factory=list)
    """Rows that failed alone (their attach, their detokenising); the others went on."""


class GenerationBatch(Protocol):
    """A base's running generation (serve/engine/forwards.py); every method runs on the compute thread."""

    def __len__(self) -> int: ...

    def run(self, new: list[Row], gone: list[Row], park: list[Row], victims: list[Row],
            rank: Callable[[Row], Any] | None = None,
            share: Callable[[Row], tuple[Hashable, int]] | None = None) -> Step: ...

    def prompt_waits(self, row: Row, rank: Callable[[Row], Any],
                     share: Callable[[Row], tuple[Hashable, int]] | None) -> bool:
        """A new row would wait at the next step for the prompts being written (DecodeBatch.prompt_waits)."""

    def rows(self) -> list[tuple[Row, Generation]]: ...

    def close(self) -> None: ...


class Forwards(Protocol):
    def encode(self, rows: list[Row]) -> list[Any]:
        """Classify or embed rows of one base (compute thread): a result, or the exception of a row that failed
        alone, per row."""

    def generation(self, base: str) -> GenerationBatch: ...


def row_error(row: Row, stage: str, e: BaseException) -> ManyfoldError:
    """A ManyfoldError is the row's own answer (a client's mistake, a variant that does not fit, capacity);
    anything else becomes RowFailed naming the model and the stage."""
    if isinstance(e, ManyfoldError):
        return e
    cause = (str(e).splitlines() or [""])[0][:200]
    err = RowFailed(f"model '{row.label}': {stage} failed ({type(e).__name__}{': ' + cause if cause else ''})")
    err.__cause__ = e
    return err
