"""Paged KV caches for the attention kernels' tests: each row's positions laid over blocks in a shuffled order, so a
kernel that read blocks in place of tables (or one row's blocks for another's) would read the wrong keys."""

import torch


def paged(rows: int, kv_heads: int, positions: int, dim: int, block_tokens: int, dtype: torch.dtype,
          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables, k, v): rows' keys and values k, v [rows, KVH, positions, D] as the reference
    reads them, and the same laid over a cache of shuffled blocks (one spare block, never in a table)."""
    width = -(-positions // block_tokens)
    count = rows * width + 1
    k = torch.randn(rows, kv_heads, width * block_tokens, dim, generator=gen).to(dtype)
    v = torch.randn(rows, kv_heads, width * block_tokens, dim, generator=gen).to(dtype)
    order = torch.randperm(count, generator=gen)
    tables = order[:rows * width].view(rows, width).contiguous()
    k_cache = torch.randn(count, kv_heads, block_tokens, dim, generator=gen).to(dtype)
    v_cache = torch.randn(count, kv_heads, block_tokens, dim, generator=gen).to(dtype)
    for r in range(rows):
        for i, b in enumerate(tables[r].tolist()):
            k_cache[b] = k[r, :, i * block_tokens:(i + 1) * block_tokens]
            v_cache[b] = v[r, :, i * block_tokens:(i + 1) * block_tokens]
    return k_cache, v_cache, tables, k[:, :, :positions], v[:, :, :positions]
