"""Chunk attention: the prompt chunks of one generation step, each attending causally over its own row's blocks of
a paged KV cache, in one launch for every chunk (flash attention over variable-length sequences, as vLLM's prefill
kernels).

A chunk is `length` consecutive tokens of the step, at positions first..first + length - 1 of the row whose block
table is block_tables[row]; its keys and values are already in the cache (the step writes every token's before
any attention), the earlier positions too. Rows of `chunks` with length 0 are padding: a fixed-shape step (a CUDA
graph) has a fixed number of them, and a launch whose grid covers `max_tokens` tokens a chunk serves every step of
its token bucket.

Semantics (keys(row, j, n): the first n positions of key head j of the row, through its block table, as
kernels/decode_attention.py reads them; values alike):
    for (start, length, row, first) in chunks:
        for i in range(length), h in range(H):
            t, p = start + i, first + i
            j = h // (H // KVH)                                      # the key/value head h reads (GQA)
            o[t, h] = softmax(scale * q[t, h] @ keys(row, j, p + 1).T) @ values(row, j, p + 1)
    every other row of o is left as it was.

Shapes: q [T, H, D]; k_cache, v_cache [NB, BT, KVH, D] in q's dtype; block_tables [R, W] int64; chunks [C, 4] int64
(start, length, row, first), on q's device; o [T, H, D] like q, written in place and returned. `max_tokens` bounds
every chunk's length (a host int: the kernel's grid; the twin ignores it).
"""

import torch

from kernels._backend import INTERPRET, tl, triton
from kernels.decode_attention import attend_block, check_cache, gather_blocks

BLOCK_M = 16
"""Query tokens a program takes: a short chunk wastes few lanes, a long one reads each key block once per 16."""


def chunk_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                          chunks: torch.Tensor, scale: float, max_tokens: int, o: torch.Tensor) -> torch.Tensor:
    """The twin, which is what CPU serving runs: one SDPA a chunk over its row's first positions (gathered from its
    blocks), grouped-query (enable_gqa: no repeated keys). Queries as [1, H, n, D] under one [n, end] mask take a third
    to a half of the time the [KVH, G * n, D] layout took under its mask repeated G times (SmolLM2's heads, side by
    side on a 2-core Xeon VM: 400 tokens from the start 9.6 -> 3.4 ms, after 600 positions 30 -> 8.2 ms; 32 tokens
    after 600, 1.2 -> 0.6 ms)."""
    _check(q, k_cache, v_cache, block_tables, chunks, o)
    for start, length, row, first in chunks.tolist():
        if length == 0:
            continue
        end = first + length
        table = block_tables[row:row + 1]
        causal = (torch.arange(end, device=q.device)[None, :]
                  <= torch.arange(first, end, device=q.device)[:, None])  # [n, end]
        out = torch.nn.functional.scaled_dot_product_attention(
            q[start:start + length].transpose(0, 1)[None], gather_blocks(k_cache, table, end),
            gather_blocks(v_cache, table, end), attn_mask=causal, scale=scale, enable_gqa=True)  # [1, H, n, D]
        o[start:start + length] = out[0].transpose(0, 1)
    return o


@triton.jit
def _chunk_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, chunks_ptr,
    scale, GROUP, block_tokens,
    stride_qt, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl, stride_ot, stride_oh,
    stride_tr,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    """One program: BLOCK_M query tokens of one chunk for one query head, over the keys up to the last of them,
    causal. A program past its chunk's end writes nothing."""
    c = tl.program_id(0)
    block = tl.program_id(1)
    h = tl.program_id(2)
    start = tl.load(chunks_ptr + c * 4)
    length = tl.load(chunks_ptr + c * 4 + 1)
    if block * BLOCK_M < length:
        row = tl.load(chunks_ptr + c * 4 + 2)
        first = tl.load(chunks_ptr + c * 4 + 3)
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] places in the chunk
        mask_m = offs_m < length
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        q = tl.load(q_ptr + (start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        kv = h // GROUP
        end = first + tl.minimum(block * BLOCK_M + BLOCK_M, length)  # the last query's position + 1
        out = attend_block(q, k_ptr + kv * stride_kh, v_ptr + kv * stride_vh, tables_ptr + row * stride_tr,
                           block_tokens, stride_kb, stride_kl, stride_vb, stride_vl, offs_d, mask_d, end,
                           first + offs_m, scale, True, IEEE, BLOCK_M, BLOCK_N, BLOCK_D)
        tl.store(o_ptr + (start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def chunk_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, chunks: torch.Tensor, scale: float, max_tokens: int,
                           o: torch.Tensor) -> torch.Tensor:
    """Host wrapper: a fixed grid of (chunks, query blocks of max_tokens, query heads); each program reads its
    chunk's row of `chunks` and its block table on the device, so the launch is the same for every step of a token
    bucket (CUDA graphs capture it)."""
    _check(q, k_cache, v_cache, block_tables, chunks, o)
    heads, dim = q.shape[1:]
    if chunks.shape[0] == 0 or max_tokens <= 0:
        return o
    _chunk_attention_kernel[(chunks.shape[0], triton.cdiv(max_tokens, BLOCK_M), heads)](
        q, k_cache, v_cache, o, block_tables, chunks,
        scale, heads // k_cache.shape[2], k_cache.shape[1],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(2), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(2), v_cache.stride(1), o.stride(0), o.stride(1), block_tables.stride(0),
        D=dim, BLOCK_M=BLOCK_M, BLOCK_N=64, BLOCK_D=max(16, triton.next_power_of_2(dim)),
        IEEE=q.dtype == torch.float32 or INTERPRET,
    )
    return o


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           chunks: torch.Tensor, o: torch.Tensor) -> None:
    """Both forms check the same contract, so a bad call fails the same way on CPU and GPU."""
    check_cache(q, k_cache, v_cache, block_tables, 0)
    if chunks.dim() != 2 or chunks.shape[1] != 4 or chunks.dtype != torch.int64 or chunks.device != q.device \
            or not chunks.is_contiguous():
        raise ValueError(f"chunks: expected a contiguous [C, 4] int64 tensor on {q.device}; got "
                         f"{list(chunks.shape)} {chunks.dtype} on {chunks.device}")
    if o.shape != q.shape or o.dtype != q.dtype or o.device != q.device or o.stride(-1) != 1:
        raise ValueError(f"o: expected {list(q.shape)} {q.dtype} on {q.device} (q's); got {list(o.shape)} {o.dtype}")
