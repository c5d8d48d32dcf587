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


def make_segments(slot_ids: torch.Tensor) -> Segments:
    """Group tokens by slot; the grouping runs on the host because grids and padding need its sizes there.

    Example: slot_ids [2, -1, 0, 2, -1, 1, 0] -> order [2, 6, 5, 0, 3], slots [0, 1, 2],
    starts [0, 2, 3], lengths [2, 1, 2], max_length 2, num_tokens 7.
    One device-to-host copy (the only sync) and one host-to-device copy when slot_ids live on a GPU.
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
    packed = torch.cat([order, starts, lengths, slots]).to(slot_ids.device)  # [n + 3S], one copy over
    order, starts, lengths, slots = packed.split([n, s, s, s])
    return Segments(order, starts, lengths, slots, max_length, host.numel())


def padded_index(seg: Segments) -> tuple[torch.Tensor, torch.Tensor]:
    """Token index of each (segment, row) padded to max_length, and which entries are real tokens.

    Padding entries repeat the last token of `order`, so a gather through them stays in bounds;
    whatever they produce is dropped through `valid`. Used by the torch twins' padded bmm.
    """
    rows = torch.arange(seg.max_length, device=seg.order.device)  # [L]
    valid = rows < seg.lengths[:, None]  # [S, L]
    pos = (seg.starts[:, None] + rows).clamp_max_(seg.order.numel() - 1)  # [S, L]
    return seg.order[pos], valid  # [S, L], [S, L]
