"""RMSNorm in one launch (Llama's, as transformers' LlamaRMSNorm computes it):

    h = x in fp32;  h = h * rsqrt(mean(h^2 over the last dim) + eps);  y = weight * h.to(x.dtype)

Eager, that is eight kernels (casts, pow, mean, add, rsqrt, two products); a decode step of a 32-layer model runs
65 of these norms, and at a few rows each kernel's launch and ramp cost more than its bytes. Shapes: x [..., N]
fp32 | fp16 | bf16, last dim contiguous; weight [N]. Returns a new tensor of x's shape in the dtype
`weight * x` promotes to.
"""

import torch

from kernels._backend import tl, triton


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The twin: transformers' LlamaRMSNorm.forward, step for step."""
    _check(x, weight)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    """One program: one row."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    h = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(h * h, 0) / N + eps)
    h = (h * r).to(x.dtype).to(tl.float32)  # rounded to x's dtype, as the twin's h.to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (w * h).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, weight)
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    y = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, n, x2.stride(0), y.stride(0), eps,
                                        BLOCK=triton.next_power_of_2(n))
    return y.view(x.shape)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or x.dim() < 1 or x.stride(-1) != 1:
        raise ValueError(f"x: expected an fp32, fp16 or bf16 tensor, last dim contiguous; got {list(x.shape)} "
                         f"{x.dtype}")
    if weight.shape != (x.shape[-1],) or weight.device != x.device:
        raise ValueError(f"weight: expected [{x.shape[-1]}] on {x.device}; got {list(weight.shape)} on "
                         f"{weight.device}")
