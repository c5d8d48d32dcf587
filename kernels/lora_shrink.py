"""LoRA shrink over segments, the first half of a batched multi-adapter LoRA (Punica SGMV): project every token
onto its own slot's A. What a CPU runs in half precision (the adapter pool, before lora_expand): fp32 on a CPU and
every dtype on CUDA run kernels.lora_by_token instead, so this op has no GPU form.

Semantics:
    for t in range(T):
        s = slot[t]
        z[t] = scale[s] * x[t] @ a_stacked[s].T   if s >= 0   else 0

Shapes: x [T, in] fp32 | fp16 | bf16; a_stacked [num_slots, R, in], x's dtype; scale [num_slots] fp32;
seg: Segments of the T tokens. Returns a new z [T, R] fp32 (accumulated in fp32); inputs are not touched.
"""

import torch

from kernels.segments import Segments, slot_rows

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def lora_shrink(x: torch.Tensor, a_stacked: torch.Tensor, scale: torch.Tensor, seg: Segments) -> torch.Tensor:
    """One batched matmul, never a loop over tokens.

    One segment covering the batch is a plain matmul. Otherwise each segment's tokens are gathered into
    a [max_length, in] block (seg.padded, built once per step) and multiplied by that segment's A in one bmm;
    the padding costs up to S times the rows when one segment dominates. Consecutive slots are read as a view
    of the stack: copying the used slots' weights out would cost more than the matmul.
    """
    _check_shrink(x, a_stacked, scale, seg)
    num_tokens, rank = x.shape[0], a_stacked.shape[1]
    if seg.slots.numel() == 0:
        return x.new_zeros((num_tokens, rank), dtype=torch.float32)
    a, s = slot_rows(a_stacked, seg), slot_rows(scale, seg)  # [S, R, in], [S]
    if seg.slots.numel() == 1 and seg.order.numel() == num_tokens:  # one adapter for the batch: no gather
        return (x.float() @ a[0].float().T).mul_(s)  # [T, R]
    zs = torch.bmm(x[seg.padded].float(), a.float().transpose(1, 2)).mul_(s[:, None, None])  # [S, L, R]
    zs = zs.view(-1, rank) if seg.valid is None else zs[seg.valid]  # [n, R], in seg.order
    return x.new_zeros((num_tokens, rank), dtype=torch.float32).index_copy_(0, seg.order, zs)  # [T, R]


def _check_shrink(x: torch.Tensor, a_stacked: torch.Tensor, scale: torch.Tensor, seg: Segments) -> None:
    """Bad arguments fail by name, in one line."""
    if x.dim() != 2 or x.dtype not in DTYPES or not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous [T, in] fp32, fp16 or bf16 tensor; "
                         f"got {list(x.shape)} {x.dtype}{'' if x.is_contiguous() else ' non-contiguous'}")
    if a_stacked.dim() != 3 or a_stacked.shape[2] != x.shape[1] or not a_stacked.is_contiguous():
        raise ValueError(f"a_stacked: expected a contiguous [num_slots, R, {x.shape[1]}] tensor; "
                         f"got {list(a_stacked.shape)}{'' if a_stacked.is_contiguous() else ' non-contiguous'}")
    if a_stacked.dtype != x.dtype:
        raise ValueError(f"a_stacked: expected dtype {x.dtype} (x's); got {a_stacked.dtype}")
    if scale.shape != (a_stacked.shape[0],) or scale.dtype != torch.float32:
        raise ValueError(f"scale: expected [{a_stacked.shape[0]}] float32; got {list(scale.shape)} {scale.dtype}")
    if seg.num_tokens != x.shape[0]:
        raise ValueError(f"seg: expected segments of {x.shape[0]} tokens (x's); got {seg.num_tokens}")
    for name, t in (("a_stacked", a_stacked), ("scale", scale), ("seg.order", seg.order)):
        if t.device != x.device:
            raise ValueError(f"{name}: expected device {x.device} (x's); got {t.device}")
