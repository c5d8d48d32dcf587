"""The forwards the scheduler (serve/engine/scheduling/scheduler.py) runs on the compute thread: classify and embed rows
in as few forwards as slots allow, and each base's generation batch over the scheduler's rows. The model room's side
of the seam: torch, no asyncio.
"""

import logging
from collections.abc import Callable
from typing import Any

from serve.engine import faults
from serve.engine.step.batch import RowSlot
from serve.engine.generation.decode_batch import DecodeBatch
from serve.engine.generation.row import NewRow
from serve.engine.model import BaseModelRuntime
from serve.engine.scheduling.rows import Row, Step
from serve.engine.step.layout import Share
from serve.engine.types import Embeddings
from serve.errors import CapacityExceeded, ManyfoldError

log = logging.getLogger("manyfold.engine")


class Forwards:
    def __init__(self, bases: dict[str, BaseModelRuntime]):
        self.bases = bases

    def generation(self, base: str) -> "RowGeneration":
        return RowGeneration(DecodeBatch(self.bases[base]))

    def encode(self, rows: list[Row]) -> list[Any]:
        """Classify or embed rows of one base: as many rows as get slots go in one forward, then the next, so rows
        of more adapters than slots still run. -> per row its result, or the exception it failed with (its
        attach, or its forward's)."""
        rt = self.bases[rows[0].base]
        results: dict[int, Any] = {}
        todo = list(rows)
        while todo:
            chunk, slots, todo = self._attach(rt, todo, results)
            if not chunk:
                for r in todo:
                    results[id(r)] = CapacityExceeded(f"every adapter slot of base '{rt.name}' is in use; retry later")
                break
            try:
                faults.hit("encode", [r.entry for r in chunk])
                results.update(zip(map(id, chunk), _forward_rows(rt, chunk, slots)))
            except Exception as e:  # the rows of this forward fail; later chunks go on
                if not isinstance(e, ManyfoldError):
                    log.exception("a %s forward on base '%s' failed", rows[0].op, rt.name)
                results.update((id(r), e) for r in chunk)
            finally:
                for slot in slots:
                    rt.detach(slot)
        return [results[id(r)] for r in rows]

    @staticmethod
    def _attach(rt: BaseModelRuntime, rows: list[Row], results: dict[int, Any]
                ) -> tuple[list[Row], list[RowSlot], list[Row]]:
        """Slots for rows in order until one finds none: (rows attached, their slots, rows left for later). A
        row whose attach raises fails alone."""
        chunk, slots = [], []
        for i, r in enumerate(rows):
            try:
                slot = rt.attach(r.loaded)
            except Exception as e:
                if not isinstance(e, ManyfoldError):
                    log.exception("attaching '%s' failed", r.label)
                results[id(r)] = e
                continue
            if slot is None:
                return chunk, slots, rows[i:]
            chunk.append(r)
            slots.append(slot)
        return chunk, slots, []


class RowGeneration:
    """A DecodeBatch whose rows are the scheduler's."""

    def __init__(self, batch: DecodeBatch):
        self.batch = batch

    def __len__(self) -> int:
        return len(self.batch)

    def run(self, new: list[Row], gone: list[Row], park: list[Row], victims: list[Row],
            rank: Callable[[Row], Any] | None = None, share: Share | None = None) -> Step:
        rows, failed = [], []
        for r in new:
            try:
                rows.append(NewRow(r, r.payload[0], r.payload[1], r.loaded, *r.payload[2:],  # ids, params[, grammar]
                                   scope=r.scope))
            except Exception as e:  # its variant no longer has the member it asked for, say
                failed.append((r, e))
        with self.batch.rt.seconds.timing("step"):
            step = self.batch.run(rows, gone, park, victims, rank, share)
        step.failed += failed
        return step

    def prompt_waits(self, row: Row, rank: Callable[[Row], Any], share: Share | None) -> bool:
        return self.batch.prompt_waits(row, rank, share)

    def rows(self) -> list[tuple[Row, Any]]:
        return self.batch.rows()

    def close(self) -> None:
        self.batch.close()


def _forward_rows(rt: BaseModelRuntime, rows: list[Row], slots: list[RowSlot]) -> list:
    op = rows[0].op
    texts = [t for r in rows for t in r.payload]
    per_text = [s for r, s in zip(rows, slots) for _ in r.payload]
    if op == "embed":
        out, tokens = rt.embed(texts, per_text)
    else:
        out, tokens = rt.classify(texts, per_text, [r.loaded.head for r in rows for _ in r.payload])
    at_limit = [i for i, n in enumerate(tokens.tolist()) if n == rt.max_input_tokens]
    cut = set(i for i, n in zip(at_limit, rt.input_lengths([texts[i] for i in at_limit]))
              if n > rt.max_input_tokens)
    results, at = [], 0
    for r in rows:
        span = range(at, at + len(r.payload))
        read, truncated = int(tokens[at:span.stop].sum()), sum(i in cut for i in span)
        if op == "embed":
            results.append(Embeddings(out[at:span.stop].tolist(), read, truncated))
        else:
            results.append(([out[i].tolist() for i in span], read, truncated))
        at = span.stop
    return results
