"""Decode attention over a KV store of slots (flash decoding for rows that each add one token).

The store holds each row's keys and values in a slot of its own, written in place; rows are the store's first
slots (row b is slot b), so a decode step reads the store where it lies, never a gathered copy.

Semantics:
    for b in range(B), h in range(H):
        j = h // (H // KVH)                       # the key/value head that query head h reads (GQA)
        n = lengths[b]                            # keys of row b, this step's included; 0: a padding row
        o[b, h] = softmax(scale * q[b, h] @ k_store[b, j, :n].T) @ v_store[b, j, :n]   if n > 0   else 0

Shapes: q [B, H, D]; k_store, v_store [S, KVH, L, D] with S >= B, q's dtype; lengths [B] int (<= L). Returns a new
o [B, H, D] in q's dtype (accumulated in fp32). `max_length` bounds lengths (a host int: the twin reads only that
many positions; the kernel ignores it, so one captured launch serves every step of its row bucket).
"""

import torch

from kernels._backend import INTERPRET, tl, triton

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def decode_attention_torch(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, lengths: torch.Tensor,
                           scale: float, max_length: int) -> torch.Tensor:
    """The twin, which is what CPU serving runs: one SDPA over the store's first B slots as a view.

    The H query heads of a row are read as KVH groups of H / KVH queries each (every query of a group reads the
    same keys under the same mask), so grouped-query attention needs no repeated keys.
    """
    _check(q, k_store, v_store, lengths)
    rows, heads, dim = q.shape
    kv_heads = k_store.shape[1]
    n = max(1, min(max_length, k_store.shape[2]))
    keys, values = k_store[:rows, :, :n], v_store[:rows, :, :n]  # [B, KVH, n, D], views
    live = torch.arange(n, device=q.device)[None, :] < lengths[:, None]  # [B, n]
    live[:, 0] |= lengths == 0  # a padding row reads one key rather than none (no NaN); it is zeroed below
    o = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(rows, kv_heads, heads // kv_heads, dim), keys, values, attn_mask=live[:, None, None, :], scale=scale)
    return o.reshape(rows, heads, dim).masked_fill_((lengths == 0)[:, None, None], 0)


@triton.jit
def attend_block(q, k_base, v_base, stride_kl, stride_vl, offs_d, mask_d, end, pos, scale,
                 CAUSAL: tl.constexpr, IEEE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """q [BLOCK_Q, BLOCK_D] over the keys and values at positions 0..end - 1 (k_base, v_base: one slot's and key
    head's), in BLOCK_N steps with an online softmax in fp32; CAUSAL: query i sees only positions <= pos[i].
    Half-precision stores multiply on the tensor cores (the probabilities cast to the store's dtype, as flash
    attention does); fp32 ones, and every store under Triton's interpreter (whose half-precision dot is not a
    GPU's), in IEEE fp32. -> [BLOCK_Q, BLOCK_D] fp32; a query that sees no key gets zeros. chunk_attention's kernel
    calls it too."""
    m = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q, BLOCK_D), dtype=tl.float32)
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        mask_n = offs_n < end
        k = tl.load(k_base + offs_n[:, None] * stride_kl + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_base + offs_n[:, None] * stride_vl + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        if IEEE:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        seen = mask_n[None, :]
        if CAUSAL:
            seen = seen & (offs_n[None, :] <= pos[:, None])
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query that sees no key yet
        p = tl.exp(scores - m_safe[:, None])  # [BLOCK_Q, BLOCK_N]
        alpha = tl.exp(m - m_safe)
        s = s * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    return acc / tl.maximum(s, 1e-30)[:, None]  # no key seen (a padding row): acc and s are zero, so is out


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lengths_ptr,
    scale, GROUP,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_kl, stride_vs, stride_vh, stride_vl, stride_ob, stride_oh,
    D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    """One program: the GROUP query heads of one row that share key/value head `pid_h`, over the row's keys."""
    row = tl.program_id(0)
    pid_h = tl.program_id(1)
    length = tl.load(lengths_ptr + row)
    offs_g = tl.arange(0, BLOCK_G)  # [BLOCK_G] query heads of the group
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask_g = offs_g < GROUP
    mask_d = offs_d < D
    heads = pid_h * GROUP + offs_g
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    out = attend_block(q, k_ptr + row * stride_ks + pid_h * stride_kh, v_ptr + row * stride_vs + pid_h * stride_vh,
                       stride_kl, stride_vl, offs_d, mask_d, length, offs_g, scale, False, IEEE, BLOCK_G, BLOCK_N,
                       BLOCK_D)
    tl.store(o_ptr + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


def decode_attention_triton(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, lengths: torch.Tensor,
                            scale: float, max_length: int) -> torch.Tensor:
    """Host wrapper: a fixed grid of (rows, key/value heads); each program loops over its own row's length, read
    on the device, so the launch is the same for every step of a row bucket (CUDA graphs capture it)."""
    _check(q, k_store, v_store, lengths)
    rows, heads, dim = q.shape
    kv_heads = k_store.shape[1]
    group = heads // kv_heads
    o = torch.empty_like(q)
    if rows == 0:
        return o
    _decode_attention_kernel[(rows, kv_heads)](
        q, k_store, v_store, o, lengths,
        scale, group,
        q.stride(0), q.stride(1), k_store.stride(0), k_store.stride(1), k_store.stride(2),
        v_store.stride(0), v_store.stride(1), v_store.stride(2), o.stride(0), o.stride(1),
        D=dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=64,
        BLOCK_D=max(16, triton.next_power_of_2(dim)), IEEE=q.dtype == torch.float32 or INTERPRET,
    )
    return o


def _check(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, lengths: torch.Tensor) -> None:
    """Both forms check the same contract, so a bad call fails the same way on CPU and GPU."""
    check_store(q, k_store, v_store, q.shape[0] if q.dim() == 3 else 0)
    rows = q.shape[0]
    if lengths.shape != (rows,) or lengths.dtype not in (torch.int32, torch.int64) or lengths.device != q.device:
        raise ValueError(f"lengths: expected [{rows}] int32 or int64 on {q.device}; got {list(lengths.shape)} "
                         f"{lengths.dtype} on {lengths.device}")


def check_store(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, slots: int) -> None:
    """q [T, H, D] and one layer's KV store of at least `slots` slots, as both attention ops read them."""
    if q.dim() != 3 or q.dtype not in DTYPES or q.stride(-1) != 1:
        raise ValueError(f"q: expected a [T, H, D] fp32, fp16 or bf16 tensor, last dim contiguous; "
                         f"got {list(q.shape)} {q.dtype}")
    heads, dim = q.shape[1:]
    for name, t in (("k_store", k_store), ("v_store", v_store)):
        if t.dim() != 4 or t.shape[0] < slots or t.shape[3] != dim or t.stride(-1) != 1:
            raise ValueError(f"{name}: expected [S >= {slots}, KVH, L, {dim}], last dim contiguous; got {list(t.shape)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name}: expected {q.dtype} on {q.device} (q's); got {t.dtype} on {t.device}")
    if v_store.shape != k_store.shape:
        raise ValueError(f"v_store: expected k_store's shape {list(k_store.shape)}; got {list(v_store.shape)}")
    if heads % k_store.shape[1]:
        raise ValueError(f"q: {heads} heads do not split over {k_store.shape[1]} key/value heads")
