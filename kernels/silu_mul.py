"""A gated MLP's activation in one launch (Llama's act_fn(gate_proj(x)) * up_proj(x) with act_fn = SiLU).

Semantics: y = silu(g) * u, silu rounded to g's dtype before the product, as eager's two kernels round it.
Shapes: g, u [..., N] of one dtype (fp32, fp16, bf16), last dim contiguous; y is a new contiguous tensor.
"""

import torch

from kernels._backend import tl, triton

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK = 1024


def silu_mul_torch(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The twin: what LlamaMLP runs eagerly."""
    _check(g, u)
    return torch.nn.functional.silu(g) * u


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, N, stride_g, stride_u, stride_y, BLOCK: tl.constexpr):
    """One program: BLOCK features of one row."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(y_ptr + row * stride_y + offs, (a.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_mul_triton(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    _check(g, u)
    n = g.shape[-1]
    g2, u2 = g.reshape(-1, n), u.reshape(-1, n)
    y = torch.empty(g2.shape, dtype=g.dtype, device=g.device)
    if g2.numel():
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(n, BLOCK))](g2, u2, y, n, g2.stride(0), u2.stride(0), y.stride(0),
                                                               BLOCK=BLOCK)
    return y.view(g.shape)


def _check(g: torch.Tensor, u: torch.Tensor) -> None:
    if g.dtype not in DTYPES or g.dim() < 1 or g.stride(-1) != 1:
        raise ValueError(f"g: expected an fp32, fp16 or bf16 tensor, last dim contiguous; got {list(g.shape)} {g.dtype}")
    if u.shape != g.shape or u.dtype != g.dtype or u.device != g.device or u.stride(-1) != 1:
        raise ValueError(f"u: expected g's {list(g.shape)} {g.dtype} on {g.device}, last dim contiguous; got "
                         f"{list(u.shape)} {u.dtype} on {u.device}")
