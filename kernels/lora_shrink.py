"""LoRA shrink, the first half of a batched multi-adapter LoRA (Punica SGMV, vLLM lora_shrink):
project every token onto its own slot's A. The engine's LinearWithSlots calls it before lora_expand.

Semantics:
    for t in range(T):
        s = slot[t]
        z[t] = scale[s] * x[t] @ a_stacked[s].T   if s >= 0   else 0

Shapes: x [T, in] fp32 | fp16 | bf16; a_stacked [num_slots, R, in], x's dtype; scale [num_slots] fp32;
seg: Segments of the T tokens. Returns a new z [T, R] fp32 (accumulated in fp32); inputs are not touched.
"""

import torch

from kernels._backend import tl, triton
from kernels.segments import Segments, slot_rows

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TARGET_PROGRAMS = 256  # enough to fill an H100's 132 SMs twice


def lora_shrink_torch(x: torch.Tensor, a_stacked: torch.Tensor, scale: torch.Tensor, seg: Segments) -> torch.Tensor:
    """The twin, which is what CPU serving runs: one batched matmul, never a loop over tokens.

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


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, scale_ptr, z_ptr,
    order_ptr, starts_ptr, lengths_ptr, slots_ptr,
    K, R,
    stride_xt, stride_as, stride_ar, stride_zt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """One program: BLOCK_M tokens of one segment x BLOCK_N ranks x every SPLIT_K-th BLOCK_K slice of `in`."""
    pid_s = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2) // SPLIT_K
    pid_k = tl.program_id(2) % SPLIT_K
    length = tl.load(lengths_ptr + pid_s)
    # The grid is sized for the longest segment; tiles past the end of a shorter one have nothing to do.
    if pid_m * BLOCK_M < length:
        slot = tl.load(slots_ptr + pid_s)
        start = tl.load(starts_ptr + pid_s)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows within the segment
        mask_m = offs_m < length
        tok = tl.load(order_ptr + start + offs_m, mask=mask_m, other=0)  # [BLOCK_M] token indices
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] ranks
        mask_n = offs_n < R
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            mask_k = offs_k < K
            x_tile = tl.load(
                x_ptr + tok[:, None] * stride_xt + offs_k[None, :],
                mask=mask_m[:, None] & mask_k[None, :], other=0.0,
            ).to(tl.float32)  # [BLOCK_M, BLOCK_K]
            a_tile = tl.load(
                a_ptr + slot * stride_as + offs_n[None, :] * stride_ar + offs_k[:, None],
                mask=mask_n[None, :] & mask_k[:, None], other=0.0,
            ).to(tl.float32)  # [BLOCK_K, BLOCK_N], A[slot].T
            acc += tl.dot(x_tile, a_tile, input_precision="ieee")
        acc = acc * tl.load(scale_ptr + slot)
        z_ptrs = z_ptr + tok[:, None] * stride_zt + offs_n[None, :]  # [BLOCK_M, BLOCK_N]
        mask = mask_m[:, None] & mask_n[None, :]
        if SPLIT_K == 1:
            tl.store(z_ptrs, acc, mask=mask)
        else:  # z starts at zero; the splits of one tile sum into it (in no fixed order)
            tl.atomic_add(z_ptrs, acc, mask=mask)


def lora_shrink_triton(x: torch.Tensor, a_stacked: torch.Tensor, scale: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Host wrapper: check, allocate z (zeros: NO_SLOT rows need no program, splits add into it), launch."""
    _check_shrink(x, a_stacked, scale, seg)
    num_tokens, in_features = x.shape
    rank = a_stacked.shape[1]
    z = torch.zeros((num_tokens, rank), dtype=torch.float32, device=x.device)  # [T, R]
    num_segments = seg.slots.numel()
    if num_segments == 0:
        return z
    # tl.dot wants every tile dim >= 16; masks cover what the padding adds. Sizes measured on an H100.
    block_m = min(64, max(16, triton.next_power_of_2(seg.max_length)))
    block_n = min(64, max(16, triton.next_power_of_2(rank)))
    block_k = min(64, max(16, triton.next_power_of_2(in_features)))
    # R is small and `in` long, so a few segments make few programs: split `in` until ~256 programs run.
    tiles = num_segments * triton.cdiv(seg.max_length, block_m) * triton.cdiv(rank, block_n)
    split_k = max(1, min(triton.cdiv(in_features, block_k), TARGET_PROGRAMS // tiles))
    grid = (num_segments, triton.cdiv(seg.max_length, block_m), triton.cdiv(rank, block_n) * split_k)
    _lora_shrink_kernel[grid](
        x, a_stacked, scale, z,
        seg.order, seg.starts, seg.lengths, seg.slots,
        in_features, rank,
        x.stride(0), a_stacked.stride(0), a_stacked.stride(1), z.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
    )
    return z


def _check_shrink(x: torch.Tensor, a_stacked: torch.Tensor, scale: torch.Tensor, seg: Segments) -> None:
    """Both forms check the same contract, so a bad call fails the same way on CPU and GPU."""
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
