"""One generation step's forward, laid out: every token of the step in one flattened sequence, where it writes in
the KV store, what it reads, which variant it runs, and which logits come back.

The layout (the generation's own rows are serve/engine/generation/decode_batch.py's):
    tokens 0..B-1    a decode token for lanes 0..B-1: a running row's last token at its next position, or
                     padding (a free lane, a row still prefilling) that writes through the scratch lane and reads
                     nothing. B covers the highest running lane, rounded up to a row bucket where shapes are fixed.
    tokens B..T-1    the step's prefill chunks, one after another; where shapes are fixed, their tokens padded to
                     a token bucket P (padding writes through the scratch lane and reads nothing), at most CHUNK_ROWS
                     chunks, and the chunk table padded to that many rows.
Logits are computed only for the tokens some row reads (`kept`): the running rows', the last token of each prompt
that ends in this step, and every token of an echoing prompt; where shapes are fixed, B + CHUNK_ROWS of them
whichever prompts end. Every host-built index goes to the device in one copy. So with fixed shapes a step's
launches depend only on (B, P) and on its families: every step whose families allow it replays a CUDA graph of
its buckets (serve/engine/step/graphs.py), prompt chunks and all. An echoing prompt's step (its logits of every
position) runs eagerly, as does any step on a CPU; the reason is counted.
"""

from collections import Counter
from collections.abc import Callable, Hashable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from serve.engine.step.batch import BASE_ROW, BatchPlan
from serve.engine.kv.store import StepLayout
from serve.engine.step.invariant import BatchInvariant

CHUNK_ROWS = 8
"""Prompt chunks a fixed-shape step holds at most (its chunk table's rows, and the LM head's rows for them)."""
Share = Callable[[Any], tuple[Hashable, int]]
"""share(tag) -> (the group a row's prompt tokens count against, the most prompt tokens a step writes of that group's
rows in all): a tenant's rows share its allowance (Fairness.prompt_share)."""
MIN_TOKEN_BUCKET = 16
"""The smallest token bucket of a fixed-shape step's prompt chunks (a power of two up from there)."""


def row_bucket(rows: int, most: int) -> int:
    """The row count a fixed-shape decode step of `rows` rows runs at: 1, 2, 4, 8, then multiples of 8 (up to 64)
    or of 16, at most `most` (vLLM's capture sizes, roughly)."""
    if rows <= 8:
        bucket = 1 << (rows - 1).bit_length() if rows > 1 else 1
    elif rows <= 64:
        bucket = -(-rows // 8) * 8
    else:
        bucket = -(-rows // 16) * 16
    return min(bucket, most)


def token_bucket(tokens: int, most: int) -> int:
    """The prompt tokens a fixed-shape step runs for `tokens` of them: a power of two, MIN_TOKEN_BUCKET at least,
    at most `most` (the step's token budget)."""
    return min(max(MIN_TOKEN_BUCKET, 1 << (tokens - 1).bit_length()), most)


def chunk_rows(prompt_tokens: int) -> int:
    """The chunk table's rows (and the LM head's for them) of a fixed-shape step of `prompt_tokens` prompt tokens:
    CHUNK_ROWS, one more where that would make the kept tokens as many as all of them (a module tells the LM head's
    tokens from all of a step's by their count: serve/engine/step/batch.py)."""
    return CHUNK_ROWS + (prompt_tokens == CHUNK_ROWS)


@dataclass(frozen=True)
class Prefill:
    """A prompt's next chunk in this step."""

    row: Any
    """Its generation row (the caller's: serve/engine/generation/decode_batch.py's _Seq)."""
    lane: int
    """Its KV lane (its row of the block tables)."""
    first: int
    """The position of its first token."""
    length: int
    tokens: list[int]
    keep_all: bool
    """Every position's logits come back (an echoing prompt's log probabilities)."""
    samples: bool
    """The prompt ends here: its last position's logits are sampled from."""


@dataclass
class StepOutput:
    logits: torch.Tensor
    """[kept, vocab] fp32 (a replayed graph's: overwritten by its next replay)."""
    sample_at: dict[int, int]
    """KV lane -> its row of logits to sample from."""
    chunk_at: dict[int, tuple[int, int]]
    """KV lane -> the rows of logits of its echoing chunk."""
    graph: Any = None
    """The graph a decode step replayed (serve/engine/step/graphs.py), None for an eager step: the next decode step
    can then be launched from this one's tokens without the host (StepRunner.continue_)."""

    def chunk_logits(self, p: Prefill) -> torch.Tensor:
        start, end = self.chunk_at[p.lane]
        return self.logits[start:end]


@dataclass
class StepInputs:
    """A step's host-built layout (ints), before it goes to the device."""

    rows: list
    """Each row's RowSlot: B decode rows, then one per chunk (and one for a fixed-shape step's padding tokens)."""
    tokens: list[int]
    ids: list[int]
    positions: list[int]
    write_lanes: list[int]
    lengths: list[int]
    """[B]: keys each decode row attends to (0: padding)."""
    kept: list[int] | None
    """Token indices whose logits come back; None: every token."""
    chunks: list[int]
    """The chunk table, flat: (first token, length, lane, first position) a chunk; [] when the step has none."""
    chunk_tokens: int
    """The chunks' token bucket (fixed shapes), or their longest."""
    sample_at: dict[int, int]
    chunk_at: dict[int, tuple[int, int]]

    @property
    def decode_rows(self) -> int:
        return len(self.lengths)

    @property
    def prompt_tokens(self) -> int:
        """Tokens after the decode rows (0: a decode-only step)."""
        return len(self.ids) - self.decode_rows

    def packed(self) -> torch.Tensor:
        """ids, positions, write lanes, lengths, kept indices and the chunk table in one host tensor: one copy to
        the device."""
        return torch.tensor(self.ids + self.positions + self.write_lanes + self.lengths + (self.kept or [])
                            + self.chunks, dtype=torch.long)

    def unpack(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(ids [1, T], positions [1, T], write lanes [T], lengths [B], kept [K] or None, chunks [C, 4] or None) from
        packed()'s copy."""
        t = len(self.ids)
        parts = flat.split([t, t, t, self.decode_rows, len(self.kept or []), len(self.chunks)])
        return (parts[0][None], parts[1][None], parts[2], parts[3], parts[4] if self.kept is not None else None,
                parts[5].view(-1, 4) if self.chunks else None)

    def layout(self, flat: torch.Tensor, max_length: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, StepLayout]:
        """(ids [1, T], positions [1, T], kept or None, the StepLayout) from packed()'s copy on the device.
        max_length: what the decode rows may read (default: this step's longest; a graph replayed for later steps
        says the cache's positions)."""
        ids, positions, lanes, lengths, kept, chunks = self.unpack(flat)
        longest = max(self.lengths, default=0) if max_length is None else max_length
        return ids, positions, kept, StepLayout(lanes, positions[0], lengths, longest, self.decode_rows, chunks,
                                                self.chunk_tokens)


def prompt_chunks(prefilling: list, budget: int, most: int | None, rank: Callable[[Any], Any],
                  share: Share | None = None) -> list[Prefill]:
    """The next chunks of the prompts being written (rows with .prompt, .written, .kv, .params, .tag), in `rank`'s
    order of their tags (the fairness policy's; among equals, theirs), within `budget` tokens (at least one, so a
    batch of max_step_tokens running rows still admits), `most` chunks (None: any) and each group's allowance
    (share; None: any). A row whose group's allowance is spent writes nothing this step: two of a flood's long
    prompts written at once would each take the allowance, and the step twice it."""
    budget = max(budget, 1)
    chunks, used = [], Counter()
    for s in sorted(prefilling, key=lambda s: rank(s.tag)):
        if budget == 0 or (most is not None and len(chunks) == most):
            break
        n = min(len(s.prompt) - s.written, budget)
        if share is not None:
            group, allowed = share(s.tag)
            n = min(n, allowed - used[group])
            if n <= 0:
                continue
            used[group] += n
        chunks.append(Prefill(s, s.kv, s.written, n, s.prompt[s.written:s.written + n],
                              keep_all=s.params.echoes_logprobs, samples=s.written + n == len(s.prompt)))
        budget -= n
    return chunks


def prompt_waits(prefilling: list, tag: Any, budget: int, rank: Callable[[Any], Any], share: Share | None) -> bool:
    """prompt_chunks would write none of a new row tagged `tag` at the next step, so admitted it would hold its lane
    and blocks unwritten: the prompts still to write of the rows it would follow (ranked before it or with it;
    among equals, in admission's order) fill `budget`, or those of its share group fill the group's allowance."""
    at = rank(tag)
    if sum(len(s.prompt) - s.written for s in prefilling if not at < rank(s.tag)) >= budget:
        return True
    if share is None:
        return False
    group, allowed = share(tag)
    return sum(len(s.prompt) - s.written for s in prefilling if share(s.tag)[0] == group) >= allowed


def lay_out(decoding: dict[int, Any], prefills: list[Prefill], bucket: int, scratch: int, pad_id: int,
            prompt_bucket: int | None = None) -> StepInputs:
    """decoding: KV lane -> a running row (.slot its RowSlot, .next_token, .written: its next position).
    prompt_bucket: fixed shapes: the prefills' tokens padded to it, their chunks to chunk_rows(prompt_bucket) (None:
    as they are)."""
    rows, tokens, ids, positions, lanes, lengths = [], [], [], [], [], []
    kept: list[int] = []
    sample_at: dict[int, int] = {}
    chunk_at: dict[int, tuple[int, int]] = {}
    for b in range(bucket):
        s = decoding.get(b)
        rows.append(s.slot if s is not None else BASE_ROW)
        tokens.append(1)
        ids.append(s.next_token if s is not None else pad_id)
        positions.append(s.written if s is not None else 0)
        lanes.append(b if s is not None else scratch)
        lengths.append(s.written + 1 if s is not None else 0)
        if s is not None:
            sample_at[b] = len(kept)
        kept.append(b)  # padding rows too: a decode step's shapes stay those of its bucket
    chunks: list[int] = []
    for p in prefills:
        start = len(ids)
        rows.append(p.row.slot)
        tokens.append(p.length)
        ids += p.tokens
        positions += range(p.first, p.first + p.length)
        lanes += [p.lane] * p.length
        chunks += [start, p.length, p.lane, p.first]
        if prompt_bucket is not None:  # one kept row a chunk, whether it samples or not
            kept.append(start + p.length - 1)
        elif p.keep_all:
            chunk_at[p.lane] = (len(kept), len(kept) + p.length)
            kept += range(start, start + p.length)
        elif p.samples:
            kept.append(start + p.length - 1)
        if p.samples:
            sample_at[p.lane] = len(kept) - 1
    if prompt_bucket is not None and prefills:
        pad = bucket + prompt_bucket - len(ids)
        if pad:
            rows.append(BASE_ROW)
            tokens.append(pad)
            ids += [pad_id] * pad
            positions += [0] * pad
            lanes += [scratch] * pad
        padding_chunks = chunk_rows(prompt_bucket) - len(prefills)
        kept += [0] * padding_chunks  # read by no row
        chunks += [0, 0, 0, 0] * padding_chunks
    every = kept == list(range(len(ids)))
    longest = prompt_bucket if prompt_bucket is not None else max((p.length for p in prefills), default=0)
    return StepInputs(rows, tokens, ids, positions, lanes, lengths, None if every else kept, chunks, longest,
                      sample_at, chunk_at)


class StepRunner:
    """Runs a base's generation steps: lays each out, then replays its buckets' graph or runs it eagerly."""

    def __init__(self, rt):
        self.rt = rt
        self.steps: Counter[str] = rt.step_counts
        """"graphed", or "eager:<reason>": steps by how they ran (the runtime's, so /metrics reads them)."""
        self.tokens: Counter[str] = rt.token_counts
        """Decode tokens (a running row's) and prompt tokens, by how their step ran, as `steps`:
        "<decode|prompt>:<graphed|eager>"."""

    def run(self, decoding: dict[int, Any], prefills: list[Prefill]) -> StepOutput:
        rt = self.rt
        rt.kv.sync()
        bucket = max(decoding, default=-1) + 1
        if rt.fixed_shapes and bucket:
            bucket = row_bucket(bucket, rt.kv.lanes)
        echo = any(p.keep_all for p in prefills)
        prompt = sum(p.length for p in prefills)
        fixed = rt.fixed_shapes and prefills and not echo
        inputs = lay_out(decoding, prefills, bucket, rt.kv.scratch, rt.tokenizer.pad_token_id,
                         token_bucket(prompt, rt.max_step_tokens) if fixed else None)
        plan = BatchPlan(inputs.rows, rt.device, tokens=inputs.tokens, kept=inputs.kept)
        reason = self._eager_reason(plan, echo)
        how = "graphed" if reason is None else "eager"
        self.steps[how if reason is None else f"eager:{reason}"] += 1
        self.tokens[f"decode:{how}"] += len(decoding)
        self.tokens[f"prompt:{how}"] += prompt
        if reason is not None:
            return StepOutput(self._eager(inputs, plan), inputs.sample_at, inputs.chunk_at)
        graph = rt.graphs.run(inputs, plan)
        return StepOutput(graph.logits, inputs.sample_at, inputs.chunk_at, graph)

    def continue_(self, last: StepOutput, tokens: torch.Tensor) -> StepOutput:
        """The decode step after `last` (a replayed one) for the same rows, each feeding the token sampled from
        it: launched from `tokens` on the device, nothing read by the host."""
        self.steps["graphed"] += 1
        self.tokens["decode:graphed"] += len(last.sample_at)
        self.rt.graphs.continue_(last.graph, tokens)
        return StepOutput(last.graph.logits, last.sample_at, last.chunk_at, last.graph)

    def _eager_reason(self, plan: BatchPlan, echo: bool) -> str | None:
        """Why this step cannot replay a graph (None: it can)."""
        rt = self.rt
        if rt.graphs is None:
            return rt.device.type if rt.device.type == "cpu" else "graphs off"
        if echo:
            return "echo"
        other = [f.partition(":")[0] for f in plan.families if not rt.families[f].graphable]
        return other[0] if other else None

    def _eager(self, inputs: StepInputs, plan: BatchPlan) -> torch.Tensor:
        rt = self.rt
        ids, positions, kept, layout = inputs.layout(inputs.packed().to(rt.device, non_blocking=True))
        layout.invariant = BatchInvariant() if rt.batch_invariant else None
        with layout.invariant or nullcontext():
            out = rt.call(plan, input_ids=ids, position_ids=positions, past_key_values=rt.kv.stepping(layout),
                          use_cache=True, kv_layout=layout, logits_to_keep=0 if kept is None else kept)
        return out.logits[0].float()
