"""Decode attention over a paged KV cache (flash decoding for rows that each add one token).

The cache holds keys and values in fixed-size blocks; each row's block table lists its blocks in position order
(position p of row b lies in block block_tables[b, p // BT] at offset p % BT), so a row's keys are read where they
lie, never gathered into a copy on a GPU (vLLM's PagedAttention). A block of max_model_len positions and one
block a row is the slot store the engine had before: the same op.

Semantics:
    for b in range(B), h in range(H):
        j = h // (H // KVH)                       # the key/value head that query head h reads (GQA)
        n = lengths[b]                            # keys of row b, this step's included; 0: a padding row
        keys = [k_cache[block_tables[b, p // BT], p % BT, j] for p in range(n)]   (values alike)
        o[b, h] = softmax(scale * q[b, h] @ keys.T) @ values   if n > 0   else 0

Shapes: q [B, H, D]; k_cache, v_cache [NB, BT, KVH, D] in q's dtype (a block's positions in turn, each position's
heads together, vLLM's layout for flash attention); block_tables [R >= B, W] int64 (every entry a
block of the cache, W * BT >= lengths); lengths [B] int. Returns a new o [B, H, D] in q's dtype (accumulated in
fp32). `max_length` bounds lengths (a host int: the twin reads only that many positions; the kernel ignores it, so
one captured launch serves every step of its row bucket).
"""

import torch

from kernels._backend import INTERPRET, tl, triton

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor, n: int) -> torch.Tensor:
    """cache [NB, BT, KVH, D], tables [R, W] -> the first n positions of each table's row as [R, KVH, n, D] (a view
    of one copy, positions before heads): what the twins attend over. The blocks are copied in one index_select,
    which lays a row's positions one after another; one block a row (the slot layout) is cut to its first n
    positions first, so no more is copied than is read."""
    rows, (_, block, kv_heads, dim) = tables.shape[0], cache.shape
    count = -(-n // block)
    if count == 1:
        return cache[:, :n].index_select(0, tables[:, 0]).transpose(1, 2)
    picked = cache.index_select(0, tables[:, :count].reshape(-1))  # [R * count, BT, KVH, D]
    return picked.view(rows, count * block, kv_heads, dim)[:, :n].transpose(1, 2)


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, lengths: torch.Tensor, scale: float, max_length: int
                           ) -> torch.Tensor:
    """The twin, which is what CPU serving runs: the rows' blocks gathered up to the longest, then one SDPA.

    The H query heads of a row are read as KVH groups of H / KVH queries each (every query of a group reads the
    same keys under the same mask), so grouped-query attention needs no repeated keys.
    """
    _check(q, k_cache, v_cache, block_tables, lengths)
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    n = max(1, min(max_length, block_tables.shape[1] * k_cache.shape[1]))
    keys, values = gather_blocks(k_cache, block_tables[:rows], n), gather_blocks(v_cache, block_tables[:rows], n)
    live = torch.arange(n, device=q.device)[None, :] < lengths[:, None]  # [B, n]
    live[:, 0] |= lengths == 0  # a padding row reads one key rather than none (no NaN); it is zeroed below
    o = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(rows, kv_heads, heads // kv_heads, dim), keys, values, attn_mask=live[:, None, None, :], scale=scale)
    return o.reshape(rows, heads, dim).masked_fill_((lengths == 0)[:, None, None], 0)


@triton.jit
def attend_block(q, k_head, v_head, table, block_tokens, stride_kb, stride_kl, stride_vb, stride_vl, offs_d, mask_d,
                 end, pos, scale, CAUSAL: tl.constexpr, IEEE: tl.constexpr, BLOCK_Q: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """q [BLOCK_Q, BLOCK_D] over the keys and values at positions 0..end - 1 of one row and key head (k_head, v_head:
    the cache at that head; table: the row's block table), in BLOCK_N steps with an online softmax in fp32; CAUSAL:
    query i sees only positions <= pos[i]. Each lane finds its position's block in the table, so a step may span
    blocks of any size. Half-precision caches multiply on the tensor cores (the probabilities cast to the cache's
    dtype, as flash attention does); fp32 ones, and every cache under Triton's interpreter (whose half-precision dot
    is not a GPU's), in IEEE fp32. -> [BLOCK_Q, BLOCK_D] fp32; a query that sees no key gets zeros.
    chunk_attention's kernel calls it too."""
    m = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q, BLOCK_D), dtype=tl.float32)
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        mask_n = offs_n < end
        blocks = tl.load(table + offs_n // block_tokens, mask=mask_n, other=0)  # [BLOCK_N] each position's block
        within = offs_n % block_tokens
        mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_head + blocks[:, None] * stride_kb + within[:, None] * stride_kl + offs_d[None, :], mask=mask,
                    other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_head + blocks[:, None] * stride_vb + within[:, None] * stride_vl + offs_d[None, :], mask=mask,
                    other=0.0)  # [BLOCK_N, BLOCK_D]
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
    q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, lengths_ptr,
    scale, GROUP, block_tokens,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl, stride_ob, stride_oh,
    stride_tr,
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
    out = attend_block(q, k_ptr + pid_h * stride_kh, v_ptr + pid_h * stride_vh, tables_ptr + row * stride_tr,
                       block_tokens, stride_kb, stride_kl, stride_vb, stride_vl, offs_d, mask_d, length, offs_g, scale,
                       False, IEEE, BLOCK_G, BLOCK_N, BLOCK_D)
    tl.store(o_ptr + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, lengths: torch.Tensor, scale: float, max_length: int
                            ) -> torch.Tensor:
    """Host wrapper: a fixed grid of (rows, key/value heads); each program loops over its own row's length and
    block table, read on the device, so the launch is the same for every step of a row bucket (CUDA graphs capture
    it)."""
    _check(q, k_cache, v_cache, block_tables, lengths)
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    o = torch.empty_like(q)
    if rows == 0:
        return o
    _decode_attention_kernel[(rows, kv_heads)](
        q, k_cache, v_cache, o, block_tables, lengths,
        scale, group, k_cache.shape[1],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(2), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(2), v_cache.stride(1), o.stride(0), o.stride(1), block_tables.stride(0),
        D=dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=64,
        BLOCK_D=max(16, triton.next_power_of_2(dim)), IEEE=q.dtype == torch.float32 or INTERPRET,
    )
    return o


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           lengths: torch.Tensor) -> None:
    """Both forms check the same contract, so a bad call fails the same way on CPU and GPU."""
    rows = q.shape[0] if q.dim() == 3 else 0
    check_cache(q, k_cache, v_cache, block_tables, rows)
    if lengths.shape != (rows,) or lengths.dtype not in (torch.int32, torch.int64) or lengths.device != q.device:
        raise ValueError(f"lengths: expected [{rows}] int32 or int64 on {q.device}; got {list(lengths.shape)} "
                         f"{lengths.dtype} on {lengths.device}")


def check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                rows: int) -> None:
    """q [T, H, D], one layer's paged KV cache and block tables of at least `rows` rows, as both attention ops read
    them."""
    if q.dim() != 3 or q.dtype not in DTYPES or q.stride(-1) != 1:
        raise ValueError(f"q: expected a [T, H, D] fp32, fp16 or bf16 tensor, last dim contiguous; "
                         f"got {list(q.shape)} {q.dtype}")
    heads, dim = q.shape[1:]
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4 or t.shape[3] != dim or t.stride(-1) != 1:
            raise ValueError(f"{name}: expected [NB, BT, KVH, {dim}], last dim contiguous; got {list(t.shape)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name}: expected {q.dtype} on {q.device} (q's); got {t.dtype} on {t.device}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: expected k_cache's shape {list(k_cache.shape)}; got {list(v_cache.shape)}")
    if heads % k_cache.shape[2]:
        raise ValueError(f"q: {heads} heads do not split over {k_cache.shape[2]} key/value heads")
    if block_tables.dim() != 2 or block_tables.shape[0] < rows or block_tables.dtype != torch.int64 \
            or block_tables.device != q.device or block_tables.stride(-1) != 1:
        raise ValueError(f"block_tables: expected [R >= {rows}, W] int64 on {q.device}, last dim contiguous; got "
                         f"{list(block_tables.shape)} {block_tables.dtype} on {block_tables.device}")
