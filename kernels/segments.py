"""Tokens grouped by adapter slot (Punica's SGMV segments): built once per forward step from per-token
slot ids and read by every LoRA op in kernels/, so each op sees one contiguous run of tokens per slot.
"""

from typing import NamedTuple

import torch

NO_SLOT = -1


class Segments(NamedTuple):
    """Tokens grouped by slot, built once per forward step and shared by every wrapped module."""

    order: torch.Tensor  # [n] int64: token indices, stably sorted by slot; NO_SLOT tokens left out, n <= T
    starts: torch.Tensor  # [S] int64: where each segment begins in `order`
    lengths: torch.Tensor  # [S] int64: tokens in each segment
    slots: torch.Tensor  # [S] int64: the slot of each segment (>= 0), ascending
    max_length: int  # longest segment, a host int (sizes grids and padding); 0 when S == 0
    num_tokens: int  # T, a host int
    padded: torch.Tensor  # [S, L] int64: each segment's tokens padded to L = max_length with a repeat of a real one
    valid: torch.Tensor | None  # [S, L] bool: which entries of `padded` are real; None when none is padding
    slot_range: tuple[int, int] | None  # (first, last + 1) when the slots are consecutive: a view, not a gather


def make_segments(slot_ids: torch.Tensor, device: torch.device | None = None) -> Segments:
    """Group tokens by slot; the grouping runs on the host because grids and padding need its sizes there.

    Example: slot_ids [2, -1, 0, 2, -1, 1, 0] -> order [2, 6, 5, 0, 3], slots [0, 1, 2],
    starts [0, 2, 3], lengths [2, 1, 2], max_length 2, num_tokens 7, padded [[2, 6], [5, 5], [0, 3]],
    valid [[1, 1], [1, 0], [1, 1]], slot_range (0, 3).
    One device-to-host copy (the only sync) and one host-to-device copy when slot_ids live on a GPU; slot ids
    built on the host for a GPU's ops name their `device` instead (one host-to-device copy, no sync).
    """
    if slot_ids.dim() != 1:
        raise ValueError(f"slot_ids: expected shape [T]; got {list(slot_ids.shape)}")
    if slot_ids.dtype.is_floating_point or slot_ids.dtype.is_complex or slot_ids.dtype == torch.bool:
        raise ValueError(f"slot_ids: expected an integer dtype; got {slot_ids.dtype}")
    host = slot_ids.to("cpu", torch.int64)  # [T]
    if host.numel() and int(host.min()) < NO_SLOT:
        raise ValueError(f"slot_ids: expected values >= {NO_SLOT}; got {int(host.min())}")
    order = torch.argsort(host, stable=True)  # [T], NO_SLOT tokens first
    slots, lengths = torch.unique_consecutive(host[order], return_counts=True)  # [S'], [S']
    if slots.numel() and slots[0] == NO_SLOT:
        order, slots, lengths = order[lengths[0]:], slots[1:], lengths[1:]
    starts = torch.cumsum(lengths, 0) - lengths  # [S]
    max_length = int(lengths.max()) if lengths.numel() else 0
    n, s = order.numel(), slots.numel()
    rows = torch.arange(max_length)  # [L]
    padded = order[(starts[:, None] + rows).clamp_max_(max(n - 1, 0))] if n else order.new_zeros((s, 0))  # [S, L]
    dest = slot_ids.device if device is None else torch.device(device)
    valid = None if n == s * max_length else (rows < lengths[:, None]).to(dest)  # [S, L]
    span = (int(slots[0]), int(slots[-1]) + 1) if s and int(slots[-1] - slots[0]) + 1 == s else None
    packed = torch.cat([order, starts, lengths, slots, padded.reshape(-1)]).to(dest)  # one copy over
    order, starts, lengths, slots, flat = packed.split([n, s, s, s, padded.numel()])
    return Segments(order, starts, lengths, slots, max_length, host.numel(), flat.view(s, max_length), valid, span)


def slot_rows(stacked: torch.Tensor, seg: Segments) -> torch.Tensor:
    """The rows of a per-slot tensor for the segments' slots, in segment order: a view when they are
    consecutive, a gather otherwise."""
    if seg.slot_range is not None:
        return stacked[seg.slot_range[0]:seg.slot_range[1]]
    return stacked.index_select(0, seg.slots)
