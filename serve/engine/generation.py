"""Continuous batching for a causal LM: one running batch per variant; rows join between decode steps.

The batch is every running row's KV cache, left-padded to one length. New rows are prefilled together and
merged in: both sides are padded on the left to the longer length and concatenated along the batch. A row
leaves as soon as it finishes, and columns that are padding in every remaining row are trimmed, so a long
prompt that has gone costs nothing. Positions count each row's own tokens, so padding never shifts them.
Greedy rows give the tokens they give alone; sampled rows draw from their own seeded generator.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from serve.engine.model import BaseModelRuntime, Generation, SamplingParams


@dataclass
class _Seq:
    gen: Generation
    params: SamplingParams
    rng: torch.Generator | None
    tag: Any
    """The caller's handle for the row, returned with its Generation."""
    done: bool = False


def _pad_left(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    if x.shape[dim] == length:
        return x
    shape = list(x.shape)
    shape[dim] = length - x.shape[dim]
    return torch.cat([x.new_zeros(shape), x], dim)


class DecodeBatch:
    """The running rows of one (base, variant): admit() and step() run on the engine's compute thread."""

    def __init__(self, rt: BaseModelRuntime, weights: dict[str, torch.Tensor] | None):
        self.rt = rt
        self.weights = weights
        self.seqs: list[_Seq] = []
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
    def run(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams], tags: Sequence[Any],
            abort: Sequence[Any] = ()) -> list[tuple[Any, Generation]]:
        """Drop the rows tagged in abort, admit new rows, then one decode step for every row; -> (tag,
        Generation) of the rows that finished."""
        if abort:
            for s in self.seqs:
                s.done = s.done or any(s.tag is t for t in abort)
            self._drop_finished()
        finished = self._admit(prompts, params, tags) if prompts else []
        if self.seqs:
            finished += self._step()
        return finished

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: DynamicCache) -> torch.Tensor:
        out = self.rt.call(self.weights, input_ids=ids, attention_mask=mask, position_ids=positions,
                           past_key_values=cache, use_cache=True)
        return out.logits[:, -1, :].float()  # [rows, vocab]

    def _admit(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams],
               tags: Sequence[Any]) -> list[tuple[Any, Generation]]:
        dev, n, longest = self.rt.device, len(prompts), max(len(p) for p in prompts)
        ids = torch.full((n, longest), self.rt.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, longest), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p):] = torch.tensor(p)
            mask[i, longest - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        cache = DynamicCache()
        logits = self._forward(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), cache)
        seqs = [_Seq(Generation(prompt_tokens=len(p)), q, torch.Generator().manual_seed(q.seed)
                     if q.seed is not None else None, tag) for p, q, tag in zip(prompts, params, tags)]
        last = self._choose(seqs, logits)
        next_pos = torch.tensor([[len(p)] for p in prompts], dtype=torch.long, device=dev)
        self._merge(seqs, cache, mask, last, next_pos)
        return self._drop_finished()

    def _step(self) -> list[tuple[Any, Generation]]:
        ones = torch.ones((len(self.seqs), 1), dtype=torch.long, device=self.rt.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        logits = self._forward(self.last, self.mask, self.next_pos, self.cache)
        self.next_pos = self.next_pos + 1
        self.last = self._choose(self.seqs, logits)
        return self._drop_finished()

    def _choose(self, seqs: list[_Seq], logits: torch.Tensor) -> torch.Tensor:
        tokens = []
        for s, row in zip(seqs, logits):
            tok = pick(row, s.params, s.rng)
            s.done = self.rt.advance(s.gen, tok, s.params)
            tokens.append(tok)
        return torch.tensor(tokens, dtype=torch.long, device=self.rt.device).unsqueeze(-1)

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
        finished = [(s.tag, s.gen) for s in self.seqs if s.done]
        if not finished:
            return finished
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


def pick(logits: torch.Tensor, params: SamplingParams, rng: torch.Generator | None) -> int:
    if params.temperature <= 0:
        return int(logits.argmax())
    probs = (logits / params.temperature).softmax(-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=rng))
