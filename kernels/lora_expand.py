"""LoRA expand over segments, the second half of a batched multi-adapter LoRA (Punica SGMV): lift each token's
shrunk z through its own slot's B and add it into the base layer's output y. What a CPU runs in half precision
after kernels.lora_shrink (no GPU form: see there).

Semantics:
    for t in range(T):
        s = slot[t]
        if s >= 0:
            y[t] = cast(y[t] + z[t] @ b_stacked[s].T)   # sum in fp32, one rounding to y's dtype

Shapes: z [T, R] fp32 (from lora_shrink); b_stacked [num_slots, out, R], y's dtype (contiguous, or the transpose of
a contiguous [num_slots, R, out]); y [T, out] fp32 | fp16 | bf16,
contiguous; seg: Segments of the T tokens. Adds into y in place and returns it; NO_SLOT rows keep their bits.
"""

import torch

from kernels.segments import Segments, slot_rows

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def lora_expand(z: torch.Tensor, b_stacked: torch.Tensor, seg: Segments, y: torch.Tensor) -> torch.Tensor:
    """One batched matmul, never a loop over tokens.

    Same plan as lora_shrink: a plain matmul for one segment covering the batch, else one padded
    bmm over the segments (consecutive slots read as a view). Adding an fp32 tensor into y in place sums in
    fp32 and rounds once to y's dtype, as the kernel does.
    """
    _check_expand(z, b_stacked, seg, y)
    if seg.slots.numel() == 0:
        return y
    b = slot_rows(b_stacked, seg).float()  # [S, out, R]
    if seg.slots.numel() == 1 and seg.order.numel() == y.shape[0]:  # one adapter for the batch: no gather
        if y.dtype == torch.float32:
            return y.addmm_(z, b[0].T)  # [T, out]
        y += z @ b[0].T
        return y
    ys = torch.bmm(z[seg.padded], b.transpose(1, 2))  # [S, L, out]
    ys = ys.view(-1, y.shape[1]) if seg.valid is None else ys[seg.valid]  # [n, out], in seg.order
    if y.dtype == torch.float32:  # index_put_ accumulating: index_add_'s sums in a third of its time at few rows
        return y.index_put_((seg.order,), ys, accumulate=True)
    y[seg.order] += ys
    return y


def _slot_major(b: torch.Tensor) -> bool:
    """Contiguous [slots, out, R], or a transposed view of a contiguous [slots, R, out] (what the adapter pool's
    buckets keep: the CPU twin's bmm reads it twice as fast)."""
    return b.is_contiguous() or b.transpose(1, 2).is_contiguous()


def _check_expand(z: torch.Tensor, b_stacked: torch.Tensor, seg: Segments, y: torch.Tensor) -> None:
    """Bad arguments fail by name, in one line."""
    if y.dim() != 2 or y.dtype not in DTYPES or not y.is_contiguous():
        raise ValueError(f"y: expected a contiguous [T, out] fp32, fp16 or bf16 tensor; "
                         f"got {list(y.shape)} {y.dtype}{'' if y.is_contiguous() else ' non-contiguous'}")
    if b_stacked.dim() != 3 or b_stacked.shape[1] != y.shape[1] or not _slot_major(b_stacked):
        raise ValueError(f"b_stacked: expected a [num_slots, {y.shape[1]}, R] tensor, contiguous or the transpose of "
                         f"a contiguous [num_slots, R, {y.shape[1]}]; got {list(b_stacked.shape)} strides "
                         f"{b_stacked.stride()}")
    if b_stacked.dtype != y.dtype:
        raise ValueError(f"b_stacked: expected dtype {y.dtype} (y's); got {b_stacked.dtype}")
    rank = b_stacked.shape[2]
    if z.shape != (y.shape[0], rank) or z.dtype != torch.float32 or not z.is_contiguous():
        raise ValueError(f"z: expected a contiguous [{y.shape[0]}, {rank}] float32 tensor; "
                         f"got {list(z.shape)} {z.dtype}{'' if z.is_contiguous() else ' non-contiguous'}")
    if seg.num_tokens != y.shape[0]:
        raise ValueError(f"seg: expected segments of {y.shape[0]} tokens (y's); got {seg.num_tokens}")
    for name, t in (("z", z), ("b_stacked", b_stacked), ("seg.order", seg.order)):
        if t.device != y.device:
            raise ValueError(f"{name}: expected device {y.device} (y's); got {t.device}")
