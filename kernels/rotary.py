"""Rotary position embedding and the paged KV cache's write in one launch.

Eager, transformers' apply_rotary_pos_emb is ten kernels a layer (products, a negation, a concatenation, sums for
q and for k) and the cache's write two more; in a captured decode step of Llama-3-8B at 64 rows they were 1.1 of
its 11.1 ms on an H100, each kernel's ramp costing more than its bytes.

Semantics (transformers' rotation, then the KV cache's write):
    rot(x)[t] = x[t] * cos[t] + rotate_half(x[t]) * sin[t]      rotate_half(x) = cat(-x[D/2:], x[:D/2])
    q <- rot(q)                                                 in place
    k_cache[blocks[t], offsets[t]] = rot(k)[t];  v_cache[blocks[t], offsets[t]] = v[t]
Each product and the sum are rounded to x's dtype, as eager's half-precision ops round them, so the two forms
agree bit for bit in half precision. k is left as it was.

Shapes: q [T, H, D], k, v [T, KVH, D], last dim contiguous; cos, sin [T, D] in q's dtype; k_cache, v_cache
[NB, BT, KVH, D] in q's dtype; blocks, offsets [T] int (each token's block and its place in it). D even.
"""

import torch

from kernels._backend import tl, triton

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_store_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor
                       ) -> torch.Tensor:
    """The twin: transformers' apply_rotary_pos_emb op for op, then the cache's indexed writes. Returns q."""
    _check(q, k, v, cos, sin, k_cache, v_cache, blocks, offsets)
    c, s = cos[:, None], sin[:, None]  # [T, 1, D]: over the heads
    q.copy_(q * c + _rotate_half(q) * s)
    k_cache[blocks, offsets] = k * c + _rotate_half(k) * s
    v_cache[blocks, offsets] = v
    return q


@triton.jit
def _rotary_store_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, blocks_ptr, offsets_ptr,
    H, HALF,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    stride_kss, stride_ksh, stride_ksl, stride_vss, stride_vsh, stride_vsl,
    BLOCK: tl.constexpr,
):
    """One program: one head of one token; heads 0..H-1 are q's (rotated in place), the rest k's and v's (k
    rotated into the cache, v copied)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    c1 = tl.load(cos_ptr + t * stride_ct + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if h < H:
        src = q_ptr + t * stride_qt + h * stride_qh
        dst = src
    else:
        j = h - H
        block = tl.load(blocks_ptr + t)
        at = tl.load(offsets_ptr + t)
        src = k_ptr + t * stride_kt + j * stride_kh
        dst = kc_ptr + block * stride_kss + j * stride_ksh + at * stride_ksl
        v_src = v_ptr + t * stride_vt + j * stride_vh
        v_dst = vc_ptr + block * stride_vss + j * stride_vsh + at * stride_vsl
        tl.store(v_dst + offs, tl.load(v_src + offs, mask=mask), mask=mask)
        tl.store(v_dst + HALF + offs, tl.load(v_src + HALF + offs, mask=mask), mask=mask)
    x1 = tl.load(src + offs, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0)
    dt = x1.dtype
    a1 = (x1.to(tl.float32) * c1).to(dt).to(tl.float32)
    b1 = (-x2.to(tl.float32) * s1).to(dt).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2).to(dt).to(tl.float32)
    b2 = (x1.to(tl.float32) * s2).to(dt).to(tl.float32)
    tl.store(dst + offs, (a1 + b1).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + offs, (a2 + b2).to(dst.dtype.element_ty), mask=mask)


def rotary_store_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor
                        ) -> torch.Tensor:
    _check(q, k, v, cos, sin, k_cache, v_cache, blocks, offsets)
    tokens, heads, dim = q.shape
    if tokens:
        _rotary_store_kernel[(tokens, heads + k.shape[1])](
            q, k, v, cos, sin, k_cache, v_cache, blocks, offsets,
            heads, dim // 2,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            sin.stride(0), k_cache.stride(0), k_cache.stride(2), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(2), v_cache.stride(1),
            BLOCK=triton.next_power_of_2(dim // 2),
        )
    return q


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
    """Both forms check the same contract, so a bad call fails the same way on CPU and GPU."""
    if q.dim() != 3 or q.dtype not in DTYPES or q.stride(-1) != 1 or q.shape[2] % 2:
        raise ValueError(f"q: expected a [T, H, D] fp32, fp16 or bf16 tensor, D even, last dim contiguous; "
                         f"got {list(q.shape)} {q.dtype}")
    tokens, _, dim = q.shape
    kv_heads = k.shape[1] if k.dim() == 3 else -1
    for name, t, shape in (("k", k, (tokens, kv_heads, dim)), ("v", v, (tokens, kv_heads, dim)),
                           ("cos", cos, (tokens, dim)), ("sin", sin, (tokens, dim))):
        if tuple(t.shape) != shape or t.stride(-1) != 1 or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name}: expected {list(shape)} {q.dtype} on {q.device}, last dim contiguous; got "
                             f"{list(t.shape)} {t.dtype} on {t.device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4 or t.shape[2] != kv_heads or t.shape[3] != dim or t.stride(-1) != 1 or t.dtype != q.dtype \
                or t.device != q.device:
            raise ValueError(f"{name}: expected [NB, BT, {kv_heads}, {dim}] {q.dtype} on {q.device}, last dim "
                             f"contiguous; got {list(t.shape)} {t.dtype} on {t.device}")
    for name, t in (("blocks", blocks), ("offsets", offsets)):
        if t.shape != (tokens,) or t.dtype not in (torch.int32, torch.int64) or t.device != q.device:
            raise ValueError(f"{name}: expected [{tokens}] int32 or int64 on {q.device}; got {list(t.shape)} "
                             f"{t.dtype} on {t.device}")
