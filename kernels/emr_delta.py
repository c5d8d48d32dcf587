"""EMR delta: each token adds its task's modulated share of one unified task vector (EMR-Merging), reading the
task's 1-bit mask packed, never unpacked into memory.

Semantics:
    for t in range(T):
        s = slot[t]
        if s >= 0:
            y[t] = cast(y[t] + scale[s] * x[t] @ (unpack(masks[s]) * tau).T)   # fp32 sum, one rounding

Shapes: x [T, in] fp32 | fp16 | bf16, contiguous; tau [out, in], x's dtype, contiguous (one group's unified
task vector for this weight); masks [num_slots, out, ceil(in / 8)] uint8, contiguous: bit j of byte b of row o
is the mask at column 8 b + j (little-endian bit order, as numpy.packbits(..., bitorder="little")); scale
[num_slots] fp32; seg: Segments of the T tokens; y [T, out], x's dtype, contiguous. Adds into y in place and
returns it; NO_SLOT rows keep their bits.
"""

import torch

from kernels._backend import tl, triton
from kernels.segments import Segments

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CHUNK_ELEMENTS = 1 << 22
"""The twin unpacks at most this many weights per task at a time (16 MiB in fp32): a 50k-row LM head's delta
is never whole in memory."""

_BIT_TABLE = torch.tensor([[(b >> j) & 1 for j in range(8)] for b in range(256)], dtype=torch.bool)  # [256, 8]


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """[..., ceil(n / 8)] uint8 -> [..., n] bool, little-endian bit order (the inverse of pack_bits)."""
    table = _BIT_TABLE.to(packed.device)
    return table[packed.long()].flatten(-2)[..., :n]


def masked(packed: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """unpack(packed) * tau in tau's dtype: [..., out, ceil(in / 8)] uint8 and [out, in] -> [..., out, in]. The bits
    become 0.0 / 1.0 through a 256-row table lookup (an embedding), several times faster on CPU than a bool unpack
    followed by a multiply."""
    table = _BIT_TABLE.to(device=tau.device, dtype=tau.dtype)  # [256, 8]
    bits = torch.nn.functional.embedding(packed.long(), table).flatten(-2)[..., :tau.shape[-1]]
    return bits.mul_(tau)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """[..., n] bool -> [..., ceil(n / 8)] uint8, little-endian bit order along the last dimension."""
    n = mask.shape[-1]
    pad = -n % 8
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).unflatten(-1, (-1, 8))  # [..., n8, 8]
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=mask.device)
    return (m * weights).sum(-1, dtype=torch.uint8)


def emr_delta_torch(x: torch.Tensor, tau: torch.Tensor, masks: torch.Tensor, scale: torch.Tensor, seg: Segments,
                    y: torch.Tensor) -> torch.Tensor:
    """The twin, which is what CPU serving runs: one matmul per task (segment) over its tokens, never a loop over
    tokens (a loop of per-task matmuls runs about 20% faster here than one padded bmm, and pads nothing). Each
    chunk of a task's masked delta is unpacked, used and dropped: at most CHUNK_ELEMENTS weights at a time."""
    _check(x, tau, masks, scale, seg, y)
    if seg.slots.numel() == 0:
        return y
    out_features, in_features = tau.shape
    rows = max(1, CHUNK_ELEMENTS // max(in_features, 1))
    whole = seg.slots.numel() == 1 and seg.order.numel() == x.shape[0]  # one task for the whole batch
    for slot, start, length in zip(seg.slots.tolist(), seg.starts.tolist(), seg.lengths.tolist()):
        tokens = seg.order[start:start + length]  # [n]
        xs = (x if whole else x.index_select(0, tokens)).float()  # [n, in]
        delta = torch.empty((length, out_features), dtype=torch.float32, device=x.device)  # [n, out]
        for o in range(0, out_features, rows):  # bounded: ceil(out / rows) chunks
            w = masked(masks[slot, o:o + rows], tau[o:o + rows])  # [c, in]
            torch.mm(xs, w.float().T, out=delta[:, o:o + rows])
        delta.mul_(scale[slot])
        if whole:
            y += delta
        elif y.dtype == torch.float32:
            y.index_add_(0, tokens, delta)
        else:
            y[tokens] += delta
    return y


@triton.jit
def _emr_delta_kernel(
    x_ptr, tau_ptr, masks_ptr, scale_ptr, y_ptr,
    order_ptr, tok_seg_ptr, slots_ptr,
    n, N, K, K8,
    stride_xt, stride_tn, stride_ms, stride_mn, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program: BLOCK_M consecutive tokens of seg.order (several tasks, sorted by slot) x BLOCK_N outputs.
    Each tau tile is read once and used for every task in the block; each task reads its mask bytes."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] positions in seg.order
    mask_m = offs_m < n
    tok = tl.load(order_ptr + offs_m, mask=mask_m, other=0)  # [BLOCK_M] token indices
    seg_of = tl.load(tok_seg_ptr + offs_m, mask=mask_m, other=-1)  # [BLOCK_M] segment of each token
    first = tl.load(tok_seg_ptr + pid_m * BLOCK_M)
    last = tl.load(tok_seg_ptr + tl.minimum(pid_m * BLOCK_M + BLOCK_M, n) - 1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        mask_k = offs_k < K
        x_tile = tl.load(x_ptr + tok[:, None] * stride_xt + offs_k[None, :],
                         mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        tau_tile = tl.load(tau_ptr + offs_n[None, :] * stride_tn + offs_k[:, None],
                           mask=mask_n[None, :] & mask_k[:, None], other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_N]
        shift = (offs_k % 8).to(tl.uint8)[:, None]  # [BLOCK_K, 1]
        for si in range(first, last + 1):  # the tasks of this block: at most BLOCK_M
            slot = tl.load(slots_ptr + si)
            byte = tl.load(masks_ptr + slot * stride_ms + offs_n[None, :] * stride_mn + (offs_k // 8)[:, None],
                           mask=mask_n[None, :] & mask_k[:, None], other=0)  # [BLOCK_K, BLOCK_N] uint8
            on = ((byte >> shift) & 1) != 0
            w = tl.where(on, tau_tile, 0.0) * tl.load(scale_ptr + slot)  # [BLOCK_K, BLOCK_N]
            xs = tl.where((seg_of == si)[:, None], x_tile, 0.0)  # this task's tokens only
            acc += tl.dot(xs, w, input_precision="ieee")
    y_ptrs = y_ptr + tok[:, None] * stride_yt + offs_n[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    y_old = tl.load(y_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y_old + acc).to(y_ptr.dtype.element_ty), mask=out_mask)


def emr_delta_triton(x: torch.Tensor, tau: torch.Tensor, masks: torch.Tensor, scale: torch.Tensor, seg: Segments,
                     y: torch.Tensor) -> torch.Tensor:
    """Host wrapper: check, give each sorted token its segment index, launch over token blocks x output tiles."""
    _check(x, tau, masks, scale, seg, y)
    n = seg.order.numel()
    if n == 0:
        return y
    out_features, in_features = tau.shape
    tok_seg = torch.repeat_interleave(torch.arange(seg.slots.numel(), device=x.device), seg.lengths)  # [n]
    block_m = min(64, max(16, triton.next_power_of_2(n)))
    block_n = min(64, max(16, triton.next_power_of_2(out_features)))
    block_k = min(64, max(16, triton.next_power_of_2(in_features)))
    grid = (triton.cdiv(n, block_m), triton.cdiv(out_features, block_n))
    _emr_delta_kernel[grid](
        x, tau, masks, scale, y,
        seg.order, tok_seg, seg.slots,
        n, out_features, in_features, masks.shape[2],
        x.stride(0), tau.stride(0), masks.stride(0), masks.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return y


def _check(x: torch.Tensor, tau: torch.Tensor, masks: torch.Tensor, scale: torch.Tensor, seg: Segments,
           y: torch.Tensor) -> None:
    """Both forms check the same contract, so a bad call fails the same way on CPU and GPU."""
    if x.dim() != 2 or x.dtype not in DTYPES or not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous [T, in] fp32, fp16 or bf16 tensor; got {list(x.shape)} {x.dtype}")
    if tau.dim() != 2 or tau.shape[1] != x.shape[1] or tau.dtype != x.dtype or not tau.is_contiguous():
        raise ValueError(f"tau: expected a contiguous [out, {x.shape[1]}] {x.dtype} tensor; got "
                         f"{list(tau.shape)} {tau.dtype}")
    packed = (tau.shape[0], -(-tau.shape[1] // 8))
    if masks.dim() != 3 or tuple(masks.shape[1:]) != packed or masks.dtype != torch.uint8 or not masks.is_contiguous():
        raise ValueError(f"masks: expected a contiguous [num_slots, {packed[0]}, {packed[1]}] uint8 tensor; got "
                         f"{list(masks.shape)} {masks.dtype}")
    if scale.shape != (masks.shape[0],) or scale.dtype != torch.float32:
        raise ValueError(f"scale: expected [{masks.shape[0]}] float32; got {list(scale.shape)} {scale.dtype}")
    if y.shape != (x.shape[0], tau.shape[0]) or y.dtype != x.dtype or not y.is_contiguous():
        raise ValueError(f"y: expected a contiguous [{x.shape[0]}, {tau.shape[0]}] {x.dtype} tensor; got "
                         f"{list(y.shape)} {y.dtype}")
    if seg.num_tokens != x.shape[0]:
        raise ValueError(f"seg: expected segments of {x.shape[0]} tokens (x's); got {seg.num_tokens}")
    for name, t in (("tau", tau), ("masks", masks), ("scale", scale), ("y", y), ("seg.order", seg.order)):
        if t.device != x.device:
            raise ValueError(f"{name}: expected device {x.device} (x's); got {t.device}")
