"""Sampling a step's tokens on the device: greedy rows by argmax, the others by temperature and top-p with a
uniform draw from each row's own generator (seeded rows repeat), every host value sent without waiting for the
device (serve/engine/generation.py reads a step while the next may run)."""

from collections.abc import Sequence

import torch

from serve.engine.types import SamplingParams


def sample(logits: torch.Tensor, params: Sequence[SamplingParams | None], rngs: Sequence[torch.Generator | None]
           ) -> torch.Tensor:
    """[rows, vocab] fp32 logits -> [rows] tokens, on the logits' device: argmax for greedy rows (and rows no
    request reads: params None); for the others temperature and top-p over the whole batch at once, then
    inverse-CDF with one uniform draw per row from its own generator."""
    tokens = logits.argmax(-1)  # [rows]
    sampled = [i for i, p in enumerate(params) if p is not None and p.temperature > 0]
    if not sampled:
        return tokens
    dev = logits.device
    idx = _to(torch.tensor(sampled, dtype=torch.long), dev)
    u = torch.stack([torch.rand((), generator=rngs[i]) for i in sampled])  # [k], each row's own draw
    temps, top_p, u = _to(torch.stack([torch.tensor([params[i].temperature for i in sampled]),
                                       torch.tensor([params[i].top_p for i in sampled]), u]), dev)  # [3, k]
    probs = (logits[idx] / temps[:, None]).softmax(-1)  # [k, vocab]
    sorted_p, order = probs.sort(-1, descending=True)
    sorted_p = sorted_p * (sorted_p.cumsum(-1) - sorted_p < top_p[:, None])  # the nucleus of each row
    cdf = sorted_p.cumsum(-1)  # [k, vocab]
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=cdf.shape[1] - 1)  # [k, 1]
    tokens[idx] = order.gather(1, pick).squeeze(1)
    return tokens


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device (a pinned copy), so that sampling a step queued
    behind another does not stall the host."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
