"""LoRA by token (Punica's BGMV): each token reads its own stack row, so a launch depends only on the number of
tokens, never on which adapters the step's rows use. On CUDA a decode step's launches are then the same for every
mix of adapters and a CUDA graph replays them; on a CPU one compiled loop does a module's whole LoRA for every
token (lora_by_token_host, over stacks viewed once), where the torch twins pay a dozen small operations a call.

Semantics:
    bgmv_shrink: z[t] = x[t] @ a_stacked[r].T * scale[r]         for r = rows[t] >= 0, else z[t] = 0
    bgmv_expand: y[t] = cast(y[t] + z[t] @ b_stacked[r].T)       for r = rows[t] >= 0, else y[t] untouched
    lora_by_token: bgmv_shrink then bgmv_expand

Several Linear layers that read one input (a layer's q, k and v) shrink in one launch (Punica's packed slices):
their A stacks lie in one [N, G * R, in] tensor and scale is [N, G], block g of R columns scaled by scale[:, g];
each layer's expand then reads its own block of z, z[..., g * R:(g + 1) * R].

z is [S, T, R] fp32: S partial sums over parts of `in` (a decode step has few tokens and `in` is long, so the
Triton shrink splits it; the twin's S is 1), which bgmv_expand adds up. No atomics and no zeroed buffer: the same
bits every run.

Shapes: x [T, in]; a_stacked [N, R, in] in x's dtype, last dim contiguous; scale [N] or [N, G] fp32 (G divides
R); rows [T] int (a row of the stacks, or -1); b_stacked [N, out, R] in y's dtype (contiguous, or the transpose of
a contiguous [N, R, out]); y [T, out], contiguous, added into in place.
"""

from typing import NamedTuple

import numpy as np
import torch
from numba import njit

from kernels._backend import tl, triton

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TARGET_PROGRAMS = 512
SHRINK_BLOCK_K = 128
EXPAND_BLOCK_N = 128


def bgmv_shrink_torch(x: torch.Tensor, a_stacked: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor
                      ) -> torch.Tensor:
    """The twin: each token's A gathered, one batched matrix-vector product; -> [1, T, R]."""
    _check_shrink(x, a_stacked, scale, rows)
    live = rows >= 0  # [T]
    at = rows.clamp(min=0)
    a = a_stacked.index_select(0, at).float()  # [T, R, in]
    z = torch.bmm(a, x.float()[:, :, None])[:, :, 0]  # [T, R]
    s = scale.index_select(0, at).reshape(len(at), -1) * live[:, None]  # [T, G]
    return z.mul_(s.repeat_interleave(z.shape[1] // s.shape[1], dim=1))[None]


def bgmv_expand_torch(z: torch.Tensor, b_stacked: torch.Tensor, rows: torch.Tensor, y: torch.Tensor
                      ) -> torch.Tensor:
    """The twin: the partial sums added up, each token's B gathered, one batched matrix-vector product added where
    rows[t] >= 0."""
    _check_expand(z, b_stacked, rows, y)
    live = rows >= 0
    b = b_stacked.index_select(0, rows.clamp(min=0)).float()  # [T, out, R]
    delta = torch.bmm(b, z.sum(0)[:, :, None])[:, :, 0]  # [T, out]
    y[live] = (y[live].float() + delta[live]).to(y.dtype)
    return y


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr, a_ptr, scale_ptr, rows_ptr, z_ptr,
    K, R, R_BLOCK, K_PER,
    stride_xt, stride_as, stride_ar, stride_sn, stride_sg, stride_zs, stride_zt,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program: one token's R outputs over one K_PER-long part of `in`, written as that part's partial sum."""
    t = tl.program_id(0)
    part = tl.program_id(1)
    k_start = part * K_PER
    r = tl.load(rows_ptr + t)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if r >= 0:
        for k0 in range(k_start, k_start + K_PER, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_ptr + t * stride_xt + offs_k, mask=mask_k, other=0.0).to(tl.float32)  # [BLOCK_K]
            a = tl.load(a_ptr + r * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :],
                        mask=mask_r[:, None] & mask_k[None, :], other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_K]
            acc += tl.sum(a * x[None, :], 1)
        acc = acc * tl.load(scale_ptr + r * stride_sn + (offs_r // R_BLOCK) * stride_sg, mask=mask_r, other=0.0)
    tl.store(z_ptr + part * stride_zs + t * stride_zt + offs_r, acc, mask=mask_r)


@triton.jit
def _bgmv_expand_kernel(
    z_ptr, b_ptr, rows_ptr, y_ptr,
    N, R,
    stride_zs, stride_zt, stride_bs, stride_bn, stride_bk, stride_yt,
    SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """One program: BLOCK_N outputs of one token."""
    t = tl.program_id(0)
    r = tl.load(rows_ptr + t)
    if r >= 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        mask_n = offs_n < N
        mask_r = offs_r < R
        z = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for part in tl.static_range(SPLIT):
            z += tl.load(z_ptr + part * stride_zs + t * stride_zt + offs_r, mask=mask_r, other=0.0)
        b = tl.load(b_ptr + r * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_bk,
                    mask=mask_n[:, None] & mask_r[None, :], other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_R]
        y_ptrs = y_ptr + t * stride_yt + offs_n
        y = tl.load(y_ptrs, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + tl.sum(b * z[None, :], 1)).to(y_ptr.dtype.element_ty), mask=mask_n)


def bgmv_shrink_triton(x: torch.Tensor, a_stacked: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor
                       ) -> torch.Tensor:
    _check_shrink(x, a_stacked, scale, rows)
    tokens, in_features = x.shape
    rank = a_stacked.shape[1]
    block_k = SHRINK_BLOCK_K
    # A few tokens make few programs: split `in` until about TARGET_PROGRAMS run (a fixed split per token count,
    # so a step's launches stay those of its bucket).
    split = max(1, min(triton.cdiv(in_features, block_k), TARGET_PROGRAMS // max(tokens, 1)))
    per = triton.cdiv(triton.cdiv(in_features, split), block_k) * block_k
    split = triton.cdiv(in_features, per)
    z = torch.empty((split, tokens, rank), dtype=torch.float32, device=x.device)
    scale2 = scale.reshape(scale.shape[0], -1)
    if tokens:
        _bgmv_shrink_kernel[(tokens, split)](
            x, a_stacked, scale2, rows, z, in_features, rank, rank // scale2.shape[1], per,
            x.stride(0), a_stacked.stride(0), a_stacked.stride(1), scale2.stride(0), scale2.stride(1),
            z.stride(0), z.stride(1),
            BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_K=block_k,
        )
    return z


def bgmv_expand_triton(z: torch.Tensor, b_stacked: torch.Tensor, rows: torch.Tensor, y: torch.Tensor
                       ) -> torch.Tensor:
    _check_expand(z, b_stacked, rows, y)
    tokens, out = y.shape
    block_n = EXPAND_BLOCK_N
    if tokens:
        _bgmv_expand_kernel[(tokens, triton.cdiv(out, block_n))](
            z, b_stacked, rows, y, out, z.shape[2],
            z.stride(0), z.stride(1), b_stacked.stride(0), b_stacked.stride(1), b_stacked.stride(2), y.stride(0),
            SPLIT=z.shape[0], BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(z.shape[2])),
        )
    return y


def _check_rows(rows: torch.Tensor, tokens: int, device: torch.device) -> None:
    if rows.shape != (tokens,) or rows.dtype not in (torch.int32, torch.int64) or rows.device != device:
        raise ValueError(f"rows: expected [{tokens}] int32 or int64 on {device}; got {list(rows.shape)} "
                         f"{rows.dtype} on {rows.device}")


def _check_shrink(x: torch.Tensor, a_stacked: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> None:
    """Both forms check the same contract, so a bad call fails the same way on CPU and GPU."""
    if x.dim() != 2 or x.dtype not in DTYPES or x.stride(-1) != 1:
        raise ValueError(f"x: expected a [T, in] fp32, fp16 or bf16 tensor, last dim contiguous; "
                         f"got {list(x.shape)} {x.dtype}")
    if a_stacked.dim() != 3 or a_stacked.shape[2] != x.shape[1] or a_stacked.stride(-1) != 1:
        raise ValueError(f"a_stacked: expected an [N, R, {x.shape[1]}] tensor, last dim contiguous; got "
                         f"{list(a_stacked.shape)}")
    if a_stacked.dtype != x.dtype or a_stacked.device != x.device:
        raise ValueError(f"a_stacked: expected {x.dtype} on {x.device} (x's); got {a_stacked.dtype} on "
                         f"{a_stacked.device}")
    n, rank = a_stacked.shape[:2]
    blocks = scale.shape[1] if scale.dim() == 2 else 1
    if scale.shape[:1] != (n,) or scale.dim() > 2 or rank % blocks or scale.dtype != torch.float32 \
            or scale.device != x.device:
        raise ValueError(f"scale: expected [{n}] or [{n}, G] (G dividing {rank}) float32 on {x.device}; got "
                         f"{list(scale.shape)} {scale.dtype}")
    _check_rows(rows, x.shape[0], x.device)


def _check_expand(z: torch.Tensor, b_stacked: torch.Tensor, rows: torch.Tensor, y: torch.Tensor) -> None:
    if z.dim() != 3 or z.shape[1] != y.shape[0] or z.dtype != torch.float32 or z.device != y.device \
            or z.stride(-1) != 1:
        raise ValueError(f"z: expected [S, {y.shape[0]}, R] float32 on {y.device}, last dim contiguous; got "
                         f"{list(z.shape)} {z.dtype}")
    _check_out(b_stacked, rows, y, z.shape[2])


def _check_out(b_stacked: torch.Tensor, rows: torch.Tensor, y: torch.Tensor, rank: int) -> None:
    """b_stacked, rows and y for an expand at `rank` (the fused form has no z to read it from)."""
    if y.dim() != 2 or y.dtype not in DTYPES or not y.is_contiguous():
        raise ValueError(f"y: expected a contiguous [T, out] fp32, fp16 or bf16 tensor; got {list(y.shape)} {y.dtype}")
    if b_stacked.dim() != 3 or tuple(b_stacked.shape[1:]) != (y.shape[1], rank):
        raise ValueError(f"b_stacked: expected [N, {y.shape[1]}, {rank}]; got {list(b_stacked.shape)}")
    if b_stacked.dtype != y.dtype or b_stacked.device != y.device:
        raise ValueError(f"b_stacked: expected {y.dtype} on {y.device} (y's); got {b_stacked.dtype} on "
                         f"{b_stacked.device}")
    _check_rows(rows, y.shape[0], y.device)


def lora_by_token_torch(x: torch.Tensor, a_stacked: torch.Tensor, b_stacked: torch.Tensor, scale: torch.Tensor,
                        rows: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The twin: the two twins in turn."""
    return bgmv_expand_torch(bgmv_shrink_torch(x, a_stacked, scale, rows), b_stacked, rows, y)


def lora_by_token_triton(x: torch.Tensor, a_stacked: torch.Tensor, b_stacked: torch.Tensor, scale: torch.Tensor,
                         rows: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return bgmv_expand_triton(bgmv_shrink_triton(x, a_stacked, scale, rows), b_stacked, rows, y)


@njit(nogil=True, cache=True, fastmath=True)
def _lora_by_token(x, a, bt, scale, rows, y):  # pragma: no cover (compiled)
    """Each token's z = scale * A[r] x (R dot products over `in`), then y += z B[r]^T row by row of B^T: both
    inner loops run along contiguous memory and vectorise (fastmath: the dot products' sums reassociate)."""
    rank = a.shape[1]
    z = np.empty(rank, dtype=np.float32)
    for t in range(x.shape[0]):
        r = rows[t]
        if r < 0:
            continue
        for k in range(rank):
            acc = np.float32(0.0)
            for j in range(x.shape[1]):
                acc += a[r, k, j] * x[t, j]
            z[k] = acc * scale[r]
        for k in range(rank):
            zk = z[k]
            for o in range(y.shape[1]):
                y[t, o] += zk * bt[r, k, o]


class HostStacks(NamedTuple):
    """One module's stacks as the numba form reads them, checked and viewed once (host_stacks): CPU serving calls
    it for every module of every step, where checking and converting the stacks again cost more than the loop."""

    a: np.ndarray
    """[N, R, in] fp32."""
    bt: np.ndarray
    """[N, R, out] fp32, contiguous."""
    scale: np.ndarray
    """[N] fp32."""


def host_stacks(a_stacked: torch.Tensor, b_stacked: torch.Tensor, scale: torch.Tensor) -> HostStacks:
    """The numba form's view of CPU fp32 stacks (shapes as lora_by_token's), sharing their memory."""
    if a_stacked.is_cuda or a_stacked.dtype != torch.float32 or scale.dim() != 1:
        raise ValueError(f"host stacks: expected fp32 CPU stacks and an [N] scale; got {a_stacked.dtype} on "
                         f"{a_stacked.device}, scale {list(scale.shape)}")
    _check_shrink(torch.empty(0, a_stacked.shape[2]), a_stacked, scale, torch.empty(0, dtype=torch.int32))
    _check_out(b_stacked, torch.empty(0, dtype=torch.int32), torch.empty(0, b_stacked.shape[1]), a_stacked.shape[1])
    bt = b_stacked.transpose(1, 2)
    if not bt.is_contiguous():
        raise ValueError("b_stacked: expected the transpose of a contiguous [N, R, out] tensor")
    return HostStacks(a_stacked.numpy(), bt.numpy(), scale.numpy())


def lora_by_token_host(x: torch.Tensor, stacks: HostStacks, rows: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """CPU serving's form for fp32 (one compiled loop a call, the GIL released), over stacks viewed once: about 15
    us for a decode step's 16 tokens on SmolLM2's q_proj, against 60 for the torch twins (2-core CPU). Sums in
    another order than the twins: equal up to fp32 rounding. Only x, rows and y are checked here."""
    xn, rn, yn = x.numpy(), rows.numpy(), y.numpy()  # CPU tensors only (numpy() refuses the others)
    tokens, in_f = xn.shape if xn.ndim == 2 else (-1, -1)
    if (xn.dtype != np.float32 or in_f != stacks.a.shape[2] or not xn.flags.c_contiguous
            or yn.dtype != np.float32 or yn.shape != (tokens, stacks.bt.shape[2]) or not yn.flags.c_contiguous
            or rn.shape != (tokens,) or rn.dtype not in (np.int32, np.int64)):
        raise ValueError(f"x, rows, y: expected contiguous fp32 [T, {stacks.a.shape[2]}], int [T] and contiguous "
                         f"fp32 [T, {stacks.bt.shape[2]}]; got {list(x.shape)} {x.dtype}, {list(rows.shape)} "
                         f"{rows.dtype}, {list(y.shape)} {y.dtype}")
    _lora_by_token(xn, stacks.a, stacks.bt, stacks.scale, rn, yn)
    return y
