"""Continuous batching for a causal LM: one running batch per base, whose rows may each be of another variant.

Each row holds a lane of the base's KV cache (serve/engine/kv/store.py) from admission to its last token, and the
blocks its positions fill: its prompt's at admission (a row waits while the cache has too few free), one more
each time its length crosses a block. Where a running row needs a block and none is free, running rows are parked
(their keys and values kept in host memory, their blocks given back) in the order the scheduler gives (the fairness
policy's: the tenant served most, its latest row), the row itself last; a parked row resumes where it stopped once
blocks are free. Every step is one forward over one flattened sequence of tokens (serve/engine/step/layout.py):
- a decode token for every running row, row b at lane b (rows without one are padding: a row still
  prefilling, a lane free), the rows rounded up to a bucket where shapes are fixed;
- then the admitted prompts' next tokens, in the fairness policy's order, up to the step's token budget
  (batch.max_step_tokens); a long prompt takes several steps, and a row whose prompt is all written samples
  its first token in the same step.
Nothing is copied between rows: a finished row gives its blocks back and the next admitted row writes over them.
On CUDA a decode step that replays a graph is followed at once by the next, launched from its sampled tokens on
the device before the host reads them, so the host's reading and detokenising overlap the GPU (see `run`).
Each row keeps its variant's slot (serve/engine/families/slots.py) too, and the step's BatchPlan maps every token to its
row's variant. Sampling runs on the device over every row that samples this step (greedy rows give the tokens
they give alone, seeded rows draw from their own generator) and the sampled tokens come back in one copy; each
row's text and where it stops are detokenize.py's. Log probabilities (when a row asks) are a log-softmax over
the whole vocabulary in fp32 of the same logits the row samples from; a row that echoes its prompt keeps the
logits of every prompt position, chunk by chunk.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from serve.engine import faults
from serve.engine.generation.detokenize import Detokenizer
from serve.engine.generation.row import BatchRow, NewRow, prefix_of, register
from serve.engine.generation.sampling import RowSampling, sample_to_host
from serve.engine.model import BaseModelRuntime
from serve.engine.scheduling.rows import Step
from serve.engine.step.batch import RowSlot
from serve.engine.step.layout import Prefill, Share, StepOutput, StepRunner, prompt_chunks, prompt_waits
from serve.engine.types import Generation


@dataclass(eq=False)
class _Launched:
    """A step on its way: its forward and sampling are queued on the device; `_read` applies its tokens."""

    out: StepOutput
    decode: dict[int, BatchRow]
    """KV lane -> the row whose decode token it ran."""
    prefills: list[Prefill]
    sampling: list[tuple[BatchRow, int]]
    """(row, its row of logits) for the rows that sample from this step."""
    tokens: torch.Tensor
    """[kept] sampled, on the device."""
    host: torch.Tensor
    """Their copy on the host, complete once `ready` has passed."""
    ready: Any


class DecodeBatch:
    """The running rows of one base: run() happens on the engine's compute thread."""

    def __init__(self, rt: BaseModelRuntime):
        if rt.kv is None:
            raise ValueError(f"base '{rt.name}' is not a causal language model: it has no KV store")
        self.rt = rt
        self.runner = StepRunner(rt)
        self.text = Detokenizer(rt)
        self.decoding: dict[int, BatchRow] = {}
        """KV lane -> its row, for rows whose prompt is written."""
        self.prefilling: list[BatchRow] = []
        """Admitted rows whose prompt is still being written, in admission order."""
        self.inflight: _Launched | None = None
        """The step launched last and not read yet (see run)."""
        self.parked: list[tuple[BatchRow, list]] = []
        """Rows taken out of the batch for now (run's park), each with its keys and values."""
        self._failed: list[tuple[Any, BaseException]] = []
        self._admitted = 0

    def __len__(self) -> int:
        return len(self.decoding) + len(self.prefilling)

    def rows(self) -> list[tuple[Any, Generation]]:
        """(tag, Generation so far) of every row that has begun generating."""
        return [(s.tag, s.gen) for s in self.decoding.values()]

    @torch.no_grad()
    def run(self, new: Sequence[NewRow], abort: Sequence[Any] = (), park: Sequence[Any] = (),
            victims: Sequence[Any] = (), rank: Callable[[Any], Any] | None = None,
            share: Share | None = None) -> Step:
        """Drop the rows tagged in abort, park the rows tagged in park, admit new rows that get a variant
        slot, a KV lane and their prompt's blocks, give every decoding row the block its next position needs
        (parking rows, those tagged in victims first, where the cache has too few), then one step for every row;
        -> the tags of the rows that finished (with their Generation), were parked, were left waiting for a free
        slot or blocks (new rows), and failed alone. If the step raises, the batch is to be closed.

        A parked row (preempted: the scheduler gives its slots to another tenant's row, or the cache ran short)
        keeps its keys and values in host memory (KVStore.save) and all its state, and gives back its slots and
        blocks; passed again in `new` (its tag, its variant) it resumes in whatever lane and blocks are free, as if
        it had never left: nothing is computed twice (vLLM's swap, not its recompute). A row still writing its
        prompt is parked with what it has written, and resumes writing the rest.

        A decode step that replays a graph is followed at once by the next one, launched on the device from its
        sampled tokens before the host reads them (`_continue`): while the host detokenises a step, the GPU runs
        the next. So a call reads one step and leaves one in flight; the next call reads that one. A row that
        finished in the step read wasted its place in the one in flight, nothing more.

        rank(tag): the fairness policy's order of the rows (smaller first; None: admission order). The prompts being
        written share a step's token budget in that order, and a new row is admitted while the prompts ranked
        before it leave room, so a light tenant's prompt is not written after a flood's long ones. share(tag): the
        group and the most prompt tokens a step writes of that group's rows (Fairness.prompt_share)."""
        rank = rank or (lambda tag: 0)
        if abort:
            for s in self._all():
                s.done = s.done or any(s.tag is t for t in abort)
            self.parked = [p for p in self.parked if not any(p[0].tag is t for t in abort)]
        step = Step()
        if park:
            if self.inflight is not None:  # settled first: the step in flight writes the blocks being given up
                inflight, self.inflight = self.inflight, None
                self._read(inflight)
            step.finished += self._drop_finished()
            step.parked = self._park(park)
        self._admit(new, step, rank, share)
        if self.inflight is not None:
            inflight, self.inflight = self.inflight, None
            if self._continuable(inflight):
                self.inflight = self._continue(inflight)
            self._read(inflight)
        if self.inflight is None:
            finished = self._drop_finished()
            room = self._make_room(victims)
            step.parked += room
            step.full = step.full or bool(room)
            if self.decoding or self.prefilling:
                launched = self._launch(rank, share)
                if self._continuable(launched):
                    self.inflight = self._continue(launched)
                self._read(launched)
            step.finished += finished
        step.finished += self._drop_finished()
        step.failed += self._failed
        self._failed = []
        return step

    def close(self) -> None:
        """Give back every row's slots, running or being admitted (the batch failed, or has ended); each is
        given back even if another's raises, and the first error is raised after. A step still in flight only
        writes slots given back here, before any later step can write them."""
        errors = []
        self.inflight, self.parked = None, []
        for s in self._all():
            try:
                self._release(s)
                faults.hit("close", [s.name])
            except Exception as e:
                errors.append(e)
        self.decoding, self.prefilling = {}, []
        if errors:
            raise errors[0]

    def prompt_waits(self, tag: Any, rank: Callable[[Any], Any], share: Share | None) -> bool:
        """A new row tagged `tag` would wait at the next step for the prompts being written (_admit's test; a parked
        row resumes at once): the scheduler passes it over when it gives out the free slots."""
        if any(p[0].tag is tag for p in self.parked):
            return False
        return prompt_waits(self.prefilling, tag, self.rt.max_step_tokens - len(self.decoding), rank, share)

    def _admit(self, new: Sequence[NewRow], step: Step, rank: Callable[[Any], Any], share: Share | None) -> None:
        """Each new row that gets a KV lane, the blocks of its prompt and first token (a parked row: what it
        needs, BatchRow.needs) and a variant slot starts its prompt, or resumes where it was parked; the others
        are step's waiting (no free lane, blocks or slot) or failed (its attach, alone). Rows come in the fairness
        policy's order, and once one finds too few blocks the rows after it wait too (as vLLM's scheduler stops at
        the first), so a long prompt is not passed over for ever by shorter ones. A new row is admitted only while
        the prompts ranked before it leave room in the next step's token budget (what vLLM's scheduler admits): one
        that could not start its prompt would hold its blocks unwritten, and would wait out of the fairness policy's
        reach; so would one whose group's prompts being written already fill its allowance (share). A row left
        waiting for the budget holds back no row after it: those are ranked by the same policy and checked against
        the prompts ranked before them (a flood's long prompt waiting behind its own does not keep a light tenant's
        short one, ranked first, out of the step).

        With prefix caching a new row starts with the cached blocks of its prompt's longest cached prefix (never
        its last token, whose logits it samples from; none for a row echoing its prompt's log probabilities) and
        writes from there. A row whose next uncached block is being written by a row still writing its prompt (a
        request's other choices; the same system prompt sent twice at once) waits a step for it, so that a prompt
        shared by rows arriving together is written once."""
        kv = self.rt.kv
        short = False
        writing = {h for s in self.prefilling for h in s.hashes[s.registered:]}
        budget = self.rt.max_step_tokens - len(self.decoding)
        for row in new:
            if short:  # a row before it is short: it waits, its prompt not even hashed
                step.waiting.append(row.tag)
                continue
            parked = next((p for p in self.parked if p[0].tag is row.tag), None)
            length = parked[0].needs() if parked is not None else len(row.prompt) + 1
            seed, owner, hashes, cached = prefix_of(self.rt.kv, row) if parked is None else (b"", b"", [], [])
            queued = parked is None and prompt_waits(self.prefilling, row.tag, budget, rank, share)
            full = not kv.free_lanes or not kv.fits(length, cached)
            step.full = step.full or full
            step.budget = step.budget or queued
            short = full
            if full or queued or (len(cached) < len(hashes) and hashes[len(cached)] in writing):
                step.waiting.append(row.tag)
                continue
            try:
                slot = self.rt.attach(row.variant)
            except Exception as e:  # this row alone
                step.failed.append((row.tag, e))
                continue
            if slot is None:
                step.waiting.append(row.tag)
                step.full = True
                continue
            lane = kv.take()
            kv.share(lane, cached)
            kv.grow(lane, length)
            self._admitted += 1
            if parked is not None:
                parked[0].order = self._admitted
                self._resume(*parked, slot, lane)
                continue
            self._start(row, slot, lane, seed, owner, hashes, cached)
            writing.update(hashes[len(cached):])

    def _make_room(self, victims: Sequence[Any]) -> list[Any]:
        """Every decoding row's block for the position it writes next; where the cache has none free, decoding rows
        are parked until it has: the first of `victims` still decoding, else the latest admitted, the row itself
        last of all. -> the tags parked."""
        parked = []
        for lane, s in sorted(self.decoding.items()):
            while not s.done and self.decoding.get(lane) is s and not self.rt.kv.grow(lane, s.written + 1):
                parked += self._park([self._victim(victims, s)])
        return parked

    def _victim(self, victims: Sequence[Any], needing: BatchRow) -> Any:
        """The tag of the decoding row to park for `needing`'s block."""
        running = [s for s in self.decoding.values() if not s.done]
        chosen = next((s for tag in victims for s in running if s.tag is tag), None)
        if chosen is None:
            chosen = max(running, key=lambda s: (s is not needing, s.order))
        return chosen.tag

    def _park(self, tags: Sequence[Any]) -> list[Any]:
        """The rows tagged out of the batch, the keys and values they wrote kept; -> the tags parked."""
        out = []
        for s in [s for s in self._all() if not s.done and any(s.tag is t for t in tags)]:
            self.parked.append((s, self.rt.kv.save(s.kv, s.written)))
            if s in self.prefilling:
                self.prefilling.remove(s)
            else:
                del self.decoding[s.kv]
            self._release(s)
            out.append(s.tag)
        return out

    def _start(self, row: NewRow, slot: RowSlot, lane: int, seed: bytes, owner: bytes, hashes: list[bytes],
               cached: list[int]) -> None:
        """A new row in the batch, writing its prompt from the end of its cached prefix (the blocks `cached`,
        already shared into its lane)."""
        kv = self.rt.kv
        name = row.variant.entry if row.variant is not None else self.rt.name
        s = BatchRow.start(row, slot, lane, name, self.rt.eos_ids, self._admitted)
        s.seed, s.owner, s.hashes, s.registered = seed, owner, hashes, len(cached)
        s.written = s.gen.cached_tokens = len(cached) * kv.block_tokens
        if kv.prefix_caching:
            self.rt.prefix_tokens["queries"] += len(row.prompt)
            self.rt.prefix_tokens["hits"] += s.written
        self.prefilling.append(s)

    def _resume(self, s: BatchRow, saved: list, slot: RowSlot, kv: int) -> None:
        """A parked row back in the batch, its keys and values written into its new lane's blocks."""
        self.rt.kv.restore(kv, saved)
        s.slot, s.kv = slot, kv
        if s.next_token is None:
            self.prefilling.append(s)
        else:
            self.decoding[kv] = s
        self.parked = [p for p in self.parked if p[0] is not s]

    def _all(self) -> list[BatchRow]:
        return list(self.decoding.values()) + self.prefilling

    def _release(self, s: BatchRow) -> None:
        kv, s.kv = s.kv, None
        if kv is not None:
            self.rt.kv.give(kv)
        slot, s.slot = s.slot, None
        if slot is not None:
            self.rt.detach(slot)

    def _launch(self, rank: Callable[[Any], Any], share: Share | None) -> "_Launched":
        """One forward: every decoding row's next token and the prefills the token budget allows; its tokens
        sampled on the device and on their way to the host."""
        decoding = dict(sorted(self.decoding.items()))
        if decoding:
            faults.hit("decode", [s.name for s in decoding.values()])
        prefills = prompt_chunks(self.prefilling, self.rt.max_step_tokens - len(decoding), self.rt.max_step_chunks,
                                 rank, share)
        if prefills:
            faults.hit("prefill", [p.row.name for p in prefills])
        for p in prefills:
            if (p.row.params.echo or p.row.params.logprobs is not None) and p.first == 0:
                p.row.gen.prompt_text = self.rt.tokenizer.decode(p.row.prompt)
        out = self.runner.run(decoding, prefills)
        for s in decoding.values():
            s.written += 1
        for p in prefills:
            p.row.written += p.length
        self._observe()
        sampling = [(s, out.sample_at[kv]) for kv, s in decoding.items()]
        sampling += [(p.row, out.sample_at[p.lane]) for p in prefills if p.samples]
        return _Launched(out, decoding, prefills, sampling, *self._sample(out.logits, sampling))

    def _observe(self) -> None:
        """The KV cache's use at this step (KVStore.usage)."""
        rows = self._all()
        self.rt.kv.usage.observe(len(rows), sum(s.written for s in rows),
                                 sum(self.rt.kv.held(s.kv) for s in rows if s.kv is not None))

    def _continuable(self, launched: "_Launched") -> bool:
        """Whether the next step can be launched from this one's tokens on the device: a replayed decode step
        whose rows are still exactly the running rows, whose graph still reads where their variants' tensors are
        (an attach for a row left waiting can move a stack), with no prompt waiting to be written, no row reading
        its logits afterwards (the next replay overwrites them) and no row whose controls change with the token it
        takes (a grammar's mask, penalties, min_tokens: the host must read it first)."""
        return (launched.out.graph is not None and not launched.prefills and not self.prefilling
                and launched.decode == self.decoding and self.rt.graphs.current(launched.out.graph)
                and not any(s.done or s.params.logprobs is not None or s.written >= self.rt.kv.held(s.kv)
                            or s.sampling().reads_its_tokens for s in launched.decode.values()))

    def _continue(self, launched: "_Launched") -> "_Launched":
        faults.hit("decode", [s.name for s in launched.decode.values()])
        out = self.runner.continue_(launched.out, launched.tokens)
        for s in launched.decode.values():
            s.written += 1
        self._observe()
        return _Launched(out, launched.decode, [], launched.sampling, *self._sample(out.logits, launched.sampling))

    def _sample(self, logits: torch.Tensor, sampling: list[tuple[BatchRow, int]]
                ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The step's tokens, each row of logits under its row's controls (sampling.py: sample_to_host)."""
        rows: list[RowSampling | None] = [None] * logits.shape[0]
        for s, i in sampling:
            rows[i] = s.sampling()
        return sample_to_host(logits, rows)

    def _read(self, launched: "_Launched") -> None:
        """The step's sampled tokens, on the host (the step's one wait), applied to the rows still running."""
        if launched.ready is not None:
            launched.ready.synchronize()
        every = launched.host.tolist()
        out = launched.out
        for p in launched.prefills:
            s = p.row
            if s.done or s.kv is None:
                continue
            if s.params.echoes_logprobs:
                s.echo_logits.append(out.chunk_logits(p))
            if p.samples:
                self.prefilling.remove(s)
                self.decoding[s.kv] = s
                if s.params.echoes_logprobs:
                    s.gen.prompt_logprobs = self.text.prompt_logprobs(s.prompt, torch.cat(s.echo_logits),
                                                                      s.params.logprobs)
                    s.echo_logits = []
        live = [(s, i) for s, i in launched.sampling if not s.done and s.kv is not None]
        if live:
            self._choose([s for s, _ in live], out.logits, [i for _, i in live], every)
        for s in self._all():
            register(self.rt.kv, s)

    def _choose(self, seqs: list[BatchRow], logits: torch.Tensor, at: list[int], every: list[int]) -> None:
        """logits [kept, vocab] fp32 of the step and every: the token sampled from each row of them; at: the row
        each of seqs took its token from."""
        chosen = [every[i] for i in at]
        # Rows that asked for log probabilities get an entry for every token taken, an end-of-text token too
        # (which the text and token_ids leave out, and completion_tokens counts); a max_tokens 0 row takes none.
        asking = [i for i, s in enumerate(seqs)
                  if s.params.logprobs is not None and s.params.max_tokens > 0 and s.failed is None]
        contexts = {i: seqs[i].context() for i in asking}  # before this token
        for s, tok in zip(seqs, chosen):
            s.take(tok, self.text, self.rt.kv.positions)
        for k in sorted({seqs[i].params.logprobs for i in asking}):
            idx = [i for i in asking if seqs[i].params.logprobs == k]
            rows = torch.tensor([at[i] for i in idx], dtype=torch.long, device=logits.device)
            entries = self.text.logprobs(logits[rows], [chosen[i] for i in idx], k, [contexts[i] for i in idx])
            for i, lp in zip(idx, entries):
                seqs[i].gen.logprobs.append(lp)

    def _drop_finished(self) -> list[tuple[Any, Generation]]:
        """Rows that are done leave: their slots go back at once; -> those that finished well."""
        gone = [s for s in self._all() if s.done]
        if not gone:
            return []
        self.decoding = {k: s for k, s in self.decoding.items() if not s.done}
        self.prefilling = [s for s in self.prefilling if not s.done]
        self._failed += [(s.tag, s.failed) for s in gone if s.failed is not None]
        for s in gone:
            self._release(s)
        return [(s.tag, s.gen) for s in gone if s.failed is None]
