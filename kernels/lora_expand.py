"""LoRA expand, the second half of a batched multi-adapter LoRA (Punica SGMV, vLLM lora_expand):
lift each token's shrunk z through its own slot's B and add it into the base layer's output y.

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

from kernels._backend import tl, triton
from kernels.segments import Segments, slot_rows

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def lora_expand_torch(z: torch.Tensor, b_stacked: torch.Tensor, seg: Segments, y: torch.Tensor) -> torch.Tensor:
    """The twin, which is what CPU serving runs: one batched matmul, never a loop over tokens.

    Same plan as lora_shrink_torch: a plain matmul for one segment covering the batch, else one padded
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


@triton.jit
def _lora_expand_kernel(
    z_ptr, b_ptr, y_ptr,
    order_ptr, starts_ptr, lengths_ptr, slots_ptr,
    N, R,
    stride_zt, stride_bs, stride_bn, stride_bk, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program: BLOCK_M tokens of one segment x BLOCK_N outputs, looping over R in BLOCK_K steps."""
    pid_s = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    length = tl.load(lengths_ptr + pid_s)
    # The grid is sized for the longest segment; tiles past the end of a shorter one have nothing to do.
    if pid_m * BLOCK_M < length:
        slot = tl.load(slots_ptr + pid_s)
        start = tl.load(starts_ptr + pid_s)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows within the segment
        mask_m = offs_m < length
        tok = tl.load(order_ptr + start + offs_m, mask=mask_m, other=0)  # [BLOCK_M] token indices
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, R, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            mask_k = offs_k < R
            z_tile = tl.load(
                z_ptr + tok[:, None] * stride_zt + offs_k[None, :],
                mask=mask_m[:, None] & mask_k[None, :], other=0.0,
            ).to(tl.float32)  # [BLOCK_M, BLOCK_K]
            b_tile = tl.load(
                b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                mask=mask_n[None, :] & mask_k[:, None], other=0.0,
            ).to(tl.float32)  # [BLOCK_K, BLOCK_N], B[slot].T
            acc += tl.dot(z_tile, b_tile, input_precision="ieee")
        y_ptrs = y_ptr + tok[:, None] * stride_yt + offs_n[None, :]  # [BLOCK_M, BLOCK_N]
        mask = mask_m[:, None] & mask_n[None, :]
        y_tile = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        # Each token sits in exactly one segment, so no other program writes these rows.
        tl.store(y_ptrs, (y_tile + acc).to(y_ptr.dtype.element_ty), mask=mask)


def lora_expand_triton(z: torch.Tensor, b_stacked: torch.Tensor, seg: Segments, y: torch.Tensor) -> torch.Tensor:
    """Host wrapper: check, launch one grid that reads and writes only the rows of slotted tokens."""
    _check_expand(z, b_stacked, seg, y)
    num_segments = seg.slots.numel()
    if num_segments == 0:
        return y
    out_features, rank = b_stacked.shape[1], b_stacked.shape[2]
    # tl.dot wants every tile dim >= 16; masks cover what the padding adds. Sizes measured on an H100:
    # fp32 tiles of 64 x 128 spill and ran 10x slower than 32 x 64.
    block_m = min(32, max(16, triton.next_power_of_2(seg.max_length)))
    block_n = min(64, max(16, triton.next_power_of_2(out_features)))
    block_k = min(64, max(16, triton.next_power_of_2(rank)))
    grid = (num_segments, triton.cdiv(seg.max_length, block_m), triton.cdiv(out_features, block_n))
    _lora_expand_kernel[grid](
        z, b_stacked, y,
        seg.order, seg.starts, seg.lengths, seg.slots,
        out_features, rank,
        z.stride(0), b_stacked.stride(0), b_stacked.stride(1), b_stacked.stride(2), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return y


def _slot_major(b: torch.Tensor) -> bool:
    """Contiguous [slots, out, R], or a transposed view of a contiguous [slots, R, out] (what the adapter pool's
    buckets keep: the CPU twin's bmm reads it twice as fast)."""
    return b.is_contiguous() or b.transpose(1, 2).is_contiguous()


def _check_expand(z: torch.Tensor, b_stacked: torch.Tensor, seg: Segments, y: torch.Tensor) -> None:
    """Both forms check the same contract, so a bad call fails the same way on CPU and GPU."""
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
