"""Continuous batching for a causal LM: one running batch per base, whose rows may each be of another variant.

The batch is every running row's KV cache, left-padded to one length. New rows are prefilled together and
merged in: both sides are padded on the left to the longer length and concatenated along the batch. A row
leaves as soon as it finishes, and columns that are padding in every remaining row are trimmed, so a long
prompt that has gone costs nothing. Positions count each row's own tokens, so padding never shifts them.
Each row keeps its variant's slot (serve/engine/slots.py) from admission to its last step, and every forward
carries a BatchPlan of those slots. Sampling is batched over the rows; greedy rows give the tokens they give
alone, seeded rows draw from their own generator. Text is decoded incrementally, a few tokens a step.
Log probabilities (when a row asks) are a log-softmax over the whole vocabulary in fp32 of the same logits
the row samples from; a prefill that echoes its prompt keeps the logits of every position.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from serve.engine import faults
from serve.engine.batch import BatchPlan, RowSlot
from serve.engine.model import BaseModelRuntime
from serve.engine.rows import Step
from serve.engine.types import Generation, SamplingParams, TokenLogprob
from serve.variants.base import LoadedVariant


@dataclass(frozen=True)
class NewRow:
    tag: Any
    """The caller's handle for the row, returned with its Generation."""
    prompt: list[int]
    params: SamplingParams
    """max_tokens is set (0 or more): the engine resolves a default before a row gets here."""
    variant: LoadedVariant | None = None


@dataclass
class _Seq:
    gen: Generation
    params: SamplingParams
    rng: torch.Generator | None
    tag: Any
    slot: RowSlot | None
    """None once detached: a slot is given back exactly once, whatever fails."""
    name: str
    """The cache entry it runs, or the base's name (what a fault or a log line names)."""
    done: bool = False
    failed: BaseException | None = None
    """It failed alone (detokenising): it leaves the batch with this error, the other rows go on."""
    tail: list[int] = field(default_factory=list)
    """The prompt's last CONTEXT tokens: the text is decoded after them, so it reads as a continuation."""
    prefix_offset: int = 0
    """Incremental decoding over tail + token_ids: text is known up to read_offset; tokens from prefix_offset
    are re-decoded for context, so a piece that only makes sense after its neighbours comes out right."""
    read_offset: int = 0

    @classmethod
    def start(cls, row: NewRow, slot: RowSlot, name: str) -> "_Seq":
        p = row.params
        gen = Generation(prompt_tokens=len(row.prompt), logprobs=[] if p.logprobs is not None else None)
        rng = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        tail = row.prompt[-CONTEXT:]
        return cls(gen, p, rng, row.tag, slot, name, tail=tail, read_offset=len(tail))


CONTEXT = 5
"""Tokens of context a piece of text is decoded after: a token's text depends on its neighbours (a
SentencePiece word's leading space, a character split over byte tokens)."""


def _pad_left(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    if x.shape[dim] == length:
        return x
    shape = list(x.shape)
    shape[dim] = length - x.shape[dim]
    return torch.cat([x.new_zeros(shape), x], dim)


class DecodeBatch:
    """The running rows of one base: run() happens on the engine's compute thread."""

    def __init__(self, rt: BaseModelRuntime):
        self.rt = rt
        self.seqs: list[_Seq] = []
        self._admitting: list[_Seq] = []
        """Rows being prefilled: attached, not yet in seqs (close() releases them too)."""
        self._failed: list[tuple[Any, BaseException]] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=rt.device)  # [rows, cached length]
        self.last = torch.zeros((0, 1), dtype=torch.long, device=rt.device)  # the token each row feeds next
        self.next_pos = torch.zeros((0, 1), dtype=torch.long, device=rt.device)

    def __len__(self) -> int:
        return len(self.seqs)

    def rows(self) -> list[tuple[Any, Generation]]:
        """(tag, Generation so far) of every running row."""
        return [(s.tag, s.gen) for s in self.seqs]

    @torch.no_grad()
    def run(self, new: Sequence[NewRow], abort: Sequence[Any] = ()) -> Step:
        """Drop the rows tagged in abort, admit new rows that get a slot, then one decode step for every row;
        -> the tags of the rows that finished (with their Generation), of new rows left waiting for a free
        slot, and of rows that failed alone. If the prefill or the step raises, the batch is to be closed."""
        if abort:
            for s in self.seqs:
                s.done = s.done or any(s.tag is t for t in abort)
            self._drop_finished()
        step, admitted = Step(), []
        for row in new:
            try:
                slot = self.rt.attach(row.variant)
            except Exception as e:  # this row alone
                step.failed.append((row.tag, e))
                continue
            if slot is None:
                step.waiting.append(row.tag)
            else:
                name = row.variant.entry if row.variant is not None else self.rt.name
                self._admitting.append(_Seq.start(row, slot, name))
                admitted.append(row)
        if admitted:
            step.finished += self._admit(admitted)
        if self.seqs:
            step.finished += self._step()
        step.failed += self._failed
        self._failed = []
        return step

    def close(self) -> None:
        """Give back every row's slot, running or being admitted (the batch failed, or has ended); each is
        given back even if another's raises, and the first error is raised after."""
        errors = []
        for s in self.seqs + self._admitting:
            try:
                self._release(s)
                faults.hit("close", [s.name])
            except Exception as e:
                errors.append(e)
        self.seqs, self._admitting, self.cache = [], [], None
        if errors:
            raise errors[0]

    def _release(self, s: _Seq) -> None:
        slot, s.slot = s.slot, None
        if slot is not None:
            self.rt.detach(slot)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache,
                 seqs: list[_Seq], every_position: bool = False) -> torch.Tensor:
        """-> [rows, vocab] fp32 logits of the last position, or [rows, seq, vocab] of every position."""
        plan = BatchPlan([s.slot for s in seqs], self.rt.device)
        out = self.rt.call(plan, input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                           use_cache=True, logits_to_keep=0 if every_position else 1)
        return out.logits.float() if every_position else out.logits[:, -1, :].float()

    def _admit(self, admitted: list[NewRow]) -> list[tuple[Any, Generation]]:
        """Prefill the rows of self._admitting (in the order of `admitted`) and merge them into the batch."""
        seqs = self._admitting
        faults.hit("prefill", [s.name for s in seqs])
        dev, n = self.rt.device, len(admitted)
        longest = max(len(r.prompt) for r in admitted)
        ids = torch.full((n, longest), self.rt.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, longest), dtype=torch.long)
        for i, r in enumerate(admitted):
            ids[i, longest - len(r.prompt):] = torch.tensor(r.prompt)
            mask[i, longest - len(r.prompt):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        cache = DynamicCache()
        echo = any(r.params.echo and r.params.logprobs is not None for r in admitted)
        logits = self._forward(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), cache, seqs, every_position=echo)
        if echo:
            for s, r, row_logits in zip(seqs, admitted, logits):
                if r.params.echo and r.params.logprobs is not None:
                    s.gen.prompt_logprobs = self._prompt_logprobs(r.prompt, row_logits[longest - len(r.prompt):],
                                                                  r.params.logprobs)
            logits = logits[:, -1, :]
        for s, r in zip(seqs, admitted):
            if r.params.echo or r.params.logprobs is not None:
                s.gen.prompt_text = self.rt.tokenizer.decode(r.prompt)
        last = self._choose(seqs, logits)
        next_pos = torch.tensor([[len(r.prompt)] for r in admitted], dtype=torch.long, device=dev)
        self._merge(seqs, cache, mask, last, next_pos)
        self._admitting = []
        return self._drop_finished()

    def _step(self) -> list[tuple[Any, Generation]]:
        faults.hit("decode", [s.name for s in self.seqs])
        ones = torch.ones((len(self.seqs), 1), dtype=torch.long, device=self.rt.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        logits = self._forward(self.last, self.mask, self.next_pos, self.cache, self.seqs)
        self.next_pos = self.next_pos + 1
        self.last = self._choose(self.seqs, logits)
        return self._drop_finished()

    def _choose(self, seqs: list[_Seq], logits: torch.Tensor) -> torch.Tensor:
        tokens = sample(logits, [s.params for s in seqs], [s.rng for s in seqs])  # [rows]
        chosen = tokens.tolist()
        # Rows that asked for log probabilities get an entry for every token taken, an end-of-text token too
        # (which the text and token_ids leave out, and completion_tokens counts); a max_tokens 0 row takes none.
        asking = [i for i, s in enumerate(seqs)
                  if s.params.logprobs is not None and s.params.max_tokens > 0 and s.failed is None]
        contexts = {i: (seqs[i].tail + seqs[i].gen.token_ids)[-CONTEXT:] for i in asking}  # before this token
        for s, tok in zip(seqs, chosen):
            try:
                s.done = self._advance(s, tok)
            except Exception as e:  # this row's text alone: it leaves with the error, the batch goes on
                s.failed, s.done = e, True
        for k in sorted({seqs[i].params.logprobs for i in asking}):
            idx = [i for i in asking if seqs[i].params.logprobs == k]
            entries = self._logprobs(logits[idx], [chosen[i] for i in idx], k, [contexts[i] for i in idx])
            for i, lp in zip(idx, entries):
                seqs[i].gen.logprobs.append(lp)
        return tokens.unsqueeze(-1)

    def _logprobs(self, logits: torch.Tensor, tokens: list[int], k: int, contexts: list[list[int]]
                  ) -> list[TokenLogprob]:
        """[n, vocab] fp32 logits and the token taken at each (after its context) -> its log probability and
        the top k there, each as its text after that context."""
        lp = torch.log_softmax(logits, -1)
        taken = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
        top_lp, top_ids = (x.tolist() for x in lp.topk(k, -1)) if k else ([[]] * len(tokens), [[]] * len(tokens))
        out = []
        for t, v, ids, ps, ctx in zip(tokens, taken, top_ids, top_lp, contexts):
            before = self.rt.tokenizer.decode(ctx)
            piece = self._pieces(ctx, before, [t, *ids])
            out.append(TokenLogprob(piece[0], v, list(zip(piece[1:], ps))))
        return out

    def _prompt_logprobs(self, prompt: list[int], logits: torch.Tensor, k: int) -> list[TokenLogprob]:
        """logits [len(prompt), vocab] of the prompt's positions: position j predicts token j + 1."""
        first = TokenLogprob(self.rt.tokenizer.decode(prompt[:1]), None, [])
        contexts = [prompt[max(0, j + 1 - CONTEXT):j + 1] for j in range(len(prompt) - 1)]
        return [first] + self._logprobs(logits[:-1], prompt[1:], k, contexts)

    def _pieces(self, context: list[int], before: str, tokens: list[int]) -> list[str]:
        """The text each token adds after `context` (which decodes to `before`)."""
        decode = self.rt.tokenizer.decode
        return [decode(context + [t])[len(before):] for t in tokens]

    def _advance(self, s: _Seq, tok: int) -> bool:
        """Append one token; -> whether the row is finished."""
        gen, params = s.gen, s.params
        if params.max_tokens == 0:  # the prompt alone was asked for (echo)
            return True
        if tok in self.rt.eos_ids:
            gen.finish_reason, gen.end_token = "stop", tok
            self._flush(s)
            return True
        gen.token_ids.append(tok)
        before = len(gen.text)
        faults.hit("detokenize", [s.name])
        self._decode_new(s)
        longest_stop = max((len(x) for x in params.stop), default=0)
        for x in params.stop:
            at = gen.text.find(x, max(0, before - longest_stop + 1))
            if at >= 0:
                gen.text = gen.text[:at]
                gen.finish_reason = "stop"
                return True
        if len(gen.token_ids) >= params.max_tokens:
            gen.finish_reason = "length"
            self._flush(s)
            return True
        return False

    def _decode_new(self, s: _Seq, final: bool = False) -> None:
        decode = self.rt.tokenizer.decode
        ids = s.tail + s.gen.token_ids
        known = decode(ids[s.prefix_offset:s.read_offset], skip_special_tokens=True)
        text = decode(ids[s.prefix_offset:], skip_special_tokens=True)
        if len(text) > len(known) and (final or not text.endswith("\ufffd")):  # half a character waits
            s.gen.text += text[len(known):]
            s.prefix_offset, s.read_offset = s.read_offset, len(ids)

    def _flush(self, s: _Seq) -> None:
        if s.read_offset < len(s.tail) + len(s.gen.token_ids):
            self._decode_new(s, final=True)

    def _merge(self, seqs: list[_Seq], cache: DynamicCache, mask: torch.Tensor, last: torch.Tensor,
               next_pos: torch.Tensor) -> None:
        if not self.seqs:
            self.seqs, self.cache, self.mask, self.last, self.next_pos = seqs, cache, mask, last, next_pos
            return
        length = max(self.mask.shape[1], mask.shape[1])
        kv = [(torch.cat([_pad_left(a.keys, length, 2), _pad_left(b.keys, length, 2)]),
               torch.cat([_pad_left(a.values, length, 2), _pad_left(b.values, length, 2)]))
              for a, b in zip(self.cache.layers, cache.layers)]
        self.cache = DynamicCache(kv)
        self.mask = torch.cat([_pad_left(self.mask, length, 1), _pad_left(mask, length, 1)])
        self.last = torch.cat([self.last, last])
        self.next_pos = torch.cat([self.next_pos, next_pos])
        self.seqs = self.seqs + seqs

    def _drop_finished(self) -> list[tuple[Any, Generation]]:
        if not any(s.done for s in self.seqs):
            return []
        finished = [(s.tag, s.gen) for s in self.seqs if s.done and s.failed is None]
        self._failed += [(s.tag, s.failed) for s in self.seqs if s.failed is not None]
        for s in self.seqs:
            if s.done:
                self._release(s)
        keep = [i for i, s in enumerate(self.seqs) if not s.done]
        self.seqs = [self.seqs[i] for i in keep]
        if not keep:
            self.cache = None
            self.mask = self.mask[:0, :0]
            self.last, self.next_pos = self.last[:0], self.next_pos[:0]
            return finished
        idx = torch.tensor(keep, dtype=torch.long, device=self.rt.device)
        self.cache.batch_select_indices(idx)
        self.mask, self.last, self.next_pos = self.mask[idx], self.last[idx], self.next_pos[idx]
        lead = int(self.mask.any(0).int().argmax())  # columns of padding in every remaining row
        if lead:
            self.mask = self.mask[:, lead:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
        return finished


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], rngs: Sequence[torch.Generator | None]
           ) -> torch.Tensor:
    """[rows, vocab] fp32 logits -> [rows] tokens: argmax for greedy rows; for the others temperature and
    top-p over the whole batch at once, then inverse-CDF with one uniform draw per row from its own generator."""
    tokens = logits.argmax(-1)  # [rows]
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    if not sampled:
        return tokens
    dev = logits.device
    idx = torch.tensor(sampled, dtype=torch.long, device=dev)
    temps = torch.tensor([params[i].temperature for i in sampled], device=dev)
    top_p = torch.tensor([params[i].top_p for i in sampled], device=dev)
    probs = (logits[idx] / temps[:, None]).softmax(-1)  # [k, vocab]
    sorted_p, order = probs.sort(-1, descending=True)
    sorted_p = sorted_p * (sorted_p.cumsum(-1) - sorted_p < top_p[:, None])  # the nucleus of each row
    cdf = sorted_p.cumsum(-1)  # [k, vocab]
    u = torch.stack([torch.rand((), generator=rngs[i]) for i in sampled]).to(dev)  # [k]
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=cdf.shape[1] - 1)  # [k, 1]
    tokens[idx] = order.gather(1, pick).squeeze(1)
    return tokens
