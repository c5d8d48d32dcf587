"""EMR delta: each token adds its task's modulated share of one unified task vector (EMR-Merging), reading the
task's 1-bit mask packed, never unpacked into memory (BitDelta's binary GEMM, with one shared vector per group).
Each token names its task in a map, so a launch depends only on the number of tokens and of tasks, never on which
tasks a step's rows run: a CUDA graph replays it whatever they are.

Semantics:
    for t in range(T):
        s = rows[t]
        if s >= 0:
            y[t] = cast(y[t] + scale[s] * x[t] @ (unpack(masks[s]) * tau).T)   # fp32 sum, one rounding

Shapes: x [T, in] fp32 | fp16 | bf16, contiguous; tau [out, in], x's dtype, contiguous (one group's unified
task vector for this weight); masks [num_slots, out, ceil(in / 8)] uint8, contiguous: bit j of byte b of row o
is the mask at column 8 b + j (little-endian bit order, as numpy.packbits(..., bitorder="little")); scale
[num_slots] fp32; rows [T] int (a task's slot, or -1); y [T, out], x's dtype, contiguous. Adds into y in place and
returns it; rows of -1 keep their bits.
"""

import torch

from kernels._backend import tl, triton

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CHUNK_ELEMENTS = 1 << 22
"""The twin unpacks at most this many weights per task at a time (16 MiB in fp32): a 50k-row LM head's delta
is never whole in memory."""

_BIT_TABLE = torch.tensor([[(b >> j) & 1 for j in range(8)] for b in range(256)], dtype=torch.bool)  # [256, 8]
_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def bit_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8] the bits of every byte, on `device` in `dtype`, copied there once: a CUDA graph capturing a step
    that unpacks masks may not copy from the host."""
    key = (torch.device(device), dtype)
    if key not in _TABLES:
        _TABLES[key] = _BIT_TABLE.to(device=device, dtype=dtype)
    return _TABLES[key]


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """[..., ceil(n / 8)] uint8 -> [..., n] bool, little-endian bit order (the inverse of pack_bits)."""
    table = bit_table(packed.device, torch.bool)
    return table[packed.long()].flatten(-2)[..., :n]


def masked(packed: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """unpack(packed) * tau in tau's dtype: [..., out, ceil(in / 8)] uint8 and [out, in] -> [..., out, in]. The bits
    become 0.0 / 1.0 through a 256-row table lookup (an embedding), several times faster on CPU than a bool unpack
    followed by a multiply."""
    table = bit_table(tau.device, tau.dtype)  # [256, 8]
    bits = torch.nn.functional.embedding(packed.long(), table).flatten(-2)[..., :tau.shape[-1]]
    return bits.mul_(tau)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """[..., n] bool -> [..., ceil(n / 8)] uint8, little-endian bit order along the last dimension."""
    n = mask.shape[-1]
    pad = -n % 8
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).unflatten(-1, (-1, 8))  # [..., n8, 8]
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=mask.device)
    return (m * weights).sum(-1, dtype=torch.uint8)


def emr_delta_torch(x: torch.Tensor, tau: torch.Tensor, masks: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor,
                    y: torch.Tensor) -> torch.Tensor:
    """The twin: every task's masked delta over every token, kept where the map names that task, summed in fp32
    and added with one rounding. Its operations depend only on the shapes (a fixed-shape step's, on a CPU); it is
    the specification, not a server's path (a CPU serves a task's rows through its formed weights). Each chunk of
    a task's masked delta is unpacked, used and dropped: at most CHUNK_ELEMENTS weights at a time."""
    _check(x, tau, masks, scale, rows, y)
    out_features, in_features = tau.shape
    chunk = max(1, CHUNK_ELEMENTS // max(in_features, 1))
    xs = x.float()  # [T, in]
    delta = torch.zeros(y.shape, dtype=torch.float32, device=x.device)  # [T, out]
    part = torch.empty_like(delta)
    for s in range(masks.shape[0]):
        for o in range(0, out_features, chunk):  # bounded: ceil(out / chunk) chunks
            w = masked(masks[s, o:o + chunk], tau[o:o + chunk])  # [c, in]
            torch.mm(xs, w.float().T, out=part[:, o:o + chunk])
        delta += torch.where((rows == s)[:, None], part * scale[s], 0.0)
    live = (rows >= 0)[:, None]
    y.copy_(torch.where(live, (y.float() + delta).to(y.dtype), y))
    return y


@triton.jit
def _emr_delta_kernel(
    x_ptr, tau_ptr, masks_ptr, scale_ptr, rows_ptr, y_ptr,
    T, N, K, S,
    stride_xt, stride_tn, stride_ms, stride_mn, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program: BLOCK_M tokens x BLOCK_N outputs. Each tau tile is read once and used for every task with a
    token in the block; each such task reads its mask bytes; a block without any task's token writes nothing."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    mask_m = offs_m < T
    task = tl.load(rows_ptr + offs_m, mask=mask_m, other=-1)  # [BLOCK_M] each token's task, -1: none
    if tl.max(task, 0) >= 0:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            mask_k = offs_k < K
            x_tile = tl.load(x_ptr + offs_m[:, None] * stride_xt + offs_k[None, :],
                             mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
            tau_tile = tl.load(tau_ptr + offs_n[None, :] * stride_tn + offs_k[:, None],
                               mask=mask_n[None, :] & mask_k[:, None], other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_N]
            shift = (offs_k % 8).to(tl.uint8)[:, None]  # [BLOCK_K, 1]
            for s in range(0, S):
                mine = task == s
                if tl.max(mine.to(tl.int32), 0) > 0:
                    byte = tl.load(masks_ptr + s * stride_ms + offs_n[None, :] * stride_mn + (offs_k // 8)[:, None],
                                   mask=mask_n[None, :] & mask_k[:, None], other=0)  # [BLOCK_K, BLOCK_N] uint8
                    on = ((byte >> shift) & 1) != 0
                    w = tl.where(on, tau_tile, 0.0) * tl.load(scale_ptr + s)  # [BLOCK_K, BLOCK_N]
                    acc += tl.dot(tl.where(mine[:, None], x_tile, 0.0), w, input_precision="ieee")
        y_ptrs = y_ptr + offs_m[:, None] * stride_yt + offs_n[None, :]
        out_mask = (task >= 0)[:, None] & mask_n[None, :]
        y_old = tl.load(y_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y_old + acc).to(y_ptr.dtype.element_ty), mask=out_mask)


def emr_delta_triton(x: torch.Tensor, tau: torch.Tensor, masks: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor,
                     y: torch.Tensor) -> torch.Tensor:
    """Host wrapper: a grid of (token blocks, output tiles), fixed by the shapes alone, so a CUDA graph replays it
    whichever tasks the step's rows run."""
    _check(x, tau, masks, scale, rows, y)
    tokens = x.shape[0]
    if tokens == 0:
        return y
    out_features, in_features = tau.shape
    block_m = min(64, max(16, triton.next_power_of_2(tokens)))
    block_n = min(64, max(16, triton.next_power_of_2(out_features)))
    block_k = min(64, max(16, triton.next_power_of_2(in_features)))
    grid = (triton.cdiv(tokens, block_m), triton.cdiv(out_features, block_n))
    _emr_delta_kernel[grid](
        x, tau, masks, scale, rows, y,
        tokens, out_features, in_features, masks.shape[0],
        x.stride(0), tau.stride(0), masks.stride(0), masks.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return y


def _check(x: torch.Tensor, tau: torch.Tensor, masks: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor,
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
    if rows.shape != (x.shape[0],) or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows: expected [{x.shape[0]}] int32 or int64; got {list(rows.shape)} {rows.dtype}")
    for name, t in (("tau", tau), ("masks", masks), ("scale", scale), ("y", y), ("rows", rows)):
        if t.device != x.device:
            raise ValueError(f"{name}: expected device {x.device} (x's); got {t.device}")
