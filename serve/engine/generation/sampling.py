"""Sampling a step's tokens on the device, each row under its own controls, in one pass over the rows that have any
(vLLM's sampling metadata): the controls are per-row tensors of the step, so rows of every kind and every mix of
controls share one step and its graph, and rows with none (greedy, no penalty, no bias, no grammar) pay one argmax.

In order, on a row's fp32 logits: its grammar's token bitmask (structured outputs, serve/engine/generation/grammars.py),
its logit_bias, min_tokens (its end tokens left out), then the penalties (repetition over the prompt and the output,
frequency and presence over the output); a greedy row takes the argmax of that; a sampled row divides by its
temperature, keeps the tokens min_p, top_k and top_p leave, and draws by inverse CDF with one uniform from its own
generator (a seeded row repeats). Every host value goes to the device without waiting for it (decode_batch.py reads a
step while the next may run)."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from serve.engine.generation.grammars import apply_bitmask, bitmask_for
from serve.engine.types import SamplingParams


@dataclass(eq=False)
class RowSampling:
    """What sampling reads of one row of a step's logits (the batch's row, serve/engine/generation/decode_batch.py)."""

    params: SamplingParams
    rng: torch.Generator | None
    prompt: Sequence[int]
    output: Sequence[int]
    """Its tokens so far (an end token it ignores included): penalties and min_tokens read them."""
    end_ids: frozenset[int]
    """Tokens that would end it: left out while fewer than min_tokens are out."""
    grammar: Any = None
    """Its grammar's matcher (serve/engine/generation/grammars.py RowGrammar) where it has a constraint."""

    @property
    def penalized(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0

    @property
    def held_open(self) -> bool:
        """Its end tokens are left out at this step."""
        return len(self.output) < self.params.min_tokens and bool(self.end_ids)

    @property
    def controlled(self) -> bool:
        """Anything but the argmax of its logits: sampled, or a control changes them."""
        return self.params.temperature > 0 or bool(self.params.logit_bias) or self.reads_its_tokens

    @property
    def reads_its_tokens(self) -> bool:
        """Its controls change with every token it takes (penalties, min_tokens, a grammar): the host must have read
        the last one before the next step samples (no step launched ahead: decode_batch.py)."""
        return self.penalized or self.held_open or self.grammar is not None


@dataclass
class Penalties:
    rows: torch.Tensor
    """[p] the metadata's rows that have a penalty."""
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    """[p] each."""
    seen: torch.Tensor
    """[p, vocab] bool: in the prompt or the output (repetition)."""
    counts: torch.Tensor
    """[p, vocab] fp32: times in the output (frequency, presence)."""


@dataclass
class SamplingMetadata:
    """A step's controls for its controlled rows, as device tensors (k rows)."""

    rows: torch.Tensor
    """[k] their rows of the step's logits."""
    greedy: torch.Tensor
    """[k] bool."""
    temperature: torch.Tensor
    """[k] (1 for greedy rows)."""
    top_k: torch.Tensor
    """[k] int64 (vocab for none)."""
    top_p: torch.Tensor
    min_p: torch.Tensor
    uniform: torch.Tensor
    """[k] each: the draw of each sampled row, from its own generator."""
    sampled: bool
    """Some row is not greedy."""
    truncated: bool
    """Some sampled row has top_k, top_p or min_p."""
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(row [b], token [b], value [b]): logit_bias."""
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    """(row [e], token [e]): end tokens under min_tokens."""
    penalties: Penalties | None = None
    bitmask: tuple[list[int], torch.Tensor] | None = None
    """(the constrained rows, bitmask [k, ceil(vocab / 32)] int32): each row's allowed tokens (every token for a row
    without a grammar)."""


def sampling_metadata(rows: Sequence[RowSampling | None], vocab: int, device: torch.device
                      ) -> SamplingMetadata | None:
    """rows: one per row of the step's logits (None: a row nobody reads) -> the controlled rows' metadata, None when
    every row takes its argmax. Grammars fill their rows of the bitmask here, on the host."""
    chosen = [(i, r) for i, r in enumerate(rows) if r is not None and r.controlled]
    if not chosen:
        return None
    params = [r.params for _, r in chosen]
    greedy = [p.temperature <= 0 for p in params]
    uniform = [torch.rand((), generator=r.rng).item() if not g else 0.0 for (_, r), g in zip(chosen, greedy)]
    floats = torch.tensor([[1.0 if g else p.temperature for p, g in zip(params, greedy)],
                           [p.top_p for p in params], [p.min_p for p in params], uniform], dtype=torch.float32)
    ints = torch.tensor([[i for i, _ in chosen], [p.top_k if p.top_k > 0 else vocab for p in params], greedy],
                        dtype=torch.long)
    floats, ints = _to(floats, device), _to(ints, device)
    return SamplingMetadata(
        rows=ints[0], greedy=ints[2].bool(), temperature=floats[0], top_k=ints[1], top_p=floats[1], min_p=floats[2],
        uniform=floats[3], sampled=not all(greedy),
        truncated=any(not g and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0) for p, g in zip(params, greedy)),
        bias=_bias(chosen, device), banned=_banned(chosen, device), penalties=_penalties(chosen, vocab, device),
        bitmask=_bitmask(chosen, vocab, device))


def sample(logits: torch.Tensor, meta: SamplingMetadata | None) -> torch.Tensor:
    """[rows, vocab] fp32 logits -> [rows] tokens, on the logits' device: the argmax, and for the metadata's rows
    the token their controls choose."""
    tokens = logits.argmax(-1)  # [rows]
    if meta is None:
        return tokens
    x = controlled_logits(logits.index_select(0, meta.rows), meta)  # [k, vocab]
    chosen = x.argmax(-1)
    if meta.sampled:
        chosen = torch.where(meta.greedy, chosen, draw(probabilities(x, meta), meta.uniform))
    return tokens.index_copy_(0, meta.rows, chosen)


def sample_to_host(logits: torch.Tensor, rows: Sequence[RowSampling | None]) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Every row of logits sampled on the device, row i under rows[i]'s controls (None: its argmax, a row nobody
    reads: a decode step's sampling has its bucket's shapes), and their copy to the host started -> (tokens, their
    host copy, the CUDA event it is complete at; None on a CPU, where the tokens are their own copy). A constrained
    row's bitmask is filled here, on the host, while the step runs on a GPU."""
    tokens = sample(logits, sampling_metadata(rows, logits.shape[1], logits.device))
    if not tokens.is_cuda:
        return tokens, tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return tokens, host, ready


def controlled_logits(x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """x [k, vocab]: the metadata's rows of logits, changed in place by the grammar's bitmask, logit_bias, min_tokens
    and the penalties."""
    if meta.bitmask is not None:
        apply_bitmask(x, *meta.bitmask)
    if meta.bias is not None:
        rows, tokens, values = meta.bias
        x.index_put_((rows, tokens), values, accumulate=True)
    if meta.banned is not None:
        x.index_put_(meta.banned, torch.tensor(float("-inf"), device=x.device))
    pen = meta.penalties
    if pen is not None:
        y = x.index_select(0, pen.rows)  # [p, vocab]
        rep = pen.repetition[:, None]
        y = torch.where(pen.seen, torch.where(y > 0, y / rep, y * rep), y)
        y = y - pen.frequency[:, None] * pen.counts - pen.presence[:, None] * (pen.counts > 0)
        x.index_copy_(0, pen.rows, y)
    return x


def probabilities(x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """x [k, vocab] controlled logits -> the probabilities each row draws from (unnormalised where tokens are left
    out): after temperature, the tokens that min_p, top_k and top_p leave, in vocabulary order."""
    probs = (x / meta.temperature[:, None]).softmax(-1)  # [k, vocab]
    if not meta.truncated:
        return probs
    sorted_p, order = probs.sort(-1, descending=True)
    rank = torch.arange(probs.shape[1], device=probs.device)
    keep = ((sorted_p.cumsum(-1) - sorted_p < meta.top_p[:, None]) & (rank < meta.top_k[:, None])
            & (sorted_p >= meta.min_p[:, None] * sorted_p[:, :1]))  # the most likely always stays
    return probs * torch.zeros_like(keep).scatter_(1, order, keep)


def draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[k, vocab] probabilities and [k] uniforms in [0, 1) -> [k] tokens, by inverse CDF."""
    cdf = probs.cumsum(-1)
    pick = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)
    return pick.clamp(max=probs.shape[1] - 1).squeeze(1)


def _bias(chosen: list[tuple[int, RowSampling]], device: torch.device):
    entries = [(k, t, v) for k, (_, r) in enumerate(chosen) for t, v in r.params.logit_bias]
    if not entries:
        return None
    rows, tokens, values = zip(*entries)
    return (_to(torch.tensor(rows), device), _to(torch.tensor(tokens), device),
            _to(torch.tensor(values, dtype=torch.float32), device))


def _banned(chosen: list[tuple[int, RowSampling]], device: torch.device):
    entries = [(k, t) for k, (_, r) in enumerate(chosen) if r.held_open for t in sorted(r.end_ids)]
    if not entries:
        return None
    both = _to(torch.tensor(entries).T.contiguous(), device)
    return both[0], both[1]


def _penalties(chosen: list[tuple[int, RowSampling]], vocab: int, device: torch.device) -> Penalties | None:
    """Each penalised row's prompt and output tokens, as flat ids copied once and scattered on the device."""
    rows = [(k, r) for k, (_, r) in enumerate(chosen) if r.penalized]
    if not rows:
        return None
    seen_at = [(j, t) for j, (_, r) in enumerate(rows) for t in (*r.prompt, *r.output)]
    out_at = [(j, t) for j, (_, r) in enumerate(rows) for t in r.output]
    ids = _to(torch.tensor(seen_at + out_at, dtype=torch.long).reshape(-1, 2), device)  # [n, 2]
    flat = ids[:, 0] * vocab + ids[:, 1]
    p = len(rows)
    seen = torch.zeros(p * vocab, dtype=torch.bool, device=device)
    seen[flat[:len(seen_at)]] = True
    counts = torch.zeros(p * vocab, dtype=torch.float32, device=device)
    counts.index_add_(0, flat[len(seen_at):], torch.ones(len(out_at), device=device))
    pars = _to(torch.tensor([[r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty]
                             for _, r in rows], dtype=torch.float32).T.contiguous(), device)
    return Penalties(_to(torch.tensor([k for k, _ in rows]), device), pars[0], pars[1], pars[2],
                     seen.view(p, vocab), counts.view(p, vocab))


def _bitmask(chosen: list[tuple[int, RowSampling]], vocab: int, device: torch.device):
    rows = [k for k, (_, r) in enumerate(chosen) if r.grammar is not None]
    if not rows:
        return None
    bitmask = bitmask_for(len(chosen), vocab)  # [k, words] on the host, every token allowed
    for k in rows:
        chosen[k][1].grammar.fill(bitmask, k)
    return rows, _to(bitmask, device)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device (a pinned copy), so that sampling a step queued
    behind another does not stall the host."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
