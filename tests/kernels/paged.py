"""Paged KV caches for the attention kernels' tests: each row's positions laid over blocks in a shuffled order, so a
kernel that read blocks in place of tables (or one row's blocks for another's) would read the wrong keys."""

import torch


def paged(rows: int, kv_heads: int, positions: int, dim: int, block_tokens: int, dtype: torch.dtype,
          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables, k, v): rows' keys and values k, v [rows, KVH, positions, D] as the reference
    reads them, and the same laid over a cache of shuffled blocks (lay_over)."""
    k = torch.randn(rows, kv_heads, positions, dim, generator=gen).to(dtype)
    v = torch.randn(rows, kv_heads, positions, dim, generator=gen).to(dtype)
    return (*lay_over(k, v, block_tokens, gen), k, v)


def lay_over(k: torch.Tensor, v: torch.Tensor, block_tokens: int, gen: torch.Generator
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache [NB, BT, KVH, D], v_cache, block_tables): k, v [rows, KVH, positions, D] over blocks of
    `block_tokens` in a shuffled order, one spare block never in a table, unwritten places random."""
    rows, kv_heads, positions, dim = k.shape
    width = -(-positions // block_tokens)
    count = rows * width + 1
    tables = torch.randperm(count, generator=gen)[:rows * width].view(rows, width).contiguous()
    k_cache = torch.randn(count, block_tokens, kv_heads, dim, generator=gen).to(k.dtype)
    v_cache = torch.randn(count, block_tokens, kv_heads, dim, generator=gen).to(k.dtype)
    for r in range(rows):
        for i, b in enumerate(tables[r].tolist()):
            part = slice(i * block_tokens, min((i + 1) * block_tokens, positions))
            n = part.stop - part.start
            k_cache[b, :n] = k[r, :, part].transpose(0, 1)
            v_cache[b, :n] = v[r, :, part].transpose(0, 1)
    return k_cache, v_cache, tables
