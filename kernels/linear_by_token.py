"""A Linear layer by token over a stack of weights (full fine-tunes' own weights for the rows that run them): each
token reads the stack row its map names, so a launch depends only on the number of tokens and of stack rows, never
on which fine-tunes a step's rows use, and a CUDA graph replays it whatever they are.

Semantics:
    for t in range(T):
        r = rows[t]
        if r >= 0:
            y[t] = cast(x[t] @ w_stacked[r].T + (b_stacked[r] if b_stacked is not None else 0))   # fp32 sum
        else: y[t] untouched

Shapes: x [T, in], w_stacked [N, out, in] in x's dtype, contiguous; b_stacked [N, out] or None; rows [T] int (a row
of the stack, or -1); y [T, out] in x's dtype, contiguous, overwritten in place where rows[t] >= 0 (the base's
output for the other tokens stays). Returns y.

The Triton kernel's programs each take one stack row, BLOCK_M tokens and BLOCK_N outputs, and stop at once when no
token of their block maps to their row: a step reads each fine-tune's weights once per block of tokens, however
many of its rows it holds (Punica's SGMV, without sorting the tokens: the map stays a fixed-shape buffer).
"""

import torch

from kernels._backend import INTERPRET, tl, triton

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def linear_by_token_torch(x: torch.Tensor, w_stacked: torch.Tensor, b_stacked: torch.Tensor | None,
                          rows: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The twin: every stack row's Linear over every token, kept where the map names that row. Its operations
    depend only on the shapes (a fixed-shape step's, on a CPU); it is the specification, not a server's path."""
    _check(x, w_stacked, b_stacked, rows, y)
    for r in range(w_stacked.shape[0]):
        out = torch.nn.functional.linear(x.float(), w_stacked[r].float(),
                                         None if b_stacked is None else b_stacked[r].float())  # [T, out]
        y.copy_(torch.where((rows == r)[:, None], out.to(y.dtype), y))
    return y


@triton.jit
def _linear_by_token_kernel(
    x_ptr, w_ptr, b_ptr, rows_ptr, y_ptr,
    T, N, K,
    stride_xt, stride_ws, stride_wn, stride_bs, stride_yt,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program: stack row `r`, BLOCK_M tokens, BLOCK_N outputs; nothing unless some token of the block maps
    to r."""
    pid_n = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)  # r * stride_ws passes 2^31 on a stack of lm_heads (128256 x 4096 a row)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < T
    mine = (tl.load(rows_ptr + offs_m, mask=mask_m, other=-1) == r) & mask_m  # [BLOCK_M]
    if tl.max(mine.to(tl.int32), 0) > 0:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xt + offs_k[None, :],
                        mask=mine[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_ptr + r * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None],
                        mask=mask_n[None, :] & mask_k[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
            if IEEE:
                acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        if HAS_BIAS:
            acc += tl.load(b_ptr + r * stride_bs + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_yt + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mine[:, None] & mask_n[None, :])


def linear_by_token_triton(x: torch.Tensor, w_stacked: torch.Tensor, b_stacked: torch.Tensor | None,
                           rows: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Host wrapper: a grid of (output tiles, stack rows, token blocks), fixed by the shapes alone."""
    _check(x, w_stacked, b_stacked, rows, y)
    tokens, in_features = x.shape
    stack, out_features = w_stacked.shape[:2]
    if tokens == 0 or stack == 0:
        return y
    block_m = min(64, max(16, triton.next_power_of_2(tokens)))
    block_n, block_k = 64, 64
    bias = b_stacked if b_stacked is not None else w_stacked  # never read without HAS_BIAS
    _linear_by_token_kernel[(triton.cdiv(out_features, block_n), stack, triton.cdiv(tokens, block_m))](
        x, w_stacked, bias, rows, y,
        tokens, out_features, in_features,
        x.stride(0), w_stacked.stride(0), w_stacked.stride(1), bias.stride(0), y.stride(0),
        HAS_BIAS=b_stacked is not None, IEEE=x.dtype == torch.float32 or INTERPRET,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return y


def _check(x: torch.Tensor, w_stacked: torch.Tensor, b_stacked: torch.Tensor | None, rows: torch.Tensor,
           y: torch.Tensor) -> None:
    """Both forms check the same contract, so a bad call fails the same way on CPU and GPU."""
    if x.dim() != 2 or x.dtype not in DTYPES or not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous [T, in] fp32, fp16 or bf16 tensor; got {list(x.shape)} {x.dtype}")
    if w_stacked.dim() != 3 or w_stacked.shape[2] != x.shape[1] or not w_stacked.is_contiguous() \
            or w_stacked.dtype != x.dtype or w_stacked.device != x.device:
        raise ValueError(f"w_stacked: expected a contiguous [N, out, {x.shape[1]}] {x.dtype} tensor on {x.device}; "
                         f"got {list(w_stacked.shape)} {w_stacked.dtype} on {w_stacked.device}")
    stack, out_features = w_stacked.shape[:2]
    if b_stacked is not None and (b_stacked.shape != (stack, out_features) or not b_stacked.is_contiguous()
                                  or b_stacked.dtype != x.dtype or b_stacked.device != x.device):
        raise ValueError(f"b_stacked: expected a contiguous [{stack}, {out_features}] {x.dtype} tensor on {x.device};"
                         f" got {list(b_stacked.shape)} {b_stacked.dtype}")
    if rows.shape != (x.shape[0],) or rows.dtype not in (torch.int32, torch.int64) or rows.device != x.device:
        raise ValueError(f"rows: expected [{x.shape[0]}] int32 or int64 on {x.device}; got {list(rows.shape)} "
                         f"{rows.dtype} on {rows.device}")
    if y.shape != (x.shape[0], out_features) or y.dtype != x.dtype or not y.is_contiguous() or y.device != x.device:
        raise ValueError(f"y: expected a contiguous [{x.shape[0]}, {out_features}] {x.dtype} tensor; got "
                         f"{list(y.shape)} {y.dtype}")
