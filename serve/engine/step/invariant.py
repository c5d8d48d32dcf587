"""Batch invariance (`engine.batch_invariant`): a row's logits bitwise the same whatever else its step holds.

Without it a row's answer depends on its neighbours, because some reductions change their order with the shape
of the batch, not with the row: a matmul's kernel and blocking are chosen by its row count (on the 2-core Xeon
this project measures on, a bf16 matmul of 64 rows or more rounds differently from one of a single row, and an fp32
one already at 2 rows), a decode step attends over every row's keys padded to the longest row, and a prompt's
chunk (cut where the step's token budget ends, which depends on the other prompts) sets SDPA's query blocks.

Under the option a step runs two things differently, the ideas of Thinking Machines' batch_invariant_ops and
vLLM's batch-invariant mode (reductions whose order is fixed per row), done here without kernels of their own:
- every matmul of the forward (aten mm, addmm and bmm: the base's linears, the LM head, every family's
  corrections) runs in tiles of TILE_ROWS rows, the last padded with zero rows, so each call has one shape
  whatever the batch; a row's result does not depend on the other rows of its tile (checked on both dtypes,
  tests/engine/test_invariant.py);
- attention runs query by query over exactly the keys that query reads (`attend`), so its shapes depend on the
  query's position alone, a prompt's token and a decode token alike.
Norms, softmax, log-softmax and elementwise ops already reduce within one token. The price is tiles of mostly
padding on small steps and a query at a time; `manyfold bench engine --traffic --kv-layouts paged,paged-invariant`
measures it. On CUDA the same torch operations run (with no step graphs): invariance there rests on cuBLAS
choosing one algorithm for one shape, as it does.
"""

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

TILE_ROWS = 32
"""Rows of every matmul call under the option. Measured on this project's CPU for SmolLM2's MLP shape: a 32-row tile
costs 1.8x (bf16) to 3x (fp32) an 8-row matmul, and 512 rows in tiles 1.7x (fp32) to 2.5x (bf16) one 512-row
matmul; tiles of 16 cost fp32 prompts 4x, tiles of 64 small steps more."""

aten = torch.ops.aten


class BatchInvariant(TorchDispatchMode):
    """Entered around a step's forward: its matmuls run by fixed tiles of rows; `attend` is its attention."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.mm.default:
            a, b = args
            return by_tiles(a, lambda tile: func(tile, b))
        if func is aten.addmm.default:
            bias, a, b = args
            if bias.dim() == 2 and bias.shape[0] == a.shape[0] and a.shape[0] > 1:
                raise NotImplementedError("addmm with a bias of one row per row under engine.batch_invariant")
            return by_tiles(a, lambda tile: func(bias, tile, b, **kwargs))
        if func is aten.bmm.default:
            a, b = args
            return torch.stack([by_tiles(a[i], lambda tile, w=b[i]: aten.mm.default(tile, w))
                                for i in range(a.shape[0])])
        return func(*args, **kwargs)

    @staticmethod
    def paused():
        """Operations whose shapes already depend on one row alone run as they are, and without this mode's Python
        call for each (attention's: most of the option's cost on a CPU otherwise)."""
        return _disable_current_modes()

    def attend(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tables: torch.Tensor,
               lengths: list[int], chunks: list[list[int]], scale: float) -> torch.Tensor:
        """q [T, H, D]; key, value: one layer's cache [NB, BT, KVH, D]; tables: the block tables; lengths: the keys
        each decode row (token b, lane b) reads, 0 for padding; chunks: (first token, length, lane, first position)
        of each prompt chunk. -> [T, H, D], zero for tokens of neither."""
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        with self.paused():
            qs = q.float()
            for lane, n in enumerate(lengths):
                if n:
                    keys, values = lane_positions(key, tables[lane], n), lane_positions(value, tables[lane], n)
                    out[lane] = one_query(qs[lane], keys, values, scale)
            for first, length, lane, position in chunks:
                if not length:
                    continue
                end = position + length
                keys, values = lane_positions(key, tables[lane], end), lane_positions(value, tables[lane], end)
                for i in range(length):
                    n = position + i + 1
                    out[first + i] = one_query(qs[first + i], keys[:, :n], values[:, :n], scale)
            return out.to(q.dtype)


def by_tiles(a: torch.Tensor, op: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """op over a [M, K] in tiles of TILE_ROWS rows (the last padded with zeros); -> the [M, N] rows."""
    a = a.contiguous()
    m = a.shape[0]
    pad = -m % TILE_ROWS
    if pad or m == 0:
        a = torch.cat([a, a.new_zeros(pad or TILE_ROWS, a.shape[1])])
    out = torch.cat([op(a[i:i + TILE_ROWS]) for i in range(0, a.shape[0], TILE_ROWS)])
    return out[:m]


def lane_positions(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """cache [NB, BT, KVH, D], one lane's block table [W] -> its first n positions as [KVH, n, D] fp32."""
    count = -(-n // cache.shape[1])
    return cache.index_select(0, table[:count]).flatten(0, 1)[:n].transpose(0, 1).float()


def one_query(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, D] fp32; keys, values [KVH, n, D] fp32 (the keys this query reads) -> [H, D] fp32, in shapes that depend
    on n alone. The H query heads read KVH groups of H / KVH (grouped-query attention)."""
    heads, dim = q.shape
    kv_heads = keys.shape[0]
    scores = torch.bmm(q.view(kv_heads, heads // kv_heads, dim), keys.transpose(1, 2)).mul_(scale)  # [KVH, G, n]
    return torch.bmm(scores.softmax(-1), values).view(heads, dim)
