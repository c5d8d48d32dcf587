"""NeuZip decode of a group of coded tensors in one launch: what a GPU server runs (serve/engine/neuzip/groups.py
cuts a model's coded weights into groups). A launch costs about as long as one lane's steps whatever the tensor's
size, so a budget-0 forward decoding every weight a launch would pay that once a weight; a group pays it once.

The lane steps are kernels/neuzip_decode.py's (`decode_lanes_block`); a group's tensors are found through a table
of their addresses and sizes built once (DecodeGroup), so the tensors must stay where they are for as long as the
group is used. Two forms, (group) -> status: neuzip_decode_group_torch (each tensor in turn, by the one-tensor
specification) and neuzip_decode_group_triton (all of them in one launch).
"""

import torch

from kernels._backend import tl, triton
from kernels.neuzip_decode import (BLOCK_LANES, check_stream, decode_lanes_block, log_fields_per_byte,
                                   neuzip_decode_torch)

Part = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""One coded tensor of a group: (words, offsets, table, sm, out), as the one-tensor forms take them."""
META = 9
"""int64 per program of a group: words, offsets, table, sm and out addresses, then words, lanes, elements and the
program's first lane."""


class DecodeGroup:
    """Coded tensors of one bit width decoded together, and the table of their addresses (built once)."""

    def __init__(self, parts: list[Part], bits: int):
        if not parts:
            raise ValueError("a decode group needs at least one coded tensor")
        self.device = parts[0][4].device
        for part in parts:
            check_stream(*part[:4], bits, part[4])
            if any(t.device != self.device or not t.is_contiguous() for t in part):
                raise ValueError(f"a decode group's tensors are contiguous and on {self.device}: its kernel reads "
                                 "them by address")
        self.parts, self.bits = parts, bits
        rows = []
        for words, offsets, table, sm, out in parts:
            lanes = offsets.numel() - 1
            rows += [[t.data_ptr() for t in (words, offsets, table, sm, out)] + [words.numel(), lanes, out.numel(),
                     first] for first in range(0, lanes, BLOCK_LANES)]
        self.meta = torch.tensor(rows, dtype=torch.int64).to(self.device)
        self.status = torch.zeros(len(rows) * BLOCK_LANES, dtype=torch.int32, device=self.device)
        """The Triton form's status: each program's block of lanes (a block's lanes past its tensor's stay 0)."""


@triton.jit
def _neuzip_decode_group_kernel(meta_ptr, status_ptr, BITS: tl.constexpr, LOG_PER: tl.constexpr,
                                BLOCK: tl.constexpr, META: tl.constexpr):
    """One program: BLOCK lanes of one of the group's tensors, whose addresses and sizes are its row of meta
    (DecodeGroup's layout); its lanes' status at status[program * BLOCK:]."""
    pid = tl.program_id(0)
    row = meta_ptr + pid * META
    words_ptr = tl.load(row).to(tl.pointer_type(tl.int16))
    offsets_ptr = tl.load(row + 1).to(tl.pointer_type(tl.int64))
    table_ptr = tl.load(row + 2).to(tl.pointer_type(tl.int32))
    sm_ptr = tl.load(row + 3).to(tl.pointer_type(tl.uint8))
    out_ptr = tl.load(row + 4).to(tl.pointer_type(tl.int16))
    n_words, lanes, n, first = tl.load(row + 5), tl.load(row + 6), tl.load(row + 7), tl.load(row + 8)
    lane = first + tl.arange(0, BLOCK)
    ok = decode_lanes_block(words_ptr, offsets_ptr, table_ptr, sm_ptr, out_ptr, lane, n, lanes, n_words, BITS,
                             LOG_PER)
    at = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(status_ptr + at, tl.where(ok, 0, 1).to(tl.int32), mask=lane < lanes)


def neuzip_decode_group_torch(group: DecodeGroup) -> torch.Tensor:
    """Every part in turn, by the one-tensor specification; -> the parts' statuses, one after another."""
    return torch.cat([neuzip_decode_torch(*part[:4], group.bits, part[4]) for part in group.parts])


def neuzip_decode_group_triton(group: DecodeGroup) -> torch.Tensor:
    """Every part in one launch; -> the status of each program's block of lanes (nonzero where a lane of a part
    did not decode cleanly). The two forms lay their status out differently, so only where it is nonzero means
    anything to a caller; this one is the group's own buffer, which the next launch overwrites."""
    grid = (group.meta.shape[0],)
    _neuzip_decode_group_kernel[grid](group.meta, group.status, BITS=group.bits,
                                      LOG_PER=log_fields_per_byte(group.bits), BLOCK=BLOCK_LANES, META=META)
    return group.status
