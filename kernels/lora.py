"""A whole batched multi-adapter LoRA, shrink then expand, for tokens grouped by slot (Punica's SGMV pair):
y[t] += scale[s] * (x[t] @ a_stacked[s].T) @ b_stacked[s].T for s = slot[t] >= 0.

The Triton form is lora_shrink_triton then lora_expand_triton. The twin runs both halves as one sequence of
batched matmuls, the segments' tokens gathered once and the shrunk z never scattered back to token order between
them: half the operations of the two twins in turn (a CPU's decode step pays per operation, not per FLOP), and
the same bits, since the batched matmuls are the same.

Shapes: as lora_shrink (x, a_stacked, scale, seg) and lora_expand (b_stacked, y). Adds into y in place, returns y.
"""

import torch

from kernels.lora_expand import add_rows, check_b, lora_expand_triton
from kernels.lora_shrink import _check_shrink, lora_shrink_triton
from kernels.segments import Segments, slot_rows


def lora_torch(x: torch.Tensor, a_stacked: torch.Tensor, b_stacked: torch.Tensor, scale: torch.Tensor,
               seg: Segments, y: torch.Tensor) -> torch.Tensor:
    _check_shrink(x, a_stacked, scale, seg)
    check_b(b_stacked, seg, y)
    if b_stacked.shape[2] != a_stacked.shape[1]:
        raise ValueError(f"b_stacked: expected rank {a_stacked.shape[1]} (a_stacked's); got {b_stacked.shape[2]}")
    if seg.slots.numel() == 0:
        return y
    a, b, s = slot_rows(a_stacked, seg), slot_rows(b_stacked, seg), slot_rows(scale, seg)  # views when consecutive
    if seg.slots.numel() == 1 and seg.order.numel() == x.shape[0]:  # one adapter for the batch: no gather
        z = (x.float() @ a[0].float().T).mul_(s)  # [T, R]
        if y.dtype == torch.float32:
            return y.addmm_(z, b[0].float().T)
        y += z @ b[0].float().T
        return y
    zs = torch.bmm(x[seg.padded].float(), a.float().transpose(1, 2)).mul_(s[:, None, None])  # [S, L, R]
    ys = torch.bmm(zs, b.float().transpose(1, 2))  # [S, L, out]
    ys = ys.view(-1, y.shape[1]) if seg.valid is None else ys[seg.valid]  # [n, out], in seg.order
    return add_rows(y, seg.order, ys)


def lora_triton(x: torch.Tensor, a_stacked: torch.Tensor, b_stacked: torch.Tensor, scale: torch.Tensor,
                seg: Segments, y: torch.Tensor) -> torch.Tensor:
    return lora_expand_triton(lora_shrink_triton(x, a_stacked, scale, seg), b_stacked, seg, y)
